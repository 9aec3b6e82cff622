"""Thread scaling of fastattn's cpu backend: the same call at several thread counts, interleaved.

For each case of bench_cpu.py (C1-C5 by default) and each pass, the call runs at every thread count
of ``--threads`` in turn, ``--repeats`` rounds (bench_cpu's ``timed``: the pools settle, one untimed
run, one timed run), and each count quotes its median; the speed-up of n threads is the median time
at the lowest count over the median at n.  Interleaving in one process keeps a noisy neighbour or a
clock change from landing on one thread count only, as it can between two separate runs.

The machine's own scaling is timed in the same rounds: machine_ceilings.c's register-only FMA loop
(bench_cpu's "fma peak"), the same total work split over each thread count.  A kernel bound by its
FMAs cannot scale past it, and on a shared host it does not reach n: a 2-core VM whose second vCPU
the host also runs elsewhere gives both the loop and the kernels a few percent less than 2x, and
the kernels' speed-up over the loop's (``of the loop``) is what the code itself loses.

    python benchmarks/bench_scaling.py                          # 1 and all threads, C1-C5
    python benchmarks/bench_scaling.py --threads 1 2 4 --cases C1 C4
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from bench_cpu import (
    CASES,
    _machine_ceilings,
    implementations,
    interleaved_medians,
    machine_description,
    write_report,
)

import fastattn


def at_threads(count: int, run: Callable[[], Any]) -> Callable[[], Any]:
    """``run`` with fastattn set to ``count`` threads first."""

    def call() -> Any:
        fastattn.set_num_threads(count)
        return run()

    return call


#: FMA-loop iterations a timing runs, split evenly over its threads: ~0.1 s on one 2.5 GHz core with
#: 256-bit FMAs (machine_ceilings.c's 10 chains a step).
FMA_LOOP_ITERATIONS = 2 * 10**7


def fma_loop_runs(counts: list[int]) -> dict[str, Callable[[], Any]]:
    """The register-only FMA loop at each thread count, the same total work each (none without a C
    compiler: bench_cpu's machine_ceilings)."""
    native = _machine_ceilings()
    if native is None:
        return {}
    return {
        f"FMA loop, {n} threads": (lambda n=n: native.fma_peak_gflops(FMA_LOOP_ITERATIONS // n, n)) for n in counts
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["C1", "C2", "C3", "C4", "C5"], choices=list(CASES))
    parser.add_argument("--threads", nargs="+", type=int, default=[1, os.cpu_count() or 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--passes", nargs="+", default=["forward", "forward+backward"], choices=["forward", "forward+backward"]
    )
    parser.add_argument("--json", type=Path, help="output path (default benchmarks/results/scaling-<date>.json)")
    arguments = parser.parse_args(argv)
    counts = sorted(set(arguments.threads))
    rows = []
    loop = fma_loop_runs(counts)
    for direction in arguments.passes:
        make = implementations(None, direction)["fastattn cpu"]
        for name in arguments.cases:
            batch, heads_q, heads_kv, seq_q, seq_k, dim, causal = CASES[name]
            rng = np.random.default_rng(1)
            q = rng.standard_normal((batch, heads_q, seq_q, dim), dtype=np.float32)
            k, v = (rng.standard_normal((batch, heads_kv, seq_k, dim), dtype=np.float32) for _ in range(2))
            dout = rng.standard_normal(q.shape, dtype=np.float32)
            run = make(q, k, v, dout, causal)
            print(f"  {name} {direction}", file=sys.stderr, flush=True)
            runs = {f"{n} threads": at_threads(n, run) for n in counts} | loop
            medians = interleaved_medians(runs, arguments.repeats)
            base = medians[f"{counts[0]} threads"]
            for n in counts:
                seconds = medians[f"{n} threads"]
                row = {"case": name, "pass": direction, "threads": n, "median_ms": 1e3 * seconds,
                       "speedup": base / seconds}
                if loop:
                    row["fma_loop_speedup"] = medians[f"FMA loop, {counts[0]} threads"] / medians[f"FMA loop, {n} threads"]
                    row["of_fma_loop"] = row["speedup"] / row["fma_loop_speedup"]
                rows.append(row)
    machine = machine_description()
    print(f"CPU: {machine.get('model_name')} (family {machine.get('family')}, model {machine.get('model')}), "
          f"{machine['cores']} logical CPUs; fastattn level {machine['fastattn_isa']}")
    print(f"{'case':<5} {'pass':<17} {'threads':>7} {'ms':>10} {'speed-up':>9} {'FMA loop':>9} {'of the loop':>12}")
    for row in rows:
        line = f"{row['case']:<5} {row['pass']:<17} {row['threads']:>7} {row['median_ms']:>10.2f} {row['speedup']:>8.2f}x"
        if "fma_loop_speedup" in row:
            line += f" {row['fma_loop_speedup']:>8.2f}x {100 * row['of_fma_loop']:>11.0f}%"
        print(line)
    write_report({"machine": machine, "threads": counts, "repeats": arguments.repeats, "rows": rows},
                 arguments.json, "scaling")
    return 0


if __name__ == "__main__":
    sys.exit(main())
