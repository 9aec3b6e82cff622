"""Ring attention: each rank keeps its queries, the keys and values travel around the ring.

Forward, on rank r of R (the algorithm of Liu et al., "Ring Attention with Blockwise Transformers",
2023, on fastattn's own kernels):

* step s = 0 .. R-1: the rank holds the K/V shard of rank ``(r - s) mod R`` (its own at s = 0).
  It starts sending that shard to rank r+1 and receiving the next from rank r-1 (nonblocking), then
  runs the kernel on each block (a chunk of its queries x a chunk of the held keys,
  :mod:`._blocks`: blocks the causal mask or window hides entirely are skipped), and folds each
  block's ``(out, lse)`` into its float32 accumulators (:mod:`._merge`).  The next shard is then
  awaited; it was in flight while the blocks ran.
* K and V travel as one message; under grouped-query attention only the Hkv heads travel.

Backward: the rank keeps q, out, dout, the final lse and a float32 dq; K/V travel as in the
forward, and with them a float32 dK/dV accumulator for the held shard.  At step s the rank
computes its blocks' gradients against the held K/V (P from the global lse, so each block's share
is exact), adds them to the accumulator that arrives from rank r-1 (sent after that rank's step
s-1, in flight during this step's blocks) and sends it on to rank r+1.  After the last step each
accumulator reaches the rank that owns its shard.  Messages: R-1 K/V shards and R dK/dV shards
per rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import _arrays
from . import _setup
from ._blocks import block_backward, block_forward, block_rule
from ._comm import Communicator, Request
from ._merge import merge_into
from ._setup import ShardedCall


def _pack(xp: Any, arrays: list[Any]) -> Any:
    """One flat contiguous buffer holding ``arrays`` (of one dtype) one after the other."""
    return xp.concatenate([array.reshape(-1) for array in arrays])


def _unpack(flat: Any, shapes: list[tuple[int, ...]]) -> list[Any]:
    parts, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        parts.append(flat[start : start + size].reshape(shape))
        start += size
    return parts


def _kv_shapes(plan: ShardedCall, owner: int) -> list[tuple[int, ...]]:
    p = plan.call.problem
    seq = plan.seq_k(owner)
    return [(p.batch, p.heads_kv, seq, p.head_dim), (p.batch, p.heads_kv, seq, p.head_dim_v)]


def _flat_size(shapes: list[tuple[int, ...]]) -> int:
    return sum(int(np.prod(shape)) for shape in shapes)


class _Ring:
    """The neighbour exchange of one call: a message per step, each awaited with the deadline."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.pending: list[tuple[Request, str]] = []

    def exchange(self, send: Any, receive: Any, tag: int, what: str) -> Request:
        """Send ``send`` to the next rank, receive ``receive`` from the previous; return the receive."""
        comm = self.comm
        incoming = comm.irecv(receive, comm.previous_rank(), tag)
        self.pending.append((comm.isend(send, comm.next_rank(), tag), f"{what}: send to rank {comm.next_rank()}"))
        return incoming

    def wait(self, request: Request, what: str) -> None:
        comm = self.comm
        request.wait(comm.timeout, f"rank {comm.rank}: {what} from rank {comm.previous_rank()}")

    def finish(self) -> None:
        for request, what in self.pending:
            request.wait(self.comm.timeout, f"rank {self.comm.rank}: {what}")
        self.pending.clear()


