"""Ring attention benchmark: R ranks x 1 thread against 1 process x R threads, memory, and a model.

Three measurements (issue #24), each in fresh processes so that thread settings do not leak:

* throughput: the causal forward (and with ``--backward`` forward+backward) of B=1, H=8, D=64 at
  each ``--seqs`` length, float32, as ``mpiexec -n 2`` ranks with one thread each (zig-zag
  sharding, ring attention over mpi4py) against one process with two threads
  (``fastattn.attention``).  ``--repeats`` rounds alternate the two; medians are quoted.
* memory: ``--memory-ranks`` ranks (oversubscribed on a small machine: for memory only), each
  measuring with tracemalloc the peak of what the forward allocates beyond its inputs, against
  the bound 2/R of the single process's K/V footprint (its own shard's copy and the block in
  flight) plus its Q and O shards.
* model: the kernel time of one (S/R x S/R) block at one thread, for R = 8..64 at the longest
  length, against the time a K/V shard takes over a link of each ``--bandwidth`` (GB/s): the step
  time is the larger of the two, and communication stops hiding where it is the larger.

    python benchmarks/bench_ring.py                         # writes benchmarks/results/ring-<date>.json
    python benchmarks/bench_ring.py --seqs 16384 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_cpu import machine_description, write_report  # noqa: E402

BATCH, HEADS, DIM = 1, 8, 64
MODEL_RANKS = (8, 16, 32, 64)


def _inputs(seq: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((BATCH, HEADS, seq, DIM), dtype=np.float32) for _ in range(4)]


def _flops(seq: int, backward: bool) -> float:
    forward = 4.0 * BATCH * HEADS * seq * seq * DIM / 2
    return forward * (3.5 if backward else 1.0)


def worker_single(seq: int, backward: bool, threads: int) -> dict[str, Any]:
    import fastattn

    fastattn.set_num_threads(threads)
    warm = _inputs(1024)
    fastattn.attention(*warm[:3], causal=True)
    q, k, v, dout = _inputs(seq)
    start = time.perf_counter()
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    if backward:
        fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    return {"seconds": time.perf_counter() - start}


def worker_ring(seq: int, backward: bool, memory: bool) -> dict[str, Any] | None:
    import tracemalloc

    import fastattn
    from fastattn import distributed

    fastattn.set_num_threads(1)
    comm = distributed.MPICommunicator(timeout=3600.0)
    rank, size = comm.rank, comm.size
    warm = [distributed.shard_sequence(x, rank, size) for x in _inputs(1024)]
    distributed.ring_attention(*warm[:3], comm=comm, causal=True)
    q, k, v, dout = (distributed.shard_sequence(x, rank, size) for x in _inputs(seq))
    comm.allreduce(np.zeros(1))
    if memory:
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    out, lse = distributed.ring_attention(q, k, v, comm=comm, causal=True, return_lse=True)
    if backward:
        distributed.ring_attention_backward(dout, q, k, v, out, lse, comm=comm, causal=True)
    comm.allreduce(np.zeros(1))
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {"seconds": seconds}
    if memory:
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
        kv_whole = 2 * BATCH * HEADS * seq * DIM * 4
        shard_bytes = q.nbytes  # Q shard; the O shard has the same size (D = Dv)
        result.update(
            rank=rank,
            peak_bytes=peak,
            bound_bytes=2 * kv_whole / size + 2 * shard_bytes,
            kv_whole_bytes=kv_whole,
            shard_bytes=shard_bytes,
        )
    table = np.zeros((size, 6))
    table[rank] = [seconds, result.get("peak_bytes", 0), result.get("bound_bytes", 0), 0, 0, 0]
    gathered = comm.allreduce(table)
    if rank != 0:
        return None
    return {
        "seconds": float(gathered[:, 0].max()),
        "ranks": [
            {"rank": r, "seconds": float(gathered[r, 0]), "peak_bytes": int(gathered[r, 1]),
             "bound_bytes": int(gathered[r, 2])}
            for r in range(size)
        ],
        **({"kv_whole_bytes": result["kv_whole_bytes"]} if memory else {}),
    }  # fmt: skip


def worker_blocks(seq: int) -> dict[str, Any]:
    """One thread's kernel time per full (S/R x S/R) block (non-causal), R in MODEL_RANKS."""
    import fastattn

    fastattn.set_num_threads(1)
    times = {}
    for ranks in MODEL_RANKS:
        rows = seq // ranks
        q, k, v = (x[:, :, :rows] for x in _inputs(rows)[:3])
        fastattn.attention(q, k, v)
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fastattn.attention(q, k, v)
            samples.append(time.perf_counter() - start)
        times[str(ranks)] = statistics.median(samples)
    return {"block_seconds": times}


