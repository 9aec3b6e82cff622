"""MultiheadAttention.forward against a brute-force float64 layer: variants, masks, layouts, dtypes."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn.backends import registry
from fastattn.nn import MultiheadAttention, RotaryEmbedding

from . import _reference
from ._helpers import max_error, params_of, random_layer

HEADS = [(4, 4), (4, 2), (4, 1), (6, 3), (1, 1)]


@st.composite
def layer_problems(draw):
    heads, kv_heads = draw(st.sampled_from(HEADS))
    seq_q = draw(st.integers(1, 9))
    cross = draw(st.booleans())
    return {
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": draw(st.sampled_from([2, 4, 8])),
        "batch": draw(st.integers(1, 3)),
        "seq_q": seq_q,
        "seq_k": draw(st.integers(1, 9)) if cross else seq_q,
        "cross": cross,
        "bias": draw(st.booleans()),
        "causal": draw(st.booleans()),
        "window": draw(st.sampled_from([None, 0, 2, (1, 3), (-1, 1)])),
        "rope": draw(st.sampled_from([None, 10000.0, 100.0])),
        "padding": draw(st.sampled_from([None, "right", "scattered", "float"])),
        "attn_mask": draw(st.sampled_from([None, "bool2d", "bool3d", "float2d", "float3d"])),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _torch_style_masks(problem, rng):
    """Random torch-convention masks and what they mean as (visible, additive) for the oracle."""
    batch, heads, seq_q, seq_k = problem["batch"], problem["heads"], problem["seq_q"], problem["seq_k"]
    visible = np.ones((batch, heads, seq_q, seq_k), dtype=bool)
    additive = np.zeros((batch, heads, seq_q, seq_k))
    padding = None
    if problem["padding"] == "right":
        lengths = rng.integers(1, seq_k + 1, size=batch)
        padding = np.arange(seq_k)[None, :] >= lengths[:, None]
        visible &= ~padding[:, None, None, :]
    elif problem["padding"] == "scattered":
        padding = rng.random((batch, seq_k)) < 0.4
        visible &= ~padding[:, None, None, :]
    elif problem["padding"] == "float":
        padding = rng.standard_normal((batch, seq_k))
        additive += padding[:, None, None, :]
    attn_mask = None
    kind = problem["attn_mask"]
    if kind is not None:
        shape = (seq_q, seq_k) if kind.endswith("2d") else (batch * heads, seq_q, seq_k)
        full = (1, 1, seq_q, seq_k) if kind.endswith("2d") else (batch, heads, seq_q, seq_k)
        if kind.startswith("bool"):
            attn_mask = rng.random(shape) < 0.3
            visible &= ~attn_mask.reshape(full)
        else:
            attn_mask = rng.standard_normal(shape)
            additive += attn_mask.reshape(full)
    return padding, attn_mask, visible, additive


@settings(max_examples=60)
@given(layer_problems())
def test_forward_matches_brute_force(problem):
    rng = np.random.default_rng(problem["seed"])
    embed = problem["heads"] * problem["head_dim"]
    rope = None if problem["rope"] is None else RotaryEmbedding(problem["head_dim"], problem["rope"])
    layer = random_layer(
        rng,
        embed,
        problem["heads"],
        problem["kv_heads"],
        bias=problem["bias"],
        causal=problem["causal"],
        window=problem["window"],
        rope=rope,
    )
    x = rng.standard_normal((problem["batch"], problem["seq_q"], embed))
    memory = rng.standard_normal((problem["batch"], problem["seq_k"], embed)) if problem["cross"] else x
    padding, attn_mask, visible, additive = _torch_style_masks(problem, rng)
    positions = np.broadcast_to(np.arange(problem["seq_q"]), (problem["batch"], problem["seq_q"]))
    window = None if problem["window"] is None else layer.window
    visible = visible & _reference.visibility(
        positions, problem["seq_k"], causal=problem["causal"], window=window
    )[:, None]
    expected, expected_weights = _reference.layer(
        params_of(layer),
        x,
        memory,
        memory,
        num_heads=problem["heads"],
        num_kv_heads=problem["kv_heads"],
        visible=visible,
        additive=additive,
        rope_base=problem["rope"],
    )
    key = memory if problem["cross"] else None
    out, weights = layer(x, key, attn_mask=attn_mask, key_padding_mask=padding, need_weights=True)
    assert out.shape == x.shape and out.dtype == np.float64
    assert max_error(out, expected) < 1e-10
    assert weights.shape == (problem["batch"], problem["seq_q"], problem["seq_k"])
    assert max_error(weights, expected_weights) < 1e-10
    assert np.array_equal(layer(x, key, attn_mask=attn_mask, key_padding_mask=padding), out)


def test_three_distinct_inputs(rng):
    layer = random_layer(rng, 24, 6, 2)
    query, key, value = (rng.standard_normal((2, s, 24)) for s in (3, 5, 5))
    expected, _ = _reference.layer(params_of(layer), query, key, value, num_heads=6, num_kv_heads=2)
    assert max_error(layer(query, key, value), expected) < 1e-10


def test_key_is_query_is_self_attention(rng):
    layer = random_layer(rng, 16, 4, 2, causal=True)
    x = rng.standard_normal((2, 5, 16))
    assert np.array_equal(layer(x), layer(x, x, x))


def test_value_defaults_to_key(rng):
    layer = random_layer(rng, 16, 4, 2)
    x, memory = rng.standard_normal((2, 3, 16)), rng.standard_normal((2, 7, 16))
    assert np.array_equal(layer(x, memory), layer(x, memory, memory))


def test_is_causal_overrides_the_layer_setting(rng):
    causal = random_layer(rng, 16, 2, causal=True)
    plain = MultiheadAttention(16, 2, dtype=np.float64)
    plain.load_state_dict(causal.state_dict())
    x = rng.standard_normal((1, 6, 16))
    assert np.array_equal(causal(x), plain(x, is_causal=True))
    assert np.array_equal(causal(x, is_causal=False), plain(x))
    assert not np.allclose(causal(x), plain(x))
    with pytest.raises(TypeError, match="is_causal: expected a bool"):
        plain(x, is_causal="yes")


def test_batch_first_false_and_unbatched_layouts(rng):
    first = random_layer(rng, 16, 4, 2, causal=True, rope=True)
    second = MultiheadAttention(16, 4, 2, batch_first=False, causal=True, rope=True, dtype=np.float64)
    second.load_state_dict(first.state_dict())
    x = rng.standard_normal((3, 5, 16))
    padding = np.zeros((3, 5), dtype=bool)
    padding[1, 3] = True
    reference = first(x, key_padding_mask=padding)
    swapped = second(np.ascontiguousarray(x.swapaxes(0, 1)), key_padding_mask=padding)
    assert swapped.shape == (5, 3, 16)
    assert max_error(swapped.swapaxes(0, 1), reference) < 1e-12
    for layer in (first, second):
        single = layer(x[1], key_padding_mask=padding[1])
        assert single.shape == (5, 16)
        assert max_error(single, reference[1]) < 1e-12
        per_head = np.triu(np.ones((5, 5), dtype=bool), 1)[None].repeat(4, 0)
        out, weights = layer(x[1], need_weights=True, attn_mask=per_head)
        assert weights.shape == (5, 5)


def test_attention_mask_combinations_match_torch_semantics(rng):
    """bool attn_mask with float padding (and vice versa) become one float mask."""
    layer = random_layer(rng, 8, 2)
    x = rng.standard_normal((2, 4, 8))
    params = params_of(layer)
    blocked = rng.random((4, 4)) < 0.3
    np.fill_diagonal(blocked, False)
    float_padding = rng.standard_normal((2, 4))
    expected, _ = _reference.layer(
        params, x, x, x, num_heads=2, num_kv_heads=2, visible=~blocked, additive=float_padding[:, None, None, :]
    )
    assert max_error(layer(x, attn_mask=blocked, key_padding_mask=float_padding), expected) < 1e-10
    float_mask = rng.standard_normal((4, 4))
    bool_padding = np.array([[False, True, False, False], [False, False, False, True]])
    expected, _ = _reference.layer(
        params, x, x, x, num_heads=2, num_kv_heads=2, visible=~bool_padding[:, None, None, :], additive=float_mask
    )
    assert max_error(layer(x, attn_mask=float_mask, key_padding_mask=bool_padding), expected) < 1e-10


def test_a_row_that_sees_nothing_gives_zeros_not_nan(rng):
    layer = random_layer(rng, 8, 2, bias=False)
    x = rng.standard_normal((2, 3, 8))
    padding = np.array([[True, True, True], [False, True, False]])
    out = layer(x, key_padding_mask=padding)
    assert not np.isnan(out).any()
    assert np.array_equal(out[0], np.zeros((3, 8)))


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    layer = random_layer(rng, 16, 4, 2, causal=True)
    x = rng.standard_normal((2, 5, 16))
    padding = np.array([[False] * 5, [False, False, True, False, True]])
    out, weights = layer(torch.from_numpy(x), key_padding_mask=torch.from_numpy(padding), need_weights=True)
    assert isinstance(out, torch.Tensor) and isinstance(weights, torch.Tensor)
    assert out.dtype == torch.float64
    assert np.array_equal(out.numpy(), layer(x, key_padding_mask=padding))


@pytest.mark.parametrize(("dtype", "tolerance"), [(np.float32, 1e-5), (ml_dtypes.bfloat16, 3e-2), (np.float16, 3e-3)])
def test_low_precision_close_to_float64(rng, dtype, tolerance):
    exact = random_layer(rng, 32, 4, 2, causal=True, rope=True)
    low = MultiheadAttention(32, 4, 2, causal=True, rope=True, dtype=dtype)
    low.load_state_dict(exact.state_dict())
    low_params = params_of(low)
    exact.load_state_dict(low_params)  # the same (rounded) weights in float64
    x = rng.standard_normal((2, 7, 32)).astype(dtype)
    out = low(x)
    assert out.dtype == np.dtype(dtype)
    expected = exact(x.astype(np.float64))
    relative = np.linalg.norm(out.astype(np.float64) - expected) / np.linalg.norm(expected)
    assert relative < tolerance


def test_input_errors(rng):
    layer = MultiheadAttention(16, 4)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    cases = [
        (lambda: layer(x.astype(np.float64)), TypeError,
         "query: expected dtype float32 (the layer's), received float64"),
        (lambda: layer(x[..., :8]), ValueError,
         "query: expected a 3-D (N, S, E) or 2-D (S, E) array with E = embed_dim = 16, received shape (2, 5, 8)"),
        (lambda: layer(x[None]), ValueError, "query: expected a 3-D (N, S, E)"),
        (lambda: layer([[1.0] * 16]), TypeError,
         "query: expected a numpy array, a CuPy array or a DLPack-capable tensor"),
        (lambda: layer(x, x[:1]), ValueError, "key: expected batch size 2 like query, received shape (1, 5, 16)"),
        (lambda: layer(x, x[0]), ValueError, "key: expected 3 axes like query, received shape (5, 16)"),
        (lambda: layer(x, x, x[:, :3]), ValueError, "value: expected 5 tokens like key, received shape (2, 3, 16)"),
        (lambda: layer(x, attn_mask=np.ones((5, 4), dtype=bool)), ValueError,
         "attn_mask: expected shape (5, 5) or (8, 5, 5) (batch * num_heads, target, source), received (5, 4)"),
        (lambda: layer(x, attn_mask=np.ones((5, 5), dtype=np.int32)), TypeError,
         "attn_mask: expected a bool array (True = ignore, torch's convention) or a float array"),
        (lambda: layer(x, key_padding_mask=np.ones((2, 4), dtype=bool)), ValueError,
         "key_padding_mask: expected shape (2, 5) (batch, key sequence), received (2, 4)"),
        (lambda: layer(x, need_weights=1), TypeError, "need_weights: expected a bool"),
        (lambda: layer(x, cache="cache"), TypeError, "cache: expected a KVCache or None, received str"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()


def test_the_backend_option_reaches_every_attention_call(rng, monkeypatch):
    seen = []
    real = registry.select

    def spy(problem, argument=None):
        seen.append((problem.direction, argument))
        return real(problem, argument)

    monkeypatch.setattr(registry, "select", spy)
    layer = random_layer(rng, 16, 4, 2, causal=True, backend="reference")
    default = MultiheadAttention(16, 4, 2, causal=True, dtype=np.float64)
    default.load_state_dict(layer.state_dict())
    x = rng.standard_normal((2, 5, 16))
    out, _ = layer(x, need_weights=True)
    layer.backward(np.ones_like(out))
    assert seen == [("forward", "reference"), ("forward", "reference"), ("backward", "reference")]
    assert max_error(out, default(x)) < 1e-12
