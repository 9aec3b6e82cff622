"""Validation of every public argument, once per call, before any backend runs.

Each check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value)
with a message that starts with the argument's name and says what was expected and what was
received.  Nothing here writes into a caller's array.

A call is validated in two parts.  What follows from the arrays' descriptions (framework, device,
dtype, shape, strides) and the scalar options decides the :class:`AttentionProblem`; it is checked
in full the first time such a call is seen and remembered under that description (its key is built
in C by ``fastattn/_describe.pyx``), so a decode loop that repeats one call shape pays one
dictionary lookup for it.  A new array of the same
description passes the same checks by construction: its device, dtype, shape and strides are the
key.  What the description cannot vouch for is checked on every call (DESIGN.md §3, "What is
scanned per call"): host ``key_lengths`` values, and the dropout seed and offset.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from . import _arrays, _describe, _dropout
from ._options import AttentionOptions
from ._problem import AttentionExtras, AttentionProblem, Causal, Direction, Layout
from .backends import registry

_LAYOUTS = ("bhsd", "bshd")
#: The largest head_dim (and Dv) a call may have: four times the largest any released model uses;
#: beyond it a per-thread tile no longer fits in cache and the call is almost surely a mistake
#: (a sequence axis passed as the head axis).
MAX_HEAD_DIM = 1024
_AXES = {"bhsd": "(B, H, S, D)", "bshd": "(B, S, H, D)"}
_DEFAULT_LABELS = {"q": "q", "k": "k", "v": "v", "mask": "mask"}
#: The arrays a backend takes, by direction (the mask and key_lengths travel in the extras).
_ARRAY_NAMES: dict[str, tuple[str, ...]] = {
    "forward": ("q", "k", "v"),
    "backward": ("q", "k", "v", "dout", "out", "lse"),
}
_NO_EXTRAS = AttentionExtras()
#: How many validated call descriptions are remembered (oldest dropped first).
CACHE_SIZE = 512


class PreparedCall(NamedTuple):
    """A validated call: the problem, native ``(B, H, S, D)`` views, the extras and the options.

    Attributes
    ----------
    problem : AttentionProblem
    arrays : dict of str to array
        ``q``, ``k``, ``v`` (and ``dout``, ``out``, ``lse`` for a backward) as numpy or CuPy views
        in ``(B, H, S, D)`` order; a copy only where the last axis was not contiguous.
    extras : AttentionExtras
    origin : ArrayOrigin
        The caller's framework and device, to hand results back.
    options : AttentionOptions
        As the caller gave them (``return_lse`` and ``backend`` are read from here).
    """

    problem: AttentionProblem
    arrays: dict[str, Any]
    extras: AttentionExtras
    origin: _arrays.ArrayOrigin
    options: AttentionOptions


@dataclass(frozen=True)
class _Validated:
    """What a call description decided, remembered for the next call with the same description.

    Attributes
    ----------
    problem : AttentionProblem
    copies : tuple of str
        Arrays whose last axis is strided: a contiguous copy is made of each on every call.
    mask_shape : tuple of four ints or None
        The mask's shape with leading axes of size 1 added.
    lengths_need_copy : bool
        ``key_lengths`` is not a contiguous int64 array (the kernels read one).
    plain : bool
        Layout ``"bhsd"``, no copy, no mask, no key_lengths, no dropout: the caller's arrays go to
        the backend as they are, with no extras (what a decode loop calls).
    prefix_candidate : bool
        The mask is bool of shape (B|1, 1, 1, Sk|1): each call looks whether it is a key prefix
        per batch row, which then runs as ``key_lengths``.
    """

    problem: AttentionProblem
    copies: tuple[str, ...]
    mask_shape: tuple[int, int, int, int] | None
    lengths_need_copy: bool
    plain: bool
    prefix_candidate: bool = False


_validated: dict[tuple[Any, ...], _Validated] = {}
#: One object per distinct problem: the plan and selection caches downstream are keyed by problem,
#: and a lookup that meets the same object skips comparing some twenty fields (about 2 us).
_problems: dict[AttentionProblem, AttentionProblem] = {}


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
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, received {_arrays.describe_value(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name}: expected a finite number, received {value!r}")
    return result


def _softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    value = _real("softcap", softcap)
    if value <= 0:
        raise ValueError(f"softcap: expected a positive number or None, received {softcap!r}")
    return value


def _window(window: Any) -> tuple[int, int] | None:
    """Validate a window's type and sides (how far a side reaches is decided with the sizes)."""
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
    return left, right


