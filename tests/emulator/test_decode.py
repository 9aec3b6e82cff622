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

import pytest

from fastattn import _arrays
from fastattn._gpu import decode

from .._decode_cases import (
    FEATURES,
    NONFINITE_CASES,
    RISING_CASES,
    assert_decode_matches_the_reference,
    decode_case,
    nonfinite_inputs,
    ragged,
    rising_inputs,
)
from .._poison import poisoned_allocator
from ..conformance._cases import Case
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


def check_nonfinite_decode(case: Case) -> None:
    """:func:`nonfinite_inputs` on the emulated decode, fresh seed, poisoned results."""
    case = dataclasses.replace(case, seed=random.randrange(2**32))
    with _decode_runs(case):
        assert_decode_matches_the_reference("cuda-emulated", "cpu", case, nonfinite_inputs(case))


def check_rising_maximum(case: Case) -> None:
    """:func:`rising_inputs` on the emulated decode, fresh seed, poisoned results."""
    case = dataclasses.replace(case, seed=random.randrange(2**32))
    with _decode_runs(case):
        assert_decode_matches_the_reference("cuda-emulated", "cpu", case, rising_inputs(case))


@pytest.mark.parametrize(("case", "forced"), [entry[1:] for entry in CASES], ids=[entry[0] for entry in CASES])
def test_decode_matches_the_oracle(case: Case, forced: tuple[int, int] | None) -> None:
    check_emulated_decode(case, forced)


@pytest.mark.parametrize("case", [entry[1] for entry in NONFINITE_CASES], ids=[entry[0] for entry in NONFINITE_CASES])
def test_nan_and_inf_in_the_cache_follow_the_reference(case: Case) -> None:
    check_nonfinite_decode(case)


@pytest.mark.parametrize("case", [entry[1] for entry in RISING_CASES], ids=[entry[0] for entry in RISING_CASES])
def test_row_maxima_rising_far_past_the_first_tile(case: Case) -> None:
    check_rising_maximum(case)
