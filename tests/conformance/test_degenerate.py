"""Degenerate problems on every backend: nothing to attend to gives 0, lse -inf and zero gradients.

Batch, Sq or Sk of 0 are valid calls (empty results, or rows that see no key); so are key_lengths
of 0, masks that hide whole rows and windows that hide everything.  Never NaN, never a crash.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import fastattn

from ._cases import to_device, to_host

DTYPES = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)


def _inputs(b: int, hq: int, hkv: int, sq: int, sk: int, d: int, dtype, layout: str, seed: int):
    rng = np.random.default_rng(seed)

    def make(h: int, s: int) -> np.ndarray:
        shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
        return rng.standard_normal(shape).astype(dtype)

    return make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)


def _run(backend: str, device: str, q, k, v, dout, **options):
    """Forward and backward of host inputs on ``device``; the results as host arrays."""
    q, k, v, dout, options = (to_device(value, device) for value in (q, k, v, dout, options))
    reasons = fastattn.explain(q, k, v, **options)
    if reasons.reasons[backend] or reasons.backward_reasons[backend]:
        pytest.skip(f"{backend} declines: {reasons.reasons[backend] + reasons.backward_reasons[backend]}")
    out, lse = fastattn.attention(q, k, v, backend=backend, return_lse=True, **options)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)
    return to_host(out), to_host(lse), tuple(to_host(grad) for grad in grads)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize(
    "sizes", [(0, 3, 5), (2, 0, 5), (2, 3, 0), (0, 0, 0)], ids=["batch0", "sq0", "sk0", "all0"]
)
def test_empty_sizes(backend: str, device: str, layout: str, dtype, sizes: tuple[int, int, int]) -> None:
    b, sq, sk = sizes
    q, k, v, dout = _inputs(b, 4, 2, sq, sk, 8, dtype, layout, seed=sum(sizes))
    out, lse, (dq, dk, dv) = _run(backend, device, q, k, v, dout, layout=layout, causal="bottom_right")
    assert out.shape == dout.shape and out.dtype == q.dtype
    assert lse.shape == (b, 4, sq) and lse.dtype == (np.float64 if dtype is np.float64 else np.float32)
    assert np.all(out.astype(np.float64) == 0) and np.all(np.isneginf(lse))
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert np.all(grad.astype(np.float64) == 0)


def _assert_nothing_seen(out, lse, grads) -> None:
    assert np.all(out.astype(np.float64) == 0), "out must be exactly 0"
    assert np.all(np.isneginf(lse)), "lse must be -inf"
    for grad in grads:
        assert np.all(grad.astype(np.float64) == 0), "gradients must be exactly 0"


HIDE_EVERYTHING = {
    "key_lengths-0": lambda b, sq, sk: {"key_lengths": np.zeros(b, dtype=np.int64)},
    "bool-mask-all-false": lambda b, sq, sk: {"mask": np.zeros((sq, sk), dtype=bool)},
    "float-mask-all-minus-inf": lambda b, sq, sk: {"mask": np.full((1, 1, sq, sk), -np.inf, np.float32)},
    "window-of-one-key-masked": lambda b, sq, sk: {"window": (0, 0), "mask": ~np.eye(sq, sk, dtype=bool)},
    "causal-window-and-mask": lambda b, sq, sk: {
        "causal": "bottom_right",
        "window": (0, 0),
        "mask": np.zeros((b, 1, 1, sk), dtype=bool),
    },
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("how", sorted(HIDE_EVERYTHING))
@pytest.mark.parametrize("sizes", [(1, 1, 1), (2, 70, 130), (3, 5, 600)], ids=["tiny", "tiles", "decode-like"])
def test_every_key_hidden(backend: str, device: str, dtype, how: str, sizes: tuple[int, int, int]) -> None:
    b, sq, sk = sizes
    q, k, v, dout = _inputs(b, 4, 2, sq, sk, 16, dtype, "bhsd", seed=sq + sk)
    options = HIDE_EVERYTHING[how](b, sq, sk)
    if "mask" in options and options["mask"].dtype != np.bool_:
        options["mask"] = options["mask"].astype(dtype)
    _assert_nothing_seen(*_run(backend, device, q, k, v, dout, **options))


def test_some_rows_hidden_others_exact(backend: str, device: str) -> None:
    """Rows that see nothing are 0 next to rows that see keys, which match the reference."""
    q, k, v, dout = _inputs(2, 4, 2, 40, 50, 16, np.float64, "bhsd", seed=7)
    mask = np.ones((2, 1, 40, 50), dtype=bool)
    mask[0, :, ::3] = False
    options = {"mask": mask, "key_lengths": np.array([50, 0])}
    out, lse, grads = _run(backend, device, q, k, v, dout, **options)
    _assert_nothing_seen(out[0, :, ::3], lse[0, :, ::3], [grads[0][0, :, ::3]])
    _assert_nothing_seen(out[1], lse[1], [grads[0][1], grads[1][1], grads[2][1]])
    want_out, want_lse, want_grads = _run("reference", "cpu", q, k, v, dout, **options)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)
