"""Backward pass of every available backend against the float64 oracle and finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fastattn

from . import _oracle
from ._cases import (
    BACKWARD_TOLERANCE,
    DTYPES,
    Case,
    bhsd_float64,
    cases,
    dout_like,
    make_inputs,
    relative_error,
    to_host,
)


def _forward_for_backward(case: Case, inputs: dict) -> tuple:
    """out and lse from the reference: the backward under test gets the contract's saved tensors."""
    return fastattn.attention(
        inputs["q"], inputs["k"], inputs["v"], backend="reference", return_lse=True, **case.kwargs(inputs)
    )


def check_backward(backend: str, device: str, case: Case, deterministic: bool = False) -> None:
    inputs = make_inputs(case, device)
    out, lse = _forward_for_backward(case, inputs)
    dout = dout_like(case, device)
    arrays = {"dout": dout, "q": inputs["q"], "k": inputs["k"], "v": inputs["v"], "out": out, "lse": lse}
    before = {name: to_host(value) for name, value in arrays.items()}
    explanation_reasons = _backward_reasons(backend, case, inputs)
    if explanation_reasons:
        with pytest.raises(fastattn.UnsupportedError) as raised:
            fastattn.attention_backward(*arrays.values(), backend=backend, **case.kwargs(inputs))
        assert raised.value.reasons == explanation_reasons
        return
    options = dict(case.kwargs(inputs), backend=backend, deterministic=deterministic)
    dq, dk, dv = fastattn.attention_backward(*arrays.values(), **options)
    if deterministic:
        again = fastattn.attention_backward(*arrays.values(), **options)
        for first, second, name in zip((dq, dk, dv), again, ("dq", "dk", "dv")):
            assert np.array_equal(to_host(first), to_host(second)), f"{name} differs between two runs"
    for name, value in before.items():
        assert np.array_equal(to_host(arrays[name]), value, equal_nan=True), f"{name} was written to"
    for grad, name in ((dq, "q"), (dk, "k"), (dv, "v")):
        assert grad.dtype == inputs[name].dtype
        assert grad.shape == inputs[name].shape

    q, k, v = (bhsd_float64(inputs[name], case.layout) for name in "qkv")
    expected = _oracle.backward(
        bhsd_float64(dout, case.layout), q, k, v, case.oracle_options(inputs), out=bhsd_float64(out, case.layout)
    )
    tolerance = BACKWARD_TOLERANCE[case.dtype]
    for got, want, magnitude, name in zip((dq, dk, dv), expected[:3], expected.magnitudes, ("dq", "dk", "dv")):
        got64 = bhsd_float64(got, case.layout)
        assert not np.isnan(got64).any(), f"NaN in {name}"
        # Against the oracle rounded to the gradient's dtype: a float16 gradient below float16's
        # smallest subnormal is 0 in any implementation (the fuzz found dq ~ 1e-9 under softcap).
        error = relative_error(got64, want.astype(DTYPES[case.dtype]).astype(np.float64), magnitude)
        assert error <= tolerance, f"{name}: {error:.3g}"
    _assert_zero_where_unseen(case, lse, dq, dk, dv)


def _backward_reasons(backend: str, case: Case, inputs: dict) -> list[str]:
    explanation = fastattn.explain(inputs["q"], inputs["k"], inputs["v"], **case.kwargs(inputs))
    return explanation.backward_reasons[backend]


def _assert_zero_where_unseen(case: Case, lse, dq, dk, dv) -> None:
    """Rows that see no key, and padding keys, get exactly zero gradient (never NaN, never tiny)."""
    dq64 = bhsd_float64(dq, case.layout)
    assert np.all(dq64[np.isneginf(to_host(lse))] == 0)
    if case.key_lengths is not None:
        dk64, dv64 = bhsd_float64(dk, case.layout), bhsd_float64(dv, case.layout)
        for b, length in enumerate(case.key_lengths):
            assert np.all(dk64[b, :, length:] == 0) and np.all(dv64[b, :, length:] == 0)


@settings(max_examples=500)
@given(case=cases())
def test_backward_matches_oracle(backend: str, device: str, case: Case) -> None:
    check_backward(backend, device, case)


