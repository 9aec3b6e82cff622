"""Validation of every public argument, once, before any backend runs.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value)
with a message that starts with the argument's name and says what was expected and what was
received.  Nothing here writes into a caller's array.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays, _dropout
from ._problem import AttentionExtras, AttentionProblem, Causal, Direction, Layout

_LAYOUTS = ("bhsd", "bshd")
#: The largest head_dim (and Dv) a call may have: four times the largest any released model uses;
#: beyond it a per-thread tile no longer fits in cache and the call is almost surely a mistake
#: (a sequence axis passed as the head axis).
MAX_HEAD_DIM = 1024
_AXES = {"bhsd": "(B, H, S, D)", "bshd": "(B, S, H, D)"}


@dataclass(frozen=True)
class PreparedCall:
    """A validated call: the problem, native ``(B, H, S, D)`` views and the extras."""

    problem: AttentionProblem
    arrays: dict[str, Any]
    extras: AttentionExtras
    origin: _arrays.ArrayOrigin


def causal_mode(causal: Any) -> Causal | None:
    """Map the ``causal`` argument to None, ``"top_left"`` or ``"bottom_right"``."""
    if causal is None or causal is False:
        return None
    if causal is True or (isinstance(causal, str) and causal == "top_left"):
        return "top_left"
    if isinstance(causal, str) and causal == "bottom_right":
        return "bottom_right"
    raise ValueError(
        f"causal: expected False, True, 'top_left' or 'bottom_right', received {causal!r}"
    )


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, received {_arrays.describe_value(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name}: expected a finite number, received {value!r}")
    return result


def _scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return _real("scale", scale)


def _softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    value = _real("softcap", softcap)
    if value <= 0:
        raise ValueError(f"softcap: expected a positive number or None, received {softcap!r}")
    return value


def _window(window: Any, seq_q: int, seq_k: int) -> tuple[int, int] | None:
    """Validate a window; a side of at least Sq + Sk hides nothing and becomes -1 (unbounded)."""
    if window is None:
        return None
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(side, numbers.Integral) and not isinstance(side, bool) for side in window)
    ):
        raise TypeError(
            f"window: expected a pair of ints (left, right) or None, received {window!r}"
        )
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        raise ValueError(
            f"window: expected sides >= 0, or -1 for unbounded, received ({left}, {right})"
        )
    return tuple(-1 if side >= seq_q + seq_k else side for side in (left, right))  # type: ignore[return-value]


def _layout(layout: Any) -> Layout:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', received {layout!r}")
    return layout


def _native(name: str, value: Any, origin: _arrays.ArrayOrigin | None) -> tuple[Any, _arrays.ArrayOrigin]:
    native, this_origin = _arrays.to_native(value, name)
    if origin is not None and (this_origin.device, this_origin.device_id) != (origin.device, origin.device_id):
        raise ValueError(
            f"{name}: expected an array on the same device as q ({origin.describe()}), "
            f"received one on {this_origin.describe()}"
        )
    return native, this_origin


def _float_input(name: str, native: Any, expected_dtype: str | None) -> str:
    dtype = _arrays.dtype_name(native.dtype)
    if expected_dtype is None:
        if dtype not in _arrays.SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: expected dtype float16, bfloat16, float32 or float64, received {dtype}"
            )
    elif dtype != expected_dtype:
        raise TypeError(f"{name}: expected dtype {expected_dtype} (the dtype of q), received {dtype}")
    if native.ndim != 4:
        raise ValueError(
            f"{name}: expected a 4-D array, received shape {tuple(native.shape)}"
        )
    return dtype


def _check_shape(name: str, native_bhsd: Any, expected: tuple[int, ...], layout: str, why: str) -> None:
    if tuple(native_bhsd.shape) != expected:
        shown = tuple(_arrays.swap_layout(native_bhsd, layout).shape)
        wanted = expected if layout == "bhsd" else (expected[0], expected[2], expected[1], expected[3])
        raise ValueError(f"{name}: expected shape {wanted} {_AXES[layout]} ({why}), received {shown}")


def _element_strides(native: Any) -> tuple[int, int, int, int]:
    return tuple(stride // native.itemsize for stride in native.strides)


def _mask(
    name: str, mask: Any, origin: _arrays.ArrayOrigin, full_shape: tuple[int, int, int, int]
) -> tuple[Any, str | None]:
    if mask is None:
        return None, None
    native, _ = _native(name, mask, origin)
    dtype = native.dtype
    if dtype == np.bool_:
        kind = "bool"
    elif _arrays.dtype_name(dtype) in _arrays.SUPPORTED_DTYPES:
        kind = "float"
    else:
        raise TypeError(
            f"{name}: expected a bool array (True = may attend) or a float array (added to the scores), "
            f"received dtype {_arrays.dtype_name(dtype)}"
        )
    if native.ndim > 4 or any(
        size not in (1, full) for size, full in zip(native.shape[::-1], full_shape[::-1])
    ):
        raise ValueError(
            f"{name}: expected a shape broadcastable to (B, Hq, Sq, Sk) = {full_shape}, "
            f"received {tuple(native.shape)}"
        )
    return native.reshape((1,) * (4 - native.ndim) + tuple(native.shape)), kind


def _key_lengths(key_lengths: Any, origin: _arrays.ArrayOrigin, batch: int, seq_k: int) -> Any:
    if key_lengths is None:
        return None
    native, _ = _native("key_lengths", key_lengths, origin)
    if native.dtype.kind not in "iu":
        raise TypeError(
            f"key_lengths: expected an integer array of shape ({batch},), "
            f"received dtype {_arrays.dtype_name(native.dtype)}"
        )
    if tuple(native.shape) != (batch,):
        raise ValueError(
            f"key_lengths: expected shape ({batch},) (one length per batch row), "
            f"received {tuple(native.shape)}"
        )
    lengths = native.astype(np.int64)
    if batch == 0:
        return lengths
    low, high = int(lengths.min()), int(lengths.max())
    if low < 0 or high > seq_k:
        raise ValueError(
            f"key_lengths: expected values in [0, Sk={seq_k}], received values in [{low}, {high}]"
        )
    return lengths


def prepare(
    direction: Direction,
    arrays: dict[str, Any],
    *,
    causal: Any = False,
    scale: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    window: Any = None,
    softcap: Any = None,
    layout: Any = "bhsd",
    dropout_p: Any = 0.0,
    dropout_seed: Any = None,
    dropout_offset: Any = 0,
    labels: dict[str, str] | None = None,
    deterministic: Any = False,
) -> PreparedCall:
    """Validate a call and build its problem.

    Parameters
    ----------
    direction : {"forward", "backward"}
        The pass the problem describes.
    arrays : dict
        ``q``, ``k``, ``v`` and, for the backward, ``dout``, ``out`` and ``lse``, as the caller
        passed them (any supported framework).
    causal, scale, mask, key_lengths, window, softcap, layout, dropout_p, dropout_seed, dropout_offset
        As in :func:`fastattn.attention` (the backward needs the forward's ``dropout_seed``).
    labels : dict, optional
        The caller's names for ``q``, ``k``, ``v`` and ``mask`` in error messages (for
        ``scaled_dot_product_attention``: query, key, value, attn_mask).
    deterministic : bool
        As in :func:`fastattn.attention_backward`.

    Returns
    -------
    PreparedCall
        Native arrays in ``(B, H, S, D)`` order (views of the caller's memory; a copy only where the
        last axis was not contiguous), the problem, the extras and the caller's origin.
    """
    label = {"q": "q", "k": "k", "v": "v", "mask": "mask", **(labels or {})}
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, received {_arrays.describe_value(deterministic)}")
    layout = _layout(layout)
    native_q, origin = _native(label["q"], arrays["q"], None)
    dtype = _float_input(label["q"], native_q, None)
    natives = {"q": native_q}
    for name in ("k", "v"):
        natives[name], _ = _native(label[name], arrays[name], origin)
        _float_input(label[name], natives[name], dtype)
    bhsd = {name: _arrays.swap_layout(native, layout) for name, native in natives.items()}
    batch, heads_q, seq_q, head_dim = bhsd["q"].shape
    _, heads_kv, seq_k, _ = bhsd["k"].shape
    head_dim_v = bhsd["v"].shape[3]
    for name, heads, dim in (("q", heads_q, head_dim), ("k", heads_kv, head_dim), ("v", heads_kv, head_dim_v)):
        if heads < 1 or dim < 1:
            raise ValueError(
                f"{label[name]}: expected at least one head and head_dim >= 1 (batch and sequence sizes "
                f"may be 0), received shape {tuple(natives[name].shape)}"
            )
        if dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{label[name]}: expected head_dim <= {MAX_HEAD_DIM}, received {dim} "
                f"(shape {tuple(natives[name].shape)} in layout {layout!r})"
            )
    if heads_q % heads_kv:
        raise ValueError(
            f"{label['k']}: expected a number of kv heads that divides the {heads_q} query heads, "
            f"received {heads_kv}"
        )
    _check_shape(label["k"], bhsd["k"], (batch, heads_kv, seq_k, head_dim), layout, "batch and head_dim of q")
    _check_shape(label["v"], bhsd["v"], (batch, heads_kv, seq_k, head_dim_v), layout, "B, Hkv and Sk of k")

    if direction == "backward":
        out_shape = (batch, heads_q, seq_q, head_dim_v)
        for name in ("dout", "out"):
            native, _ = _native(name, arrays[name], origin)
            _float_input(name, native, dtype)
            bhsd[name] = _arrays.swap_layout(native, layout)
            _check_shape(name, bhsd[name], out_shape, layout, "the attention output's shape")
        lse, _ = _native("lse", arrays["lse"], origin)
        lse_dtype = _arrays.accumulation_dtype(dtype).name
        if _arrays.dtype_name(lse.dtype) != lse_dtype:
            raise TypeError(
                f"lse: expected dtype {lse_dtype} (as returned by the forward for {dtype} inputs), "
                f"received {_arrays.dtype_name(lse.dtype)}"
            )
        if tuple(lse.shape) != (batch, heads_q, seq_q):
            raise ValueError(
                f"lse: expected shape {(batch, heads_q, seq_q)} (B, Hq, Sq), received {tuple(lse.shape)}"
            )
        bhsd["lse"] = lse

    full_shape = (batch, heads_q, seq_q, seq_k)
    mask_native, mask_kind = _mask(label["mask"], mask, origin, full_shape)
    lengths = _key_lengths(key_lengths, origin, batch, seq_k)
    dropout = _dropout.parse(dropout_p, dropout_seed, dropout_offset, need_seed=direction == "backward")
    for name, native in bhsd.items():
        if name != "lse":
            bhsd[name] = _arrays.last_axis_contiguous(native)
    problem = AttentionProblem(
        direction=direction,
        framework=origin.framework,
        device=origin.device,
        dtype=dtype,
        batch=batch,
        heads_q=heads_q,
        heads_kv=heads_kv,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        layout=layout,
        scale=_scale(scale, head_dim),
        causal=causal_mode(causal),
        window=_window(window, seq_q, seq_k),
        softcap=_softcap(softcap),
        mask=mask_kind,  # type: ignore[arg-type]
        mask_shape=None if mask_native is None else tuple(mask_native.shape),
        mask_dtype=None if mask_native is None else _arrays.dtype_name(mask_native.dtype),
        has_key_lengths=lengths is not None,
        q_strides=_element_strides(bhsd["q"]),
        k_strides=_element_strides(bhsd["k"]),
        v_strides=_element_strides(bhsd["v"]),
        deterministic=deterministic,
        dropout_p=0.0 if dropout is None else dropout.p,
    )
    return PreparedCall(problem, bhsd, AttentionExtras(mask_native, lengths, dropout), origin)
