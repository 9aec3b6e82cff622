"""Attention dropout on every backend: the same Philox mask as the reference, forward and backward.

The mask is a function of (seed, offset, b, h, i, j) (``fastattn/_shared/philox.h``), so every backend
must drop exactly the elements the reference drops.  With V = identity the output row *is* the
dropped, rescaled probability row, which makes the mask visible element by element.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import fastattn
from fastattn import _dropout

from ._cases import to_device, to_host


def _skip_if_declined(backend: str, q, k, v, **options) -> None:
    explanation = fastattn.explain(q, k, v, **options)
    reasons = explanation.reasons[backend] + explanation.backward_reasons[backend]
    if reasons:
        pytest.skip(f"{backend} declines: {reasons}")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 1, 64), (1, 8, 2, 3, 64), (2, 2, 1, 70, 64), (1, 2, 2, 33, 17)],
    ids=["decode", "gqa-few-rows", "tiles", "odd"],
)
@pytest.mark.parametrize("options", [{}, {"causal": "bottom_right"}, {"window": (3, 7), "key_lengths": [60, 9]}])
def test_mask_is_the_references_element_by_element(backend: str, device: str, dtype, shape, options) -> None:
    batch, heads_q, heads_kv, seq_q, seq_k = shape
    rng = np.random.default_rng()
    options = dict(options)
    if "key_lengths" in options:
        options["key_lengths"] = np.minimum(np.array(options["key_lengths"][:batch] * batch)[:batch], seq_k)
    q = rng.standard_normal((batch, heads_q, seq_q, 16)).astype(dtype)
    k = rng.standard_normal((batch, heads_kv, seq_k, 16)).astype(dtype)
    v = np.broadcast_to(np.eye(seq_k, dtype=dtype), (batch, heads_kv, seq_k, seq_k)).copy()
    seed, offset = int(rng.integers(2**64, dtype=np.uint64)), int(rng.integers(2**32))
    drop = {"dropout_p": 0.4, "dropout_seed": seed, "dropout_offset": offset}
    on_device = [to_device(value, device) for value in (q, k, v, options)]
    _skip_if_declined(backend, *on_device[:3], **on_device[3], **drop)
    got = to_host(fastattn.attention(*on_device[:3], backend=backend, **on_device[3], **drop))
    want = fastattn.attention(q, k, v, backend="reference", **options, **drop)
    assert np.array_equal(got == 0, want == 0), f"dropped elements differ (seed {seed}, offset {offset})"
    np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-7)
    undropped = fastattn.attention(q, k, v, backend="reference", **options)
    kept = want != 0
    np.testing.assert_allclose(want[kept], undropped[kept] / 0.6, rtol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_scale(backend: str, device: str, p: float) -> None:
    """Uniform probabilities (q = 0) on V = identity: each output entry is 0 or 1 / ((1-p) Sk),
    and the kept fraction lies within 5 binomial standard deviations of 1 - p."""
    batch, heads, seq_q, seq_k = 4, 4, 128, 64
    q = np.zeros((batch, heads, seq_q, 16), np.float32)
    k = np.random.default_rng().standard_normal((batch, heads, seq_k, 16)).astype(np.float32)
    v = np.broadcast_to(np.eye(seq_k, dtype=np.float32), (batch, heads, seq_k, seq_k)).copy()
    options = {"dropout_p": p, "dropout_seed": int(np.random.default_rng().integers(2**63))}
    q, k, v = (to_device(value, device) for value in (q, k, v))
    _skip_if_declined(backend, q, k, v, **options)
    out = to_host(fastattn.attention(q, k, v, backend=backend, **options))
    kept = out != 0
    np.testing.assert_allclose(out[kept], 1 / ((1 - p) * seq_k), rtol=1e-6)
    trials = out.size
    sigma = math.sqrt(trials * p * (1 - p))
    assert abs(kept.sum() - trials * (1 - p)) <= 5 * sigma, f"kept {kept.mean():.4f}, expected {1 - p}"


def test_seed_offset_and_extremes(backend: str) -> None:
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 40, 16)) for _ in range(3))
    _skip_if_declined(backend, q, k, v, dropout_p=0.5, dropout_seed=1)

    def run(**drop):
        return fastattn.attention(q, k, v, backend=backend, **drop)

    assert np.array_equal(run(dropout_p=0.5, dropout_seed=9), run(dropout_p=0.5, dropout_seed=9))
    assert not np.array_equal(run(dropout_p=0.5, dropout_seed=9), run(dropout_p=0.5, dropout_seed=10))
    assert not np.array_equal(
        run(dropout_p=0.5, dropout_seed=9, dropout_offset=1), run(dropout_p=0.5, dropout_seed=9)
    )
    np.testing.assert_array_equal(run(dropout_p=0.0, dropout_seed=9), run())
    assert np.all(run(dropout_p=1.0, dropout_seed=9) == 0)


@pytest.mark.parametrize("options", [{}, {"causal": True, "softcap": 2.0}, {"key_lengths": np.array([5])}])
def test_backward_matches_finite_differences_with_a_fixed_mask(backend: str, options) -> None:
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 4, 5, 8))
    k, v = rng.standard_normal((1, 2, 7, 8)), rng.standard_normal((1, 2, 7, 6))
    weights = rng.standard_normal((1, 4, 5, 6))
    drop = {"dropout_p": 0.3, "dropout_seed": int(rng.integers(2**63)), "dropout_offset": 3}
    _skip_if_declined(backend, q, k, v, **options, **drop)
    out, lse = fastattn.attention(q, k, v, backend=backend, return_lse=True, **options, **drop)
    grads = fastattn.attention_backward(weights, q, k, v, out, lse, backend=backend, **options, **drop)
    inputs = {"q": q, "k": k, "v": v}
    step = 1e-6
    for name, grad in zip("qkv", grads):
        numeric = np.zeros_like(inputs[name])
        for index in np.ndindex(numeric.shape):
            losses = []
            for sign in (1, -1):
                shifted = dict(inputs)
                shifted[name] = inputs[name].copy()
                shifted[name][index] += sign * step
                result = fastattn.attention(**shifted, backend=backend, **options, **drop)
                losses.append(float(np.sum(result * weights)))
            numeric[index] = (losses[0] - losses[1]) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("options", [{"causal": "bottom_right"}, {"window": (6, 2), "softcap": 3.0}])
def test_float32_backward_matches_the_reference_under_the_same_mask(backend: str, device: str, options) -> None:
    """The finite-difference test above runs in float64, which GPU kernels decline: here float32
    gradients (GQA, tiles of several rows and keys) against the float64 reference, same seed."""
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 4, 37, 24)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 45, 24)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    drop = {"dropout_p": 0.3, "dropout_seed": int(rng.integers(2**63)), "dropout_offset": int(rng.integers(2**32))}
    wide = [x.astype(np.float64) for x in (q, k, v)]
    out, lse = fastattn.attention(*wide, backend="reference", return_lse=True, **options, **drop)
    want = fastattn.attention_backward(dout.astype(np.float64), *wide, out, lse, backend="reference", **options, **drop)
    arguments = [to_device(x, device) for x in (dout, q, k, v, out.astype(np.float32), lse.astype(np.float32))]
    _skip_if_declined(backend, *arguments[1:4], **options, **drop)
    got = [to_host(grad) for grad in fastattn.attention_backward(*arguments, backend=backend, **options, **drop)]
    for grad, expected, name in zip(got, want, "qkv"):
        error = np.linalg.norm(grad.astype(np.float64) - expected) / np.linalg.norm(expected)
        assert error <= 1e-4, f"d{name}: {error:.3g} (seed {drop['dropout_seed']})"


def test_backward_needs_the_forwards_seed(backend: str) -> None:
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    out, lse = fastattn.attention(q, k, v, return_lse=True, dropout_p=0.5, dropout_seed=3)
    with pytest.raises(ValueError, match="^dropout_seed:"):
        fastattn.attention_backward(out, q, k, v, out, lse, backend=backend, dropout_p=0.5)


def test_philox_known_answers() -> None:
    """Random123's published Philox4x32-10 vectors, through the numpy implementation the
    reference uses (the C one in philox.h is held to it by the mask tests above)."""
    vectors = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in vectors:
        assert [int(word) for word in _dropout.philox4x32_10(np, counter, key)] == list(expected)


@pytest.mark.parametrize("options", [{}, {"causal": "bottom_right"}, {"window": (20, 3)}])
def test_bfloat16_tile_shapes_drop_the_references_elements(backend: str, device: str, options) -> None:
    """bfloat16 at shapes the matrix-tile kernels take (head dim 32, value dim 64, 80 query rows a
    kv head): the same elements dropped as the reference's, kept ones within bfloat16 rounding."""
    bfloat16 = ml_dtypes.bfloat16
    rng = np.random.default_rng()
    batch, heads_q, heads_kv, seq_q, seq_k = 1, 4, 2, 40, 64
    q = (0.3 * rng.standard_normal((batch, heads_q, seq_q, 32))).astype(bfloat16)
    k = rng.standard_normal((batch, heads_kv, seq_k, 32)).astype(bfloat16)
    v = np.broadcast_to(np.eye(seq_k, dtype=bfloat16), (batch, heads_kv, seq_k, seq_k)).copy()
    seed, offset = int(rng.integers(2**64, dtype=np.uint64)), int(rng.integers(2**32))
    drop = {"dropout_p": 0.3, "dropout_seed": seed, "dropout_offset": offset}
    on_device = [to_device(value, device) for value in (q, k, v)]
    _skip_if_declined(backend, *on_device, **options, **drop)
    got = to_host(fastattn.attention(*on_device, backend=backend, **options, **drop)).astype(np.float64)
    want = fastattn.attention(q, k, v, backend="reference", **options, **drop).astype(np.float64)
    assert np.array_equal(got == 0, want == 0), f"dropped elements differ (seed {seed}, offset {offset})"
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-6)
