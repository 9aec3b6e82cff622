"""MultiheadAttention.backward against central finite differences (float64), and its contract."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fastattn.nn import KVCache, MultiheadAttention

from ._helpers import max_error, random_layer

EPS = 1e-6
ENTRIES = 8  # entries checked per array, drawn at random


def _numeric_gradient(loss, array, rng):
    """Central differences of loss() at ENTRIES random entries of array (perturbed in place)."""
    flat = array.reshape(-1)
    picks = rng.choice(flat.size, size=min(ENTRIES, flat.size), replace=False)
    values = []
    for index in picks:
        saved = flat[index]
        flat[index] = saved + EPS
        upper = loss()
        flat[index] = saved - EPS
        lower = loss()
        flat[index] = saved
        values.append((upper - lower) / (2 * EPS))
    return picks, np.array(values)


CASES = {
    "self-gqa-causal-rope-window-padding": dict(
        layer=dict(embed_dim=8, num_heads=4, num_kv_heads=2, causal=True, rope=True, window=2),
        inputs="self",
        padding="scattered",
    ),
    "cross-mqa-float-mask-right-padding": dict(
        layer=dict(embed_dim=8, num_heads=4, num_kv_heads=1),
        inputs="distinct",
        padding="right",
        attn_mask="float3d",
    ),
    "key-is-value-no-bias": dict(
        layer=dict(embed_dim=6, num_heads=3, bias=False), inputs="kv-shared", attn_mask="bool2d"
    ),
    "value-is-query": dict(layer=dict(embed_dim=8, num_heads=2, num_kv_heads=1, rope=True), inputs="value-is-query"),
    "sequence-first": dict(layer=dict(embed_dim=8, num_heads=2, batch_first=False, causal=True), inputs="self"),
    "unbatched-cross": dict(layer=dict(embed_dim=8, num_heads=4, num_kv_heads=2), inputs="distinct", unbatched=True),
}


def _inputs(case, rng):
    batch, seq_q, seq_k, embed = 2, 4, 5, case["layer"]["embed_dim"]
    layout = "sbe" if case["layer"].get("batch_first") is False else "bse"

    def draw(seq):
        if case.get("unbatched"):
            return rng.standard_normal((seq, embed))
        return rng.standard_normal((batch, seq, embed) if layout == "bse" else (seq, batch, embed))

    kind = case["inputs"]
    query = draw(seq_q)
    if kind == "self":
        arrays, call = [query], lambda q: (q,)
        seq_k = seq_q
    elif kind == "distinct":
        arrays = [query, draw(seq_k), draw(seq_k)]
        call = lambda q, k, v: (q, k, v)  # noqa: E731
    elif kind == "kv-shared":
        arrays, call = [query, draw(seq_k)], lambda q, kv: (q, kv)
    else:  # value-is-query: the key has the query's length so that value can be the query
        seq_k = seq_q
        arrays, call = [query, draw(seq_q)], lambda q, k: (q, k, q)
    options = {}
    if case.get("padding") == "scattered":
        padding = rng.random((batch, seq_k)) < 0.3
        padding[:, 0] = False
        options["key_padding_mask"] = padding
    elif case.get("padding") == "right":
        options["key_padding_mask"] = np.arange(seq_k)[None, :] >= np.array([[seq_k], [2]])
    if case.get("attn_mask") == "float3d":
        options["attn_mask"] = rng.standard_normal((batch * case["layer"]["num_heads"], seq_q, seq_k))
    elif case.get("attn_mask") == "bool2d":
        mask = rng.random((seq_q, seq_k)) < 0.3
        mask[:, 0] = False
        options["attn_mask"] = mask
    return arrays, call, options


@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_finite_differences(name, rng):
    case = CASES[name]
    layer = random_layer(rng, **case["layer"])
    arrays, call, options = _inputs(case, rng)
    out = layer(*call(*arrays), **options)
    grad_output = rng.standard_normal(out.shape)
    input_grads = layer.backward(grad_output)
    assert len(input_grads) == len(arrays)
    for array, grad in zip(arrays, input_grads):
        assert grad.shape == array.shape and grad.dtype == np.float64
    assert set(layer.grads) == {name for name, _ in layer.named_parameters()}

    def loss():
        return float(np.sum(layer(*call(*arrays), **options) * grad_output))

    layer.eval()
    for name_, param in layer.named_parameters():
        assert layer.grads[name_].shape == param.shape
        picks, numeric = _numeric_gradient(loss, param, rng)
        assert max_error(layer.grads[name_].reshape(-1)[picks], numeric) < 1e-7, name_
    for array, grad in zip(arrays, input_grads):
        picks, numeric = _numeric_gradient(loss, array, rng)
        assert max_error(grad.reshape(-1)[picks], numeric) < 1e-7


def test_sequence_first_and_unbatched_gradients_equal_batched(rng):
    batched = random_layer(rng, 8, 2, 1, causal=True, rope=True)
    sequence_first = MultiheadAttention(8, 2, 1, batch_first=False, causal=True, rope=True, dtype=np.float64)
    sequence_first.load_state_dict(batched.state_dict())
    x = rng.standard_normal((2, 5, 8))
    grad = rng.standard_normal((2, 5, 8))
    batched(x)
    (expected,) = batched.backward(grad)
    sequence_first(x.swapaxes(0, 1))
    (swapped,) = sequence_first.backward(grad.swapaxes(0, 1))
    assert max_error(swapped.swapaxes(0, 1), expected) < 1e-12
    for name, value in batched.grads.items():
        assert max_error(sequence_first.grads[name], value) < 1e-12
    batched(x[1])
    (single,) = batched.backward(grad[1])
    assert single.shape == (5, 8)
    assert max_error(single, expected[1]) < 1e-12


def test_gradients_replace_and_forward_state_is_consumed(rng):
    layer = random_layer(rng, 8, 2)
    x = rng.standard_normal((1, 3, 8))
    layer(x)
    layer.backward(np.ones((1, 3, 8)))
    first = {name: grad.copy() for name, grad in layer.grads.items()}
    with pytest.raises(RuntimeError, match="one backward per forward"):
        layer.backward(np.ones((1, 3, 8)))
    layer(x)
    layer.backward(np.ones((1, 3, 8)))
    for name, grad in layer.grads.items():
        assert np.array_equal(grad, first[name])


def test_torch_tensors_get_torch_gradients(rng):
    torch = pytest.importorskip("torch")
    layer = random_layer(rng, 8, 2, causal=True)
    x = rng.standard_normal((2, 3, 8))
    memory = rng.standard_normal((2, 4, 8))
    layer(torch.from_numpy(x), memory)
    grads = layer.backward(torch.ones(2, 3, 8, dtype=torch.float64))
    assert isinstance(grads[0], torch.Tensor) and isinstance(grads[1], np.ndarray)
    assert grads[0].shape == (2, 3, 8) and grads[1].shape == (2, 4, 8)


def test_float32_backward_close_to_float64(rng):
    exact = random_layer(rng, 16, 4, 2, causal=True, rope=True)
    single = MultiheadAttention(16, 4, 2, causal=True, rope=True)
    single.load_state_dict(exact.state_dict())
    exact.load_state_dict(single.state_dict())
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    grad = rng.standard_normal((2, 6, 16)).astype(np.float32)
    exact(x.astype(np.float64))
    (dx_exact,) = exact.backward(grad.astype(np.float64))
    single(x)
    (dx,) = single.backward(grad)
    assert dx.dtype == np.float32
    assert np.linalg.norm(dx - dx_exact) / np.linalg.norm(dx_exact) < 1e-5
    for name, value in exact.grads.items():
        assert single.grads[name].dtype == np.float32
        assert np.linalg.norm(single.grads[name] - value) / np.linalg.norm(value) < 1e-5


def test_backward_errors(rng):
    layer = MultiheadAttention(8, 2, causal=True, dtype=np.float64)
    x = rng.standard_normal((2, 3, 8))
    with pytest.raises(RuntimeError, match=re.escape("backward: expected a forward in training mode without a cache")):
        layer.backward(np.ones((2, 3, 8)))
    layer(x)
    message = "grad_output: expected shape (2, 3, 8) (the output's), received (2, 3, 4)"
    with pytest.raises(ValueError, match=re.escape(message)):
        layer.backward(np.ones((2, 3, 4)))
    with pytest.raises(TypeError, match=re.escape("grad_output: expected dtype float64, received float32")):
        layer.backward(np.ones((2, 3, 8), dtype=np.float32))
    cache = KVCache(2, 8, 2, 4, dtype=np.float64)
    layer(x, cache=cache)
    with pytest.raises(RuntimeError, match="backward: expected a forward in training mode without a cache"):
        layer.backward(np.ones((2, 3, 8)))
