"""Head-layout properties shared by the layer and its configuration."""

from __future__ import annotations


class HeadLayout:
    """``head_dim``, ``group_size`` and the MHA/GQA/MQA tests, from three integer attributes.

    Classes using it have ``embed_dim``, ``num_heads`` and ``num_kv_heads``.
    """

    embed_dim: int
    num_heads: int
    num_kv_heads: int

    @property
    def head_dim(self) -> int:
        """Features per head, ``embed_dim // num_heads``."""
        return self.embed_dim // self.num_heads

    @property
    def group_size(self) -> int:
        """Query heads per kv head, ``num_heads // num_kv_heads``."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_mha(self) -> bool:
        """One kv head per query head."""
        return self.num_kv_heads == self.num_heads

    @property
    def is_mqa(self) -> bool:
        """One kv head shared by several query heads."""
        return self.num_kv_heads == 1 and self.num_heads > 1

    @property
    def is_gqa(self) -> bool:
        """Several kv heads, each shared by several query heads."""
        return 1 < self.num_kv_heads < self.num_heads
