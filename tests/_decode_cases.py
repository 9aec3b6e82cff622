"""Decode-sized cases (Sq <= 16, a KV cache) shared by the device tests of the decode kernels
(``test_cuda_decode.py``) and their emulated runs (``emulator/test_decode.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

import fastattn
from fastattn._gpu import decode

from .conformance._cases import (
    FORWARD_TOLERANCE,
    Case,
    array_module,
    bhsd_float64,
    make_inputs,
    relative_error,
    to_host,
)


def decode_case(**changes: Any) -> Case:
    """B=3, Hkv=2, group 4, Sq=1, D=128, float32, bottom-right causal; fields overridable."""
    base = Case(
        batch=3, heads_kv=2, group=4, seq_q=1, seq_k=63, head_dim=128, head_dim_v=128, dtype="float32",
        layout="bhsd", causal="bottom_right", window=None, mask_kind=None, mask_shape=None, key_lengths=None,
        softcap=None, scale=None, strided="contiguous", seed=1234,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def ragged(seq_k: int, batch: int = 3) -> tuple[int, ...]:
    """Per-row lengths: full, an odd part, and 0 (a row whose queries see nothing)."""
    return (seq_k, max(1, (seq_k * 5) // 7 | 1), 0)[:batch]


#: Contract features on a seq_k = 500 case, as changes to :func:`decode_case`.
FEATURES: dict[str, dict[str, Any]] = {
    "window": {"window": (100, 0)},
    "window-both-sides": {"causal": False, "window": (40, 3), "seq_q": 4},
    "bool-mask": {"mask_kind": "bool", "mask_shape": (3, 8, 1, 500)},
    "float-mask-broadcast": {"mask_kind": "float", "mask_shape": (1, 500)},
    "softcap": {"softcap": 5.0, "scale": 1.3},
    "bshd": {"layout": "bshd", "seq_q": 3},
    "mqa": {"heads_kv": 1, "group": 16, "seq_q": 2},
}


#: (id, case) of the NaN/inf runs: the float32 decode with its lanes splitting a key 1, 2 and 4 ways,
#: 4 and 8 rows a block; the tensor-core decode (its exact rerun) in both 16-bit types.
NONFINITE_CASES: list[tuple[str, Case]] = [
    (f"{dtype}-d{head_dim}-group{group}",
     decode_case(dtype=dtype, seq_k=300, head_dim=head_dim, head_dim_v=head_dim, group=group, causal=False,
                 mask_kind="bool", mask_shape=(3, 1, 1, 300), key_lengths=ragged(300)))
    for dtype, head_dim, group in (("float32", 32, 4), ("float32", 32, 8), ("float32", 64, 8), ("float32", 128, 4),
                                   ("float32", 256, 4), ("bfloat16", 32, 4), ("bfloat16", 128, 8),
                                   ("float16", 64, 4), ("float16", 256, 4))
]  # fmt: skip


def assert_decode_matches_the_reference(backend: str, device: str, case: Case, inputs: dict[str, Any]) -> None:
    """``backend``'s out and lse (inputs moved to ``device``) against the reference on the host
    inputs: the same NaN/+inf/-inf positions, the finite entries within the forward tolerance."""
    xp = array_module(device)
    moved = {name: None if value is None else xp.asarray(value) for name, value in inputs.items()}
    with np.errstate(all="ignore"):
        want_out, want_lse = fastattn.attention(
            inputs["q"], inputs["k"], inputs["v"], backend="reference", return_lse=True, **case.kwargs(inputs)
        )
        got_out, got_lse = fastattn.attention(
            moved["q"], moved["k"], moved["v"], backend=backend, return_lse=True, **case.kwargs(moved)
        )
    for name, got, want in (("out", bhsd_float64(got_out, case.layout), bhsd_float64(want_out, case.layout)),
                            ("lse", to_host(got_lse).astype(np.float64), to_host(want_lse).astype(np.float64))):
        for kind, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
            where = np.argwhere(test(got) != test(want))
            assert where.size == 0, f"{case}: {name}: {kind} pattern differs from the reference at {where[:5].tolist()}"
        finite = np.isfinite(want)
        error = relative_error(got[finite], want[finite])
        assert error <= FORWARD_TOLERANCE[case.dtype], f"{case}: {name}: finite entries off by {error:.3g}"


def nonfinite_inputs(case: Case) -> dict[str, Any]:
    """The case's host inputs with a KV cache holding NaN/inf: past key_lengths (in a tile with
    visible keys) and behind the bool mask they must never reach a row; at a few visible keys they
    must give the reference's NaN/inf pattern (a weight of 0 counts 0)."""
    inputs = make_inputs(case)
    rng = np.random.default_rng(case.seed)
    k, v, mask = inputs["k"], inputs["v"], inputs["mask"]
    poisons = np.array([np.nan, np.inf, -np.inf])
    for b, length in enumerate(case.key_lengths or ()):
        v[b, :, length:] = rng.choice(poisons, v[b, :, length:].shape)
        k[b, :, length:] = np.nan
        v[b, :, ~mask[b, 0, 0]] = np.inf
        visible = np.flatnonzero(mask[b, 0, 0, :length])
        for key in rng.choice(visible, size=min(2, visible.size), replace=False):
            v[b, rng.integers(case.heads_kv), key, rng.integers(case.head_dim_v)] = rng.choice(poisons)
    return inputs


#: float32 decode cases for :func:`check_rising_maximum`, at every head_dim, 4 and 8 rows a block.
RISING_CASES: list[tuple[str, Case]] = [
    (f"float32-d{head_dim}-group{group}",
     decode_case(seq_k=300, head_dim=head_dim, head_dim_v=head_dim, group=group, causal=False))
    for head_dim in decode.HEAD_DIMS
    for group in (4, 8)
]  # fmt: skip


def rising_inputs(case: Case) -> dict[str, Any]:
    """The case's host inputs with the first 32 keys (a whole first tile of every warp) scoring ~150
    below the others for every row of their kv head: the float32 decode's lazy tiles must leave the
    first tile's shift once the row maxima rise past their slack, or 2^(s - shift) overflows."""
    inputs = make_inputs(case)
    rng = np.random.default_rng(case.seed)
    q, k = inputs["q"], inputs["k"]
    grouped = q.reshape(case.batch, case.heads_kv, case.group, case.head_dim).sum(axis=2)
    direction = grouped / np.linalg.norm(grouped, axis=-1, keepdims=True)
    noise = 0.1 * rng.standard_normal(k[:, :, :32].shape)
    k[:, :, :32] = (-300.0 * direction[:, :, None, :] + noise).astype(k.dtype)
    return inputs