def aligned_offset(causal: Causal | None, seq_q: int, seq_k: int) -> int:
    """The key position of query 0 in a whole call: ``Sk - Sq`` under bottom-right alignment, else 0."""
    return seq_k - seq_q if causal == "bottom_right" else 0


def _unbounded_sides(
    window: tuple[int, int] | None, seq_q: int, seq_k: int, key_offset: int = 0
) -> tuple[int, int] | None:
    """A side of at least ``Sq + Sk + |key_offset|`` hides nothing and becomes -1 (unbounded)."""
    if window is None:
        return None
    reach = seq_q + seq_k + abs(key_offset)
    left, right = (-1 if side >= reach else side for side in window)
    return left, right


@functools.lru_cache(maxsize=CACHE_SIZE)
def with_key_offset(
    problem: AttentionProblem, key_offset: int, window: tuple[int, int] | None
) -> AttentionProblem:
    """``problem`` for one block of a longer sequence: query i at key position ``i + key_offset``.

    Parameters
    ----------
    problem : AttentionProblem
        A validated problem whose ``causal`` is None or ``"top_left"`` (its window normalised
        without the offset, hence ``window`` again).
    key_offset : int
        Key position of the block's query 0 (the queries' global start, minus the keys' global
        start, plus the whole call's bottom-right offset).
    window : (int, int) or None
        The caller's window, checked by :func:`prepare`.

    Returns
    -------
    AttentionProblem
        One object per distinct problem, as :func:`prepare` hands out (the plan caches downstream
        are keyed by identity).
    """
    shifted = replace(
        problem,
        key_offset=key_offset,
        window=_unbounded_sides(window, problem.seq_q, problem.seq_k, key_offset),
    )
    return _problems.setdefault(shifted, shifted)


def _layout(layout: Any) -> Layout:
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected 'bhsd' or 'bshd', received {layout!r}")
    return layout


def check_backend_argument(backend: Any) -> None:
    """Check a ``backend=`` argument: None or the name of a registered backend.

    Raises
    ------
    TypeError
        ``backend`` is neither None nor a str.
    ValueError
        No backend of that name is registered.
    """
    if backend is None:
        return
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name (str) or None, received {backend!r}")
    if not registry.is_registered(backend):
        raise ValueError(f"backend: expected one of {registry.names()}, received {backend!r}")


def _scalar_options(options: AttentionOptions, deterministic: Any) -> tuple[Any, ...]:
    """Check the options that are not arrays; return them normalised (one type per value), as
    they key the remembered validations."""
    if options.return_lse is not False and options.return_lse is not True:
        raise TypeError(f"return_lse: expected a bool, received {options.return_lse!r}")
    check_backend_argument(options.backend)
    if deterministic is not False and deterministic is not True:
        raise TypeError(f"deterministic: expected a bool, received {_arrays.describe_value(deterministic)}")
    return (
        _layout(options.layout),
        None if options.scale is None else _real("scale", options.scale),
        causal_mode(options.causal),
        _window(options.window),
        _softcap(options.softcap),
        _dropout.probability(options.dropout_p),
        deterministic,
    )


def _same_device(name: str, origin: _arrays.ArrayOrigin, expected: _arrays.ArrayOrigin) -> None:
    if (origin.device, origin.device_id) != (expected.device, expected.device_id):
        raise ValueError(
            f"{name}: expected an array on the same device as q ({expected.describe()}), "
            f"received one on {origin.describe()}"
        )


def _float_input(name: str, native: Any, expected_dtype: str | None) -> str:
    dtype = _arrays.dtype_name(native.dtype)
    if expected_dtype is None:
        if dtype not in _arrays.SUPPORTED_DTYPES:
            raise TypeError(
                f"{name}: expected dtype float16, bfloat16, float32 or float64, received {dtype}"
            )
    elif dtype != expected_dtype:
        raise TypeError(f"{name}: expected dtype {expected_dtype} (the dtype of q), received {dtype}")
    if not native.dtype.isnative:
        raise TypeError(
            f"{name}: expected the machine's byte order, received dtype {native.dtype.str} "
            f"(convert with .astype(dtype.newbyteorder('=')))"
        )
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


