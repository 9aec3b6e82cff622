"""The split-KV decode kernels (``flash_decode.cu``: tensor cores for float16/bfloat16, SIMT float32)
run by the SIMT emulator through the cuda backend (``backend="cuda-emulated"``), with the
conformance suite's checks (``check_forward``: poisoned outputs, -inf lse and zero output exactly
on rows that see no key, the float64 oracle within FORWARD_TOLERANCE) on a fresh seed per run.

A subset of the device tests (``tests/test_cuda_decode.py``), small enough for the emulator: cache
lengths at tile edges with ragged key_lengths (a row of length 0), packs of 1 to 64 rows (chunks of
16), both causal alignments, every contract feature at every head_dim, and forced split counts.
Each case asserts that the decode kernel is what ran.  Beyond the conformance checks, the float32
kernel's two slow paths get inputs that need them: a cache holding NaN/inf (behind the mask, past
key_lengths, at visible keys: the exact zero-weight rule) and row maxima rising far past the first
tile (its rescaling tiles).  ``planted_bugs.py`` replays all three lists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections.abc import Iterator
from unittest import mock

import numpy as np
import pytest

import fastattn
from fastattn import _arrays
from fastattn._gpu import decode

from .._decode_cases import FEATURES, decode_case, ragged
from .._poison import poisoned_allocator
from ..conformance._cases import FORWARD_TOLERANCE, Case, bhsd_float64, make_inputs, relative_error, to_host
from ..conformance.test_forward import check_forward


def _split_case(dtype: str, splits: int) -> tuple[Case, tuple[int, int]]:
    """A 1000-key case run with ``splits`` forced splits of whole 64-key tiles."""
    per_split = math.ceil(math.ceil(1000 / splits) / 64) * 64
    return decode_case(dtype=dtype, seq_k=1000, key_lengths=(1000, 300, 0)), (splits, per_split)


#: (id, case, forced (splits, keys_per_split) or None for the launcher's plan).
CASES: list[tuple[str, Case, tuple[int, int] | None]] = [
    *(
        (f"lengths-{dtype}-sk{seq_k}-group{group}",
         decode_case(dtype=dtype, seq_k=seq_k, group=group, key_lengths=ragged(seq_k)), None)
        for dtype in ("float16", "bfloat16", "float32")
        for seq_k, group in ((1, 4), (65, 1), (129, 8), (1001, 4))
    ),
    # 16 rows (one whole m16 fragment), 20 (two chunks; top-left leaves most splits empty), 64 (four
    # chunks), and float32's chunks of 8.
    *(
        (f"rows-{dtype}-sq{seq_q}-group{group}-{causal}",
         decode_case(dtype=dtype, seq_q=seq_q, seq_k=777, group=group, causal=causal, key_lengths=ragged(777)), None)
        for dtype, seq_q, group, causal in (
            ("bfloat16", 2, 8, "bottom_right"), ("bfloat16", 5, 4, "top_left"), ("float16", 16, 4, False),
            ("float32", 5, 4, "bottom_right"),
        )
    ),
    *(
        (f"{feature}-{dtype}-d{head_dim}",
         dataclasses.replace(decode_case(dtype=dtype, seq_k=500, head_dim=head_dim, head_dim_v=head_dim,
                                         key_lengths=ragged(500)), **FEATURES[feature]), None)
        for dtype in ("float16", "bfloat16")
        for head_dim in decode.HEAD_DIMS
        for feature in FEATURES
    ),
    # float32 at every head_dim, 4 rows a block and 8 (mqa: 32 packed rows).
    *(
        (f"{feature}-float32-d{head_dim}",
         dataclasses.replace(decode_case(seq_k=500, head_dim=head_dim, head_dim_v=head_dim, key_lengths=ragged(500)),
                             **FEATURES[feature]), None)
        for head_dim in decode.HEAD_DIMS
        for feature in ("bool-mask", "softcap", "window-both-sides", "mqa")
    ),
    # Scores spread over hundreds of log2 units: the float32 decode's row maxima rise past its lazy
    # tiles' slack again and again (rescaling tiles between lazy ones).
    *(
        (f"wide-scores-{dtype}-d{head_dim}",
         decode_case(dtype=dtype, seq_k=700, head_dim=head_dim, head_dim_v=head_dim, scale=3.0,
                     key_lengths=ragged(700)), None)
        for dtype, head_dim in (("float32", 32), ("float32", 64), ("float32", 128), ("float32", 256), ("bfloat16", 64))
    ),
    *((f"splits{splits}-{dtype}", *_split_case(dtype, splits)) for dtype in ("bfloat16", "float32")
      for splits in (1, 3, 16)),
]  # fmt: skip


@contextlib.contextmanager
def _decode_runs(case: object, forced: tuple[int, int] | None = None) -> Iterator[None]:
    """Poisoned results, the decode's split plan recorded (or ``forced``); the decode kernel must
    have run by the end."""
    plans: list[tuple[int, int]] = []
    planned = decode.plan

    def recording(problem, multiprocessors):
        plans.append(forced or planned(problem, multiprocessors))
        return plans[-1]

    with mock.patch.object(decode, "plan", recording), mock.patch.object(_arrays, "empty_bhsd", poisoned_allocator()):
        yield
    assert plans, f"the decode kernel did not run: {case}"


def check_emulated_decode(case: Case, forced: tuple[int, int] | None = None) -> None:
    """``check_forward`` on the emulated cuda backend with a fresh seed and NaN-poisoned results;
    the decode kernel must be what ran (``forced``: its split plan instead of the launcher's)."""
    case = dataclasses.replace(case, seed=random.randrange(2**32))
    with _decode_runs(case, forced):
        try:
            check_forward("cuda-emulated", "cpu", case)
        except AssertionError as error:
            raise AssertionError(f"{case}: {error}") from error


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


def _assert_decode_matches_the_reference(case: Case, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: object,
                                         key_lengths: object) -> None:
    """The emulated decode's out and lse against the reference on these inputs: the same NaN/+inf/-inf
    positions, the finite entries within the forward tolerance."""
    kwargs = case.kwargs({"mask": mask, "key_lengths": key_lengths})
    with np.errstate(all="ignore"):
        want_out, want_lse = fastattn.attention(q, k, v, backend="reference", return_lse=True, **kwargs)
        with _decode_runs(case):
            got_out, got_lse = fastattn.attention(q, k, v, backend="cuda-emulated", return_lse=True, **kwargs)
    for name, got, want in (("out", bhsd_float64(got_out, case.layout), bhsd_float64(want_out, case.layout)),
                            ("lse", to_host(got_lse).astype(np.float64), to_host(want_lse).astype(np.float64))):
        for kind, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
            where = np.argwhere(test(got) != test(want))
            assert where.size == 0, f"{case}: {name}: {kind} pattern differs from the reference at {where[:5].tolist()}"
        finite = np.isfinite(want)
        error = relative_error(got[finite], want[finite])
        assert error <= FORWARD_TOLERANCE[case.dtype], f"{case}: {name}: finite entries off by {error:.3g}"


def check_nonfinite_decode(case: Case) -> None:
    """A KV cache holding NaN/inf: past key_lengths (in a tile with visible keys) and behind the bool
    mask they must never reach a row; at a few visible keys they must give the reference's NaN/inf
    pattern (a weight of 0 counts 0)."""
    case = dataclasses.replace(case, seed=random.randrange(2**32))
    inputs = make_inputs(case)
    rng = np.random.default_rng(case.seed)
    k, v, mask = to_host(inputs["k"]).copy(), to_host(inputs["v"]).copy(), to_host(inputs["mask"])
    poisons = np.array([np.nan, np.inf, -np.inf])
    for b, length in enumerate(case.key_lengths or ()):
        v[b, :, length:] = rng.choice(poisons, v[b, :, length:].shape)
        k[b, :, length:] = np.nan
        v[b, :, ~mask[b, 0, 0]] = np.inf
        visible = np.flatnonzero(mask[b, 0, 0, :length])
        for key in rng.choice(visible, size=min(2, visible.size), replace=False):
            v[b, rng.integers(case.heads_kv), key, rng.integers(case.head_dim_v)] = rng.choice(poisons)
    _assert_decode_matches_the_reference(case, inputs["q"], k, v, inputs["mask"], inputs["key_lengths"])


#: float32 decode cases for :func:`check_rising_maximum`, at every head_dim, 4 and 8 rows a block.
RISING_CASES: list[tuple[str, Case]] = [
    (f"float32-d{head_dim}-group{group}",
     decode_case(seq_k=300, head_dim=head_dim, head_dim_v=head_dim, group=group, causal=False))
    for head_dim in decode.HEAD_DIMS
    for group in (4, 8)
]  # fmt: skip


def check_rising_maximum(case: Case) -> None:
    """The first 32 keys (a whole first tile of every warp) score ~150 below the others for every
    row of their kv head: the float32 decode's lazy tiles must leave the first tile's shift once the
    row maxima rise past their slack, or 2^(s - shift) overflows."""
    case = dataclasses.replace(case, seed=random.randrange(2**32))
    inputs = make_inputs(case)
    rng = np.random.default_rng(case.seed)
    q, k = to_host(inputs["q"]), to_host(inputs["k"]).copy()
    grouped = q.reshape(case.batch, case.heads_kv, case.group, case.head_dim).sum(axis=2)
    direction = grouped / np.linalg.norm(grouped, axis=-1, keepdims=True)
    noise = 0.1 * rng.standard_normal(k[:, :, :32].shape)
    k[:, :, :32] = (-300.0 * direction[:, :, None, :] + noise).astype(k.dtype)
    _assert_decode_matches_the_reference(case, q, k, inputs["v"], None, None)


@pytest.mark.parametrize(("case", "forced"), [entry[1:] for entry in CASES], ids=[entry[0] for entry in CASES])
def test_decode_matches_the_oracle(case: Case, forced: tuple[int, int] | None) -> None:
    check_emulated_decode(case, forced)


@pytest.mark.parametrize("case", [entry[1] for entry in NONFINITE_CASES], ids=[entry[0] for entry in NONFINITE_CASES])
def test_nan_and_inf_in_the_cache_follow_the_reference(case: Case) -> None:
    check_nonfinite_decode(case)


@pytest.mark.parametrize("case", [entry[1] for entry in RISING_CASES], ids=[entry[0] for entry in RISING_CASES])
def test_row_maxima_rising_far_past_the_first_tile(case: Case) -> None:
    check_rising_maximum(case)
