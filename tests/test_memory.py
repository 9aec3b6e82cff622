"""Resident memory stays flat over many calls: no leak in the kernels, the scratch or the wrappers."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import fastattn

CALLS = 10_000


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_resident_memory_flat_over_many_calls(backend: str) -> None:
    if not fastattn.backends.available()[backend].available:
        pytest.skip(f"{backend} unavailable")
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 4, 64, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 96, 32)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    options = {"causal": "bottom_right", "key_lengths": np.array([96, 50]), "mask": rng.random((64, 96)) < 0.9}

    def calls(count: int) -> None:
        for _ in range(count):
            out, lse = fastattn.attention(q, k, v, backend=backend, return_lse=True, **options)
            fastattn.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)

    calls(CALLS // 10)  # warm up: allocator pools, caches, lazily built state
    gc.collect()
    before = _resident_bytes()
    calls(CALLS)
    gc.collect()
    after = _resident_bytes()
    assert after <= before * 1.05, f"resident memory grew from {before >> 20} MiB to {after >> 20} MiB"
