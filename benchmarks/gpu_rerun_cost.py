"""What the float32 rerun launch costs a call that needs no rerun: the cuda backend's float32 forward
and decode with their second launch (``fp32_forward`` / ``flash_decode_fp32`` RERUN instances) and
with the walk alone, alternated, on random finite inputs (no block reruns).

Each figure is the smallest of ``--rounds`` medians of ``--calls`` whole calls timed by CUDA events
(launch overhead included: the second launch's cost is mostly that).  Needs CuPy and a GPU::

    python benchmarks/gpu_rerun_cost.py
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import fastattn
from fastattn._gpu import decode, fp32

#: name: (batch, q heads, kv heads, Sq, Sk, head_dim)
CASES = {
    "G1": (8, 16, 16, 1024, 1024, 64),
    "small": (1, 16, 16, 256, 256, 64),
    "G7": (32, 32, 8, 1, 4096, 128),
}


def _walk_only(enabled: bool, originals: tuple[Callable[..., Any], Callable[..., Any]]) -> None:
    """Make the launchers name the walk instances alone (enabled) or every instance."""
    forward_instances, decode_instances = originals
    if enabled:
        fp32.forward_instances = lambda problem: forward_instances(problem)[:1]
        decode._instances = lambda problem, splits: tuple(
            name for name in decode_instances(problem, splits) if not name.endswith(", true>")
        )
    else:
        fp32.forward_instances, decode._instances = forward_instances, decode_instances


def _median_ms(cupy: Any, q: Any, k: Any, v: Any, calls: int) -> float:
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(3):
        fastattn.attention(q, k, v)
    times = []
    for _ in range(calls):
        start.record()
        fastattn.attention(q, k, v)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    arguments = parser.parse_args()
    import cupy

    originals = (fp32.forward_instances, decode._instances)
    rng = cupy.random.default_rng(0)
    for name, (batch, heads_q, heads_kv, seq_q, seq_k, head_dim) in CASES.items():
        q = rng.standard_normal((batch, heads_q, seq_q, head_dim), dtype=cupy.float32)
        k, v = (rng.standard_normal((batch, heads_kv, seq_k, head_dim), dtype=cupy.float32) for _ in range(2))
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(arguments.rounds):
            for walk_only in (False, True):
                _walk_only(walk_only, originals)
                times[walk_only].append(_median_ms(cupy, q, k, v, arguments.calls))
        _walk_only(False, originals)
        with_rerun, alone = min(times[False]), min(times[True])
        print(f"{name}: with the rerun launch {with_rerun:.4f} ms, walk alone {alone:.4f} ms ({with_rerun / alone - 1:+.1%})")


if __name__ == "__main__":
    main()