def _forward_blocks(plan: ShardedCall, owner: int, q: Any, keys: Any, values: Any, out: Any, lse: Any) -> None:
    """Fold this rank's blocks against rank ``owner``'s keys into ``out`` and ``lse``."""
    xp = _arrays.namespace(q)
    for queries in plan.query_chunks[plan.comm.rank]:
        rows = slice(queries.local, queries.local + queries.size)
        for key_chunk in plan.key_chunks[owner]:
            rule = block_rule(queries, key_chunk, plan.aligned_offset, plan.causal, plan.window, plan.key_lengths)
            if rule is None:
                continue
            columns = slice(key_chunk.local, key_chunk.local + key_chunk.size)
            block_out, block_lse = block_forward(
                q[:, :, rows], keys[:, :, columns], values[:, :, columns], rule, plan.block_options
            )
            merge_into(xp, out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            del block_out, block_lse  # before the next block's are allocated


def _backward_blocks(plan: ShardedCall, owner: int, keys: Any, values: Any, dq: Any, part: Any) -> None:
    """Add this rank's blocks' gradients against rank ``owner``'s keys to ``dq`` and ``part`` (dK, dV)."""
    a = plan.call.arrays
    part_k, part_v = _unpack(part, _kv_shapes(plan, owner))
    for queries in plan.query_chunks[plan.comm.rank]:
        rows = slice(queries.local, queries.local + queries.size)
        for key_chunk in plan.key_chunks[owner]:
            rule = block_rule(queries, key_chunk, plan.aligned_offset, plan.causal, plan.window, plan.key_lengths)
            if rule is None:
                continue
            columns = slice(key_chunk.local, key_chunk.local + key_chunk.size)
            block_dq, block_dk, block_dv = block_backward(
                a["dout"][:, :, rows],
                a["q"][:, :, rows],
                keys[:, :, columns],
                values[:, :, columns],
                a["out"][:, :, rows],
                a["lse"][:, :, rows],
                rule,
                plan.block_options,
            )
            dq[:, :, rows] += block_dq
            part_k[:, :, columns] += block_dk
            part_v[:, :, columns] += block_dv
            del block_dq, block_dk, block_dv  # before the next block's are allocated


def ring_forward(plan: ShardedCall) -> tuple[Any, Any]:
    """Native ``(out, lse)`` of this rank's queries: out ``(B, Hq, Sq_r, Dv)`` float32 (float64 for
    float64 inputs), lse ``(B, Hq, Sq_r)``."""
    comm, call = plan.comm, plan.call
    p = call.problem
    q, k, v = call.arrays["q"], call.arrays["k"], call.arrays["v"]
    xp = _arrays.namespace(q)
    accumulate = _arrays.accumulation_dtype(p.dtype)
    out = xp.zeros((p.batch, p.heads_q, p.seq_q, p.head_dim_v), dtype=accumulate)
    lse = xp.full((p.batch, p.heads_q, p.seq_q), -np.inf, dtype=accumulate)
    held = _pack(xp, [k, v]) if comm.size > 1 else None
    ring = _Ring(comm)
    for step in range(comm.size):
        owner = (comm.rank - step) % comm.size
        incoming = None
        if step < comm.size - 1:
            following = xp.empty(_flat_size(_kv_shapes(plan, (owner - 1) % comm.size)), dtype=k.dtype)
            incoming = ring.exchange(held, following, step, "K/V")
        keys, values = (k, v) if step == 0 else _unpack(held, _kv_shapes(plan, owner))
        _forward_blocks(plan, owner, q, keys, values, out, lse)
        del keys, values  # views of the held shard, which must go when the next one arrives
        if incoming is not None:
            ring.wait(incoming, "K/V")
            ring.finish()
            held = following
    return out, lse


def ring_backward(plan: ShardedCall) -> tuple[Any, Any, Any]:
    """Native ``(dq, dk, dv)`` of this rank's shards, float32 (float64 for float64 inputs)."""
    comm, call = plan.comm, plan.call
    p = call.problem
    a = call.arrays
    q, k, v = a["q"], a["k"], a["v"]
    xp = _arrays.namespace(q)
    accumulate = _arrays.accumulation_dtype(p.dtype)
    dq = xp.zeros(q.shape, dtype=accumulate)
    held = _pack(xp, [k, v]) if comm.size > 1 else None
    ring = _Ring(comm)
    arriving = arriving_buffer = None
    part = None
    for step in range(comm.size):
        owner = (comm.rank - step) % comm.size
        following_owner = (owner - 1) % comm.size
        shapes = _kv_shapes(plan, owner)
        incoming = next_arriving = None
        if step < comm.size - 1:
            following = xp.empty(_flat_size(_kv_shapes(plan, following_owner)), dtype=k.dtype)
            incoming = ring.exchange(held, following, step, "K/V")
        if comm.size > 1:
            # Posted a step ahead: the accumulator of the shard held next (after the last step,
            # this rank's own) arrives while this step's blocks run.
            next_buffer = xp.empty(_flat_size(_kv_shapes(plan, following_owner)), dtype=accumulate)
            next_arriving = comm.irecv(next_buffer, comm.previous_rank(), comm.size + step)
        keys, values = (k, v) if step == 0 else _unpack(held, shapes)
        part = xp.zeros(_flat_size(shapes), dtype=accumulate)
        _backward_blocks(plan, owner, keys, values, dq, part)
        del keys, values  # views of the held shard, which must go when the next one arrives
        if arriving is not None:
            ring.wait(arriving, "dK/dV")
            part += arriving_buffer
        if comm.size > 1:
            ring.pending.append(
                (comm.isend(part, comm.next_rank(), comm.size + step), f"dK/dV: send to rank {comm.next_rank()}")
            )
        if incoming is not None:
            ring.wait(incoming, "K/V")
            held = following
        ring.finish()
        arriving, arriving_buffer = next_arriving, next_buffer if comm.size > 1 else None
    if arriving is not None:
        ring.wait(arriving, "dK/dV of this rank's shard")
        part = arriving_buffer
    dk, dv = _unpack(part, _kv_shapes(plan, comm.rank))
    return dq, dk, dv


def ring_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    comm: Any,
    causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    key_lengths: Any = None,
    sharding: str = "zigzag",
    layout: str = "bhsd",
    return_lse: bool = False,
    backend: str | None = None,
    mask: Any = None,
    dropout_p: float = 0.0,
) -> Any:
    """Attention over a sequence split across the ranks of ``comm``: this rank's share of the exact result.

    Every rank calls it with its own shards (collective: all ranks must call, with the same
    options).  The result equals :func:`fastattn.attention` on the whole sequences, rows of this
    rank's queries.

    Parameters
    ----------
    q : array, (B, Hq, Sq_r, D)
        This rank's queries: the positions :func:`sequence_chunks` gives it (``sharding``);
        numpy, CuPy or any DLPack tensor, float16, bfloat16, float32 or float64.
    k, v : arrays, (B, Hkv, Sk_r, D) and (B, Hkv, Sk_r, Dv)
        This rank's keys and values, sharded alike (with their own length: cross-attention).
        ``Hq % Hkv == 0``; only the Hkv heads travel.
    comm : Communicator
        :class:`MPICommunicator`, :class:`TorchCommunicator` or :class:`SimulatedCommunicator`.
    causal, scale, window, softcap
        As for :func:`fastattn.attention`, for the whole sequences (bottom-right aligns the whole
        sequences' ends).
    key_lengths : int array (B,), optional
        Valid keys of the whole key sequence per batch row (the same on every rank).
    sharding : {"zigzag", "contiguous"}
        How the sequences are split (:func:`sequence_chunks`); zigzag balances causal work.
    layout : {"bhsd", "bshd"}
    return_lse : bool
        Also return this rank's rows of the log-sum-exp.
    backend : str, optional
        The backend every block runs on.
    mask, dropout_p
        Declined: :class:`fastattn.UnsupportedError` (a dense mask's blocks would have to travel;
        dropout's counters are per call).

    Returns
    -------
    out : array, (B, Hq, Sq_r, Dv)
        In q's dtype, framework, device and layout.
    lse : array, (B, Hq, Sq_r)
        With ``return_lse``: float32 (float64 for float64 inputs).
    """
    _setup.decline("ring_attention", mask, dropout_p)
    options = _setup.sharded_options(causal, scale, window, softcap, key_lengths, layout, backend)
    plan = _setup.start("ring_attention", comm, "forward", {"q": q, "k": k, "v": v}, options, sharding)
    out, lse = ring_forward(plan)
    result = _setup.hand_back(out, plan)
    return (result, _arrays.from_native(lse, plan.call.origin)) if return_lse else result


