"""A brute-force float64 attention layer, written from the layer's documentation and nothing else.

It shares no code with fastattn: projections are plain products, RoPE rotates each (i, i + D/2)
pair with an explicit 2x2 rotation, kv heads are indexed per query head, and each head's softmax is
computed on a materialised score matrix with -inf for hidden keys (rows that see nothing give 0).
"""

from __future__ import annotations

import numpy as np


def rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """Rotate heads x (B, S, H, D) at positions (B, S): pair (i, i + D/2) by pos * base**(-2i/D)."""
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    for i in range(half):
        angle = positions[:, :, None] * base ** (-2.0 * i / x.shape[-1])
        cos, sin = np.cos(angle), np.sin(angle)
        out[..., i] = x[..., i] * cos - x[..., i + half] * sin
        out[..., i + half] = x[..., i + half] * cos + x[..., i] * sin
    return out


def visibility(
    positions_q: np.ndarray,
    key_count: int,
    *,
    causal: bool,
    window: tuple[int, int] | None = None,
    key_lengths: np.ndarray | None = None,
) -> np.ndarray:
    """bool (B, Sq, Sk): key j visible to the query at positions_q[b, i] (keys sit at 0..Sk-1)."""
    batch, seq_q = positions_q.shape
    visible = np.ones((batch, seq_q, key_count), dtype=bool)
    for b in range(batch):
        for i in range(seq_q):
            position = positions_q[b, i]
            for j in range(key_count):
                if causal and j > position:
                    visible[b, i, j] = False
                if window is not None:
                    left, right = window
                    if left >= 0 and j < position - left:
                        visible[b, i, j] = False
                    if right >= 0 and j > position + right:
                        visible[b, i, j] = False
                if key_lengths is not None and j >= key_lengths[b]:
                    visible[b, i, j] = False
    return visible


def layer(
    params: dict[str, np.ndarray],
    x_q: np.ndarray,
    x_k: np.ndarray,
    x_v: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    visible: np.ndarray | None = None,
    additive: np.ndarray | None = None,
    rope_base: float | None = None,
    positions_q: np.ndarray | None = None,
    positions_k: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention layer output (B, Sq, E) and head-averaged probabilities (B, Sq, Sk).

    ``params`` in Llama names (biases optional); ``visible`` bool broadcastable to (B, H, Sq, Sk);
    ``additive`` float likewise; positions (B, S) for RoPE (0..S-1 by default).
    """
    batch, seq_q, _ = x_q.shape
    seq_k = x_k.shape[1]

    def project(x: np.ndarray, name: str, heads: int) -> np.ndarray:
        y = x @ params[f"{name}.weight"].T
        if f"{name}.bias" in params:
            y = y + params[f"{name}.bias"]
        return y.reshape(x.shape[0], x.shape[1], heads, -1)

    q = project(x_q, "q_proj", num_heads)
    k = project(x_k, "k_proj", num_kv_heads)
    v = project(x_v, "v_proj", num_kv_heads)
    head_dim = q.shape[-1]
    if rope_base is not None:
        if positions_q is None:
            positions_q = np.broadcast_to(np.arange(seq_q), (batch, seq_q))
        if positions_k is None:
            positions_k = np.broadcast_to(np.arange(seq_k), (batch, seq_k))
        q, k = rope(q, positions_q, rope_base), rope(k, positions_k, rope_base)
    group = num_heads // num_kv_heads
    out = np.zeros((batch, seq_q, num_heads, head_dim))
    probabilities = np.zeros((batch, num_heads, seq_q, seq_k))
    for h in range(num_heads):
        scores = np.einsum("bid,bjd->bij", q[:, :, h], k[:, :, h // group]) / np.sqrt(head_dim)
        if additive is not None:
            scores = scores + np.broadcast_to(additive, (batch, num_heads, seq_q, seq_k))[:, h]
        if visible is not None:
            scores = np.where(np.broadcast_to(visible, (batch, num_heads, seq_q, seq_k))[:, h], scores, -np.inf)
        row_max = scores.max(axis=-1, keepdims=True)
        row_max = np.where(np.isfinite(row_max), row_max, 0.0)
        weights = np.exp(scores - row_max)
        totals = weights.sum(axis=-1, keepdims=True)
        p = np.where(totals > 0, weights / np.where(totals > 0, totals, 1.0), 0.0)
        probabilities[:, h] = p
        out[:, :, h] = np.einsum("bij,bjd->bid", p, v[:, :, h // group])
    flat = out.reshape(batch, seq_q, num_heads * head_dim)
    result = flat @ params["o_proj.weight"].T
    if "o_proj.bias" in params:
        result = result + params["o_proj.bias"]
    return result, probabilities.mean(axis=1)
