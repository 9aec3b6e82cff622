"""KVCache on its own, and decoding with it: cached steps equal recomputing the whole sequence."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fastattn import functional
from fastattn.nn import KVCache, MultiheadAttention

from . import _reference
from ._helpers import max_error, params_of, random_layer

# --------------------------------------------------------------------------------------------------
# the cache itself


def test_a_new_cache_is_empty_and_zeroed():
    cache = KVCache(2, 8, 3, 4, dtype=np.float64)
    assert cache.keys.shape == cache.values.shape == (2, 8, 3, 4)
    assert not cache.keys.any() and not cache.values.any()
    assert cache.lengths.tolist() == [0, 0] and cache.max_length == 0
    assert cache.view()[0].shape == (2, 0, 3, 4)
    assert cache.nbytes == 2 * 2 * 8 * 3 * 4 * 8
    assert "lengths=[0, 0]" in repr(cache)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 8, 3, 4), (4, 4096, 8, 128)])
def test_host_buffers_are_head_major_on_a_cache_line(dtype, shape):
    """Each kv head's tokens back to back (a decode streams them), the memory starting on a cache
    line (numpy alone would start a large buffer 16 bytes past one)."""
    batch, max_seq, heads, head_dim = shape
    cache = KVCache(*shape, dtype=dtype)
    itemsize = cache.keys.dtype.itemsize
    head_major = (heads * max_seq * head_dim * itemsize, head_dim * itemsize, max_seq * head_dim * itemsize, itemsize)
    for buffer in (cache.keys, cache.values):
        assert buffer.ctypes.data % 64 == 0
        assert buffer.shape == shape and buffer.dtype.name == dtype and buffer.flags.writeable
        assert buffer.strides == head_major and buffer.transpose(0, 2, 1, 3).flags.c_contiguous
        assert not buffer.any()
    assert not np.shares_memory(cache.keys, cache.values)


def test_append_view_truncate_reset(rng):
    cache = KVCache(2, 6, 1, 2)
    keys, values = (rng.standard_normal((2, 3, 1, 2)).astype(np.float32) for _ in range(2))
    assert cache.append(keys, values).tolist() == [0, 0]
    assert cache.append(keys[:, :2], values[:, :2], counts=np.array([2, 1])).tolist() == [3, 3]
    assert cache.lengths.tolist() == [5, 4]
    view_keys, view_values = cache.view()
    assert view_keys.shape == (2, 5, 1, 2) and np.shares_memory(view_keys, cache.keys)
    assert np.array_equal(view_keys[:, :3], keys) and np.array_equal(view_values[1, 3], values[1, 0])
    assert not view_keys[1, 4].any()  # the padded token was not stored
    cache.truncate([4, 1])
    assert cache.lengths.tolist() == [4, 1]
    cache.append(keys[:, :1], values[:, :1])
    assert cache.lengths.tolist() == [5, 2] and np.array_equal(cache.keys[1, 1], keys[1, 0])
    cache.truncate(1)
    assert cache.lengths.tolist() == [1, 1]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0]
    lengths = cache.lengths
    lengths[0] = 3  # a copy
    assert cache.max_length == 0


def test_cache_errors(rng):
    cache = KVCache(2, 4, 2, 3, dtype=np.float64)
    keys = rng.standard_normal((2, 3, 2, 3))
    cases = [
        (lambda: cache.append(keys[:, :, :1], keys[:, :, :1]), ValueError,
         "keys: expected shape (2, S, 2, 3) (batch, S, num_kv_heads, head_dim), received (2, 3, 1, 3)"),
        (lambda: cache.append(keys, keys.astype(np.float32)), TypeError,
         "values: expected dtype float64 (the cache's), received float32"),
        (lambda: cache.append(keys, keys[:, :2]), ValueError,
         "values: expected 3 tokens like keys, received shape (2, 2, 2, 3)"),
        (lambda: cache.append(keys[:, :0], keys[:, :0]), ValueError, "keys: expected at least one token"),
        (lambda: cache.append(keys, keys, counts=[3, 4]), ValueError,
         "counts: expected values in [0, 3] (the tokens given), received values in [3, 4]"),
        (lambda: cache.append(keys, keys, counts=[3]), ValueError, "counts: expected shape (2,), received (1,)"),
        (lambda: cache.append(keys, keys, counts=[1.0, 2.0]), TypeError, "counts: expected integers"),
        (lambda: cache.truncate(2), ValueError,
         "lengths: expected values in [0, current length] per row (current [0, 0]), received [2, 2]"),
        (lambda: KVCache(0, 4, 2, 3), ValueError, "batch: expected a positive size, received 0"),
        (lambda: KVCache(1, 4, 2, 3, dtype=np.int8), TypeError, "dtype: expected one of"),
        (lambda: KVCache(1, 4, 2, 3, device="gpu"), ValueError, "device: expected 'cpu' or 'cuda', received 'gpu'"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()
    cache.append(keys, keys, counts=[3, 1])
    message = "keys: expected room for 3 tokens in row 0, which holds 3 of max_seq=4"
    with pytest.raises(ValueError, match=re.escape(message)):
        cache.append(keys, keys)
    assert cache.lengths.tolist() == [3, 1]


# --------------------------------------------------------------------------------------------------
# decoding with a layer


LAYERS = {
    "mha": dict(embed_dim=16, num_heads=4),
    "gqa-rope": dict(embed_dim=24, num_heads=6, num_kv_heads=2, rope=True),
    "mqa-rope-window": dict(embed_dim=16, num_heads=4, num_kv_heads=1, rope=True, window=3),
    "gqa-no-bias-window": dict(embed_dim=16, num_heads=4, num_kv_heads=2, bias=False, window=(2, 0)),
}


def _cache_for(layer, batch, max_seq):
    return KVCache(batch, max_seq, layer.num_kv_heads, layer.head_dim, dtype=layer.dtype)


@pytest.mark.parametrize("name", list(LAYERS))
def test_generation_with_the_cache_equals_recomputation(name, rng):
    layer = random_layer(rng, causal=True, **LAYERS[name]).eval()
    embed = layer.embed_dim
    feedback = rng.standard_normal((embed, embed)) / np.sqrt(embed)
    sequence = rng.standard_normal((3, 4, embed))
    cache = _cache_for(layer, 3, 16)
    out = layer(sequence, cache=cache)
    assert max_error(out, layer(sequence)) < 1e-10
    for _ in range(8):
        token = np.tanh(out[:, -1:] @ feedback)
        sequence = np.concatenate([sequence, token], axis=1)
        out = layer(token, cache=cache)
        assert out.shape == (3, 1, embed)
        assert max_error(out[:, 0], layer(sequence)[:, -1]) < 1e-10
    assert cache.lengths.tolist() == [12, 12, 12]


@pytest.mark.parametrize("name", list(LAYERS))
def test_chunked_prefill_equals_one_pass(name, rng):
    layer = random_layer(rng, causal=True, **LAYERS[name]).eval()
    sequence = rng.standard_normal((2, 10, layer.embed_dim))
    cache = _cache_for(layer, 2, 10)
    chunks, start = [], 0
    for size in (3, 1, 4, 2):
        chunks.append(layer(sequence[:, start : start + size], cache=cache))
        start += size
    assert max_error(np.concatenate(chunks, axis=1), layer(sequence)) < 1e-10


@pytest.mark.parametrize("window", [None, 2])
def test_prompts_of_different_lengths(window, rng):
    """Right-padded prompts, then steps and a chunk: each row equals decoding it on its own."""
    layer = random_layer(rng, 16, 4, 2, causal=True, rope=True, window=window).eval()
    lengths = [5, 2, 4]
    prompts = rng.standard_normal((3, 5, 16))
    padding = np.arange(5)[None, :] >= np.array(lengths)[:, None]
    later = rng.standard_normal((3, 5, 16))  # three single steps, then a chunk of two
    cache = _cache_for(layer, 3, 12)
    prefill = layer(prompts, key_padding_mask=padding, cache=cache)
    assert cache.lengths.tolist() == lengths
    steps = [layer(later[:, i : i + 1], cache=cache) for i in range(3)]
    chunk = layer(later[:, 3:], cache=cache)
    assert cache.lengths.tolist() == [n + 5 for n in lengths]
    for row, length in enumerate(lengths):
        alone = np.concatenate([prompts[row : row + 1, :length], later[row : row + 1]], axis=1)
        expected = layer(alone)[0]
        assert max_error(prefill[row, :length], expected[:length]) < 1e-10
        for i, step in enumerate(steps):
            assert max_error(step[row, 0], expected[length + i]) < 1e-10
        assert max_error(chunk[row], expected[length + 3 :]) < 1e-10


class _Spy:
    """Records the arguments of every attention call the layer makes on its cache."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = functional.attention_with

        def spy(q, k, v, options):
            self.calls.append((q, k, v, options._asdict()))
            return real(q, k, v, options)

        monkeypatch.setattr(functional, "attention_with", spy)