@settings(max_examples=40)
@given(case=cases(dtypes=("float16", "bfloat16")))
# Scores up to 46 times the softcap: the tensor-core backward's sech^2 overflowed to +inf past 43.7
# (4 E with E = e^(2 score / softcap) clamped at 2^126), so dS, one row of dq and one of dk were inf.
@example(
    case=Case(
        batch=1, heads_kv=1, group=1, seq_q=26, seq_k=106, head_dim=128, head_dim_v=128, dtype="float16",
        layout="bhsd", causal=False, window=None, mask_kind=None, mask_shape=None, key_lengths=None,
        softcap=1.0, scale=1.0, strided="contiguous", seed=2,
    )  # fmt: skip
)
def test_backward_half_precision_matches_oracle(backend: str, device: str, case: Case) -> None:
    check_backward(backend, device, case)


@settings(max_examples=40)
@given(case=cases(dtypes=("float32", "float16", "bfloat16")))
def test_deterministic_backward_is_reproducible(backend: str, device: str, case: Case) -> None:
    """deterministic=True: the same tolerances, and bit-identical gradients from two calls."""
    check_backward(backend, device, case, deterministic=True)


@settings(max_examples=25)
@given(case=cases(dtypes=("float64",)), loss_seed=st.integers(0, 2**32 - 1))
def test_backward_matches_finite_differences(backend: str, case: Case, loss_seed: int) -> None:
    """Central differences of L = sum(out * W) in float64, on every input entry of a small problem."""
    small = _small(case)
    inputs = make_inputs(small)
    if _backward_reasons(backend, small, inputs):
        return
    kwargs = small.kwargs(inputs)
    out, lse = fastattn.attention(inputs["q"], inputs["k"], inputs["v"], backend=backend, return_lse=True, **kwargs)
    weights = np.random.default_rng(loss_seed).standard_normal(out.shape)
    grads = fastattn.attention_backward(
        weights, inputs["q"], inputs["k"], inputs["v"], out, lse, backend=backend, **kwargs
    )
    # Central differences carry ~1e-10 absolute noise; compare against the size of the gradient's
    # terms (the oracle's magnitudes), not against a gradient that may cancel to nearly zero.
    magnitudes = [
        bhsd_float64(magnitude, small.layout)  # (B, H, S, D) back to the caller's layout: same swap
        for magnitude in _oracle.backward(
            bhsd_float64(weights, small.layout),
            *(bhsd_float64(inputs[name], small.layout) for name in "qkv"),
            small.oracle_options(inputs),
        ).magnitudes
    ]
    step = 1e-6
    for name, grad, magnitude in zip("qkv", grads, magnitudes):
        array = np.array(inputs[name], dtype=np.float64)
        numeric = np.zeros_like(array)
        for index in np.ndindex(array.shape):
            losses = []
            for sign in (1, -1):
                shifted = array.copy()
                shifted[index] += sign * step
                trial = dict(inputs, **{name: shifted})
                result = fastattn.attention(trial["q"], trial["k"], trial["v"], backend=backend, **kwargs)
                losses.append(float(np.sum(result * weights)))
            numeric[index] = (losses[0] - losses[1]) / (2 * step)
        assert relative_error(np.asarray(grad), numeric, magnitude) <= 1e-6, name


def _small(case: Case) -> Case:
    import dataclasses

    seq_q, seq_k = min(case.seq_q, 4), min(case.seq_k, 5)
    lengths = None if case.key_lengths is None else tuple(min(n, seq_k) for n in case.key_lengths)
    return dataclasses.replace(
        case,
        batch=1,
        heads_kv=1,
        group=min(case.group, 2),
        seq_q=seq_q,
        seq_k=seq_k,
        head_dim=16,
        head_dim_v=8,
        mask_shape=_shrunk_mask_shape(case.mask_shape, (1, min(case.group, 2), seq_q, seq_k)),
        key_lengths=None if lengths is None else lengths[:1],
        strided="contiguous",
    )


def _shrunk_mask_shape(shape: tuple[int, ...] | None, full: tuple[int, int, int, int]) -> tuple[int, ...] | None:
    """Keep the mask's broadcast pattern (which axes are 1) at the smaller sizes."""
    if shape is None:
        return None
    return tuple(1 if size == 1 else new for size, new in zip(shape, full[4 - len(shape) :]))
