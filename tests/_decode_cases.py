"""Decode-sized cases (Sq <= 16, a KV cache) shared by the device tests of the decode kernels
(``test_cuda_decode.py``) and their emulated runs (``emulator/test_decode.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from .conformance._cases import Case


def decode_case(**changes: Any) -> Case:
    """B=3, Hkv=2, group 4, Sq=1, D=128, float32, bottom-right causal; fields overridable."""
    base = Case(
        batch=3, heads_kv=2, group=4, seq_q=1, seq_k=63, head_dim=128, head_dim_v=128, dtype="float32",
        layout="bhsd", causal="bottom_right", window=None, mask_kind=None, mask_shape=None, key_lengths=None,
        softcap=None, scale=None, strided="contiguous", seed=1234,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def ragged(seq_k: int, batch: int = 3) -> tuple[int, ...]:
    """Per-row lengths: full, an odd part, and 0 (a row whose queries see nothing)."""
    return (seq_k, max(1, (seq_k * 5) // 7 | 1), 0)[:batch]


#: Contract features on a seq_k = 500 case, as changes to :func:`decode_case`.
FEATURES: dict[str, dict[str, Any]] = {
    "window": {"window": (100, 0)},
    "window-both-sides": {"causal": False, "window": (40, 3), "seq_q": 4},
    "bool-mask": {"mask_kind": "bool", "mask_shape": (3, 8, 1, 500)},
    "float-mask-broadcast": {"mask_kind": "float", "mask_shape": (1, 500)},
    "softcap": {"softcap": 5.0, "scale": 1.3},
    "bshd": {"layout": "bshd", "seq_q": 3},
    "mqa": {"heads_kv": 1, "group": 16, "seq_q": 2},
}