def test_one_token_steps_take_the_decode_fast_path(rng, monkeypatch):
    layer = random_layer(rng, 16, 4, 2, causal=True, rope=True).eval()
    cache = _cache_for(layer, 2, 8)
    layer(rng.standard_normal((2, 3, 16)), cache=cache, key_padding_mask=np.array([[False] * 3, [False, False, True]]))

    def refuse(*args, **kwargs):
        raise AssertionError("a one-token step left the fast path")

    monkeypatch.setattr(MultiheadAttention, "_cached_forward", refuse)
    spy = _Spy(monkeypatch)
    layer(rng.standard_normal((2, 1, 16)), cache=cache)
    q, k, v, options = spy.calls[-1]
    assert q.shape == (2, 1, 4, 4) and k.shape == (2, 4, 2, 4)
    assert np.shares_memory(k, cache.keys) and np.shares_memory(v, cache.values)
    assert options["causal"] == "bottom_right" and options["mask"] is None
    assert options["key_lengths"].tolist() == [4, 3]
    assert options["layout"] == "bshd"
    cache.truncate([3, 3])
    layer(rng.standard_normal((2, 1, 16)), cache=cache)
    options = spy.calls[-1][3]
    assert options["causal"] == "bottom_right" and options["key_lengths"] is None and options["mask"] is None


