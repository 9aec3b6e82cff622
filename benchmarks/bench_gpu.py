"""GPU benchmark: fastattn's cuda backend against torch SDPA (default and flash backends), G1-G7.

Cases G1-G7 of DESIGN.md §5 in bfloat16, float16 and float32.  Everything runs on torch CUDA
tensors in one process: fastattn through DLPack (zero-copy), torch's default SDPA backend (cuDNN on
Hopper; its "efficient" backend for float32) and its FlashAttention-2 backend
(``torch.nn.attention.sdpa_kernel``, which declines float32).  Timing: CUDA events around each
call, one warm-up, the median of ``--repeats`` calls, the inputs rotated among ``--rotate`` copies
so that no call finds its operands in L2 from the previous one.  Beside that per-call time (which
includes the host's work between the events: Python, argument checks, launches), each row has the
kernel-only time: the device time of every kernel, memset and copy that ``--profile-calls``
back-to-back calls launched, per call, from CUPTI through ``torch.profiler`` (it sees CuPy's kernels
as well as torch's), and the ratios against torch on both.  TFLOP/s use DESIGN.md's FLOP
count (forward+backward: 3.5x the forward).  G1-G6 also time forward+backward in every dtype
(autograd: ``fastattn.torch.attention`` against torch SDPA's default and flash backends; the
half-precision backward is issue #12's).  Decode (G7) reports the K/V bytes read per
second and their fraction of the device copy bandwidth measured in the same run (a CuPy
device-to-device copy of a 1 GiB buffer, CUDA events; bytes read + written per second).

    python benchmarks/bench_gpu.py                      # -> benchmarks/results/h100-<date>.json
    python benchmarks/bench_gpu.py --cases G1 G5 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_cpu import forward_flops, write_report  # benchmarks/ is the script's directory, so on sys.path

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


def kernel_ms(torch: Any, run: Callable[[int], Any], calls: int) -> float:
    """Device time per call of the kernels (and memsets, copies) that ``calls`` calls of ``run(i)``
    launch, from CUPTI activity records (``torch.profiler``), after one warm-up: no host time."""
    from torch.profiler import ProfilerActivity, profile

    run(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        for index in range(calls):
            run(index)
        torch.cuda.synchronize()
    microseconds = sum(
        getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        for event in profiled.key_averages()
    )
    return microseconds / 1000 / calls


def copy_tbytes_per_s(repeats: int, size: int = 1 << 30) -> float:
    """Device copy bandwidth: (read + write bytes) / median time of a CuPy device-to-device copy."""
    import cupy

    source, target = cupy.ones(size, dtype=cupy.uint8), cupy.empty(size, dtype=cupy.uint8)
    target[...] = source
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        target[...] = source
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return 2 * size / statistics.median(times) / 1e9


def training_implementations(torch: Any) -> dict[str, Callable[..., Any]]:
    """Each takes (q, k, v, causal, grad) with q, k, v requiring grad and runs forward+backward
    (the previous call's gradients are dropped first, so none is accumulated into)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fastattn.torch as fastattn_torch

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fastattn_cuda(q, k, v, causal, grad):
        q.grad = k.grad = v.grad = None
        fastattn_torch.attention(q, k, v, causal=causal, backend="cuda").backward(grad)

    def torch_default(q, k, v, causal, grad):
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]).backward(grad)

    def torch_flash(q, k, v, causal, grad):  # declines float32: recorded as such
        q.grad = k.grad = v.grad = None
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]).backward(grad)

    return {"fastattn cuda": fastattn_cuda, "torch default": torch_default, "torch flash": torch_flash}


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


def run_case(
    torch: Any, name: str, dtype: str, repeats: int, rotate: int, training: bool = False, profile_calls: int = 10
) -> list[dict[str, Any]]:
    """Time every implementation on one case; ``training`` times forward+backward instead."""
    batch, heads_q, heads_kv, seq_q, seq_k, dim, causal = CASES[name]
    element = getattr(torch, dtype)
    copies = [
        tuple(
            torch.randn(shape, device="cuda", dtype=element, requires_grad=training)
            for shape in ((batch, heads_q, seq_q, dim), (batch, heads_kv, seq_k, dim), (batch, heads_kv, seq_k, dim))
        )
        for _ in range(rotate)
    ]
    grads = [torch.randn_like(q) for q, _, _ in copies] if training else []
    flops = forward_flops(batch, heads_q, seq_q, seq_k, dim, causal) * (3.5 if training else 1.0)
    kv_bytes = 2 * batch * heads_kv * seq_k * dim * copies[0][0].element_size()
    rows = []
    calls = training_implementations(torch) if training else implementations(torch)
    for label, call in calls.items():
        if training:
            run = lambda i, call=call: call(*copies[i % rotate], causal, grads[i % rotate])  # noqa: E731
        else:
            run = lambda i, call=call: call(*copies[i % rotate], causal)  # noqa: E731
        try:
            milliseconds = median_ms(torch, run, repeats)
            kernel_milliseconds = kernel_ms(torch, run, profile_calls)
        except (RuntimeError, fastattn.UnsupportedError) as error:  # a torch backend that declines
            rows.append({"case": name, "dtype": dtype, "implementation": label, "error": str(error)[:200]})
            continue
        rows.append(
            {
                "case": name,
                "dtype": dtype,
                "implementation": label,
                "median_ms": milliseconds,
                "kernel_ms": kernel_milliseconds,
                "tflops": flops / milliseconds / 1e9,
                "kernel_tflops": flops / kernel_milliseconds / 1e9,
                "kv_tbytes_per_s": kv_bytes / milliseconds / 1e9,
                "kernel_kv_tbytes_per_s": kv_bytes / kernel_milliseconds / 1e9,
            }
        )
        if training:
            rows[-1]["pass"] = "forward+backward"
        print(
            f"  {name} {dtype} {label}{' fwd+bwd' if training else ''}: {milliseconds:.3f} ms per call, "
            f"{kernel_milliseconds:.3f} ms of kernels",
            file=sys.stderr,
            flush=True,
        )
    return rows


