"""Attention layers on fastattn's kernels: MHA, GQA and MQA with backward, KV cache and RoPE.

>>> import numpy as np
>>> from fastattn.nn import MultiheadAttention
>>> layer = MultiheadAttention.gqa(64, 8, 2, causal=True, rope=True, seed=0)
>>> x = np.random.default_rng(0).standard_normal((2, 10, 64), dtype=np.float32)
>>> layer(x).shape
(2, 10, 64)

``MultiheadAttention`` reads and writes torch.nn.MultiheadAttention and Llama-style state dicts;
``KVCache`` holds keys and values for incremental decoding; ``RotaryEmbedding`` is RoPE in the
Llama convention; ``GQAConfig`` and ``PRESETS`` describe published models' attention.
"""

from __future__ import annotations

from .attention import MultiheadAttention
from .config import PRESETS, GQAConfig
from .kv_cache import KVCache
from .rope import RotaryEmbedding

__all__ = ["PRESETS", "GQAConfig", "KVCache", "MultiheadAttention", "RotaryEmbedding"]
