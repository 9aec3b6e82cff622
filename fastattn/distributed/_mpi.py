"""A communicator over MPI, through mpi4py (the ``mpi`` extra: mpi4py and the MPICH wheel).

numpy arrays travel as bytes; CuPy arrays are handed to mpi4py as they are, which works where the
MPI library is CUDA-aware (it reads the device pointer; otherwise MPI fails on them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._comm import DEFAULT_TIMEOUT, Communicator, Request, as_bytes


class _MPIRequest(Request):
    def __init__(self, request: Any, keep: Any) -> None:
        self._request, self._keep = request, keep

    def test(self) -> bool:
        done = bool(self._request.Test())
        if done:
            self._keep = None
        return done


class MPICommunicator(Communicator):
    """One MPI rank of a communicator (``MPI.COMM_WORLD`` unless given).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The group; ``MPI.COMM_WORLD`` by default.
    timeout : float
        Seconds every wait allows before it raises :class:`TimeoutError`.  Run scripts as
        ``mpiexec -n R python -m mpi4py script.py`` so that an uncaught error aborts every rank.
    """

    def __init__(self, comm: Any = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = timeout

    def isend(self, array: Any, dest: int, tag: int) -> Request:
        buffer = as_bytes(array)
        return _MPIRequest(self.comm.Isend(buffer, dest=dest, tag=tag), buffer)

    def irecv(self, array: Any, source: int, tag: int) -> Request:
        buffer = as_bytes(array)
        return _MPIRequest(self.comm.Irecv(buffer, source=source, tag=tag), buffer)

    def allreduce(self, array: np.ndarray) -> np.ndarray:
        send = np.ascontiguousarray(array)
        result = np.empty_like(send)
        request = _MPIRequest(self.comm.Iallreduce(send, result, op=self._mpi.SUM), (send, result))
        request.wait(self.timeout, f"rank {self.rank}: all-reduce")
        return result
