"""Run a sharded call on every rank of a simulation and reassemble the whole results."""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple

import numpy as np

import fastattn
from fastattn import distributed

STRATEGIES = {
    "ring": (distributed.ring_attention, distributed.ring_attention_backward),
    "ulysses": (distributed.ulysses_attention, distributed.ulysses_attention_backward),
}


class Inputs(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    seed: int


def random_inputs(batch: int, heads_q: int, heads_kv: int, seq_q: int, seq_k: int, dim: int, dim_v: int) -> Inputs:
    """Random float64 q, k, v, dout from a fresh seed (given back, for the failure message)."""
    seed = secrets.randbits(32)
    rng = np.random.default_rng(seed)
    return Inputs(
        rng.standard_normal((batch, heads_q, seq_q, dim)),
        rng.standard_normal((batch, heads_kv, seq_k, dim)),
        rng.standard_normal((batch, heads_kv, seq_k, dim_v)),
        rng.standard_normal((batch, heads_q, seq_q, dim_v)),
        seed,
    )


def single_process(inputs: Inputs, dtype: Any, **options: Any) -> tuple[np.ndarray, ...]:
    """``(out, lse, dq, dk, dv)`` of one process on the cpu backend, as float64."""
    q, k, v, dout = (x.astype(dtype) for x in inputs[:4])
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend="cpu", **options)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)
    return tuple(np.asarray(x, dtype=np.float64) for x in (out, lse, *grads))


def sharded(
    strategy: str,
    ranks: int,
    inputs: Inputs,
    dtype: Any,
    *,
    sharding: str = "zigzag",
    layout: str = "bhsd",
    **options: Any,
) -> tuple[np.ndarray, ...]:
    """``(out, lse, dq, dk, dv)`` of the sharded forward and backward on ``ranks`` simulated ranks,
    reassembled into whole sequences, as float64 (arrays in ``(B, H, S, D)`` order)."""
    forward, backward = STRATEGIES[strategy]
    axis = 2 if layout == "bhsd" else 1

    def in_layout(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x.swapaxes(1, 2)) if layout == "bshd" else x

    def rank(comm: distributed.SimulatedCommunicator) -> tuple[Any, ...]:
        shards = [
            distributed.shard_sequence(in_layout(x.astype(dtype)), comm.rank, comm.size, sharding=sharding, axis=axis)
            for x in inputs[:4]
        ]
        q, k, v, dout = shards
        out, lse = forward(q, k, v, comm=comm, sharding=sharding, layout=layout, return_lse=True, **options)
        grads = backward(dout, q, k, v, out, lse, comm=comm, sharding=sharding, layout=layout, **options)
        return (out, lse, *grads)

    results = distributed.simulate(ranks, rank, timeout=60.0)
    whole = []
    for index in range(5):
        shard_axis = 2 if index == 1 else axis
        joined = distributed.unshard_sequence([r[index] for r in results], sharding=sharding, axis=shard_axis)
        if index != 1 and layout == "bshd":
            joined = joined.swapaxes(1, 2)
        whole.append(np.asarray(joined, dtype=np.float64))
    return tuple(whole)


def worst_relative(actual: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...]) -> float:
    """Largest ``|actual - expected| / max|expected|`` over the five results (lse -inf rows must match)."""
    worst = 0.0
    for got, want in zip(actual, expected):
        finite = np.isfinite(want)
        assert np.array_equal(finite, np.isfinite(got)), "a row's visibility (lse -inf) differs"
        scale = max(float(np.abs(want[finite]).max(initial=0.0)), 1e-300)
        worst = max(worst, float(np.abs(got[finite] - want[finite]).max(initial=0.0)) / scale)
    return worst