def _needs_copy(native: Any) -> bool:
    """Whether the last axis is strided (``_arrays.last_axis_contiguous`` would copy)."""
    return bool(native.shape[-1] > 1 and native.strides[-1] != native.itemsize)


def _mask(name: str, native: Any, full_shape: tuple[int, int, int, int]) -> tuple[tuple[int, ...], str]:
    """Check a mask; return its four-axis shape and kind."""
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
    if not dtype.isnative:
        raise TypeError(
            f"{name}: expected the machine's byte order, received dtype {dtype.str} "
            f"(convert with .astype(dtype.newbyteorder('=')))"
        )
    if native.ndim > 4 or any(
        size not in (1, full) for size, full in zip(native.shape[::-1], full_shape[::-1])
    ):
        raise ValueError(
            f"{name}: expected a shape broadcastable to (B, Hq, Sq, Sk) = {full_shape}, "
            f"received {tuple(native.shape)}"
        )
    return (1,) * (4 - native.ndim) + tuple(native.shape), kind


def _key_lengths(native: Any, batch: int) -> bool:
    """Check ``key_lengths``' dtype and shape; return whether it needs a contiguous int64 copy."""
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
    return bool(native.dtype != np.int64 or (batch > 1 and native.strides[0] != native.itemsize))


def _lengths_in_range(lengths: Any, seq_k: int) -> None:
    """Host ``key_lengths`` must lie in [0, Sk] (device ones are clamped by the kernels: no sync)."""
    if not isinstance(lengths, np.ndarray) or lengths.size == 0:
        return
    values = lengths.tolist()
    low, high = min(values), max(values)
    if low < 0 or high > seq_k:
        raise ValueError(
            f"key_lengths: expected values in [0, Sk={seq_k}], received values in [{low}, {high}]"
        )


def _validate(
    direction: Direction,
    natives: dict[str, Any],
    mask: Any,
    lengths: Any,
    origins: dict[str, _arrays.ArrayOrigin],
    scalars: tuple[Any, ...],
    label: dict[str, str],
) -> _Validated:
    """Every check that follows from the arrays' descriptions and the scalar options."""
    layout, scale, causal, window, softcap, dropout_p, deterministic = scalars
    origin = origins["q"]
    for name in origins:
        _same_device(label.get(name, name), origins[name], origin)
    dtype = _float_input(label["q"], natives["q"], None)
    for name in ("k", "v"):
        _float_input(label[name], natives[name], dtype)
    bhsd = {name: _arrays.swap_layout(natives[name], layout) for name in ("q", "k", "v")}
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
            _float_input(name, natives[name], dtype)
            bhsd[name] = _arrays.swap_layout(natives[name], layout)
            _check_shape(name, bhsd[name], out_shape, layout, "the attention output's shape")
        lse = natives["lse"]
        lse_dtype = _arrays.accumulation_dtype(dtype).name
        if _arrays.dtype_name(lse.dtype) != lse_dtype:
            raise TypeError(
                f"lse: expected dtype {lse_dtype} (as returned by the forward for {dtype} inputs), "
                f"received {_arrays.dtype_name(lse.dtype)}"
            )
        if not lse.dtype.isnative:
            raise TypeError(
                f"lse: expected the machine's byte order, received dtype {lse.dtype.str} "
                f"(convert with .astype(dtype.newbyteorder('=')))"
            )
        if tuple(lse.shape) != (batch, heads_q, seq_q):
            raise ValueError(
                f"lse: expected shape {(batch, heads_q, seq_q)} (B, Hq, Sq), received {tuple(lse.shape)}"
            )

    mask_shape, mask_kind, mask_dtype = None, None, None
    if mask is not None:
        mask_shape, mask_kind = _mask(label["mask"], mask, (batch, heads_q, seq_q, seq_k))
        mask_dtype = _arrays.dtype_name(mask.dtype)
    lengths_need_copy = lengths is not None and _key_lengths(lengths, batch)
    copies = tuple(name for name, native in bhsd.items() if _needs_copy(native))
    strides = {
        name: _element_strides(_arrays.namespace(native).ascontiguousarray(native) if name in copies else native)
        for name, native in bhsd.items()
        if name in ("q", "k", "v")
    }
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
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
        causal=causal,
        window=_unbounded_sides(window, seq_q, seq_k),
        softcap=softcap,
        mask=mask_kind,  # type: ignore[arg-type]
        mask_shape=mask_shape,  # type: ignore[arg-type]
        mask_dtype=mask_dtype,
        has_key_lengths=lengths is not None,
        q_strides=strides["q"],
        k_strides=strides["k"],
        v_strides=strides["v"],
        deterministic=deterministic,
        dropout_p=dropout_p,
        key_offset=aligned_offset(causal, seq_q, seq_k),
    )
    if len(_problems) >= CACHE_SIZE:
        _problems.pop(next(iter(_problems)), None)
    problem = _problems.setdefault(problem, problem)
    plain = layout == "bhsd" and not copies and mask is None and lengths is None and dropout_p == 0.0
    prefix_candidate = mask_kind == "bool" and mask_shape is not None and mask_shape[1:3] == (1, 1)
    return _Validated(problem, copies, mask_shape, lengths_need_copy, plain, prefix_candidate)  # type: ignore[arg-type]


