"""state_dict / load_state_dict in the torch and Llama dialects, and Llama interop (RoPE, GQA)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fastattn.nn import MultiheadAttention, RotaryEmbedding

from ._helpers import max_error, params_of, random_layer


@pytest.mark.parametrize("bias", [True, False])
def test_llama_round_trip(bias, rng):
    source = random_layer(rng, 24, 6, 2, bias=bias, causal=True, rope=True)
    state = source.state_dict()
    expected_keys = {f"{p}_proj.weight" for p in "qkvo"} | ({f"{p}_proj.bias" for p in "qkvo"} if bias else set())
    assert set(state) == expected_keys
    assert state["k_proj.weight"].shape == (8, 24)
    target = MultiheadAttention(24, 6, 2, bias=bias, causal=True, rope=True, dtype=np.float64)
    target.load_state_dict(state)
    x = rng.standard_normal((2, 5, 24))
    assert np.array_equal(target(x), source(x))
    state["q_proj.weight"][...] = 0  # a copy: the layer is unaffected
    assert np.array_equal(target(x), source(x))


def test_torch_dialect_round_trip_and_layout(rng):
    layer = random_layer(rng, 12, 3)
    state = layer.state_dict(dialect="torch")
    assert set(state) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    params = params_of(layer)
    assert np.array_equal(state["in_proj_weight"], np.concatenate([params[f"{p}_proj.weight"] for p in "qkv"]))
    assert np.array_equal(state["out_proj.bias"], params["o_proj.bias"])
    other = MultiheadAttention(12, 3, dtype=np.float64)
    other.load_state_dict(state)
    assert all(np.array_equal(value, params[name]) for name, value in params_of(other).items())


def test_values_from_torch_are_cast_to_the_layer_dtype(rng):
    torch = pytest.importorskip("torch")
    layer = random_layer(rng, 8, 2)
    state = {key: torch.from_numpy(value).float().requires_grad_() for key, value in layer.state_dict().items()}
    other = MultiheadAttention(8, 2, dtype=np.float64)
    other.load_state_dict(state)
    for name, value in params_of(other).items():
        assert value.dtype == np.float64
        assert np.array_equal(value, state[name].detach().double().numpy())


def test_prefix_selects_one_layer_of_a_model(rng):
    layers = [random_layer(rng, 8, 2, 1, bias=False) for _ in range(2)]
    model = {}
    for index, layer in enumerate(layers):
        model.update(layer.state_dict(prefix=f"model.layers.{index}.self_attn."))
        model[f"model.layers.{index}.mlp.up_proj.weight"] = rng.standard_normal((16, 8))
    target = MultiheadAttention(8, 2, 1, bias=False, dtype=np.float64)
    target.load_state_dict(model, prefix="model.layers.1.self_attn.")
    x = rng.standard_normal((1, 3, 8))
    assert np.array_equal(target(x), layers[1](x))
    with pytest.raises(ValueError, match=re.escape("prefix: expected some key to start with 'decoder.'")):
        target.load_state_dict(model, prefix="decoder.")


def test_load_errors_write_nothing(rng):
    layer = random_layer(rng, 8, 2, 1)
    before = params_of(layer)
    good = layer.state_dict()
    cases = [
        ({k: v for k, v in good.items() if k != "v_proj.bias"}, ValueError,
         "state_dict: expected this layer's parameters (bias=True) in the 'llama' dialect, "
         "received missing ['v_proj.bias'] and unexpected []"),
        ({**good, "q_norm.weight": np.ones(4)}, ValueError, "unexpected ['q_norm.weight']"),
        ({**good, "k_proj.weight": np.zeros((8, 8))}, ValueError,
         "state_dict['k_proj.weight']: expected shape (4, 8), received (8, 8)"),
        ({"weight": np.zeros(3)}, ValueError,
         "state_dict: expected the keys of torch.nn.MultiheadAttention (in_proj_weight, in_proj_bias, "
         "out_proj.weight, out_proj.bias) or Llama-style keys"),
        ({**good, "q_proj.weight": "zeros"}, TypeError, "state_dict['q_proj.weight']: expected a numpy array"),
        ({"in_proj_weight": np.zeros((24, 8)), "out_proj.weight": np.zeros((8, 8))}, ValueError,
         "state_dict['in_proj_weight']: expected 16 rows (q, k and v stacked: 8 + 4 + 4), received shape (24, 8)"),
    ]
    for state, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            layer.load_state_dict(state)
        assert all(np.array_equal(value, before[name]) for name, value in params_of(layer).items())
    with pytest.raises(TypeError, match="state_dict: expected a mapping of names to arrays, received list"):
        layer.load_state_dict([("q_proj.weight", np.zeros((8, 8)))])
    with pytest.raises(TypeError, match="prefix: expected a str"):
        layer.load_state_dict(good, prefix=0)


def test_dialect_errors():
    with pytest.raises(ValueError, match=re.escape("dialect: expected one of ['llama', 'torch'], received 'jax'")):
        MultiheadAttention(8, 2).state_dict(dialect="jax")
    with pytest.raises(ValueError, match=re.escape("dialect: 'torch' holds only multi-head layers")):
        MultiheadAttention(8, 2, 1).state_dict(dialect="torch")


def _llama_attention(torch, x, weights, num_heads, num_kv_heads, base, window=None):
    """Llama attention as Hugging Face's LlamaAttention computes it (rotate_half RoPE, repeat_kv)."""
    batch, seq, embed = x.shape
    head_dim = embed // num_heads
    q = (x @ weights["q_proj.weight"].T).view(batch, seq, num_heads, head_dim).transpose(1, 2)
    k = (x @ weights["k_proj.weight"].T).view(batch, seq, num_kv_heads, head_dim).transpose(1, 2)
    v = (x @ weights["v_proj.weight"].T).view(batch, seq, num_kv_heads, head_dim).transpose(1, 2)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(t):
        return torch.cat((-t[..., head_dim // 2 :], t[..., : head_dim // 2]), dim=-1)

    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    group = num_heads // num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / head_dim**0.5
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = j <= i if window is None else (j <= i) & (j >= i - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(batch, seq, embed) @ weights["o_proj.weight"].T


@pytest.mark.parametrize(
    ("heads", "kv_heads", "base", "window"), [(4, 2, 500000.0, None), (4, 1, 10000.0, 3), (2, 2, 10000.0, None)]
)
def test_llama_weights_give_llama_outputs_and_gradients(heads, kv_heads, base, window, rng):
    torch = pytest.importorskip("torch")
    embed, head_dim = 32, 32 // heads
    weights = {
        "q_proj.weight": torch.randn(heads * head_dim, embed, dtype=torch.float64) * 0.2,
        "k_proj.weight": torch.randn(kv_heads * head_dim, embed, dtype=torch.float64) * 0.2,
        "v_proj.weight": torch.randn(kv_heads * head_dim, embed, dtype=torch.float64) * 0.2,
        "o_proj.weight": torch.randn(embed, heads * head_dim, dtype=torch.float64) * 0.2,
    }
    for tensor in weights.values():
        tensor.requires_grad_()
    layer = MultiheadAttention(
        embed,
        heads,
        kv_heads,
        bias=False,
        causal=True,
        window=window,
        rope=RotaryEmbedding(head_dim, base),
        dtype=np.float64,
    )
    prefix = "model.layers.0.self_attn."
    layer.load_state_dict({prefix + name: tensor for name, tensor in weights.items()}, prefix=prefix)
    x = torch.from_numpy(rng.standard_normal((2, 9, embed))).requires_grad_()
    expected = _llama_attention(torch, x, weights, heads, kv_heads, base, window)
    assert max_error(layer(x), expected.detach()) < 1e-10
    grad_output = torch.from_numpy(rng.standard_normal((2, 9, embed)))
    expected.backward(grad_output)
    (dx,) = layer.backward(grad_output)
    assert max_error(dx, x.grad) < 1e-10
    for name, tensor in weights.items():
        assert max_error(layer.grads[name], tensor.grad) < 1e-10
