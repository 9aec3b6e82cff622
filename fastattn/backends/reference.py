"""The reference backend: materialising attention over numpy or CuPy, the fallback for everything.

It builds the full ``(B, Hkv, G, Sq, Sk)`` score tensor (G = Hq // Hkv query heads per kv head; K and
V broadcast over G in batched matmuls, never repeated), applies the whole contract of DESIGN.md §3
to it, and computes the analytic backward from the saved ``lse``.  Arithmetic is float64 for float64
inputs and float32 otherwise.  It accepts every valid problem on either device: it is the answer of
last resort, not a fast path, and its memory is O(B·Hq·Sq·Sk).

It also defines what non-finite inputs do (README, "NaN and infinity"): IEEE arithmetic on the
max-shifted softmax, except that a product whose weight (an attention probability, or dS in the
backward) is exactly 0 counts 0 even when the other factor is infinite or NaN, so a key a row
cannot see never reaches it.  Float32 probabilities below the smallest normal float are 0, as in
the kernels' exp.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import _arrays, _dropout
from .._problem import AttentionExtras, AttentionProblem


class ReferenceBackend:
    """Array-namespace-generic (numpy or CuPy) materialising implementation of the contract."""

    name = "reference"
    devices: tuple[str, ...] = ("cpu", "cuda")
    priority = 0
    description = "materialising numpy/CuPy implementation of the whole contract; O(Sq*Sk) memory"

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """The reference runs every valid problem."""
        return []

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """Return ``(out, lse)`` for ``(B, H, S, D)``-ordered numpy or CuPy inputs."""
        xp = _arrays.namespace(q)
        compute = _arrays.accumulation_dtype(problem.dtype)
        scores = _Scores(problem, xp, q, k, extras)
        p, shift, row_sum = scores.softmax_parts()
        grouped_out = _skip_zero_weights_matmul(xp, scores.dropped(p), v.astype(compute)[:, :, None])
        has_keys = row_sum != 0  # 0 only without a key; NaN poisons the row instead
        grouped_out /= xp.where(has_keys, row_sum, 1)[..., None]
        lse = xp.where(has_keys, shift + xp.log(xp.where(has_keys, row_sum, 1)), -xp.inf)
        out = _into_layout(xp, _ungroup(grouped_out, problem), q.dtype, problem.layout)
        return out, _ungroup(lse, problem).astype(compute)

    def backward(
        self,
        problem: AttentionProblem,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        extras: AttentionExtras,
    ) -> tuple[Any, Any, Any]:
        """Return ``(dq, dk, dv)``; dk and dv are summed over each kv head's query group."""
        xp = _arrays.namespace(q)
        compute = _arrays.accumulation_dtype(problem.dtype)
        scores = _Scores(problem, xp, q, k, extras)
        saved_lse = _group(lse.astype(compute), problem)
        # exp(s - inf) = 0 for every key of a row that saw none, so such rows get zero gradients.
        p = _probabilities(xp, scores.masked, xp.where(saved_lse == -xp.inf, xp.inf, saved_lse))
        grouped_dout = _group(dout.astype(compute), problem)
        grouped_out = _group(out.astype(compute), problem)
        kv_v = v.astype(compute)
        dv = _skip_zero_weights_matmul(xp, scores.dropped(p).swapaxes(-1, -2), grouped_dout).sum(axis=2)
        dp = grouped_dout @ kv_v[:, :, None].swapaxes(-1, -2)
        if scores.dropout is not None:
            dp = xp.where(scores.dropout != 0, dp * scores.dropout, 0)
        delta = (grouped_dout * grouped_out).sum(axis=-1, keepdims=True)
        ds = p * (dp - delta)
        if problem.softcap is not None:
            ds *= scores.cap_derivative
        ds = xp.where(p != 0, ds, 0) * problem.scale
        dq = _skip_zero_weights_matmul(xp, ds, k.astype(compute)[:, :, None])
        dk = _skip_zero_weights_matmul(xp, ds.swapaxes(-1, -2), scores.grouped_q).sum(axis=2)
        return (
            _into_layout(xp, _ungroup(dq, problem), q.dtype, problem.layout),
            _into_layout(xp, dk, k.dtype, problem.layout),
            _into_layout(xp, dv, v.dtype, problem.layout),
        )


