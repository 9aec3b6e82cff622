"""A communicator over ``torch.distributed`` (gloo for CPU tensors, NCCL for CUDA tensors).

Native arrays cross into torch without copies (``torch.from_numpy`` of a byte view, DLPack for
CuPy) and travel as bytes, so every dtype does, bfloat16 included.
"""

from __future__ import annotations

import datetime
from typing import Any

import numpy as np

from ._comm import DEFAULT_TIMEOUT, Communicator, Request, as_bytes


class _TorchRequest(Request):
    def __init__(self, work: Any, keep: Any) -> None:
        self._work, self._keep = work, keep

    def test(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self, timeout: float, what: str) -> None:
        # Work.wait with a deadline, rather than polling is_completed: gloo's point-to-point work
        # completes only inside wait.
        try:
            self._work.wait(datetime.timedelta(seconds=timeout))
        except RuntimeError as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise TimeoutError(f"{what}: no completion within {timeout:g} s ({error})") from error
            raise
        self._keep = None


def _tensor(array: Any) -> Any:
    import torch

    flat = as_bytes(array)
    if isinstance(flat, np.ndarray):
        return torch.from_numpy(flat)
    return torch.from_dlpack(flat)


class TorchCommunicator(Communicator):
    """One rank of a ``torch.distributed`` process group (the default group unless given).

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, optional
        The group; the default (world) group when None.  ``torch.distributed.init_process_group``
        must have run.
    timeout : float
        Seconds every wait allows before it raises :class:`TimeoutError`.
    """

    def __init__(self, group: Any = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "TorchCommunicator: expected an initialised torch.distributed default process group "
                "(call torch.distributed.init_process_group first)"
            )
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.timeout = timeout

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    def isend(self, array: Any, dest: int, tag: int) -> Request:
        tensor = _tensor(array)
        return _TorchRequest(self._dist.isend(tensor, self._global(dest), group=self.group, tag=tag), tensor)

    def irecv(self, array: Any, source: int, tag: int) -> Request:
        tensor = _tensor(array)
        return _TorchRequest(self._dist.irecv(tensor, self._global(source), group=self.group, tag=tag), tensor)

    def allreduce(self, array: np.ndarray) -> np.ndarray:
        import torch

        result = torch.from_numpy(np.array(array, copy=True))
        if self._dist.get_backend(self.group) == "nccl":  # NCCL reduces CUDA tensors only
            result = result.to(f"cuda:{torch.cuda.current_device()}")
        work = self._dist.all_reduce(result, group=self.group, async_op=True)
        _TorchRequest(work, result).wait(self.timeout, f"rank {self.rank}: all-reduce")
        return result.cpu().numpy()
