"""The small communicator interface ring and Ulysses attention run on.

A :class:`Communicator` is one rank's view of a group of ``size`` ranks.  It moves native arrays
(numpy, or CuPy where the engine can): nonblocking point-to-point sends and receives (the ring's
neighbour exchange), a sum all-reduce of a small host array, and an all-to-all built on the
point-to-point pair.  Every wait has a deadline: a rank that fails or vanishes makes its peers raise
:class:`TimeoutError` instead of hanging.

Three implementations: :class:`~fastattn.distributed.SimulatedCommunicator` (threads in one
process, for tests), :class:`~fastattn.distributed.MPICommunicator` (mpi4py) and
:class:`~fastattn.distributed.TorchCommunicator` (torch.distributed: gloo, NCCL).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

#: Seconds a wait gives its peer before it raises, unless the communicator is told otherwise.
DEFAULT_TIMEOUT = 300.0


class Request(abc.ABC):
    """A send or receive in flight."""

    @abc.abstractmethod
    def test(self) -> bool:
        """Return whether the transfer has completed (never blocks)."""

    def wait(self, timeout: float, what: str) -> None:
        """Block until the transfer completes.

        Raises
        ------
        TimeoutError
            Not completed within ``timeout`` seconds; the message names ``what`` was awaited.
        """
        deadline = time.monotonic() + timeout
        pause = 1e-5
        while not self.test():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: no completion within {timeout:g} s (a peer failed or is missing)")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)


class Communicator(abc.ABC):
    """One rank of a group: point-to-point, all-reduce and all-to-all on native arrays.

    Attributes
    ----------
    rank, size : int
        This rank and the group's size.
    timeout : float
        Seconds every wait allows before it raises :class:`TimeoutError`.
    """

    rank: int
    size: int
    timeout: float = DEFAULT_TIMEOUT

    @abc.abstractmethod
    def isend(self, array: Any, dest: int, tag: int) -> Request:
        """Start sending a C-contiguous native array to rank ``dest``; keep it unchanged until done."""

    @abc.abstractmethod
    def irecv(self, array: Any, source: int, tag: int) -> Request:
        """Start receiving into a C-contiguous native array (its size is the message's) from ``source``."""

    @abc.abstractmethod
    def allreduce(self, array: np.ndarray) -> np.ndarray:
        """Return the element-wise sum over the ranks of a small host array (float64 or int64)."""

    def next_rank(self) -> int:
        """The rank this one sends to in the ring."""
        return (self.rank + 1) % self.size

    def previous_rank(self) -> int:
        """The rank this one receives from in the ring."""
        return (self.rank - 1) % self.size

    def alltoall(self, sends: Sequence[Any], receives: Sequence[Any], tag: int) -> None:
        """Send ``sends[j]`` to rank j and receive ``receives[j]`` from rank j, for every j.

        The arrays are C-contiguous native arrays; the one for this rank is copied locally.
        """
        if len(sends) != self.size or len(receives) != self.size:
            raise ValueError(
                f"alltoall: expected {self.size} arrays to send and to receive, received {len(sends)} "
                f"and {len(receives)}"
            )
        requests = []
        for offset in range(1, self.size):
            source = (self.rank - offset) % self.size
            requests.append((self.irecv(receives[source], source, tag), f"all-to-all receive from rank {source}"))
        for offset in range(1, self.size):
            dest = (self.rank + offset) % self.size
            requests.append((self.isend(sends[dest], dest, tag), f"all-to-all send to rank {dest}"))
        receives[self.rank][...] = sends[self.rank]
        for request, what in requests:
            request.wait(self.timeout, f"rank {self.rank}: {what}")


def as_bytes(array: Any) -> Any:
    """A flat uint8 view of a C-contiguous native array (any dtype, bfloat16 included)."""
    if not array.flags.c_contiguous:
        raise ValueError(f"communicator: expected a C-contiguous array, received strides {array.strides}")
    return array.reshape(-1).view(np.uint8)
