"""The cpu backend's results: large ones reuse the memory of results that are gone
(fastattn/_cpu/result_blocks.h), never of one still alive, and every one is written whole."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

import fastattn
from fastattn._cpu import _flash

from .conformance import _oracle

pytestmark = pytest.mark.skipif(
    not fastattn.backends.available()["cpu"].available, reason="the cpu backend is unavailable"
)

#: (B, H, S, D) of a float32 output of 2 MiB: above the cache's 256 KiB threshold.
LARGE = (1, 4, 1024, 128)


def address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def inputs(seed: int, shape: tuple[int, int, int, int] = LARGE, dtype: type = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


def test_a_result_gone_lends_its_memory_to_the_next() -> None:
    """The memory waits for the next result: an array of the same size made in between (which
    malloc would serve from memory just freed) does not get it, nor does an older block of the same
    size in the cache."""
    q, k, v = inputs(1)
    older = fastattn.attention(q, k, v, backend="cpu")
    first = fastattn.attention(q, k, v, backend="cpu")
    del older
    kept = address(first)
    del first
    gc.collect()
    between = np.empty_like(q)
    second = fastattn.attention(q, k, v, backend="cpu")
    assert address(second) == kept != address(between)


def test_live_results_never_share_memory() -> None:
    """Each of several results alive at once, and a view that outlives its array, keeps memory of
    its own, and a later call leaves their values as they were."""
    calls = [inputs(seed) for seed in (2, 3, 4)]
    results = [fastattn.attention(*x, backend="cpu") for x in calls]
    view = fastattn.attention(*inputs(5), backend="cpu")[0, 1]
    gc.collect()
    expected = [r.copy() for r in results] + [view.copy()]
    later = [fastattn.attention(*x, backend="cpu") for x in calls]
    starts = [address(r) for r in results + later]
    assert len(set(starts)) == len(starts)
    view_start = address(view)
    assert all(not (start <= view_start < start + r.nbytes) for start, r in zip(starts, results + later))
    for before, now in zip(expected, results + [view]):
        np.testing.assert_array_equal(before, now)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_reused_memory_is_written_whole(dtype: type) -> None:
    """A call whose rows see fewer keys than the last call's (key_lengths, 0 for one batch row)
    over a block that held the last result: every element is the new call's, checked against the
    float64 oracle, the rows without keys 0 and their lse -inf."""
    shape = (2, 4, 512, 128)
    q, k, v = inputs(6, shape, dtype)
    lengths = np.array([0, 300], dtype=np.int64)
    previous = _flash.poison_results(False)  # the block keeps the last result, not NaN
    try:
        last = fastattn.attention(q, k, v, backend="cpu")
        del last
        gc.collect()
        out, lse = fastattn.attention(q, k, v, key_lengths=lengths, return_lse=True, backend="cpu")
    finally:
        _flash.poison_results(previous)
    reference_out, reference_lse = _oracle.forward(
        *(x.astype(np.float64) for x in (q, k, v)), _oracle.Options(key_lengths=lengths)
    )
    assert np.all(out[0].astype(np.float64) == 0) and np.all(np.isneginf(lse[0]))
    tolerance = 2e-2 if dtype is ml_dtypes.bfloat16 else 2e-5
    np.testing.assert_allclose(out[1].astype(np.float64), reference_out[1], atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(lse[1], reference_lse[1], atol=tolerance, rtol=tolerance)
