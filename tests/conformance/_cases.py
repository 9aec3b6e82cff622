"""Hypothesis strategies that draw whole attention problems, and the inputs that realise them.

A :class:`Case` holds sizes and options; :func:`make_inputs` turns it into random arrays from the
case's own seed (drawn by hypothesis, so every example has fresh data), in the case's dtype and
layout, optionally as non-contiguous views of larger buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from ._oracle import Options

DTYPES = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}
#: Relative Frobenius error allowed against the float64 oracle (DESIGN.md §6).
FORWARD_TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}
#: Gradients: float32 within 1e-4, float64 within 1e-9 (issue #5), half precisions as the forward.
BACKWARD_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 2e-2, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Case:
    """One drawn attention problem."""

    batch: int
    heads_kv: int
    group: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    dtype: str
    layout: str
    causal: Any
    window: tuple[int, int] | None
    mask_kind: str | None
    mask_shape: tuple[int, ...] | None
    key_lengths: tuple[int, ...] | None
    softcap: float | None
    scale: float | None
    strided: str  # "contiguous", "strided" (views with gaps), "copy" (last axis not contiguous)
    seed: int = field(default=0)

    @property
    def heads_q(self) -> int:
        return self.heads_kv * self.group

    def kwargs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments for fastattn.attention / attention_backward."""
        return {
            "causal": self.causal,
            "scale": self.scale,
            "mask": inputs["mask"],
            "key_lengths": inputs["key_lengths"],
            "window": self.window,
            "softcap": self.softcap,
            "layout": self.layout,
        }

    def oracle_options(self, inputs: dict[str, Any]) -> Options:
        mask = None if inputs["mask"] is None else to_host(inputs["mask"])
        if mask is not None and mask.dtype != np.bool_:
            mask = mask.astype(np.float64)
        return Options(
            causal=self.causal,
            scale=self.scale,
            mask=mask,
            key_lengths=None if inputs["key_lengths"] is None else to_host(inputs["key_lengths"]),
            window=self.window,
            softcap=self.softcap,
        )


@st.composite
def _mask_shape(draw: Any, full: tuple[int, int, int, int]) -> tuple[int, ...]:
    ndim = draw(st.integers(2, 4))
    return tuple(draw(st.sampled_from([1, size])) for size in full[4 - ndim :])


