"""Attention over sequences split across processes: ring attention and Ulysses all-to-all.

A sequence too long for one machine is split along its positions across the ranks of a
communicator (:mod:`._sharding`).  :func:`ring_attention` keeps each rank's queries and passes
the keys and values around the ring; :func:`ulysses_attention` trades sequence shards for head
shards with an all-to-all, runs whole sequences on a slice of the heads, and trades back.  Both
return each rank's share of the exact result of :func:`fastattn.attention` on the whole
sequences, with a backward each (and autograd through :mod:`fastattn.torch`).

Communication runs on existing engines: mpi4py (:class:`MPICommunicator`), torch.distributed
(:class:`TorchCommunicator`), or threads of one process (:func:`simulate`, for tests).
"""

from ._comm import Communicator, Request
from ._mpi import MPICommunicator
from ._ring import ring_attention, ring_attention_backward
from ._sharding import Chunk, sequence_chunks, shard_positions, shard_sequence, unshard_sequence
from ._simulated import SimulatedCommunicator, simulate
from ._torch import TorchCommunicator
from ._ulysses import ulysses_attention, ulysses_attention_backward

__all__ = [
    "Chunk",
    "Communicator",
    "MPICommunicator",
    "Request",
    "SimulatedCommunicator",
    "TorchCommunicator",
    "ring_attention",
    "ring_attention_backward",
    "sequence_chunks",
    "shard_positions",
    "shard_sequence",
    "simulate",
    "ulysses_attention",
    "ulysses_attention_backward",
    "unshard_sequence",
]
