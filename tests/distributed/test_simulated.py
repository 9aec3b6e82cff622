"""Ring and Ulysses attention on 1-8 simulated ranks equal one process's attention, forward and backward.

float64: within 1e-12 relative of the single-process cpu backend.  float32: the sharded error
against the float64 result is at most twice the single-process float32 error, the error being the
root-mean-square deviation over all elements (the largest deviation alone, at a few ulps, varies
from seed to seed by more than 2x for one process too).  Every case runs
both shardings; sizes are chosen so that shards are uneven, and some ranks hold one chunk or none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ._sharded import Inputs, random_inputs, sharded, single_process, worst_relative

#: name -> ((B, Hq, Hkv, Sq, Sk, D, Dv), options)
CASES: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    "causal": ((2, 4, 4, 45, 45, 16, 16), {"causal": True}),
    "non-causal-gqa": ((1, 8, 2, 38, 38, 16, 8), {}),
    "mqa-causal": ((1, 4, 1, 41, 41, 8, 16), {"causal": "top_left"}),
    "cross-bottom-right": ((2, 4, 2, 29, 45, 16, 16), {"causal": "bottom_right"}),
    "cross-top-left-more-queries": ((1, 4, 4, 50, 31, 16, 16), {"causal": True}),
    "window": ((1, 4, 2, 47, 47, 16, 16), {"window": (6, 3)}),
    "causal-window-bottom-right": ((1, 4, 4, 33, 47, 16, 16), {"causal": "bottom_right", "window": (5, 0)}),
    "softcap-causal": ((1, 4, 4, 40, 40, 16, 16), {"causal": True, "softcap": 2.5, "scale": 0.7}),
    "key-lengths": ((2, 4, 2, 44, 44, 16, 16), {"causal": True, "key_lengths": np.array([37, 9])}),
    "key-lengths-zero-cross": ((2, 4, 4, 20, 40, 8, 8), {"key_lengths": np.array([0, 23])}),
    "tiny-shards": ((1, 8, 8, 5, 5, 8, 8), {"causal": True}),
}
RANKS = (1, 2, 3, 4, 8)


def _runs(strategy: str, ranks: int, shape: tuple[int, ...]) -> bool:
    heads_q, heads_kv = shape[1], shape[2]
    return strategy == "ring" or (heads_q % ranks == 0 and heads_kv % ranks == 0)


def _inputs(shape: tuple[int, ...]) -> Inputs:
    return random_inputs(*shape)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ranks", RANKS)
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.parametrize("case", list(CASES))
def test_float64_equals_one_process(case: str, strategy: str, ranks: int, sharding: str) -> None:
    shape, options = CASES[case]
    if not _runs(strategy, ranks, shape):
        pytest.skip(f"Ulysses needs Hq and Hkv divisible by {ranks}")
    inputs = _inputs(shape)
    expected = single_process(inputs, np.float64, **options)
    actual = sharded(strategy, ranks, inputs, np.float64, sharding=sharding, **options)
    assert worst_relative(actual, expected) <= 1e-12, f"seed {inputs.seed}"


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.parametrize("case", ["causal", "cross-bottom-right", "softcap-causal", "key-lengths"])
def test_float32_error_at_most_twice_one_process(case: str, strategy: str, ranks: int) -> None:
    shape, options = CASES[case]
    if not _runs(strategy, ranks, shape):
        pytest.skip(f"Ulysses needs Hq and Hkv divisible by {ranks}")
    inputs = _inputs(shape)
    oracle = single_process(inputs, np.float64, **options)
    one = single_process(inputs, np.float32, **options)
    split = sharded(strategy, ranks, inputs, np.float32, **options)
    for name, got, alone, want in zip(("out", "lse", "dq", "dk", "dv"), split, one, oracle):
        finite = np.isfinite(want)
        split_error = np.sqrt(np.mean((got[finite] - want[finite]) ** 2))
        alone_error = np.sqrt(np.mean((alone[finite] - want[finite]) ** 2))
        assert split_error <= 2 * alone_error, (
            f"{name}: {split_error:.3g} vs one process {alone_error:.3g}, seed {inputs.seed}"
        )


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_bshd_layout(strategy: str) -> None:
    shape, options = CASES["causal-window-bottom-right"]
    inputs = _inputs(shape)
    expected = single_process(inputs, np.float64, **options)
    actual = sharded(strategy, 2, inputs, np.float64, layout="bshd", **options)
    assert worst_relative(actual, expected) <= 1e-12, f"seed {inputs.seed}"


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_bfloat16_close_to_one_process(strategy: str) -> None:
    """bfloat16 runs (each block's partial rounded to bf16 before the float32 merge)."""
    from fastattn._arrays import bfloat16

    shape, options = CASES["causal"]
    inputs = _inputs(shape)
    oracle = single_process(inputs, np.float64, **options)
    one = single_process(inputs, bfloat16, **options)
    split = sharded(strategy, 2, inputs, bfloat16, **options)
    for got, alone, want in zip(split, one, oracle):
        finite = np.isfinite(want)
        assert np.abs(got[finite] - want[finite]).max() <= 3 * np.abs(alone[finite] - want[finite]).max() + 1e-2


@pytest.mark.parametrize("backend", ["reference", "cuda-emulated"])
def test_blocks_run_on_other_backends(backend: str) -> None:
    """Every block's key_offset reaches the kernels of the other backends (the GPU's in the emulator)."""
    import fastattn

    if not fastattn.backends.available()[backend].available:
        pytest.skip(f"{backend} unavailable here")
    shape = (1, 4, 2, 40, 40, 16, 16)
    options = {"causal": "bottom_right", "window": (9, 2), "key_lengths": np.array([33])}
    inputs = _inputs(shape)
    expected = single_process(inputs, np.float32, **options)
    actual = sharded("ring", 3, inputs, np.float32, backend=backend, **options)
    assert worst_relative(actual, expected) <= 1e-5, f"seed {inputs.seed}"
