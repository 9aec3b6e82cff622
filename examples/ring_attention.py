"""Ring attention across processes: each rank holds a shard of a long sequence.

Every rank builds the same random q, k, v (one seed), keeps its zig-zag shard of the positions
(rank r: chunks r and 2R-1-r of 2R), and runs causal ring attention forward and backward over
MPI; with ``--check`` each rank also computes the whole attention alone and compares its rows.

    mpiexec -n 2 python -m mpi4py examples/ring_attention.py
    mpiexec -n 4 python -m mpi4py examples/ring_attention.py --seq 16384 --heads 8 --kv-heads 2 --check

``python -m mpi4py`` makes an uncaught error on one rank abort them all.  Across hosts, give
mpiexec a host list (MPICH: ``mpiexec -n 8 -hosts node1,node2 ...``, with the same environment on
every host).  Under torch.distributed, swap the communicator for
``fastattn.distributed.TorchCommunicator()`` after ``torch.distributed.init_process_group``
(e.g. launched by ``torchrun --nproc-per-node 2``).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import fastattn
from fastattn import distributed


def say(line: str) -> None:
    """Print a line in one write, so that mpiexec does not interleave the ranks' lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192, help="whole sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--check", action="store_true", help="compare with one process's attention")
    args = parser.parse_args()

    fastattn.set_num_threads(args.threads)
    comm = distributed.MPICommunicator()
    rng = np.random.default_rng(2024)
    q = rng.standard_normal((1, args.heads, args.seq, args.head_dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, args.kv_heads, args.seq, args.head_dim), dtype=np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    q_r, k_r, v_r, dout_r = (distributed.shard_sequence(x, comm.rank, comm.size) for x in (q, k, v, dout))

    start = time.perf_counter()
    out_r, lse_r = distributed.ring_attention(q_r, k_r, v_r, comm=comm, causal=True, return_lse=True)
    forward = time.perf_counter() - start
    dq_r, dk_r, dv_r = distributed.ring_attention_backward(dout_r, q_r, k_r, v_r, out_r, lse_r, comm=comm, causal=True)
    backward = time.perf_counter() - start - forward
    positions = distributed.sequence_chunks(args.seq, comm.size)[comm.rank]
    held = ", ".join(f"[{chunk.start}, {chunk.stop})" for chunk in positions)
    say(f"rank {comm.rank}/{comm.size}: positions {held}: forward {forward:.3f} s, backward {backward:.3f} s")

    if args.check:
        out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
        grads = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
        mine = (out, *grads)
        errors = [
            float(np.abs(got - distributed.shard_sequence(want, comm.rank, comm.size)).max())
            for got, want in zip((out_r, dq_r, dk_r, dv_r), mine)
        ]
        listed = ", ".join(f"{error:.2e}" for error in errors)
        say(f"rank {comm.rank}: largest difference from one process (out, dq, dk, dv): {listed}")


if __name__ == "__main__":
    main()
