"""One block of a sharded attention: a run of query positions against a run of key positions.

A rank computes its result block by block, each block a contiguous run of its queries (a
:class:`~fastattn.distributed._sharding.Chunk`) against a contiguous run of some rank's keys.  The
block's causal and window rules are the whole sequence's seen from the block: query i of the block
sits at key position ``i + key_offset`` of the block's keys (the problem's ``key_offset``, DESIGN.md
§3), and its ``key_lengths`` are the global ones shifted to the block's first key.  A block that
hides every key is skipped; one that hides none runs without causal or window.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import _arrays, _validation
from .._options import AttentionOptions
from .._problem import Direction
from ..backends import registry
from ._sharding import Chunk


class BlockRule(NamedTuple):
    """How one block runs.

    Attributes
    ----------
    key_offset : int
        Key position (within the block) of the block's query 0.
    causal : bool
        Whether the block needs the causal rule (False where it hides nothing there).
    window : (int, int) or None
        The window, where it hides something in the block.
    key_lengths : int64 array (B,) or None
        Valid keys of the block per batch row, where some are padding.
    """

    key_offset: int
    causal: bool
    window: tuple[int, int] | None
    key_lengths: Any


def block_rule(
    queries: Chunk,
    keys: Chunk,
    aligned_offset: int,
    causal: bool,
    window: tuple[int, int] | None,
    key_lengths: np.ndarray | None,
) -> BlockRule | None:
    """The rule of the block ``queries`` x ``keys``, or None when it hides every key.

    Parameters
    ----------
    queries, keys : Chunk
        Global positions of the block's queries and keys.
    aligned_offset : int
        The whole call's key position of query 0 (``Sk - Sq`` for bottom-right, else 0).
    causal : bool
    window : (int, int) or None
        ``(left, right)``, -1 unbounded.
    key_lengths : int64 array (B,) or None
        Global valid key counts.
    """
    if queries.size == 0 or keys.size == 0:
        return None
    lengths = None
    if key_lengths is not None:
        lengths = np.clip(key_lengths - keys.start, 0, keys.size).astype(np.int64)
        if not lengths.any():
            return None
        if (lengths == keys.size).all():
            lengths = None
    key_offset = queries.start - keys.start + aligned_offset
    if not causal and window is None:
        return BlockRule(key_offset, False, None, lengths)
    position = np.arange(queries.size, dtype=np.int64) + key_offset
    first = np.zeros_like(position)
    last = np.full_like(position, keys.size - 1)
    left, right = window if window is not None else (-1, -1)
    if left >= 0:
        first = np.maximum(first, position - left)
    if causal:
        last = np.minimum(last, position)
    if right >= 0:
        last = np.minimum(last, position + right)
    if not (first <= last).any():
        return None
    if not first.any() and (last == keys.size - 1).all():
        return BlockRule(key_offset, False, None, lengths)
    return BlockRule(key_offset, causal, window, lengths)


def _prepared(direction: Direction, arrays: dict[str, Any], rule: BlockRule, options: AttentionOptions) -> Any:
    lengths = rule.key_lengths
    if lengths is not None and not isinstance(arrays["q"], np.ndarray):
        lengths = _arrays.namespace(arrays["q"]).asarray(lengths)
    call = _validation.prepare(
        direction,
        arrays,
        options._replace(causal="top_left" if rule.causal else False, window=rule.window, key_lengths=lengths),
    )
    problem = call.problem
    if rule.causal or rule.window is not None:
        problem = _validation.with_key_offset(problem, rule.key_offset, rule.window)
    return call, problem, registry.select(problem, options.backend)


def block_forward(q: Any, k: Any, v: Any, rule: BlockRule, options: AttentionOptions) -> tuple[Any, Any]:
    """Native ``(out, lse)`` of one block; q, k, v native ``(B, H, S, D)`` views.

    ``options`` carries scale, softcap, backend and layout ``"bhsd"``; causal, window and
    key_lengths come from ``rule``.
    """
    call, problem, backend = _prepared("forward", {"q": q, "k": k, "v": v}, rule, options)
    a = call.arrays
    return backend.forward(problem, a["q"], a["k"], a["v"], call.extras)


def block_backward(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, rule: BlockRule, options: AttentionOptions
) -> tuple[Any, Any, Any]:
    """Native ``(dq, dk, dv)`` of one block, given the whole row's ``out`` and ``lse``."""
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    call, problem, backend = _prepared("backward", arrays, rule, options)
    a = call.arrays
    return backend.backward(
        problem, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], call.extras
    )
