"""GIL benchmark: do Python threads calling fastattn run in parallel?

Each call runs with one OpenMP thread (``fastattn.set_num_threads(1)``), so any speed-up from a
second Python thread can only come from the kernels releasing the GIL.  Measured: calls per second
with one Python thread, then with two threads each making the same number of calls; the ratio is
the throughput gain (2.0 = perfect, 1.0 = serialised by the GIL).  Repeated, medians reported.

    python benchmarks/bench_threads.py                # writes benchmarks/results/threads-<date>.json
    python benchmarks/bench_threads.py --calls 40 --repeats 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

import fastattn

SHAPE_Q, SHAPE_KV = (1, 8, 512, 64), (1, 8, 512, 64)  # ~3 ms forward+backward per call on one core


def _calls_per_second(workers: int, calls: int, inputs: tuple[np.ndarray, ...]) -> float:
    q, k, v, dout = inputs
    start = threading.Barrier(workers + 1)

    def work() -> None:
        start.wait()
        for _ in range(calls):
            out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True, backend="cpu")
            fastattn.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cpu")

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return workers * calls / (time.perf_counter() - began)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60, help="calls per thread per measurement")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    rng = np.random.default_rng()
    inputs = tuple(rng.standard_normal(shape).astype(np.float32) for shape in (SHAPE_Q, SHAPE_KV, SHAPE_KV, SHAPE_Q))
    fastattn.set_num_threads(1)
    _calls_per_second(1, 5, inputs)
    one, two = [], []
    for _ in range(args.repeats):
        time.sleep(0.5)
        one.append(_calls_per_second(1, args.calls, inputs))
        time.sleep(0.5)
        two.append(_calls_per_second(2, args.calls, inputs))
    ratios = [b / a for a, b in zip(one, two)]
    result = {
        "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(),
        "problem": {"q": SHAPE_Q, "kv": SHAPE_KV, "causal": True, "dtype": "float32", "pass": "forward+backward"},
        "openmp_threads_per_call": 1,
        "calls_per_second_one_thread": one,
        "calls_per_second_two_threads": two,
        "median_one": statistics.median(one),
        "median_two": statistics.median(two),
        "median_ratio": statistics.median(ratios),
    }
    print(f"one Python thread : {result['median_one']:.1f} calls/s (median of {args.repeats})")
    print(f"two Python threads: {result['median_two']:.1f} calls/s")
    print(f"throughput ratio  : {result['median_ratio']:.2f}x (2.0 = fully parallel, 1.0 = serialised)")
    path = args.json or Path(__file__).parent / "results" / f"threads-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