class _Scores:
    """The masked score tensor ``(B, Hkv, G, Sq, Sk)`` of a problem, and what the backward needs.

    Attributes
    ----------
    grouped_q : array
        q in the compute dtype, ``(B, Hkv, G, Sq, D)``.
    cap_derivative : array or None
        With softcap, d(capped)/d(raw) = sech^2(raw / softcap) (raw = ``scale * q @ k.T``, capped =
        ``softcap * tanh(raw / softcap)``), computed as 4u / (1 + u)^2 with
        u = exp(-2|raw / softcap|): accurate where tanh saturates (1 - tanh^2 would cancel to 0).
    masked : array
        The scores (capped when softcap is on) plus the float mask, -inf wherever a key is hidden.
    dropout : array or None
        The dropout multipliers ``(B, Hkv, G, Sq, Sk)``: 0 or ``1 / (1 - p)``.
    """

    def __init__(
        self, problem: AttentionProblem, xp: ModuleType, q: Any, k: Any, extras: AttentionExtras
    ) -> None:
        compute = _arrays.accumulation_dtype(problem.dtype)
        self.xp = xp
        self.grouped_q = _group(q.astype(compute), problem)
        scores = (self.grouped_q @ k.astype(compute)[:, :, None].swapaxes(-1, -2)) * problem.scale
        self.cap_derivative = None
        if problem.softcap is not None:
            u = xp.exp(-2 * xp.abs(scores / problem.softcap))
            self.cap_derivative = 4 * u / (1 + u) ** 2
            scores = problem.softcap * xp.tanh(scores / problem.softcap)
        visible = _visibility(problem, xp, extras.key_lengths)
        if problem.mask == "float":
            scores = scores + _group_mask(extras.mask, problem).astype(compute)
        elif problem.mask == "bool":
            mask = _group_mask(extras.mask, problem)
            visible = mask if visible is None else visible & mask
        if visible is not None:
            scores = xp.where(visible, scores, -xp.inf)
        self.masked = scores
        self.dropout = None
        if extras.dropout is not None:
            shape = (problem.batch, problem.heads_q, problem.seq_q, problem.seq_k)
            self.dropout = _group(_dropout.factors(xp, extras.dropout, shape, compute), problem)

    def dropped(self, p: Any) -> Any:
        """Probabilities ``p`` after dropout (``p`` itself without it)."""
        return p if self.dropout is None else p * self.dropout

    def softmax_parts(self) -> tuple[Any, Any, Any]:
        """Return unnormalised probabilities, the shifts and the row sums.

        The shift is the row maximum (NaN if a score is NaN), or 0 for a row whose every score
        is -inf, so that such a row sums to exactly 0.
        """
        xp = self.xp
        row_max = self.masked.max(axis=-1)
        shift = xp.where(row_max == -xp.inf, 0, row_max)
        p = _probabilities(xp, self.masked, shift)
        return p, shift, p.sum(axis=-1)


def _probabilities(xp: ModuleType, masked: Any, shift: Any) -> Any:
    """``exp(masked - shift)``, exactly 0 at hidden keys (-inf) even when the shift is NaN, and
    with float32 results below the smallest normal float flushed to 0 like the kernels' exp."""
    result = xp.exp(masked - shift[..., None])
    hidden = masked == -xp.inf
    if result.dtype == xp.float32:
        hidden |= result < xp.finfo(xp.float32).tiny
    return xp.where(hidden, 0, result)


_SKIP_CHUNK = 64  # non-finite keys handled per step, bounding the (..., M, chunk, N) products


def _skip_zero_weights_matmul(xp: ModuleType, weights: Any, values: Any) -> Any:
    """``weights @ values`` in which a product with a weight of exactly 0 counts 0, whatever the value.

    Plain matmul makes ``0 * inf`` and ``0 * nan`` NaN, so a hidden key holding a NaN would poison
    rows that cannot see it.  Keys whose value rows are all finite go through one matmul; the
    others (rare: only non-finite inputs have them) are summed product by product with the
    zero-weight products dropped.

    Parameters
    ----------
    weights : array (..., M, K)
    values : array (..., K, N), broadcastable with ``weights`` over the leading axes.
    """
    finite_key = xp.isfinite(values).all(axis=-1)
    while finite_key.ndim > 1:
        finite_key = finite_key.all(axis=0)
    if bool(finite_key.all()):
        return weights @ values
    clean = xp.nonzero(finite_key)[0]
    result = weights[..., clean] @ values[..., clean, :]
    dirty = xp.nonzero(~finite_key)[0]
    for start in range(0, int(dirty.shape[0]), _SKIP_CHUNK):
        keys = dirty[start : start + _SKIP_CHUNK]
        w = weights[..., keys][..., None]
        x = values[..., keys, :][..., None, :, :]
        result = result + xp.where(w != 0, w * x, 0).sum(axis=-2)
    return result


def _visibility(problem: AttentionProblem, xp: ModuleType, key_lengths: Any) -> Any:
    """Boolean ``(B|1, 1, 1, Sq, Sk)`` of keys allowed by causal, window and key_lengths, or None."""
    if problem.causal is None and problem.window is None and key_lengths is None:
        return None
    position = xp.arange(problem.seq_q)[:, None] + problem.key_offset
    key = xp.arange(problem.seq_k)[None, :]
    visible = xp.ones((problem.seq_q, problem.seq_k), dtype=bool)
    if problem.causal is not None:
        visible &= key <= position
    if problem.window is not None:
        left, right = problem.window
        if left >= 0:
            visible &= key >= position - left
        if right >= 0:
            visible &= key <= position + right
    visible = visible[None, None, None]
    if key_lengths is not None:
        visible = visible & (key < key_lengths[:, None, None, None, None])
    return visible


def _group(array: Any, problem: AttentionProblem) -> Any:
    """``(B, Hq, ...)`` → ``(B, Hkv, G, ...)``: query head h belongs to kv head h // G."""
    return array.reshape((problem.batch, problem.heads_kv, problem.group_size) + array.shape[2:])


def _ungroup(array: Any, problem: AttentionProblem) -> Any:
    """``(B, Hkv, G, ...)`` → ``(B, Hq, ...)``."""
    return array.reshape((problem.batch, problem.heads_q) + array.shape[3:])


def _group_mask(mask: Any, problem: AttentionProblem) -> Any:
    """View a 4-axis mask ``(B|1, Hq|1, Sq|1, Sk|1)`` as ``(B|1, Hkv|1, G|1, Sq|1, Sk|1)``."""
    batch, heads, rows, cols = mask.shape
    if heads == 1:
        return mask.reshape(batch, 1, 1, rows, cols)
    return mask.reshape(batch, problem.heads_kv, problem.group_size, rows, cols)


def _into_layout(xp: ModuleType, values: Any, dtype: Any, layout: str) -> Any:
    """Copy ``(B, H, S, D)`` values into a fresh array of ``dtype`` contiguous in ``layout``."""
    result = _arrays.empty_bhsd(xp, values.shape, dtype, layout)
    result[...] = values
    return result
