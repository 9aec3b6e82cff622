"""An in-process communicator: the ranks are threads of one process (for fast, deterministic tests).

:func:`simulate` runs a function once per rank, each in its own thread with its own
:class:`SimulatedCommunicator`, and returns the results in rank order.  A send copies its array
into the receiver's mailbox at once (a buffered send); a receive completes when the matching
message (source, tag) is there.  The all-reduce sums in rank order, so results do not depend on
thread timing.  When one rank raises, every other rank's next wait raises too, and
:func:`simulate` re-raises the first error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ._comm import Communicator, Request, as_bytes

Result = TypeVar("Result")


class _World:
    """State shared by the ranks of one simulation."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.condition = threading.Condition()
        self.mailbox: dict[tuple[int, int, int], list[Any]] = {}
        self.failure: BaseException | None = None
        self.reductions: list[dict[int, np.ndarray]] = []


class _Delivered(Request):
    def test(self) -> bool:
        return True


class _Receive(Request):
    def __init__(self, world: _World, key: tuple[int, int, int], target: Any) -> None:
        self.world, self.key, self.target, self.done = world, key, target, False

    def test(self) -> bool:
        if self.done:
            return True
        with self.world.condition:
            queue = self.world.mailbox.get(self.key)
            if not queue:
                if self.world.failure is not None:
                    raise RuntimeError("simulated communicator: another rank failed") from self.world.failure
                return False
            payload = queue.pop(0)
        target = as_bytes(self.target)
        if payload.size != target.size:
            raise ValueError(
                f"simulated communicator: receive from rank {self.key[0]} (tag {self.key[2]}) expected "
                f"{target.size} bytes, the message has {payload.size}"
            )
        target[...] = payload
        self.done = True
        return True


class SimulatedCommunicator(Communicator):
    """One rank of a group simulated by threads of this process (see :func:`simulate`)."""

    def __init__(self, world: _World, rank: int, timeout: float) -> None:
        self._world = world
        self.rank = rank
        self.size = world.size
        self.timeout = timeout
        self._reductions = 0

    def isend(self, array: Any, dest: int, tag: int) -> Request:
        payload = as_bytes(array).copy()
        with self._world.condition:
            self._world.mailbox.setdefault((self.rank, dest, tag), []).append(payload)
        return _Delivered()

    def irecv(self, array: Any, source: int, tag: int) -> Request:
        return _Receive(self._world, (source, self.rank, tag), array)

    def allreduce(self, array: np.ndarray) -> np.ndarray:
        world = self._world
        round_index = self._reductions
        self._reductions += 1
        with world.condition:
            while len(world.reductions) <= round_index:
                world.reductions.append({})
            parts = world.reductions[round_index]
            parts[self.rank] = np.array(array, copy=True)
            world.condition.notify_all()

            def complete() -> bool:
                if world.failure is not None:
                    raise RuntimeError("simulated communicator: another rank failed") from world.failure
                return len(parts) == self.size

            if not world.condition.wait_for(complete, timeout=self.timeout):
                raise TimeoutError(
                    f"rank {self.rank}: all-reduce: no completion within {self.timeout:g} s "
                    "(a peer failed or is missing)"
                )
        return np.sum([parts[rank] for rank in range(self.size)], axis=0)


def simulate(size: int, function: Callable[[SimulatedCommunicator], Result], *, timeout: float = 60.0) -> list[Result]:
    """Run ``function(comm)`` on ``size`` simulated ranks, each in a thread; return the results.

    Parameters
    ----------
    size : int
        Number of ranks, at least 1.
    function : callable
        Called once per rank with that rank's :class:`SimulatedCommunicator`.
    timeout : float
        Seconds each wait of a rank allows before it raises :class:`TimeoutError`.

    Returns
    -------
    list
        ``function``'s result on each rank, in rank order.

    Raises
    ------
    Exception
        The first exception a rank raised (the others stop at their next wait).
    """
    if size < 1:
        raise ValueError(f"size: expected at least 1 rank, received {size}")
    world = _World(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = function(SimulatedCommunicator(world, rank, timeout))
        except BaseException as error:  # re-raised by simulate, in the caller's thread
            errors[rank] = error
            with world.condition:
                if world.failure is None:
                    world.failure = error
                world.condition.notify_all()

    threads = [threading.Thread(target=run, args=(rank,), name=f"simulated-rank-{rank}") for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if world.failure is not None:
        raise world.failure
    return results
