"""RotaryEmbedding: the Llama rotation, its inverse, and relative-position invariance."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from fastattn.nn import RotaryEmbedding

from . import _reference


@pytest.mark.parametrize("base", [10000.0, 500000.0, 10.0])
def test_matches_the_pairwise_rotation(base, rng):
    rope = RotaryEmbedding(8, base)
    x = rng.standard_normal((2, 5, 3, 8))
    positions = rng.integers(0, 4096, size=(2, 5))
    assert np.allclose(rope.apply(x, positions), _reference.rope(x, positions, base), rtol=0, atol=1e-10)
    assert np.allclose(rope.inv_freq, base ** (-np.arange(0, 8, 2) / 8))


def test_inverse_undoes_and_norms_are_kept(rng):
    rope = RotaryEmbedding(16)
    x = rng.standard_normal((1, 7, 2, 16))
    positions = np.arange(7)
    rotated = rope.apply(x, positions)
    assert np.allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), atol=1e-12)
    assert np.allclose(rope.apply(rotated, positions, inverse=True), x, atol=1e-12)
    assert np.array_equal(rope.apply(x, np.zeros(7, dtype=int)), x)


def test_scores_depend_only_on_relative_position(rng):
    rope = RotaryEmbedding(8)
    q, k = rng.standard_normal((2, 1, 1, 1, 8))
    shifted = [
        float(np.sum(rope.apply(q, np.array([[m + t]])) * rope.apply(k, np.array([[n + t]]))))
        for m, n, t in ((5, 2, 0), (5, 2, 100), (5, 2, 3000))
    ]
    assert np.allclose(shifted, shifted[0], atol=1e-9)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_dtype_is_kept_and_inputs_untouched(dtype, rng):
    x = rng.standard_normal((1, 3, 2, 4)).astype(dtype)
    before = x.copy()
    out = RotaryEmbedding(4).apply(x, np.arange(3))
    assert out.dtype == np.dtype(dtype) and np.array_equal(x, before)
    expected = _reference.rope(x.astype(np.float64), np.arange(3)[None], 10000.0)
    assert np.allclose(out.astype(np.float64), expected, atol=2e-2 if dtype != np.float32 else 1e-6)


def test_errors():
    with pytest.raises(ValueError, match=re.escape("head_dim: expected an even size for rotary embedding, received 5")):
        RotaryEmbedding(5)
    with pytest.raises(ValueError, match=re.escape("base: expected a number > 1, received 1")):
        RotaryEmbedding(4, 1)
    message = "x: expected a last axis of head_dim=4, received shape (1, 2, 1, 6)"
    with pytest.raises(ValueError, match=re.escape(message)):
        RotaryEmbedding(4).apply(np.zeros((1, 2, 1, 6)), np.arange(2))
    assert repr(RotaryEmbedding(4, 500000)) == "RotaryEmbedding(head_dim=4, base=500000)"
