"""A brute-force float64 oracle for attention, written from DESIGN.md §3 and nothing else.

It shares no code with any backend: visibility is decided key by key with the contract's own
inequalities, K and V are indexed per query head (h // group), and each query row's softmax,
output and gradients are computed on their own with plain numpy vector operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Options:
    """The contract's options, as the oracle reads them (arrays already float64 / bool / int)."""

    causal: object = False
    scale: float | None = None
    mask: np.ndarray | None = None
    key_lengths: np.ndarray | None = None
    window: tuple[int, int] | None = None
    softcap: float | None = None


def allowed_keys(b: int, i: int, seq_q: int, seq_k: int, options: Options) -> np.ndarray:
    """Keys query i of batch row b may see before any mask array: causal, window, key_lengths."""
    position = i + (seq_k - seq_q if options.causal == "bottom_right" else 0)
    allowed = np.zeros(seq_k, dtype=bool)
    for j in range(seq_k):
        ok = True
        if options.causal in (True, "top_left", "bottom_right"):
            ok = ok and j <= position
        if options.window is not None:
            left, right = options.window
            if left != -1:
                ok = ok and position - left <= j
            if right != -1:
                ok = ok and j <= position + right
        if options.key_lengths is not None:
            ok = ok and j < options.key_lengths[b]
        allowed[j] = ok
    return allowed


def _row(q, k, b, h, i, options, allowed_cache):
    """Return (raw, scores, allowed) of one query row.

    raw is ``scale * k @ q``; scores are raw after softcap and the float mask; allowed marks the
    keys that take part (visibility, bool mask, and not -inf after the float mask).
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    kv = h // (heads_q // heads_kv)
    scale = options.scale if options.scale is not None else 1.0 / np.sqrt(head_dim)
    raw = (k[b, kv] @ q[b, h, i]) * scale
    scores = options.softcap * np.tanh(raw / options.softcap) if options.softcap is not None else raw
    allowed = allowed_cache[(b, i)].copy()
    if options.mask is not None:
        mask = np.broadcast_to(options.mask, (batch, heads_q, seq_q, seq_k))[b, h, i]
        if mask.dtype == np.bool_:
            allowed &= mask
        else:
            scores = scores + mask
    allowed &= scores > -np.inf
    return raw, scores, allowed


def _softmax(scores, allowed):
    """Return (probabilities, lse) of a row; (None, -inf) when no key is allowed."""
    if not allowed.any():
        return None, -np.inf
    top = scores[allowed].max()
    weights = np.zeros_like(scores)
    weights[allowed] = np.exp(scores[allowed] - top)
    total = weights.sum()
    return weights / total, top + np.log(total)


def _cache(q, k, options):
    batch, _, seq_q, _ = q.shape
    seq_k = k.shape[2]
    return {(b, i): allowed_keys(b, i, seq_q, seq_k, options) for b in range(batch) for i in range(seq_q)}


def forward(q, k, v, options: Options):
    """Return (out, lse) in float64 for bhsd float64 inputs."""
    batch, heads_q, seq_q, _ = q.shape
    out = np.zeros((batch, heads_q, seq_q, v.shape[3]))
    lse = np.full((batch, heads_q, seq_q), -np.inf)
    cache = _cache(q, k, options)
    group = heads_q // k.shape[1]
    for b in range(batch):
        for h in range(heads_q):
            for i in range(seq_q):
                _, scores, allowed = _row(q, k, b, h, i, options, cache)
                probabilities, lse[b, h, i] = _softmax(scores, allowed)
                if probabilities is not None:
                    out[b, h, i] = probabilities @ v[b, h // group]
    return out, lse


class Gradients(NamedTuple):
    """The oracle's gradients and, for each, the same sum taken over absolute values.

    ``magnitudes`` bound what rounding can do to each gradient: a gradient that cancels to nearly
    zero (a row with one visible key has dq = 0 exactly) is compared against the size of the terms
    that cancelled, not against the rounding noise of the cancellation.
    """

    dq: np.ndarray
    dk: np.ndarray
    dv: np.ndarray
    magnitudes: tuple[np.ndarray, np.ndarray, np.ndarray]


def backward(dout, q, k, v, options: Options, out=None) -> Gradients:
    """Return the float64 gradients; dk/dv summed over each kv head's query group.

    ``out``, when given, is the saved forward output whose row-wise ``dout . out`` every flash
    backward uses for the softmax correction; without it the oracle's own exact output is used.
    With half-precision inputs the two differ by the rounding of ``out``, which the gradient of a
    nearly saturated row cannot absorb.
    """
    batch, heads_q, seq_q, head_dim = q.shape
    grads = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    sizes = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)]
    cache = _cache(q, k, options)
    group = heads_q // k.shape[1]
    scale = options.scale if options.scale is not None else 1.0 / np.sqrt(head_dim)
    for b in range(batch):
        for h in range(heads_q):
            kv = h // group
            for i in range(seq_q):
                raw, scores, allowed = _row(q, k, b, h, i, options, cache)
                probabilities, _ = _softmax(scores, allowed)
                if probabilities is None:
                    continue
                grad_out = dout[b, h, i]
                grad_p = v[b, kv] @ grad_out
                correction = probabilities @ grad_p if out is None else grad_out @ out[b, h, i]
                grad_scores = probabilities * (grad_p - correction)
                grad_scores_size = probabilities * (np.abs(v[b, kv]) @ np.abs(grad_out) + abs(correction))
                if options.softcap is not None:
                    # sech^2 from exp(-2|x|): 1 - tanh^2 cancels to nothing once tanh rounds to 1.
                    u = np.exp(-2.0 * np.abs(raw / options.softcap))
                    derivative = 4.0 * u / (1.0 + u) ** 2
                    grad_scores, grad_scores_size = grad_scores * derivative, grad_scores_size * derivative
                for values, row_grad in ((grads, grad_scores * scale), (sizes, grad_scores_size * abs(scale))):
                    absolute = values is sizes
                    keys, query = (np.abs(k[b, kv]), np.abs(q[b, h, i])) if absolute else (k[b, kv], q[b, h, i])
                    values[0][b, h, i] = row_grad @ keys
                    values[1][b, kv] += np.outer(row_grad, query)
                    values[2][b, kv] += np.outer(probabilities, np.abs(grad_out) if absolute else grad_out)
    return Gradients(grads[0], grads[1], grads[2], (sizes[0], sizes[1], sizes[2]))
