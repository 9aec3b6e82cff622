"""compute-sanitizer over a small forward+backward of the cuda backend; writes a summary file.

Runs the workload below once plainly (so that NVRTC's compilations land in CuPy's kernel cache and
the tools see only the kernels), then under ``compute-sanitizer --tool memcheck``, ``racecheck``
(shared-memory hazards) and ``synccheck``, each with ``--error-exitcode 1``, and writes the tools'
summaries and exit codes to ``benchmarks/results/sanitizer-<date>.txt``.

    python benchmarks/sanitize_gpu.py                  # needs CuPy, a device and compute-sanitizer
    python benchmarks/sanitize_gpu.py --workload       # what the tools run (forward + backward)

The workload: float16 and bfloat16, every head_dim, GQA (8 query heads on 2 kv heads), lengths
that are not multiples of any tile, bottom-right causal with key_lengths (one row padded to 0
keys), a bool mask and softcap, in both backward modes (atomic dQ and deterministic).
"""

from __future__ import annotations

import argparse
import datetime
import re
import shutil
import subprocess
import sys
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck")
HEAD_DIMS = (32, 64, 96, 128, 256)


def workload() -> None:
    """One forward and two backwards per (dtype, head_dim), on torch CUDA tensors (DLPack)."""
    import torch

    import fastattn

    generator = torch.Generator(device="cuda").manual_seed(0)
    batch, heads_q, heads_kv, seq_q, seq_k = 2, 8, 2, 77, 131
    for dtype in (torch.float16, torch.bfloat16):
        for head_dim in HEAD_DIMS:

            def randn(*shape, dtype=dtype):
                return torch.randn(shape, device="cuda", dtype=dtype, generator=generator)

            q = randn(batch, heads_q, seq_q, head_dim)
            k, v = randn(batch, heads_kv, seq_k, head_dim), randn(batch, heads_kv, seq_k, head_dim)
            options = {
                "causal": "bottom_right",
                "key_lengths": torch.tensor([seq_k, 0], device="cuda"),
                "mask": torch.rand(batch, 1, seq_q, seq_k, device="cuda", generator=generator) < 0.8,
                "softcap": 30.0,
                "backend": "cuda",
            }
            out, lse = fastattn.attention(q, k, v, return_lse=True, **options)
            dout = randn(*out.shape)
            for deterministic in (False, True):
                fastattn.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
            torch.cuda.synchronize()
            print(f"workload: {dtype} head_dim {head_dim} done", flush=True)


def run_tool(sanitizer: str, tool: str) -> tuple[int, str]:
    """Run the workload under one compute-sanitizer tool; return its exit code and output."""
    command = [
        sanitizer, f"--tool={tool}", "--error-exitcode=1",
        sys.executable, str(Path(__file__).resolve()), "--workload",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


def summary_lines(output: str) -> list[str]:
    """The tool's own summary lines (``ERROR SUMMARY``, ``RACECHECK SUMMARY``...) and error headers."""
    keep = re.compile(r"(SUMMARY|^========= (Invalid|Error|Race|Barrier|Warning))")
    return [line for line in output.splitlines() if keep.search(line)][:40]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="store_true", help="run the workload only (what the tools run)")
    parser.add_argument("--output", type=Path, help="summary path (default benchmarks/results/sanitizer-<date>.txt)")
    parser.add_argument(
        "--sanitizer",
        default=shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer",
        help="compute-sanitizer executable (default: on PATH, else /usr/local/cuda/bin)",
    )
    arguments = parser.parse_args(argv)
    if arguments.workload:
        workload()
        return 0
    if not Path(arguments.sanitizer).is_file():
        print(f"sanitize_gpu: no compute-sanitizer at {arguments.sanitizer} (pass --sanitizer)", file=sys.stderr)
        return 2
    workload()  # compile every kernel outside the tools
    lines = [f"compute-sanitizer on fastattn's cuda forward+backward, {datetime.datetime.now():%Y-%m-%d %H:%M}"]
    worst = 0
    for tool in TOOLS:
        code, output = run_tool(arguments.sanitizer, tool)
        worst = max(worst, code)
        lines += ["", f"## {tool}: exit code {code}", *summary_lines(output)]
        print(f"{tool}: exit code {code}", file=sys.stderr, flush=True)
    path = arguments.output or Path(__file__).parent / "results" / f"sanitizer-{datetime.date.today().isoformat()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return worst


if __name__ == "__main__":
    sys.exit(main())