def ring_attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    comm: Any,
    causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    key_lengths: Any = None,
    sharding: str = "zigzag",
    layout: str = "bhsd",
    backend: str | None = None,
) -> tuple[Any, Any, Any]:
    """Gradients of :func:`ring_attention` for this rank's shards (collective).

    Parameters
    ----------
    dout : array, (B, Hq, Sq_r, Dv)
        Gradient of the loss with respect to this rank's ``out``.
    q, k, v, out, lse
        This rank's shards and its forward's results (``return_lse=True``).
    comm, causal, scale, window, softcap, key_lengths, sharding, layout, backend
        As given to the forward.

    Returns
    -------
    dq : array, (B, Hq, Sq_r, D)
    dk, dv : arrays, (B, Hkv, Sk_r, D) and (B, Hkv, Sk_r, Dv)
        This rank's shards of the gradients, summed over every rank's queries; inputs' dtype,
        framework, device and layout.
    """
    options = _setup.sharded_options(causal, scale, window, softcap, key_lengths, layout, backend)
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    plan = _setup.start("ring_attention_backward", comm, "backward", arrays, options, sharding)
    dq, dk, dv = ring_backward(plan)
    return _setup.hand_back(dq, plan), _setup.hand_back(dk, plan), _setup.hand_back(dv, plan)
