"""The sharded calls' contract besides their results: sharding helpers, merging, refusals, failures."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import fastattn
from fastattn import distributed
from fastattn.distributed._merge import merge_into

from ._sharded import STRATEGIES


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("length", [0, 1, 5, 16, 37])
@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_chunks_cover_every_position_once(size: int, length: int, sharding: str) -> None:
    chunks = distributed.sequence_chunks(length, size, sharding)
    positions = sorted(p for rank in chunks for chunk in rank for p in range(chunk.start, chunk.stop))
    assert positions == list(range(length))
    held = [sum(chunk.size for chunk in rank) for rank in chunks]
    assert max(held) - min(held) <= (2 if sharding == "zigzag" else 1)
    for rank in chunks:
        assert [chunk.local for chunk in rank] == list(np.cumsum([0] + [c.size for c in rank])[:-1])


def test_zigzag_balances_causal_work() -> None:
    """Rank r holds chunks r and 2R-1-r: the causal pairs (query, key <= query) per rank are equal."""
    chunks = distributed.sequence_chunks(64, 4, "zigzag")
    work = [sum(sum(p + 1 for p in range(c.start, c.stop)) for c in rank) for rank in chunks]
    assert len(set(work)) == 1
    assert [(c.start, c.stop) for c in chunks[0]] == [(0, 8), (56, 64)]


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_shard_and_unshard_round_trip_numpy_and_torch(sharding: str) -> None:
    torch = pytest.importorskip("torch")
    whole = np.random.default_rng().standard_normal((2, 3, 29, 4))
    shards = [distributed.shard_sequence(whole, r, 3, sharding=sharding) for r in range(3)]
    assert np.array_equal(distributed.unshard_sequence(shards, sharding=sharding), whole)
    tensor = torch.from_numpy(whole).transpose(1, 2)  # bshd: the sequence on axis 1
    torch_shards = [distributed.shard_sequence(tensor, r, 3, sharding=sharding, axis=1) for r in range(3)]
    assert all(isinstance(shard, torch.Tensor) for shard in torch_shards)
    assert torch.equal(distributed.unshard_sequence(torch_shards, sharding=sharding, axis=1), tensor)
    with pytest.raises(ValueError, match="rank 0's shard to hold"):
        distributed.unshard_sequence(shards[::-1], sharding=sharding)


def test_merge_ignores_a_partial_that_saw_no_key() -> None:
    rng = np.random.default_rng()
    out = rng.standard_normal((1, 1, 3, 4))
    lse = np.array([[[0.5, -np.inf, -np.inf]]])
    part_out = rng.standard_normal((1, 1, 3, 4))
    part_lse = np.array([[[-np.inf, 1.5, -np.inf]]])
    merged_out, merged_lse = out.copy(), lse.copy()
    with np.errstate(all="raise"):
        merge_into(np, merged_out, merged_lse, part_out.copy(), part_lse)
    assert np.array_equal(merged_out[0, 0, 0], out[0, 0, 0])
    assert np.array_equal(merged_out[0, 0, 1], part_out[0, 0, 1])
    assert np.array_equal(merged_out[0, 0, 2], np.zeros(4))
    assert merged_lse[0, 0, 0] == 0.5 and merged_lse[0, 0, 1] == 1.5 and merged_lse[0, 0, 2] == -np.inf


def _inputs(seq: int = 16, heads: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng()
    return [rng.standard_normal((1, heads, seq, 8)) for _ in range(3)]


def _outcomes(size: int, rank_call: Any, timeout: float = 30.0) -> list[Any]:
    """Each rank's exception (or None), instead of simulate's first one."""

    def rank(comm: distributed.SimulatedCommunicator) -> Any:
        try:
            rank_call(comm)
        except Exception as error:
            return error
        return None

    return distributed.simulate(size, rank, timeout=timeout)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_rank_with_bad_input_raises_its_error_and_the_others_say_so(strategy: str) -> None:
    forward = STRATEGIES[strategy][0]
    q, k, v = _inputs()

    def call(comm: distributed.SimulatedCommunicator) -> None:
        shards = [distributed.shard_sequence(x, comm.rank, comm.size) for x in (q, k, v)]
        if comm.rank == 1:
            shards[1] = shards[1].astype(np.float32)
        forward(*shards, comm=comm)

    errors = _outcomes(3, call)
    assert isinstance(errors[1], TypeError) and "k: expected" in str(errors[1])
    for rank in (0, 2):
        assert isinstance(errors[rank], RuntimeError) and "rank(s) [1] rejected" in str(errors[rank])


def test_shards_that_do_not_follow_the_sharding_raise_on_every_rank() -> None:
    q, k, v = _inputs(seq=12)

    def uneven(comm: distributed.SimulatedCommunicator) -> None:
        held = slice(0, 8) if comm.rank == 0 else slice(8, 12)
        distributed.ring_attention(*(x[:, :, held] for x in (q, k, v)), comm=comm)

    errors = _outcomes(2, uneven)
    assert all(isinstance(e, ValueError) and "q shards of [6, 6] positions" in str(e) for e in errors), errors


def test_a_missing_rank_times_out_instead_of_hanging() -> None:
    q, k, v = _inputs()

    def call(comm: distributed.SimulatedCommunicator) -> None:
        if comm.rank == 0:
            return
        shards = [distributed.shard_sequence(x, comm.rank, comm.size) for x in (q, k, v)]
        distributed.ring_attention(*shards, comm=comm)

    errors = _outcomes(2, call, timeout=0.5)
    assert errors[0] is None
    assert isinstance(errors[1], TimeoutError) and "all-reduce" in str(errors[1])


def test_a_failing_rank_stops_the_simulation_with_its_error() -> None:
    def call(comm: distributed.SimulatedCommunicator) -> None:
        if comm.rank == 1:
            raise KeyError("rank 1 broke")
        comm.allreduce(np.ones(1))

    with pytest.raises(KeyError, match="rank 1 broke"):
        distributed.simulate(3, call, timeout=30.0)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_mask_and_dropout_are_declined_with_a_reason(strategy: str) -> None:
    forward = STRATEGIES[strategy][0]
    q, k, v = _inputs()

    def call(comm: distributed.SimulatedCommunicator) -> None:
        with pytest.raises(fastattn.UnsupportedError, match="dense mask"):
            forward(q, k, v, comm=comm, mask=np.ones((16, 16), dtype=bool))
        with pytest.raises(fastattn.UnsupportedError, match="dropout"):
            forward(q, k, v, comm=comm, dropout_p=0.1)

    distributed.simulate(1, call)


def test_ulysses_names_heads_that_do_not_divide() -> None:
    q, k, v = _inputs(heads=3)

    def call(comm: distributed.SimulatedCommunicator) -> None:
        shards = [distributed.shard_sequence(x, comm.rank, comm.size) for x in (q, k, v)]
        distributed.ulysses_attention(*shards, comm=comm)

    errors = _outcomes(2, call)
    assert all(isinstance(e, ValueError) and "Hq=3 and Hkv=3" in str(e) for e in errors)


def test_comm_must_be_a_communicator() -> None:
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="comm: expected a fastattn.distributed communicator"):
        distributed.ring_attention(q, k, v, comm=object())
