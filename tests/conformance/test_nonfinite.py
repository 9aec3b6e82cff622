"""NaN and infinity in the inputs: every backend propagates them exactly as the reference does.

The reference defines the behaviour (README, "NaN and infinity"): IEEE arithmetic on the shifted
softmax, a product whose weight is exactly 0 counting 0 (so a key a row cannot see never reaches
it, whatever it holds), a NaN score making its whole row NaN.  Here random problems get a few
NaN/±inf entries in q, k, v, the float mask or dout, and each backend must put NaN, +inf and -inf
in exactly the reference's places, with the finite entries matching it.  Nothing may crash or hang.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn

from ._cases import (
    BACKWARD_TOLERANCE,
    Case,
    array_module,
    bhsd_float64,
    cases,
    dout_like,
    make_inputs,
    to_device,
    to_host,
)

_POISONS = (np.nan, np.inf, -np.inf)


def _poison(array, rng: np.random.Generator, count: int, device: str):
    """A copy of ``array`` (on ``device``: numpy or CuPy) with ``count`` random entries set to NaN or ±inf."""
    host = to_host(array).copy()
    flat = host.reshape(-1)
    for index in rng.integers(0, flat.size, size=count):
        flat[index] = _POISONS[rng.integers(len(_POISONS))]
    return array_module(device).asarray(host)


def _assert_same(name: str, got, want, dtype: str) -> None:
    got, want = to_host(got).astype(np.float64), to_host(want).astype(np.float64)
    for kind, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        where = np.argwhere(test(got) != test(want))
        assert where.size == 0, f"{name}: {kind} pattern differs from the reference at {where[:5].tolist()}"
    finite = np.isfinite(want)
    scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
    error = float(np.abs(got[finite] - want[finite]).max(initial=0.0)) / scale
    assert error <= BACKWARD_TOLERANCE[dtype], f"{name}: finite entries differ by {error:.3g}"


@settings(max_examples=150)
@given(case=cases(), poison_seed=st.integers(0, 2**32 - 1), targets=st.sets(st.sampled_from("qkvmd"), min_size=1))
def test_nonfinite_inputs_propagate_like_the_reference(
    backend: str, device: str, case: Case, poison_seed: int, targets: set[str]
) -> None:
    if case.mask_kind == "bool":
        case = dataclasses.replace(case, mask_kind="float")
    inputs = make_inputs(case, device)
    rng = np.random.default_rng(poison_seed)
    names = {"q": "q", "k": "k", "v": "v", "m": "mask"}
    for target in targets - {"d"}:
        if inputs[names[target]] is not None:
            inputs[names[target]] = _poison(inputs[names[target]], rng, int(rng.integers(1, 4)), device)
    dout = dout_like(case, device)
    if "d" in targets:
        dout = _poison(dout, rng, int(rng.integers(1, 4)), device)
    kwargs = case.kwargs(inputs)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    reasons = fastattn.explain(q, k, v, **kwargs)
    if reasons.reasons[backend]:
        pytest.skip(f"{backend} declines: {reasons.reasons[backend]}")

    with np.errstate(all="ignore"):
        want_out, want_lse = fastattn.attention(q, k, v, backend="reference", return_lse=True, **kwargs)
        got_out, got_lse = fastattn.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
        _assert_same("out", bhsd_float64(got_out, case.layout), bhsd_float64(want_out, case.layout), case.dtype)
        _assert_same("lse", got_lse, want_lse, case.dtype)
        if reasons.backward_reasons[backend]:
            return
        saved = (dout, q, k, v, want_out, want_lse)
        want = fastattn.attention_backward(*saved, backend="reference", **kwargs)
        got = fastattn.attention_backward(*saved, backend=backend, **kwargs)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        _assert_same(name, bhsd_float64(g, case.layout), bhsd_float64(w, case.layout), case.dtype)


def test_garbage_in_hidden_keys_never_reaches_a_row(backend: str, device: str) -> None:
    """A KV cache allocated with garbage: NaN/inf past key_lengths, behind a bool mask, or in the
    future of a causal row (same tile as visible keys), never reaches a row that cannot see it."""
    rng = np.random.default_rng()
    hidden = np.ones((2, 1, 40, 40), dtype=bool)
    hidden[1, :, :, 5] = False
    settings = ({"key_lengths": np.array([30, 30]), "mask": hidden}, {"causal": True, "mask": hidden})
    # float64 where the backend takes it, else float32 (the GPU kernels take no float64).
    for dtype in (np.float64, np.float32):
        q, k, v = (rng.standard_normal((2, 4, 40, 16)).astype(dtype) for _ in range(3))
        on_device = [to_device(x, device) for x in (q, k, v)]
        explanations = [fastattn.explain(*on_device, **to_device(kwargs, device)) for kwargs in settings]
        if not any(e.reasons[backend] or e.backward_reasons[backend] for e in explanations):
            break
    else:
        pytest.skip(f"{backend} declines: {explanations[0].reasons[backend]}")
    k[:, :, 30:] = np.nan
    v[:, :, 30:] = np.inf
    k[1, :, 5], v[1, :, 5] = np.inf, np.nan
    q, k, v = (to_device(x, device) for x in (q, k, v))
    for kwargs in settings:
        kwargs = to_device(kwargs, device)
        out, lse = fastattn.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
        dout = array_module(device).ones_like(out)
        grads = fastattn.attention_backward(dout, q, k, v, out, lse, backend=backend, **kwargs)
        dq, dk, dv = (to_host(x) for x in grads)
        out, lse = to_host(out), to_host(lse)
        assert np.isfinite(out[:, :, :30]).all() and np.isfinite(lse[:, :, :30]).all()
        assert np.isfinite(dq[:, :, :30]).all()
        if "key_lengths" in kwargs:  # (under causal, rows 30+ see the NaN keys and poison every dK)
            assert np.isfinite(dk[:, :, :30]).all() and np.isfinite(dv[:, :, :30]).all()


#: (batch, q heads, kv heads, query positions, keys, the early key, the late key): a prefill tile of
#: rows over three key tiles; a one-position decode whose keys the cpu backend splits by thread and
#: the GPU decode by block; and four such rows, which on a one-SM emulated device take one split
#: each (the GPU decode's warps then hold the two keys in different shares of the tiles).
_LATE_MAXIMUM_SHAPES = {
    "prefill": (1, 2, 2, 40, 300, 5, 250),
    "decode": (1, 4, 1, 1, 4096, 5, 4000),
    "decode-unsplit": (4, 4, 1, 1, 4096, 5, 4040),
}


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", list(_LATE_MAXIMUM_SHAPES.values()), ids=list(_LATE_MAXIMUM_SHAPES))
def test_nan_at_a_key_that_underflows_against_a_later_maximum(
    backend: str, device: str, shape, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN in V at a key whose weight underflows to 0 against the row's maximum, which lies in a
    later key tile (and key split): the reference weighs every key against the final maximum, so
    the NaN reaches no output; an online softmax that weighs the early key against the maximum so
    far gives it a weight above 0 in its own tile, and the NaN stays in the accumulator however
    small the later rescale."""
    early, late = shape[5:]
    if shape == _LATE_MAXIMUM_SHAPES["decode-unsplit"]:
        monkeypatch.setenv("FASTATTN_EMULATED_SMS", "1")
    # Scores in [-1, 1] at every key but the early one (far below the others) and the late one (far
    # above).  Weights in float32 (the half precisions' too) flush below 2^-126 (e^-87.3), float64's below
    # e^-745.  Below float64: against its own tile's maximum (~1) the early key weighs ~e^-12, above
    # 0 even in float16 (the GPU kernels round P to the input type: at -60 float16 flushed it to 0,
    # so the flaw could not show); against the late key, e^-92, flushed; and the rescale of the early
    # tile's accumulator by ~e^-80 is not flushed, so a NaN kept there is not cleared by a factor 0.
    low, high = (-700.0, 100.0) if dtype == "float64" else (-11.0, 81.0)
    got, want = _attend_with_set_scores(backend, device, shape[:5], dtype, {early: low, late: high}, nan_key=early)
    assert np.isfinite(to_host(want)).all(), "the reference's weight of the early key must be exactly 0"
    _assert_same("out", got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("seq_q", [40, 1], ids=["prefill", "decode"])
def test_nan_at_a_key_of_tiny_weight_reaches_the_row(backend: str, device: str, seq_q: int, dtype: str) -> None:
    """A NaN in V at a key weighing ~e^-21 against the row's maximum (in the same key tile): the
    weight is above float32's flush (e^-87.3), so the NaN reaches every row, as in the reference,
    even where the kernel rounds P to float16, whose smallest weight is 2^-24 (~e^-16.6)."""
    got, want = _attend_with_set_scores(backend, device, (1, 2, 2, seq_q, 64), dtype, {5: -20.0}, nan_key=5)
    assert np.isnan(to_host(want)[..., 3]).all(), "the reference must carry the tiny key's NaN to every row"
    _assert_same("out", got, want, dtype)


def _attend_with_set_scores(
    backend: str, device: str, shape: tuple[int, ...], dtype: str, scores: dict[int, float], nan_key: int
) -> tuple:
    """(backend's out, reference's out) of (batch, q heads, kv heads, query positions, keys) = shape,
    head_dim 32, scale 1, whose scores q.k are k[..., 0] (q[..., 0] = 1, the rest of q and k a
    perturbation of ~1e-3): uniform in [-1, 1] but at the keys of `scores` (key: score); a NaN in V
    at nan_key, column 3, on `device`.  Skips where the backend declines."""
    batch, heads, heads_kv, seq_q, seq_k = shape
    rng = np.random.default_rng()
    q = 0.03 * rng.standard_normal((batch, heads, seq_q, 32))
    k = 0.03 * rng.standard_normal((batch, heads_kv, seq_k, 32))
    v = rng.standard_normal((batch, heads_kv, seq_k, 32))
    q[..., 0] = 1.0
    k[..., 0] = rng.uniform(-1.0, 1.0, (batch, heads_kv, seq_k))
    for key, score in scores.items():
        k[:, :, key, 0] = score
    v[:, :, nan_key, 3] = np.nan
    element = fastattn._arrays.numpy_dtype(dtype)
    q, k, v = (to_device(array.astype(element), device) for array in (q, k, v))
    reasons = fastattn.explain(q, k, v, scale=1.0).reasons[backend]
    if reasons:
        pytest.skip(f"{backend} declines: {reasons}")
    return fastattn.attention(q, k, v, scale=1.0, backend=backend), fastattn.attention(
        q, k, v, scale=1.0, backend="reference"
    )
