"""Construction of MultiheadAttention: validation, variants, initialisation, parameters, modes."""

from __future__ import annotations

import importlib.util
import re

import ml_dtypes
import numpy as np
import pytest

import fastattn
from fastattn.nn import MultiheadAttention, RotaryEmbedding


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 4), "embed_dim: expected a positive size, received 0"),
        ((64, 0), "num_heads: expected a positive size, received 0"),
        ((64, 4, 0), "num_kv_heads: expected a positive size, received 0"),
        ((-8, 4), "embed_dim: expected a positive size, received -8"),
        ((30, 4), "embed_dim: expected a multiple of num_heads=4, received 30 (30 % 4 = 2)"),
        ((48, 6, 4), "num_kv_heads: expected a divisor of num_heads=6, received 4 (6 % 4 = 2)"),
        ((64, 4, 8), "num_kv_heads: expected at most num_heads=4, received 8"),
    ],
)
def test_invalid_sizes_name_the_numbers(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MultiheadAttention(*args)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"embed_dim": 8.0}, TypeError, "embed_dim: expected a positive int, received float 8.0"),
        ({"num_heads": True}, TypeError, "num_heads: expected a positive int"),
        ({"dtype": np.int32}, TypeError, "dtype: expected one of float16, bfloat16, float32, float64, received int32"),
        ({"dtype": "complex"}, TypeError, "dtype: expected one of"),
        ({"device": "tpu"}, ValueError, "device: expected 'cpu' or 'cuda', received 'tpu'"),
        ({"window": -2}, ValueError, "window: expected an int >= 0 or a pair (left, right), received -2"),
        ({"window": (3, -5)}, ValueError, "window: expected sides >= 0, or -1 for unbounded, received (3, -5)"),
        ({"window": "wide"}, TypeError, "window: expected None, an int >= 0 or a pair of ints"),
        ({"causal": 1}, TypeError, "causal: expected a bool, received int 1"),
        ({"bias": None}, TypeError, "bias: expected a bool"),
        ({"rope": "yes"}, TypeError, "rope: expected None, a bool or a RotaryEmbedding, received 'yes'"),
        ({"rope": RotaryEmbedding(8)}, ValueError,
         "rope: expected a RotaryEmbedding of head_dim=16 (embed_dim 64 / num_heads 4), received head_dim=8"),
        ({"backend": "nope"}, ValueError, "backend: expected None or one of"),
        ({"seed": "x"}, TypeError, "seed: expected None, an int or a numpy Generator, received 'x'"),
    ],
)
def test_invalid_options(kwargs, error, message):
    arguments = {"embed_dim": 64, "num_heads": 4, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        MultiheadAttention(**arguments)


def test_rope_needs_an_even_head_dim():
    with pytest.raises(ValueError, match=re.escape("head_dim: expected an even size for rotary embedding, received 3")):
        MultiheadAttention(12, 4, rope=True)


@pytest.mark.parametrize(
    ("make", "heads", "kv_heads", "kind"),
    [
        (lambda: MultiheadAttention.mha(64, 8), 8, 8, "mha"),
        (lambda: MultiheadAttention.mqa(64, 8), 8, 1, "mqa"),
        (lambda: MultiheadAttention.gqa(64, 8, 2), 8, 2, "gqa"),
        (lambda: MultiheadAttention(64, 8), 8, 8, "mha"),
        (lambda: MultiheadAttention(64, 1, 1), 1, 1, "mha"),
    ],
)
def test_variants_and_their_properties(make, heads, kv_heads, kind):
    layer = make()
    assert (layer.num_heads, layer.num_kv_heads) == (heads, kv_heads)
    assert layer.head_dim == 64 // heads
    assert layer.group_size == heads // kv_heads
    assert {"mha": layer.is_mha, "mqa": layer.is_mqa, "gqa": layer.is_gqa} == {
        name: name == kind for name in ("mha", "mqa", "gqa")
    }


def test_classmethods_pass_options_through():
    layer = MultiheadAttention.gqa(32, 4, 2, causal=True, bias=False, dtype=np.float64, window=5)
    assert layer.causal and not layer.bias and layer.dtype == np.float64 and layer.window == (5, 5)


@pytest.mark.parametrize("bias", [True, False])
def test_parameters_names_shapes_and_count(bias):
    layer = MultiheadAttention.gqa(48, 6, 2, bias=bias)
    shapes = dict((name, param.shape) for name, param in layer.named_parameters())
    expected = {
        "q_proj.weight": (48, 48),
        "k_proj.weight": (16, 48),
        "v_proj.weight": (16, 48),
        "o_proj.weight": (48, 48),
    }
    if bias:
        expected.update({"q_proj.bias": (48,), "k_proj.bias": (16,), "v_proj.bias": (16,), "o_proj.bias": (48,)})
    assert shapes == expected
    assert [name for name, _ in layer.named_parameters()][0] == "q_proj.weight"
    assert len(layer.parameters()) == len(expected)
    assert layer.parameter_count() == sum(int(np.prod(shape)) for shape in expected.values())
    assert all(param.dtype == np.float32 for param in layer.parameters())


def test_xavier_uniform_initialisation_and_zero_biases():
    layer = MultiheadAttention.gqa(256, 8, 2, seed=3)
    params = dict(layer.named_parameters())
    for name, fan_out in (("q_proj", 256), ("k_proj", 64), ("v_proj", 64), ("o_proj", 256)):
        weight = params[f"{name}.weight"]
        bound = np.sqrt(6.0 / (256 + fan_out))
        assert np.abs(weight).max() <= bound
        assert np.abs(weight).max() > 0.95 * bound
        assert weight.var() == pytest.approx(bound**2 / 3, rel=0.05)
        assert abs(weight.mean()) < 0.01 * bound
        assert not np.any(params[f"{name}.bias"])


def test_seed_reproducibility():
    def weights(seed):
        return np.concatenate([p.ravel() for p in MultiheadAttention(32, 4, seed=seed).parameters()])

    assert np.array_equal(weights(1), weights(1))
    assert not np.array_equal(weights(1), weights(2))
    assert np.array_equal(weights(np.random.default_rng(5)), weights(5))


def test_parameters_are_live_views(rng):
    layer = MultiheadAttention(16, 2, dtype=np.float64, seed=0)
    x = rng.standard_normal((1, 3, 16))
    before = layer(x)
    for param in layer.parameters():
        param *= 0.5
    after = layer(x)
    assert not np.allclose(before, after)
    dict(layer.named_parameters())["o_proj.weight"][...] = 0
    assert np.array_equal(layer(x), np.zeros_like(x))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_dtypes(dtype):
    layer = MultiheadAttention(16, 4, dtype=dtype)
    assert all(param.dtype == np.dtype(dtype) for param in layer.parameters())


def test_train_eval_modes(rng):
    layer = MultiheadAttention(16, 2)
    assert layer.training
    assert layer.eval() is layer and not layer.training
    x = rng.standard_normal((1, 3, 16), dtype=np.float32)
    y = layer(x)
    with pytest.raises(RuntimeError, match="backward: expected a forward in training mode"):
        layer.backward(np.ones_like(y))
    assert layer.train() is layer and layer.training
    with pytest.raises(TypeError, match="mode: expected a bool"):
        layer.train("yes")


def test_repr_names_the_configuration():
    text = repr(MultiheadAttention.gqa(64, 8, 2, causal=True, rope=True, window=16))
    parts = ("embed_dim=64", "num_heads=8", "num_kv_heads=2", "head_dim=8", "causal=True", "window=(16, 16)")
    for part in parts + ("RotaryEmbedding(head_dim=8, base=10000)", "float32"):
        assert part in text


def test_package_exports():
    assert fastattn.nn.MultiheadAttention is MultiheadAttention
    assert "nn" in fastattn.__all__
    assert set(fastattn.nn.__all__) == {"PRESETS", "GQAConfig", "KVCache", "MultiheadAttention", "RotaryEmbedding"}


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_cuda_without_cupy_is_refused():
    with pytest.raises(ValueError, match=re.escape("device: expected 'cpu', or CuPy installed for 'cuda'")):
        MultiheadAttention(16, 4, device="cuda")


def test_dropout_only_in_training(rng):
    x = rng.standard_normal((2, 9, 16), dtype=np.float32)
    plain = MultiheadAttention(16, 4, seed=3)
    layer = MultiheadAttention(16, 4, seed=3, dropout=0.5)
    assert layer.dropout == 0.5
    first, second = layer(x), layer(x)
    assert not np.array_equal(first, second), "training forwards draw fresh masks"
    layer.eval()
    np.testing.assert_array_equal(layer(x), plain.eval()(x))


def test_dropout_reaches_the_backward(rng):
    """With everything dropped the attention output is 0, so no gradient reaches the input
    through it: the backward regenerated the forward's mask."""
    x = rng.standard_normal((2, 5, 16), dtype=np.float64)
    layer = MultiheadAttention(16, 4, dtype=np.float64, dropout=1.0, bias=False)
    y = layer(x)
    assert np.all(y == 0)
    (d_x,) = layer.backward(rng.standard_normal(y.shape))
    assert np.all(d_x == 0)


@pytest.mark.parametrize("dropout", [-0.1, 1.5, "0.1", True])
def test_dropout_argument_checked(dropout):
    with pytest.raises(ValueError, match="^dropout: expected a float in"):
        MultiheadAttention(16, 4, dropout=dropout)
