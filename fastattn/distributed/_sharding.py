"""Which positions of a sequence each rank holds, and the helpers to shard and unshard one.

Two schemes split a sequence of length N over R ranks:

``"contiguous"``
    R chunks, rank r holding chunk r.  Under causal attention the last rank does R times the
    first one's work.
``"zigzag"`` (default)
    2R chunks, rank r holding chunks r and 2R-1-r, concatenated in that order: every rank then holds
    one early and one late chunk, and does the same causal work (the load balance of ring attention
    under a causal mask).

Chunk boundaries are those of ``numpy.array_split``: sizes differ by at most one, the first chunks
being the longer, so any N works (a rank may hold fewer positions than another, or none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import array_api_compat
import numpy as np

Sharding = Literal["contiguous", "zigzag"]
SHARDINGS: tuple[str, ...] = ("contiguous", "zigzag")


class Chunk(NamedTuple):
    """A run of consecutive positions a rank holds.

    Attributes
    ----------
    start, stop : int
        Its global positions, ``[start, stop)``.
    local : int
        Where it starts in the rank's shard.
    """

    start: int
    stop: int
    local: int

    @property
    def size(self) -> int:
        """Number of positions."""
        return self.stop - self.start


def check_sharding(sharding: Any) -> Sharding:
    """Return ``sharding`` if it names a scheme, else raise ``ValueError``."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding: expected one of {SHARDINGS}, received {sharding!r}")
    return sharding


def _bounds(length: int, pieces: int) -> list[int]:
    base, extra = divmod(length, pieces)
    bounds = [0]
    for piece in range(pieces):
        bounds.append(bounds[-1] + base + (1 if piece < extra else 0))
    return bounds


def sequence_chunks(length: int, size: int, sharding: Sharding = "zigzag") -> list[list[Chunk]]:
    """The chunks each rank holds of a sequence of ``length`` positions split over ``size`` ranks.

    Parameters
    ----------
    length : int
        Global sequence length N.
    size : int
        Number of ranks R.
    sharding : {"zigzag", "contiguous"}

    Returns
    -------
    list of list of Chunk
        Entry r lists rank r's chunks in the order its shard concatenates them (empty chunks left
        out).
    """
    check_sharding(sharding)
    if size < 1 or length < 0:
        raise ValueError(f"sequence_chunks: expected size >= 1 and length >= 0, received {size} and {length}")
    if sharding == "contiguous":
        bounds = _bounds(length, size)
        pieces = [[rank] for rank in range(size)]
    else:
        bounds = _bounds(length, 2 * size)
        pieces = [[rank, 2 * size - 1 - rank] for rank in range(size)]
    chunks: list[list[Chunk]] = []
    for indices in pieces:
        local, held = 0, []
        for index in indices:
            start, stop = bounds[index], bounds[index + 1]
            if stop > start:
                held.append(Chunk(start, stop, local))
                local += stop - start
        chunks.append(held)
    return chunks


def _take(array: Any, axis: int, start: int, stop: int) -> Any:
    index = [slice(None)] * array.ndim
    index[axis] = slice(start, stop)
    return array[tuple(index)]


def shard_sequence(array: Any, rank: int, size: int, *, sharding: Sharding = "zigzag", axis: int = 2) -> Any:
    """Return rank ``rank``'s shard of a whole sequence (a copy; numpy, CuPy or torch).

    Parameters
    ----------
    array : array
        The whole sequence, positions along ``axis`` (2 for ``"bhsd"`` q/k/v, 1 for ``"bshd"``).
    rank, size : int
        The rank and the number of ranks.
    sharding : {"zigzag", "contiguous"}
    axis : int
        The sequence axis.

    Returns
    -------
    array
        The positions of :func:`sequence_chunks` ``[rank]``, concatenated along ``axis``.
    """
    xp = array_api_compat.array_namespace(array)
    chunks = sequence_chunks(array.shape[axis], size, sharding)[rank]
    if not chunks:
        return xp.asarray(_take(array, axis, 0, 0), copy=True)
    return xp.concat([_take(array, axis, chunk.start, chunk.stop) for chunk in chunks], axis=axis)


def unshard_sequence(shards: Sequence[Any], *, sharding: Sharding = "zigzag", axis: int = 2) -> Any:
    """Reassemble a whole sequence from every rank's shard, in rank order (inverse of
    :func:`shard_sequence`).

    Parameters
    ----------
    shards : sequence of arrays
        Shard r from rank r.
    sharding : {"zigzag", "contiguous"}
    axis : int
        The sequence axis (for lse, ``(B, H, S)``, it is 2 as well).

    Returns
    -------
    array
    """
    xp = array_api_compat.array_namespace(*shards)
    length = sum(shard.shape[axis] for shard in shards)
    pieces = []
    for rank, chunks in enumerate(sequence_chunks(length, len(shards), sharding)):
        expected = sum(chunk.size for chunk in chunks)
        if shards[rank].shape[axis] != expected:
            raise ValueError(
                f"shards: expected rank {rank}'s shard to hold {expected} positions of {length} "
                f"({sharding} over {len(shards)} ranks), received {shards[rank].shape[axis]}"
            )
        pieces += [(chunk.start, _take(shards[rank], axis, chunk.local, chunk.local + chunk.size)) for chunk in chunks]
    pieces.sort(key=lambda piece: piece[0])
    if not pieces:
        return xp.asarray(_take(shards[0], axis, 0, 0), copy=True)
    return xp.concat([piece for _, piece in pieces], axis=axis)


def shard_positions(comm: Any, length: int, sharding: Sharding = "zigzag") -> np.ndarray:
    """Global positions of this rank's ``length`` positions (collective: all-reduces the lengths).

    Parameters
    ----------
    comm : Communicator
    length : int
        How many positions this rank holds.
    sharding : {"zigzag", "contiguous"}

    Returns
    -------
    int64 numpy array (length,)
        E.g. the positions RoPE rotates this rank's queries and keys by.

    Raises
    ------
    ValueError
        On every rank, when the ranks' lengths do not follow ``sharding``.
    """
    table = np.zeros(comm.size, dtype=np.int64)
    table[comm.rank] = length
    lengths = comm.allreduce(table)
    chunks = sequence_chunks(int(lengths.sum()), comm.size, sharding)
    expected = [sum(chunk.size for chunk in rank) for rank in chunks]
    if lengths.tolist() != expected:
        raise ValueError(
            f"shard_positions: expected shards of {expected} positions on ranks 0..{comm.size - 1} "
            f"({sharding} sharding of {int(lengths.sum())}), received {lengths.tolist()}"
        )
    if not chunks[comm.rank]:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(chunk.start, chunk.stop, dtype=np.int64) for chunk in chunks[comm.rank]])
