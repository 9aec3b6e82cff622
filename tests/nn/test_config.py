"""GQAConfig and the presets: published sizes, statistics, and the layers and caches they build."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fastattn.nn import PRESETS, GQAConfig, KVCache, MultiheadAttention

GIB = 1024**3


@pytest.mark.parametrize(
    ("name", "sizes", "kind", "attention_parameters"),
    [
        ("Llama-2-7B", (4096, 32, 32, 32, 128), "MHA", 32 * 4 * 4096 * 4096),
        ("Llama-2-70B", (8192, 64, 8, 80, 128), "GQA", 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024)),
        ("Mistral-7B", (4096, 32, 8, 32, 128), "GQA", 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)),
        ("Falcon-7B", (4544, 71, 1, 32, 64), "MQA", 32 * (2 * 4544 * 4544 + 2 * 4544 * 64)),
        ("Falcon-40B", (8192, 128, 8, 60, 64), "GQA", 60 * (2 * 8192 * 8192 + 2 * 8192 * 512)),
        ("Llama-3-8B", (4096, 32, 8, 32, 128), "GQA", 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)),
    ],
)
def test_presets(name, sizes, kind, attention_parameters):
    config = GQAConfig.preset(name.upper())
    assert config is PRESETS[name]
    assert (config.embed_dim, config.num_heads, config.num_kv_heads, config.num_layers, config.head_dim) == sizes
    assert config.kind == kind
    assert config.num_parameters == attention_parameters
    assert config.kv_cache_reduction == config.num_heads / config.num_kv_heads
    assert config.memory_savings == pytest.approx(1 - config.num_kv_heads / config.num_heads)


def test_preset_details():
    assert PRESETS["Mistral-7B"].window == 4096
    assert PRESETS["Llama-3-8B"].rope_base == 500000.0
    assert PRESETS["Llama-2-7B"].rope_base == 10000.0
    with pytest.raises(ValueError, match=re.escape("name: expected one of ['Falcon-40B', 'Falcon-7B', 'Llama-2-70B'")):
        GQAConfig.preset("gpt-2")


def test_kv_cache_bytes():
    assert PRESETS["Llama-2-7B"].kv_cache_bytes(1, 4096) == 2 * GIB  # the well-known 0.5 MiB per token
    assert PRESETS["Llama-2-70B"].kv_cache_bytes(1, 4096, "float16") == 1.25 * GIB
    assert PRESETS["Llama-2-70B"].kv_cache_bytes(8, 4096, np.float32) == 8 * 2.5 * GIB
    assert PRESETS["Llama-3-8B"].kv_cache_bytes(1, 8192, "bfloat16") == GIB
    with pytest.raises(ValueError, match="seq: expected a positive size, received 0"):
        PRESETS["Llama-2-7B"].kv_cache_bytes(1, 0)
    with pytest.raises(TypeError, match="dtype: expected one of"):
        PRESETS["Llama-2-7B"].kv_cache_bytes(1, 16, np.int8)


def test_summary():
    text = PRESETS["Llama-2-70B"].summary()
    for part in (
        "Llama-2-70B: GQA, 80 layers, 64 query heads, 8 kv heads (group size 8), head_dim 128",
        "attention parameters: 12,079,595,520",
        "KV cache (batch 1, 4096 tokens, float16): 1.25 GiB (10.00 GiB with multi-head attention)",
        "KV cache reduction: 8x (87.5% saved)",
        "RoPE base 10000, context 4096",
    ):
        assert part in text
    assert "sliding window 4096" in PRESETS["Mistral-7B"].summary(batch=2, seq=1024, dtype="float32")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(embed_dim=100, num_heads=8, num_kv_heads=2), ValueError,
         "embed_dim: expected a multiple of num_heads=8, received 100"),
        (dict(embed_dim=64, num_heads=8, num_kv_heads=3), ValueError,
         "num_kv_heads: expected a divisor of num_heads=8, received 3"),
        (dict(embed_dim=64, num_heads=8, num_kv_heads=16), ValueError,
         "num_kv_heads: expected at most num_heads=8, received 16"),
        (dict(embed_dim=64, num_heads=8, num_kv_heads=2, num_layers=0), ValueError,
         "num_layers: expected a positive size, received 0"),
        (dict(embed_dim=24, num_heads=8, num_kv_heads=2), ValueError,
         "head_dim: expected an even size for rotary embedding, received 3"),
    ],
)
def test_invalid_configs(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        GQAConfig("custom", **kwargs)


def test_layer_and_cache_from_a_config(rng):
    config = GQAConfig("tiny", 32, 4, 2, num_layers=2, max_seq_len=16, rope_base=500000.0, window=3)
    layer = config.layer(dtype=np.float64, seed=1)
    assert isinstance(layer, MultiheadAttention)
    assert (layer.num_heads, layer.num_kv_heads, layer.causal, layer.window, layer.bias) == (4, 2, True, (3, 3), False)
    assert layer.rope.base == 500000.0
    assert layer.parameter_count() * config.num_layers == config.num_parameters
    cache = config.kv_cache(2, dtype=np.float64)
    assert isinstance(cache, KVCache) and cache.keys.shape == (2, 16, 2, 8)
    assert cache.nbytes * config.num_layers == config.kv_cache_bytes(2, 16, np.float64)
    x = rng.standard_normal((2, 5, 32))
    assert np.allclose(layer(x, cache=cache), layer(x), atol=1e-12)
    assert GQAConfig("no-rope", 32, 4, 4, rope_base=None).layer().rope is None
