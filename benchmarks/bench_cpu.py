"""CPU benchmark: fastattn's cpu backend against torch SDPA and numpy, cases C1-C6 of DESIGN.md §5.

Every implementation runs in the same process on the same inputs: one warm-up, then the median of
``--repeats`` timed runs.  numpy's sgemm (2048^3) is timed in the same run as the practical
ceiling, under whatever OpenBLAS kernel this environment selects (reported via threadpoolctl; on
machines where OPENBLAS_CORETYPE is set it is an older kernel, which changes the ceiling but not
fastattn, whose kernels call no BLAS).  ``--memory`` adds the (1, 8, 32768, 32768, 128) causal
forward and reports its peak RSS beyond inputs and outputs, measured in a subprocess.

    python benchmarks/bench_cpu.py                 # table + benchmarks/results/cpu-<date>.json
    python benchmarks/bench_cpu.py --cases C1 C6 --repeats 7
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import fastattn
from fastattn._bench import numpy_naive_attention

CASES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "C1": (1, 8, 8, 1024, 1024, 64, False),
    "C2": (1, 8, 8, 1024, 1024, 64, True),
    "C3": (1, 16, 16, 2048, 2048, 64, True),
    "C4": (1, 8, 8, 4096, 4096, 128, True),
    "C5": (1, 32, 8, 2048, 2048, 128, True),
    "C6": (8, 32, 8, 1, 4096, 128, False),
}


def forward_flops(batch: int, heads_q: int, seq_q: int, seq_k: int, dim: int, causal: bool) -> float:
    """``4·B·Hq·Sq·Sk·D``, halved for causal with Sq = Sk (DESIGN.md §5)."""
    flops = 4.0 * batch * heads_q * seq_q * seq_k * dim
    return flops / 2 if causal and seq_q == seq_k else flops


def median_seconds(run: Callable[[], Any], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sgemm_gflops(repeats: int) -> float:
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    return 2 * 2048**3 / median_seconds(lambda: a @ a, repeats) / 1e9


def blas_description() -> list[dict[str, Any]]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return [{"note": "threadpoolctl not installed"}]
    return [
        {key: info.get(key) for key in ("internal_api", "version", "architecture", "num_threads")}
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]


def implementations(torch: Any) -> dict[str, Callable[..., Callable[[], Any]]]:
    """Each entry takes (q, k, v, causal) as numpy arrays and returns a zero-argument runner."""

    def fastattn_cpu(q, k, v, causal):
        return lambda: fastattn.attention(q, k, v, causal=causal, backend="cpu")

    def numpy_naive(q, k, v, causal):
        return lambda: numpy_naive_attention(q, k, v, causal)

    found = {"fastattn cpu": fastattn_cpu, "numpy naive": numpy_naive}
    if torch is not None:

        def torch_sdpa(q, k, v, causal):
            tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            return lambda: sdpa(tq, tk, tv, is_causal=causal, enable_gqa=tq.shape[1] != tk.shape[1])

        found["torch sdpa"] = torch_sdpa
    return found


def run_case(name: str, impls: dict[str, Callable[..., Callable[[], Any]]], repeats: int) -> list[dict[str, Any]]:
    batch, heads_q, heads_kv, seq_q, seq_k, dim, causal = CASES[name]
    rng = np.random.default_rng(1)
    q = rng.standard_normal((batch, heads_q, seq_q, dim), dtype=np.float32)
    k = rng.standard_normal((batch, heads_kv, seq_k, dim), dtype=np.float32)
    v = rng.standard_normal((batch, heads_kv, seq_k, dim), dtype=np.float32)
    flops = forward_flops(batch, heads_q, seq_q, seq_k, dim, causal)
    kv_bytes = k.nbytes + v.nbytes
    rows = []
    for label, make in impls.items():
        seconds = median_seconds(make(q, k, v, causal), repeats)
        rows.append(
            {
                "case": name,
                "implementation": label,
                "median_ms": 1e3 * seconds,
                "gflops": flops / seconds / 1e9,
                "kv_gbytes_per_s": kv_bytes / seconds / 1e9,
            }
        )
        print(f"  {name} {label}: {1e3 * seconds:.2f} ms", file=sys.stderr, flush=True)
    return rows


_MEMORY_PROBE = r"""
import json, resource
import numpy as np
import fastattn
batch, heads, seq, dim = 1, 8, 32768, 128
q, k, v = (np.random.default_rng(i).standard_normal((batch, heads, seq, dim), dtype=np.float32) for i in range(3))
fastattn.attention(q[:, :, :128], k[:, :, :128], v[:, :, :128], causal=True, backend="cpu")
# Touch and free as much memory as the outputs take, so the high-water mark already covers them.
outputs = (np.ones_like(q), np.ones((batch, heads, seq), np.float32))
del outputs
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out, lse = fastattn.attention(q, k, v, causal=True, backend="cpu", return_lse=True)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_mib_beyond_outputs": (after - before) / 1024}))
"""


def memory_case() -> dict[str, Any]:
    """Peak RSS of the (1, 8, 32768, 32768, 128) causal forward beyond its inputs and outputs.

    The high-water mark is first raised by output-sized buffers that are then freed, so the growth
    measured during the call is what the kernel needs beyond inputs and outputs.
    """
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["seconds"] = time.perf_counter() - start
    return measured


def format_table(rows: list[dict[str, Any]], sgemm: float) -> str:
    torch_ms = {row["case"]: row["median_ms"] for row in rows if row["implementation"] == "torch sdpa"}
    header = f"{'case':<5} {'implementation':<14} {'ms':>9} {'GFLOP/s':>8} {'KV GB/s':>8} {'vs torch':>9} {'of sgemm':>9}"
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = torch_ms.get(row["case"], math.nan) / row["median_ms"]
        lines.append(
            f"{row['case']:<5} {row['implementation']:<14} {row['median_ms']:>9.2f} {row['gflops']:>8.1f} "
            f"{row['kv_gbytes_per_s']:>8.1f} {ratio:>8.2f}x {row['gflops'] / sgemm:>8.0%}"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    ratios = {}
    for row in rows:
        if row["implementation"] != "fastattn cpu":
            continue
        torch_row = [r for r in rows if r["case"] == row["case"] and r["implementation"] == "torch sdpa"]
        if torch_row:
            ratios[row["case"]] = torch_row[0]["median_ms"] / row["median_ms"]
    forward = [ratios[c] for c in ("C1", "C2", "C3", "C4", "C5") if c in ratios]
    if forward:
        ratios["geomean C1-C5"] = math.exp(sum(map(math.log, forward)) / len(forward))
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-numpy", action="store_true", help="skip numpy naive (slow on C3-C5)")
    parser.add_argument("--memory", action="store_true", help="also run the 32768-token memory case")
    parser.add_argument("--json", type=Path, help="output path (default benchmarks/results/cpu-<date>.json)")
    arguments = parser.parse_args(argv)

    try:
        import torch

        torch.set_num_threads(fastattn.get_num_threads())
    except ImportError:
        torch = None
    impls = implementations(torch)
    if arguments.no_numpy:
        impls.pop("numpy naive")
    sgemm = sgemm_gflops(arguments.repeats)
    rows = [row for name in arguments.cases for row in run_case(name, impls, arguments.repeats)]
    print(format_table(rows, sgemm))
    print(f"numpy sgemm 2048^3: {sgemm:.1f} GFLOP/s; BLAS: {blas_description()}")
    ratios = summary(rows)
    print("fastattn cpu / torch: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    report: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor(), "cores": os.cpu_count(), "python": platform.python_version()},
        "threads": fastattn.get_num_threads(),
        "torch": None if torch is None else torch.__version__,
        "numpy": np.__version__,
        "blas": blas_description(),
        "openblas_env": {key: os.environ.get(key) for key in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
        "sgemm_gflops": sgemm,
        "repeats": arguments.repeats,
        "rows": rows,
        "ratios_vs_torch": ratios,
    }
    if arguments.memory:
        report["memory_case"] = memory_case()
        print(f"memory case (1, 8, 32768, 32768, 128) causal: {report['memory_case']}")
    path = arguments.json or Path(__file__).parent / "results" / f"cpu-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