def key_prefix_lengths(mask: Any, batch: int, seq_k: int) -> np.ndarray | None:
    """The key lengths a bool ``(B|1, 1, 1, Sk|1)`` host mask stands for, or None.

    Where every batch row of the mask is ``True`` on keys ``[0, L_b)`` and ``False`` after, the mask
    says exactly what ``key_lengths = L`` says (DESIGN.md §3 allows this inspection), and lengths
    let the kernels skip whole tiles.  Reads ``B x Sk`` booleans; a device array is never read.

    Returns
    -------
    numpy.ndarray of int64, shape (batch,), or None
        The lengths, or None when the mask is not a key prefix (or not a host array).
    """
    if type(mask) is not np.ndarray:
        return None
    rows = np.broadcast_to(mask[:, 0, 0, :], (batch, seq_k))
    lengths = np.count_nonzero(rows, axis=1)
    if not np.array_equal(rows, np.arange(seq_k) < lengths[:, None]):
        return None
    return lengths.astype(np.int64)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _with_prefix_as_lengths(problem: AttentionProblem) -> AttentionProblem:
    """``problem`` with its key-prefix mask run as ``key_lengths`` (interned like every problem)."""
    converted = replace(problem, mask=None, mask_shape=None, mask_dtype=None, has_key_lengths=True)
    return _problems.setdefault(converted, converted)


def _remember(key: tuple[Any, ...], validated: _Validated) -> None:
    if len(_validated) >= CACHE_SIZE:
        _validated.pop(next(iter(_validated)), None)
    _validated[key] = validated