def test_aligned_chunks_use_bottom_right_alignment_without_masks(rng, monkeypatch):
    layer = random_layer(rng, 16, 4, 2, causal=True, window=4).eval()
    cache = _cache_for(layer, 2, 8)
    layer(rng.standard_normal((2, 3, 16)), cache=cache)
    spy = _Spy(monkeypatch)
    layer(rng.standard_normal((2, 2, 16)), cache=cache)
    options = spy.calls[-1][3]
    assert options["causal"] == "bottom_right" and options["window"] == (4, 4)
    assert options["mask"] is None and options["key_lengths"] is None


def test_non_causal_window_with_a_cache(rng):
    layer = random_layer(rng, 16, 4, 2, window=(1, 1), rope=True).eval()
    tokens = rng.standard_normal((2, 7, 16))
    cache = _cache_for(layer, 2, 8)
    layer(tokens[:, :4], cache=cache)
    out = layer(tokens[:, 4:], cache=cache)
    positions = np.broadcast_to(np.arange(4, 7), (2, 3))
    visible = _reference.visibility(positions, 7, causal=False, window=(1, 1))[:, None]
    expected, _ = _reference.layer(
        params_of(layer), tokens[:, 4:], tokens, tokens, num_heads=4, num_kv_heads=2, visible=visible,
        rope_base=10000.0, positions_q=positions,
    )
    assert max_error(out, expected) < 1e-10


def test_weights_with_a_cache(rng):
    layer = random_layer(rng, 16, 4, 1, causal=True, rope=True).eval()
    tokens = rng.standard_normal((2, 5, 16))
    _, full_weights = layer(tokens, need_weights=True)
    cache = _cache_for(layer, 2, 8)
    _, prefill_weights = layer(tokens[:, :4], cache=cache, need_weights=True)
    assert max_error(prefill_weights, full_weights[:, :4, :4]) < 1e-10
    out, step_weights = layer(tokens[:, 4:], cache=cache, need_weights=True)
    assert step_weights.shape == (2, 1, 5)
    assert max_error(step_weights, full_weights[:, 4:]) < 1e-10


def test_torch_tensors_with_a_cache(rng):
    torch = pytest.importorskip("torch")
    layer = random_layer(rng, 8, 2, causal=True).eval()
    cache = _cache_for(layer, 1, 4)
    out = layer(torch.from_numpy(rng.standard_normal((1, 2, 8))), cache=cache)
    step = layer(torch.from_numpy(rng.standard_normal((1, 1, 8))), cache=cache)
    assert isinstance(out, torch.Tensor) and isinstance(step, torch.Tensor) and step.shape == (1, 1, 8)


def test_cache_errors_in_the_layer(rng):
    layer = MultiheadAttention(16, 4, 2, causal=True, dtype=np.float64)
    x = rng.standard_normal((2, 3, 16))
    cache = KVCache(2, 4, 2, 4, dtype=np.float64)
    cases = [
        (lambda: layer(x, rng.standard_normal((2, 3, 16)), cache=cache), ValueError,
         "key: expected None or query itself with a cache (cached attention is self-attention)"),
        (lambda: layer(x, cache=cache, attn_mask=np.zeros((3, 3), dtype=bool)), ValueError,
         "attn_mask: expected None with a cache"),
        (lambda: layer(x, cache=cache, key_padding_mask=np.array([[False, True, False]] * 2)), ValueError,
         "key_padding_mask: expected right padding with a cache (True only after a row's real tokens)"),
        (lambda: layer(x, cache=cache, key_padding_mask=np.zeros((2, 3))), ValueError,
         "key_padding_mask: expected a bool (2, 3) array with a cache"),
        (lambda: layer(x, cache=KVCache(2, 4, 4, 4, dtype=np.float64)), ValueError,
         "cache: expected num_kv_heads=2 (the layer's), received KVCache("),
        (lambda: layer(x, cache=KVCache(2, 4, 2, 4)), ValueError, "cache: expected dtype=float64 (the layer's)"),
        (lambda: layer(x, cache=KVCache(3, 4, 2, 4, dtype=np.float64)), ValueError,
         "cache: expected batch=2 (the input's)"),
        (lambda: layer(np.concatenate([x, x], axis=1), cache=cache), ValueError,
         "keys: expected room for 6 tokens in row 0, which holds 0 of max_seq=4"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()
    assert cache.lengths.tolist() == [0, 0]
