"""GPU benchmark: fastattn's cuda backend against torch SDPA (default and flash backends), G1-G7.

Cases G1-G7 of DESIGN.md §5 in bfloat16 and float16.  Everything runs on torch CUDA tensors in one
process: fastattn through DLPack (zero-copy), torch's default SDPA backend (cuDNN on Hopper) and
its FlashAttention-2 backend (``torch.nn.attention.sdpa_kernel``).  Timing: CUDA events around
each call, one warm-up, the median of ``--repeats`` calls, the inputs rotated among ``--rotate``
copies so that no call finds its operands in L2 from the previous one.  TFLOP/s use DESIGN.md's
FLOP count; decode (G7) reports the K/V bytes streamed per second instead.

With ``--backward``, G1-G6 are also timed forward+backward in the same run: one forward and
``torch.autograd.grad`` of q, k and v (fastattn through ``fastattn.torch.attention``), FLOPs 3.5x
the forward's, in a second table.

    python benchmarks/bench_gpu.py                      # -> benchmarks/results/h100-<date>.json
    python benchmarks/bench_gpu.py --cases G1 G5 --dtypes bfloat16
    python benchmarks/bench_gpu.py --backward           # forward, then forward+backward tables
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_cpu import forward_flops  # benchmarks/ is the script's directory, so on sys.path

import fastattn

CASES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "G1": (8, 16, 16, 1024, 1024, 64, False),
    "G2": (8, 16, 16, 1024, 1024, 64, True),
    "G3": (4, 16, 16, 4096, 4096, 64, True),
    "G4": (4, 16, 16, 4096, 4096, 128, False),
    "G5": (4, 16, 16, 4096, 4096, 128, True),
    "G6": (2, 32, 8, 8192, 8192, 128, True),
    "G7": (32, 32, 8, 1, 4096, 128, False),
}
#: Cases timed forward+backward with --backward (G7 is decode: no training step).
BACKWARD_CASES = ("G1", "G2", "G3", "G4", "G5", "G6")
#: DESIGN.md §5: forward+backward costs 3.5x the forward's FLOPs.
BACKWARD_FLOP_FACTOR = 3.5


def median_ms(torch: Any, run: Callable[[int], Any], repeats: int) -> float:
    """Median CUDA-event time of ``run(i)`` over ``repeats`` calls after one warm-up."""
    run(0)
    torch.cuda.synchronize()
    times = []
    for index in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(index)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def implementations(torch: Any) -> dict[str, Callable[..., Any]]:
    """Each takes (q, k, v, causal) torch CUDA tensors and runs one forward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fastattn_cuda(q, k, v, causal):
        return fastattn.attention(q, k, v, causal=causal, backend="cuda")

    def torch_default(q, k, v, causal):
        return sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    def torch_flash(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    return {"fastattn cuda": fastattn_cuda, "torch default": torch_default, "torch flash": torch_flash}


def training_implementations(torch: Any) -> dict[str, Callable[..., Any]]:
    """Each takes (q, k, v, dout, causal), q/k/v requiring grad, and returns (dq, dk, dv)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fastattn.torch as fastattn_torch

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fastattn_cuda(q, k, v, dout, causal):
        out = fastattn_torch.attention(q, k, v, causal=causal, backend="cuda")
        return torch.autograd.grad(out, (q, k, v), dout)

    def torch_default(q, k, v, dout, causal):
        out = sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        return torch.autograd.grad(out, (q, k, v), dout)

    def torch_flash(q, k, v, dout, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
            return torch.autograd.grad(out, (q, k, v), dout)

    return {"fastattn cuda": fastattn_cuda, "torch default": torch_default, "torch flash": torch_flash}


def run_case(
    torch: Any, name: str, dtype: str, repeats: int, rotate: int, direction: str = "forward"
) -> list[dict[str, Any]]:
    """Time every implementation on one case; ``direction`` is "forward" or "forward+backward"."""
    batch, heads_q, heads_kv, seq_q, seq_k, dim, causal = CASES[name]
    element = getattr(torch, dtype)
    training = direction == "forward+backward"
    shapes = [(batch, heads_q, seq_q, dim), (batch, heads_kv, seq_k, dim), (batch, heads_kv, seq_k, dim)]
    if training:
        shapes.append((batch, heads_q, seq_q, dim))  # dout
    copies = [
        tuple(
            torch.randn(shape, device="cuda", dtype=element, requires_grad=training and index < 3)
            for index, shape in enumerate(shapes)
        )
        for _ in range(rotate)
    ]
    flops = forward_flops(batch, heads_q, seq_q, seq_k, dim, causal) * (BACKWARD_FLOP_FACTOR if training else 1)
    kv_bytes = 2 * batch * heads_kv * seq_k * dim * copies[0][0].element_size()
    rows = []
    calls = training_implementations(torch) if training else implementations(torch)
    for label, call in calls.items():
        row = {"case": name, "dtype": dtype, "pass": direction, "implementation": label}
        try:
            milliseconds = median_ms(torch, lambda i, call=call: call(*copies[i % rotate], causal), repeats)
        except (RuntimeError, fastattn.UnsupportedError) as error:  # a torch backend that declines
            rows.append({**row, "error": str(error)[:200]})
            continue
        rows.append(
            {
                **row,
                "median_ms": milliseconds,
                "tflops": flops / milliseconds / 1e9,
                "kv_tbytes_per_s": kv_bytes / milliseconds / 1e9,
            }
        )
        print(f"  {name} {dtype} {direction} {label}: {milliseconds:.3f} ms", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table with the ratio of each implementation to torch's two backends."""
    by_key = {(r["case"], r["dtype"], r["implementation"]): r for r in rows if "median_ms" in r}
    header = f"{'case':<4} {'dtype':<9} {'implementation':<14} {'ms':>9} {'TFLOP/s':>8} {'vs default':>10} {'vs flash':>9}"
    lines = [header, "-" * len(header)]
    for row in rows:
        if "median_ms" not in row:
            lines.append(f"{row['case']:<4} {row['dtype']:<9} {row['implementation']:<14} declined: {row['error']}")
            continue
        ratios = []
        for anchor in ("torch default", "torch flash"):
            other = by_key.get((row["case"], row["dtype"], anchor))
            ratios.append(other["median_ms"] / row["median_ms"] if other else math.nan)
        lines.append(
            f"{row['case']:<4} {row['dtype']:<9} {row['implementation']:<14} {row['median_ms']:>9.3f} "
            f"{row['tflops']:>8.1f} {ratios[0]:>9.2f}x {ratios[1]:>8.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rotate", type=int, default=4, help="input copies cycled through (defeats L2 reuse)")
    parser.add_argument("--json", type=Path, help="output path (default benchmarks/results/h100-<date>.json)")
    parser.add_argument("--backward", action="store_true", help="also time forward+backward on G1-G6")
    arguments = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    rows = [
        row
        for dtype in arguments.dtypes
        for name in arguments.cases
        for row in run_case(torch, name, dtype, arguments.repeats, arguments.rotate)
    ]
    print(format_table(rows))
    if arguments.backward:
        training = [
            row
            for dtype in arguments.dtypes
            for name in arguments.cases
            if name in BACKWARD_CASES
            for row in run_case(torch, name, dtype, arguments.repeats, arguments.rotate, "forward+backward")
        ]
        print(f"\nforward+backward (FLOPs {BACKWARD_FLOP_FACTOR}x the forward's)")
        print(format_table(training))
        rows += training
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "repeats": arguments.repeats,
        "rotate": arguments.rotate,
        "rows": rows,
    }
    path = arguments.json or Path(__file__).parent / "results" / f"h100-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