def format_decode_table(rows: list[dict[str, Any]], copy_tbytes: float) -> str:
    """G7: K/V GB/s per call and kernel-only, and their fractions of the copy bandwidth measured in
    the same run."""
    header = (
        f"{'case':<4} {'dtype':<9} {'implementation':<14} {'ms':>9} {'K/V GB/s':>9} {'of copy':>8} "
        f"{'kernel ms':>9} {'GB/s':>6} {'of copy':>8}"
    )
    lines = [f"device copy bandwidth: {copy_tbytes * 1000:.0f} GB/s (read + write)", header, "-" * len(header)]
    for row in rows:
        if row["case"] != "G7" or "median_ms" not in row:
            continue
        gbytes, kernel_gbytes = row["kv_tbytes_per_s"] * 1000, row["kernel_kv_tbytes_per_s"] * 1000
        lines.append(
            f"{row['case']:<4} {row['dtype']:<9} {row['implementation']:<14} {row['median_ms']:>9.3f} "
            f"{gbytes:>9.0f} {row['copy_fraction']:>7.0%} {row['kernel_ms']:>9.3f} {kernel_gbytes:>6.0f} "
            f"{row['kernel_copy_fraction']:>7.0%}"
        )
    return "\n".join(lines)


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table with the ratio of each implementation to torch's two backends, per call and
    kernel-only."""
    by_key = {(r["case"], r["dtype"], r["implementation"], r.get("pass")): r for r in rows if "median_ms" in r}
    header = (
        f"{'case':<4} {'dtype':<9} {'implementation':<14} {'ms':>9} {'TFLOP/s':>8} {'vs default':>10} {'vs flash':>9}"
        f" {'kernel ms':>9} {'TFLOP/s':>8} {'vs default':>10} {'vs flash':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        if "median_ms" not in row:
            lines.append(f"{row['case']:<4} {row['dtype']:<9} {row['implementation']:<14} declined: {row['error']}")
            continue
        ratios = []
        for key in ("median_ms", "kernel_ms"):
            for anchor in ("torch default", "torch flash"):
                other = by_key.get((row["case"], row["dtype"], anchor, row.get("pass")))
                ratios.append(other[key] / row[key] if other else math.nan)
        lines.append(
            f"{row['case']:<4} {row['dtype']:<9} {row['implementation']:<14} {row['median_ms']:>9.3f} "
            f"{row['tflops']:>8.1f} {ratios[0]:>9.2f}x {ratios[1]:>8.2f}x {row['kernel_ms']:>9.3f} "
            f"{row['kernel_tflops']:>8.1f} {ratios[2]:>9.2f}x {ratios[3]:>8.2f}x"
            + ("  (forward+backward)" if row.get("pass") else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "float16", "float32"], choices=["bfloat16", "float16", "float32"]
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rotate", type=int, default=4, help="input copies cycled through (defeats L2 reuse)")
    parser.add_argument("--profile-calls", type=int, default=10, help="back-to-back calls profiled for kernel time")
    parser.add_argument("--json", type=Path, help="output path (default benchmarks/results/h100-<date>.json)")
    arguments = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    copy_tbytes = copy_tbytes_per_s(arguments.repeats)
    rows = [
        row
        for dtype in arguments.dtypes
        for name in arguments.cases
        for row in run_case(torch, name, dtype, arguments.repeats, arguments.rotate, False, arguments.profile_calls)
    ]
    rows += [
        row
        for dtype in arguments.dtypes
        for name in arguments.cases
        if name != "G7"
        for row in run_case(torch, name, dtype, arguments.repeats, arguments.rotate, True, arguments.profile_calls)
    ]
    for row in rows:
        if row["case"] == "G7" and "median_ms" in row:
            row["copy_fraction"] = row["kv_tbytes_per_s"] / copy_tbytes
            row["kernel_copy_fraction"] = row["kernel_kv_tbytes_per_s"] / copy_tbytes
    print(format_table(rows))
    print()
    print(format_decode_table(rows, copy_tbytes))
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "repeats": arguments.repeats,
        "rotate": arguments.rotate,
        "profile_calls": arguments.profile_calls,
        "copy_tbytes_per_s": copy_tbytes,
        "rows": rows,
    }
    write_report(report, arguments.json, "h100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