def prepare(
    direction: Direction,
    arrays: dict[str, Any],
    options: AttentionOptions,
    *,
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
    options : AttentionOptions
        The call's options (the backward needs the forward's ``dropout_seed``).
    labels : dict, optional
        The caller's names for ``q``, ``k``, ``v`` and ``mask`` in error messages, all four (for
        ``scaled_dot_product_attention``: query, key, value, attn_mask).
    deterministic : bool
        As in :func:`fastattn.attention_backward`.

    Returns
    -------
    PreparedCall
        Native arrays in ``(B, H, S, D)`` order (views of the caller's memory; a copy only where the
        last axis was not contiguous), the problem, the extras, the caller's origin and the options.
    """
    label = _DEFAULT_LABELS if labels is None else labels
    # origins: None while every array is a numpy array (of NUMPY_ORIGIN), else one ArrayOrigin
    # shared by all, or a dict of each array's own.
    natives: dict[str, Any] = arrays
    origins: Any = None
    for value in arrays.values():
        if type(value) is not np.ndarray:
            natives, origins = _arrays.natives_of(arrays, label)
            break
    mask = lengths = None
    if options.mask is not None or options.key_lengths is not None:
        natives, origins = dict(natives), _origin_dict(origins, natives)
        if options.mask is not None:
            mask, origins["mask"] = _arrays.to_native(options.mask, label["mask"])
            natives["mask"] = mask
        if options.key_lengths is not None:
            lengths, origins["key_lengths"] = _arrays.to_native(options.key_lengths, "key_lengths")
            natives["key_lengths"] = lengths
    key = _describe.call_key(direction, natives, origins, options, deterministic)
    validated = None if key is None else _validated.get(key)
    if validated is None:
        scalars = _scalar_options(options, deterministic)
        validated = _validate(direction, natives, mask, lengths, _origin_dict(origins, natives), scalars, label)
        if key is not None:
            _remember(key, validated)
    elif options.backend is not None:
        check_backend_argument(options.backend)
    if origins is None:
        origin = _arrays.NUMPY_ORIGIN
    else:
        origin = origins["q"] if type(origins) is dict else origins
    offset = options.dropout_offset
    if validated.plain and options.dropout_seed is None and type(offset) is int and offset == 0:
        # tuple.__new__ builds the NamedTuple without its Python-level __new__ (0.1 us of a call).
        return tuple.__new__(PreparedCall, (validated.problem, natives, _NO_EXTRAS, origin, options))
    return _finish_prepare(direction, validated, natives, mask, lengths, origin, options)


def _origin_dict(origins: Any, natives: dict[str, Any]) -> dict[str, _arrays.ArrayOrigin]:
    """Each array's origin, by name, from ``prepare``'s compact form of them."""
    if type(origins) is dict:
        return dict(origins)
    return dict.fromkeys(natives, _arrays.NUMPY_ORIGIN if origins is None else origins)


def _finish_prepare(
    direction: Direction,
    validated: _Validated,
    natives: dict[str, Any],
    mask: Any,
    lengths: Any,
    origin: _arrays.ArrayOrigin,
    options: AttentionOptions,
) -> PreparedCall:
    """The per-call part of a validated call: views, copies, the values checked every call, extras."""
    problem = validated.problem
    bhsd = natives
    if problem.layout == "bshd":
        bhsd = {
            name: natives[name] if name == "lse" else natives[name].swapaxes(1, 2) for name in _ARRAY_NAMES[direction]
        }
    elif mask is not None or lengths is not None:
        bhsd = {name: natives[name] for name in _ARRAY_NAMES[direction]}
    for name in validated.copies:
        bhsd[name] = _arrays.namespace(bhsd[name]).ascontiguousarray(bhsd[name])
    if mask is not None and mask.ndim != 4:
        mask = mask.reshape(validated.mask_shape)
    if lengths is not None:
        if validated.lengths_need_copy:
            lengths = lengths.astype(np.int64)
        _lengths_in_range(lengths, problem.seq_k)
    if validated.prefix_candidate and (lengths is None or type(lengths) is np.ndarray):
        prefix = key_prefix_lengths(mask, problem.batch, problem.seq_k)
        if prefix is not None:
            lengths = prefix if lengths is None else np.minimum(lengths, prefix)
            mask, problem = None, _with_prefix_as_lengths(problem)
    seed, offset = options.dropout_seed, options.dropout_offset
    if problem.dropout_p == 0.0 and seed is None and type(offset) is int and offset == 0 and mask is None:
        extras = _NO_EXTRAS if lengths is None else AttentionExtras(None, lengths, None)
    else:
        dropout = _dropout.request(problem.dropout_p, seed, offset, need_seed=direction == "backward")
        extras = AttentionExtras(mask, lengths, dropout)
    return PreparedCall(problem, bhsd, extras, origin, options)


@functools.lru_cache(maxsize=CACHE_SIZE)
def backward_problem(forward: AttentionProblem, deterministic: bool = False) -> AttentionProblem:
    """The backward twin of a forward problem (same sizes, options and strides of q, k, v)."""
    return replace(forward, direction="backward", deterministic=deterministic)


def prepare_gradient(forward: PreparedCall, out: Any, lse: Any, dout: Any) -> PreparedCall:
    """The backward call of a forward that fastattn ran itself: only ``dout`` is new.

    Parameters
    ----------
    forward : PreparedCall
        The forward's validated call.
    out, lse : native arrays
        The forward's results as the backend returned them (``(B, H, S, D)`` order).
    dout : array
        The gradient of the output, in the caller's framework and layout: checked here for its
        device, dtype and shape (the rest was checked by the forward).

    Returns
    -------
    PreparedCall
        The backward call, sharing the forward's arrays, extras and options.
    """
    problem = forward.problem
    native, origin = _arrays.to_native(dout, "dout")
    _same_device("dout", origin, forward.origin)
    _float_input("dout", native, problem.dtype)
    view = _arrays.swap_layout(native, problem.layout)
    _check_shape("dout", view, tuple(out.shape), problem.layout, "the attention output's shape")
    arrays = {**forward.arrays, "dout": _arrays.last_axis_contiguous(view), "out": out, "lse": lse}
    return PreparedCall(backward_problem(problem), arrays, forward.extras, forward.origin, forward.options)
