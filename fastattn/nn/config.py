"""Attention configurations of well-known models, and what grouped-query attention saves.

A :class:`GQAConfig` describes the attention of a decoder (sizes, layers, RoPE base, sliding
window), computes its parameter count and KV-cache size, and builds the matching
:class:`~fastattn.nn.MultiheadAttention` and :class:`~fastattn.nn.KVCache`.  :data:`PRESETS` holds
published architectures (values from the models' released configurations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _checks
from ._heads import HeadLayout
from .attention import MultiheadAttention
from .kv_cache import KVCache
from .rope import RotaryEmbedding


def _human_bytes(count: float) -> str:
    """``1342177280`` -> ``"1.25 GiB"``."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while count >= 1024 and index < len(units) - 1:
        count /= 1024
        index += 1
    return f"{count:.2f} {units[index]}"


@dataclass(frozen=True)
class GQAConfig(HeadLayout):
    """The attention of a decoder-only model.

    Parameters
    ----------
    name : str
        A label (e.g. ``"Llama-2-70B"``).
    embed_dim : int
        Hidden size E.
    num_heads : int
        Query heads Hq (divides E).
    num_kv_heads : int
        Key/value heads Hkv (divides Hq).
    num_layers : int
        Attention layers.
    max_seq_len : int
        Context length the model was trained for.
    rope_base : float or None
        RoPE frequency base (``rope_theta``), None for no rotary embedding.
    window : int or None
        Sliding window (Mistral): a query at position i sees keys ``i - window <= j <= i``.
    bias : bool
        Whether the projections have biases.

    Raises
    ------
    ValueError
        For the sizes :class:`MultiheadAttention` rejects, naming the numbers.
    """

    name: str
    embed_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int = 1
    max_seq_len: int = 4096
    rope_base: float | None = 10000.0
    window: int | None = None
    bias: bool = False

    def __post_init__(self) -> None:
        _checks.head_counts(self.embed_dim, self.num_heads, self.num_kv_heads)
        _checks.positive_int("num_layers", self.num_layers)
        _checks.positive_int("max_seq_len", self.max_seq_len)
        _checks.window(self.window)
        _checks.flag("bias", self.bias)
        if self.rope_base is not None:
            RotaryEmbedding(self.head_dim, self.rope_base)

    @classmethod
    def preset(cls, name: str) -> GQAConfig:
        """Return the preset called ``name`` (case-insensitive), one of :data:`PRESETS`."""
        for key, config in PRESETS.items():
            if isinstance(name, str) and key.lower() == name.lower():
                return config
        raise ValueError(f"name: expected one of {sorted(PRESETS)}, received {name!r}")

    @property
    def kind(self) -> str:
        """``"MHA"``, ``"GQA"`` or ``"MQA"``."""
        if self.is_mha:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def num_parameters(self) -> int:
        """Parameters of the attention projections (q, k, v, o) over all layers."""
        width_q = self.num_heads * self.head_dim
        width_kv = self.num_kv_heads * self.head_dim
        weights = self.embed_dim * (width_q + 2 * width_kv) + width_q * self.embed_dim
        biases = (width_q + 2 * width_kv + self.embed_dim) if self.bias else 0
        return self.num_layers * (weights + biases)

    def kv_cache_bytes(self, batch: int, seq: int, dtype: Any = "float16") -> int:
        """Bytes of the keys and values of ``batch`` sequences of ``seq`` tokens, all layers.

        Parameters
        ----------
        batch, seq : int
        dtype : numpy dtype or name
            The cache's element type (float16, bfloat16, float32 or float64).
        """
        batch = _checks.positive_int("batch", batch)
        seq = _checks.positive_int("seq", seq)
        itemsize = _checks.float_dtype("dtype", dtype).itemsize
        return 2 * self.num_layers * batch * seq * self.num_kv_heads * self.head_dim * itemsize

    @property
    def kv_cache_reduction(self) -> float:
        """How many times smaller the KV cache is than with one kv head per query head."""
        return self.num_heads / self.num_kv_heads

    @property
    def memory_savings(self) -> float:
        """Fraction of the multi-head KV cache saved, ``1 - num_kv_heads / num_heads``."""
        return 1.0 - self.num_kv_heads / self.num_heads

    def summary(self, batch: int = 1, seq: int | None = None, dtype: Any = "float16") -> str:
        """A few lines describing the configuration and its KV cache.

        Parameters
        ----------
        batch : int
        seq : int, optional
            Tokens per sequence; ``max_seq_len`` by default.
        dtype : numpy dtype or name
            The cache's element type.
        """
        seq = self.max_seq_len if seq is None else seq
        cache = self.kv_cache_bytes(batch, seq, dtype)
        lines = [
            f"{self.name}: {self.kind}, {self.num_layers} layers, {self.num_heads} query heads, "
            f"{self.num_kv_heads} kv heads (group size {self.group_size}), head_dim {self.head_dim}, "
            f"embed_dim {self.embed_dim}",
            f"  attention parameters: {self.num_parameters:,}",
            f"  KV cache (batch {batch}, {seq} tokens, {_checks.float_dtype('dtype', dtype).name}): "
            f"{_human_bytes(cache)} "
            f"({_human_bytes(cache * self.kv_cache_reduction)} with multi-head attention)",
            f"  KV cache reduction: {self.kv_cache_reduction:g}x ({self.memory_savings:.1%} saved)",
        ]
        position = "no RoPE" if self.rope_base is None else f"RoPE base {self.rope_base:g}"
        window = "" if self.window is None else f", sliding window {self.window}"
        lines.append(f"  {position}, context {self.max_seq_len}{window}")
        return "\n".join(lines)

    def layer(self, **options: Any) -> MultiheadAttention:
        """One causal attention layer of this model (random weights).

        Parameters
        ----------
        **options
            ``dtype``, ``device``, ``seed``, ``backend``, ``batch_first``: as for
            :class:`MultiheadAttention`.
        """
        rope = None if self.rope_base is None else RotaryEmbedding(self.head_dim, self.rope_base)
        return MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            self.num_kv_heads,
            bias=self.bias,
            causal=True,
            window=self.window,
            rope=rope,
            **options,
        )

    def kv_cache(self, batch: int, max_seq: int | None = None, **options: Any) -> KVCache:
        """An empty KV cache for one layer: ``max_seq`` tokens (``max_seq_len`` by default) per row.

        ``options``: ``dtype`` and ``device``, as for :class:`KVCache`.
        """
        max_seq = self.max_seq_len if max_seq is None else max_seq
        return KVCache(batch, max_seq, self.num_kv_heads, self.head_dim, **options)


#: Published attention configurations, by model name.
PRESETS: dict[str, GQAConfig] = {
    config.name: config
    for config in (
        GQAConfig("Llama-2-7B", 4096, 32, 32, num_layers=32, max_seq_len=4096),
        GQAConfig("Llama-2-70B", 8192, 64, 8, num_layers=80, max_seq_len=4096),
        GQAConfig("Mistral-7B", 4096, 32, 8, num_layers=32, max_seq_len=32768, window=4096),
        GQAConfig("Falcon-7B", 4544, 71, 1, num_layers=32, max_seq_len=2048),
        GQAConfig("Falcon-40B", 8192, 128, 8, num_layers=60, max_seq_len=2048),
        GQAConfig("Llama-3-8B", 4096, 32, 8, num_layers=32, max_seq_len=8192, rope_base=500000.0),
    )
}
