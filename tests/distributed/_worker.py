"""One rank of the real-process tests (``test_processes.py`` starts them).

    mpiexec -n 2 python -m mpi4py tests/distributed/_worker.py mpi SEED [fail]
    RANK=r WORLD_SIZE=2 MASTER_PORT=p python tests/distributed/_worker.py torch SEED [fail]

Every rank builds the same random inputs from SEED, computes the single-process result, runs
ring and Ulysses attention forward and backward on its shards (and, under torch, through
autograd), and checks its shards of the results within 1e-12 relative.  ``fail``: rank 1 raises
before the call, which must end the run with that error rather than hang rank 0.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import fastattn
from fastattn import distributed

CASES = [
    {"causal": True},
    {"causal": "bottom_right", "window": (9, 0), "key_lengths": np.array([50, 21])},
    {"softcap": 4.0},
]


def _communicator(engine: str) -> distributed.Communicator:
    if engine == "mpi":
        return distributed.MPICommunicator(timeout=30.0)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
    return distributed.TorchCommunicator(timeout=30.0)


def _check(name: str, got: object, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    scale = max(float(np.abs(want[np.isfinite(want)]).max(initial=0.0)), 1e-300)
    error = float(np.abs(np.where(np.isfinite(want), got - want, 0)).max(initial=0.0)) / scale
    if error > 1e-12 or not np.array_equal(np.isfinite(got), np.isfinite(want)):
        raise AssertionError(f"{name}: relative error {error:.3g} against one process")


def main(engine: str, seed: int, fail: bool) -> None:
    comm = _communicator(engine)
    if fail and comm.rank == 1:
        raise ValueError("rank 1 fails on purpose")
    rng = np.random.default_rng(seed)
    for options in CASES:
        shapes = [(2, 4, 53, 16), (2, 2, 53, 16), (2, 2, 53, 16), (2, 4, 53, 16)]
        q, k, v, dout = (rng.standard_normal(shape) for shape in shapes)
        out, lse = fastattn.attention(q, k, v, return_lse=True, backend="cpu", **options)
        whole = [out, lse, *fastattn.attention_backward(dout, q, k, v, out, lse, backend="cpu", **options)]
        mine = [distributed.shard_sequence(x, comm.rank, comm.size) for x in whole]
        shards = [distributed.shard_sequence(x, comm.rank, comm.size) for x in (q, k, v, dout)]
        for strategy in ("ring", "ulysses"):
            forward = getattr(distributed, f"{strategy}_attention")
            backward = getattr(distributed, f"{strategy}_attention_backward")
            got_out, got_lse = forward(*shards[:3], comm=comm, return_lse=True, **options)
            grads = backward(shards[3], *shards[:3], got_out, got_lse, comm=comm, **options)
            for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (got_out, got_lse, *grads), mine):
                _check(f"{strategy} {options} {name}", got, want)
        if engine == "torch":
            import torch

            from fastattn import torch as fastattn_torch

            tensors = [torch.from_numpy(x).requires_grad_(i < 3) for i, x in enumerate(shards)]
            result = fastattn_torch.ring_attention(*tensors[:3], comm=comm, **options)
            (result * tensors[3]).sum().backward()
            grads = (result.detach(), *(tensor.grad for tensor in tensors[:3]))
            for name, got, want in zip(("out", "dq", "dk", "dv"), grads, [mine[0], *mine[2:]]):
                _check(f"torch autograd {options} {name}", got, want)
    sys.stdout.write(f"rank {comm.rank} of {comm.size} ({engine}): ok\n")  # one write: no interleaving
    sys.stdout.flush()
    if engine == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "fail")