def _run(command: list[str], threads: int) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout}{result.stderr}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        raise SystemExit("bench_ring: mpiexec not found (pip install -e '.[mpi]')")
    return found


def _ring_command(ranks: int, seq: int, backward: bool, memory: bool) -> list[str]:
    command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", __file__, "--worker", "ring"]
    command += ["--seq", str(seq)] + (["--backward"] if backward else []) + (["--memory"] if memory else [])
    return command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2, help="ranks (one thread each) against one process")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward")
    parser.add_argument("--memory-ranks", type=int, default=4)
    parser.add_argument("--bandwidth", type=float, nargs="+", default=[1.25, 12.5, 50.0], help="GB/s")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=["single", "ring", "blocks"], help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "single":
        print(json.dumps(worker_single(args.seq, args.backward, args.threads)))
        return
    if args.worker == "ring":
        result = worker_ring(args.seq, args.backward, args.memory)
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    if args.worker == "blocks":
        print(json.dumps(worker_blocks(args.seq)))
        return

    report: dict[str, Any] = {"machine": machine_description(), "shape": {"B": BATCH, "H": HEADS, "D": DIM}}
    passes = [False, True] if args.backward else [False]
    throughput = []
    for seq in args.seqs:
        for backward in passes:
            label = "forward+backward" if backward else "forward"
            single_command = [sys.executable, __file__, "--worker", "single", "--seq", str(seq)]
            single_command += ["--threads", str(args.ranks)] + (["--backward"] if backward else [])
            times: dict[str, list[float]] = {"single": [], "ring": []}
            for _ in range(args.repeats):
                times["single"].append(_run(single_command, args.ranks)["seconds"])
                times["ring"].append(_run(_ring_command(args.ranks, seq, backward, False), 1)["seconds"])
                print(f"  S={seq} {label}: single {times['single'][-1]:.2f} s, ring {times['ring'][-1]:.2f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
            single, ring = statistics.median(times["single"]), statistics.median(times["ring"])
            row = {
                "seq": seq, "pass": label, "single_seconds": single, "ring_seconds": ring,
                "single_gflops": _flops(seq, backward) / single / 1e9, "ring_gflops": _flops(seq, backward) / ring / 1e9,
                "ring_over_single": single / ring, "samples": times,
            }  # fmt: skip
            throughput.append(row)
            print(f"S={seq:6d} {label:17s} 1 process x {args.ranks} threads {single:7.2f} s "
                  f"({row['single_gflops']:.0f} GFLOP/s)   {args.ranks} ranks x 1 thread {ring:7.2f} s "
                  f"({row['ring_gflops']:.0f} GFLOP/s)   ring/single throughput {single / ring:.2f}x")  # fmt: skip
    report["throughput"] = throughput

    seq = min(args.seqs)
    memory = _run(_ring_command(args.memory_ranks, seq, False, True), 1)
    report["memory"] = {"seq": seq, **memory}
    for entry in memory["ranks"]:
        print(f"memory S={seq} R={args.memory_ranks} rank {entry['rank']}: peak {entry['peak_bytes'] / 2**20:.1f} MiB "
              f"beyond inputs, bound {entry['bound_bytes'] / 2**20:.1f} MiB "
              f"({entry['peak_bytes'] / entry['bound_bytes']:.2f} of it)")  # fmt: skip

    seq = max(args.seqs)
    blocks = _run([sys.executable, __file__, "--worker", "blocks", "--seq", str(seq)], 1)["block_seconds"]
    model = []
    for ranks in MODEL_RANKS:
        rows = seq // ranks
        compute = blocks[str(ranks)]
        shard_bytes = 2 * BATCH * HEADS * rows * DIM * 4
        for bandwidth in args.bandwidth:
            transfer = shard_bytes / (bandwidth * 1e9)
            model.append({
                "ranks": ranks, "block_rows": rows, "block_seconds": compute, "bandwidth_gbs": bandwidth,
                "shard_bytes": shard_bytes, "transfer_seconds": transfer, "step_seconds": max(compute, transfer),
                "hidden": transfer <= compute,
            })  # fmt: skip
            print(f"model S={seq} R={ranks:2d}: block {rows}x{rows} {1e3 * compute:8.2f} ms/thread, K/V shard "
                  f"{shard_bytes / 2**20:6.2f} MiB at {bandwidth:5.2f} GB/s {1e3 * transfer:7.2f} ms -> "
                  f"{'hidden' if transfer <= compute else 'EXPOSED'}")  # fmt: skip
    report["model"] = {"seq": seq, "rows": model}
    write_report(report, args.out, "ring")


if __name__ == "__main__":
    main()