@st.composite
def cases(draw: Any, dtypes: tuple[str, ...] = ("float64", "float32")) -> Case:
    """Draw a Case covering every feature of the contract."""
    # Small problems explore the options; large ones cross the kernels' tile edges (32-256 rows).
    large = draw(st.booleans())
    batch = 1 if large else draw(st.integers(1, 2))
    heads_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    seq_q = draw(st.one_of(st.just(1), st.integers(1, 130 if large else 33)))
    seq_k = draw(st.integers(41, 300) if large else st.integers(1, 40))
    head_dim = draw(st.sampled_from([16, 32, 64, 80, 128]))
    head_dim_v = draw(st.one_of(st.just(head_dim), st.sampled_from([8, 24, 48, 64])))
    causal = draw(st.sampled_from([False, True, "top_left", "bottom_right"]))
    window = draw(st.one_of(st.none(), st.tuples(st.integers(-1, 12), st.integers(-1, 12))))
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    full = (batch, heads_kv * group, seq_q, seq_k)
    mask_shape = draw(_mask_shape(full)) if mask_kind else None
    key_lengths = draw(
        st.one_of(
            st.none(),
            st.lists(
                st.one_of(st.just(0), st.just(seq_k), st.integers(0, seq_k)),
                min_size=batch,
                max_size=batch,
            ).map(tuple),
        )
    )
    return Case(
        batch=batch,
        heads_kv=heads_kv,
        group=group,
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=draw(st.sampled_from(dtypes)),
        layout=draw(st.sampled_from(["bhsd", "bshd"])),
        causal=causal,
        window=window,
        mask_kind=mask_kind,
        mask_shape=mask_shape,
        key_lengths=key_lengths,
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 1.5))),
        strided=draw(st.sampled_from(["contiguous", "strided", "copy"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def array_module(device: str) -> Any:
    """numpy for "cpu", cupy for "cuda"."""
    if device == "cuda":
        import cupy

        return cupy
    return np


def to_host(array: Any) -> np.ndarray:
    """A numpy copy of a numpy, CuPy or torch (CPU) array."""
    if hasattr(array, "get") and not isinstance(array, np.ndarray):
        return array.get()
    return np.array(array, copy=True)


def to_device(value: Any, device: str) -> Any:
    """``value`` on ``device``: a numpy array copied there, a dict's numpy values likewise (call
    options such as ``mask`` and ``key_lengths``), anything else as it is."""
    if isinstance(value, dict):
        return {name: to_device(item, device) for name, item in value.items()}
    if isinstance(value, np.ndarray):
        return array_module(device).asarray(value)
    return value


def _array(rng: np.random.Generator, shape_bhsd: tuple[int, ...], case: Case, device: str) -> Any:
    """Random values in the case's dtype and layout, as the case's kind of (non-)contiguous view."""
    xp = array_module(device)
    batch, heads, seq, dim = shape_bhsd
    ordered = (batch, seq, heads, dim) if case.layout == "bshd" else shape_bhsd
    dtype = DTYPES[case.dtype]
    if case.strided == "strided":
        # Every other row along axis 2 of a buffer with a padded last axis: gaps everywhere.
        padded = ordered[:2] + (2 * ordered[2], ordered[3] + 3)
        base = xp.asarray(rng.standard_normal(padded).astype(dtype))
        return base[:, :, ::2, : ordered[3]]
    values = xp.asarray(rng.standard_normal(ordered).astype(dtype))
    if case.strided == "copy":
        return xp.asfortranarray(values)  # last axis not contiguous: the API must copy it once
    return values


def make_inputs(case: Case, device: str = "cpu") -> dict[str, Any]:
    """Return q, k, v (and the optional mask and key_lengths) for a case, from its seed."""
    rng = np.random.default_rng(case.seed)
    xp = array_module(device)
    inputs: dict[str, Any] = {
        "q": _array(rng, (case.batch, case.heads_q, case.seq_q, case.head_dim), case, device),
        "k": _array(rng, (case.batch, case.heads_kv, case.seq_k, case.head_dim), case, device),
        "v": _array(rng, (case.batch, case.heads_kv, case.seq_k, case.head_dim_v), case, device),
        "mask": None,
        "key_lengths": None,
    }
    if case.mask_kind == "bool":
        inputs["mask"] = xp.asarray(rng.random(case.mask_shape) < 0.8)
    elif case.mask_kind == "float":
        values = rng.standard_normal(case.mask_shape).astype(np.float32)
        values[rng.random(case.mask_shape) < 0.15] = -np.inf
        inputs["mask"] = xp.asarray(values)
    if case.key_lengths is not None:
        inputs["key_lengths"] = xp.asarray(np.array(case.key_lengths, dtype=np.int32))
    return inputs


def dout_like(case: Case, device: str = "cpu") -> Any:
    """A random output gradient ``(B, Hq, Sq, Dv)`` in the case's layout, dtype and device."""
    rng = np.random.default_rng(case.seed + 1)
    return _array(rng, (case.batch, case.heads_q, case.seq_q, case.head_dim_v), case, device)


def bhsd_float64(array: Any, layout: str) -> np.ndarray:
    """A caller-layout array (any device) as a float64 host array in (B, H, S, D) order."""
    values = to_host(array).astype(np.float64)
    return values.swapaxes(1, 2) if layout == "bshd" else values


def relative_error(result: np.ndarray, expected: np.ndarray, magnitude: np.ndarray | None = None) -> float:
    """``||result - expected||_F / ||expected||_F`` (absolute norm when expected is all zero).

    With ``magnitude`` (the same sum over absolute values of its terms, see ``_oracle.Gradients``)
    the denominator is ``||magnitude||_F``: the componentwise error bound, which equals the plain
    relative error where nothing cancels and stays meaningful where a gradient cancels to ~0.
    """
    difference = float(np.linalg.norm((result - expected).ravel()))
    scale = float(np.linalg.norm((expected if magnitude is None else magnitude).ravel()))
    return difference / scale if scale > 0 else difference
