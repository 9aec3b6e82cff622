"""Merging partial attention results by their log-sum-exp (what the split-KV decode's combine does).

Two partial results over disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, combine into
the result over their union: with ``m = max(lse_a, lse_b)``, ``w_a = exp(lse_a - m)`` and
``w_b = exp(lse_b - m)``, ``out = (w_a out_a + w_b out_b) / (w_a + w_b)`` and
``lse = m + log(w_a + w_b)``.  Subtracting the max first keeps the weights in [0, 1]; a partial
whose lse is -inf (its rows saw no key) weighs 0, and a row neither saw stays 0 with lse -inf.
"""

from __future__ import annotations

from typing import Any


def merge_into(xp: Any, out: Any, lse: Any, part_out: Any, part_lse: Any) -> None:
    """Fold one partial result into an accumulated one, in place.

    Parameters
    ----------
    xp : module
        numpy or cupy.
    out : array (B, H, S, Dv)
        Accumulated output, float32 (float64 for float64 inputs); updated.
    lse : array (B, H, S)
        Accumulated log-sum-exp, same dtype; updated.
    part_out : array (B, H, S, Dv)
        The partial output (any float dtype); overwritten when it has ``out``'s dtype (it is
        scaled in place, sparing a temporary of its size).
    part_lse : array (B, H, S)
        Its log-sum-exp.
    """
    peak = xp.maximum(lse, part_lse)
    peak = xp.where(xp.isfinite(peak), peak, 0)
    weight, part_weight = xp.exp(lse - peak), xp.exp(part_lse - peak)
    total = weight + part_weight
    seen = total > 0
    safe_total = xp.where(seen, total, 1)
    scaled = part_out.astype(out.dtype, copy=False)
    scaled *= (part_weight / safe_total)[..., None]
    out *= (weight / safe_total)[..., None]
    out += scaled
    lse[...] = xp.where(seen, peak + xp.log(safe_total), -xp.inf)
