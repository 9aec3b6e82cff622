"""Ulysses attention: trade sequence shards for head shards, attend, trade back.

(Jacobs et al., "DeepSpeed Ulysses", 2023.)  Each of R ranks holds every head of its share of the
positions.  One all-to-all per array gives rank j every position of heads ``[j Hq/R, (j+1) Hq/R)``
(and of kv heads ``[j Hkv/R, (j+1) Hkv/R)``, the same groups under grouped-query attention); the
rank runs :func:`fastattn.attention` on whole sequences, with every option whole-sequence
attention has; a last all-to-all returns each rank its positions of every head.

Compared with ring attention: four all-to-alls of the whole activations (each rank sends
``(R-1)/R`` of its q, k, v and out) instead of R-1 neighbour exchanges of K/V; no partial results to
merge and no per-block overhead, but Hq and Hkv must divide by R (so R <= Hkv), and each rank
needs whole-sequence K/V for its heads.  Pick Ulysses where the heads divide and the network's
all-to-all is fast (one node); ring attention where they do not, or where K/V of the whole
sequence do not fit one rank.
"""

from __future__ import annotations

from typing import Any

from .. import _arrays, _validation, functional
from .._options import AttentionOptions
from . import _setup
from ._setup import ShardedCall
from ._sharding import Chunk

#: Tags of the all-to-alls (apart from the ring's, which count steps from 0).
_TAG = 1 << 14


def _heads_per_rank(plan: ShardedCall, name: str) -> tuple[int, int]:
    p, size = plan.call.problem, plan.comm.size
    if p.heads_q % size or p.heads_kv % size:
        raise ValueError(
            f"{name}: expected query and kv heads that divide by the {size} ranks, received Hq={p.heads_q} "
            f"and Hkv={p.heads_kv} (ring_attention has no such condition)"
        )
    return p.heads_q // size, p.heads_kv // size


def _to_heads(plan: ShardedCall, array: Any, heads: int, chunks: list[list[Chunk]], tag: int) -> Any:
    """``(B, H, S_r, E)`` shards of every rank → ``(B, H/R, S, E)``: this rank's heads, whole sequence."""
    comm = plan.comm
    xp = _arrays.namespace(array)
    batch, _, _, width = array.shape
    sends = [xp.ascontiguousarray(array[:, j * heads : (j + 1) * heads]) for j in range(comm.size)]
    lengths = [sum(chunk.size for chunk in rank_chunks) for rank_chunks in chunks]
    receives = [xp.empty((batch, heads, lengths[j], width), dtype=array.dtype) for j in range(comm.size)]
    comm.alltoall(sends, receives, tag)
    whole = xp.empty((batch, heads, sum(lengths), width), dtype=array.dtype)
    for j, rank_chunks in enumerate(chunks):
        for chunk in rank_chunks:
            whole[:, :, chunk.start : chunk.stop] = receives[j][:, :, chunk.local : chunk.local + chunk.size]
    return whole


def _to_sequence(plan: ShardedCall, whole: Any, chunks: list[list[Chunk]], tag: int) -> Any:
    """Inverse of :func:`_to_heads`: ``(B, H/R, S, E)`` → this rank's positions of every head."""
    comm = plan.comm
    xp = _arrays.namespace(whole)
    batch, heads, _, width = whole.shape
    sends = []
    for rank_chunks in chunks:
        parts = [whole[:, :, chunk.start : chunk.stop] for chunk in rank_chunks]
        sends.append(xp.concatenate(parts, axis=2) if parts else xp.empty((batch, heads, 0, width), whole.dtype))
    mine = sum(chunk.size for chunk in chunks[comm.rank])
    receives = [xp.empty((batch, heads, mine, width), dtype=whole.dtype) for _ in range(comm.size)]
    comm.alltoall(sends, receives, tag)
    return xp.concatenate(receives, axis=1)


def _whole_options(options: AttentionOptions) -> AttentionOptions:
    """The caller's options for the whole sequences of this rank's heads (``(B, H, S, D)`` views)."""
    return options._replace(layout="bhsd", return_lse=True)


def ulysses_attention(
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
    """:func:`ring_attention`'s result by the all-to-all strategy (Hq and Hkv divisible by R).

    Parameters and returns are those of :func:`ring_attention`; a ``ValueError`` names the heads
    when Hq or Hkv does not divide by the number of ranks.
    """
    _setup.decline("ulysses_attention", mask, dropout_p)
    options = _setup.sharded_options(causal, scale, window, softcap, key_lengths, layout, backend)
    plan = _setup.start("ulysses_attention", comm, "forward", {"q": q, "k": k, "v": v}, options, sharding)
    heads_q, heads_kv = _heads_per_rank(plan, "ulysses_attention")
    a = plan.call.arrays
    whole_q = _to_heads(plan, a["q"], heads_q, plan.query_chunks, _TAG)
    whole_k = _to_heads(plan, a["k"], heads_kv, plan.key_chunks, _TAG + 1)
    whole_v = _to_heads(plan, a["v"], heads_kv, plan.key_chunks, _TAG + 2)
    out, lse = functional.run_forward(
        _validation.prepare(
            "forward", {"q": whole_q, "k": whole_k, "v": whole_v}, _whole_options(options)
        )
    )
    out = _to_sequence(plan, out, plan.query_chunks, _TAG + 3)
    result = _setup.hand_back(out, plan)
    if not return_lse:
        return result
    lse = _to_sequence(plan, lse[..., None], plan.query_chunks, _TAG + 4)[..., 0]
    return result, _arrays.from_native(lse, plan.call.origin)


def ulysses_attention_backward(
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
    """Gradients of :func:`ulysses_attention` for this rank's shards (parameters and returns as
    :func:`ring_attention_backward`)."""
    options = _setup.sharded_options(causal, scale, window, softcap, key_lengths, layout, backend)
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    plan = _setup.start("ulysses_attention_backward", comm, "backward", arrays, options, sharding)
    heads_q, heads_kv = _heads_per_rank(plan, "ulysses_attention_backward")
    a = plan.call.arrays
    whole = {
        name: _to_heads(plan, a[name], heads_q, plan.query_chunks, _TAG + index)
        for index, name in enumerate(("q", "dout", "out"))
    }
    whole["lse"] = _to_heads(plan, a["lse"][..., None], heads_q, plan.query_chunks, _TAG + 3)[..., 0]
    whole["k"] = _to_heads(plan, a["k"], heads_kv, plan.key_chunks, _TAG + 4)
    whole["v"] = _to_heads(plan, a["v"], heads_kv, plan.key_chunks, _TAG + 5)
    call = _validation.prepare("backward", whole, _whole_options(options))
    dq, dk, dv = functional.run_backward(call)
    dq = _to_sequence(plan, dq, plan.query_chunks, _TAG + 6)
    dk = _to_sequence(plan, dk, plan.key_chunks, _TAG + 7)
    dv = _to_sequence(plan, dv, plan.key_chunks, _TAG + 8)
    return _setup.hand_back(dq, plan), _setup.hand_back(dk, plan), _setup.hand_back(dv, plan)
