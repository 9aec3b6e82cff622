"""Median table over repeated benchmark runs: one markdown table from several bench_cpu.py JSONs.

    python benchmarks/summarize.py benchmarks/results/cpu-2026-11-22-run*.json

Each cell is the median over the runs of that implementation's median time; ratios are taken
per run against torch in the same run, then their median is reported.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(paths: list[str]) -> int:
    runs = [json.loads(Path(path).read_text()) for path in paths]
    times: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    gflops: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    ratios: dict[tuple[str, str], list[float]] = defaultdict(list)
    sgemm = [run["sgemm_gflops"] for run in runs]
    for run in runs:
        torch_ms = {(r["case"], r["pass"]): r["median_ms"] for r in run["rows"] if r["implementation"] == "torch sdpa"}
        for row in run["rows"]:
            key = (row["case"], row["pass"], row["implementation"])
            times[key].append(row["median_ms"])
            gflops[key].append(row["gflops"])
            if row["implementation"] == "fastattn cpu" and (row["case"], row["pass"]) in torch_ms:
                ratios[(row["case"], row["pass"])].append(torch_ms[(row["case"], row["pass"])] / row["median_ms"])
    print(f"Medians over {len(runs)} runs; numpy sgemm 2048^3 in the same runs: {statistics.median(sgemm):.0f} GFLOP/s "
          f"(BLAS {runs[0]['blas'][0].get('architecture')}).\n")
    print("| case | pass | fastattn cpu ms (GFLOP/s) | torch sdpa ms | numpy naive ms | fastattn / torch | fastattn of sgemm |")
    print("|---|---|---|---|---|---|---|")
    for (case, direction), values in ratios.items():
        def cell(impl: str) -> str:
            key = (case, direction, impl)
            return f"{statistics.median(times[key]):.1f}" if key in times else "-"

        ours = (case, direction, "fastattn cpu")
        print(
            f"| {case} | {direction} | {statistics.median(times[ours]):.1f} ({statistics.median(gflops[ours]):.0f}) | "
            f"{cell('torch sdpa')} | {cell('numpy naive')} | {statistics.median(values):.2f}x | "
            f"{statistics.median(gflops[ours]) / statistics.median(sgemm):.0%} |"
        )
    for direction in ("forward", "forward+backward"):
        chosen = [statistics.median(ratios[(c, direction)]) for c in ("C1", "C2", "C3", "C4", "C5") if (c, direction) in ratios]
        if chosen:
            print(f"\nGeomean C1-C5 {direction}: {math.exp(sum(map(math.log, chosen)) / len(chosen)):.2f}x torch")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
