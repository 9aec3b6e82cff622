"""A/B test of two versions of the CPU kernels' headers, without rebuilding the package.

Compiles ``kernel_ab.cpp`` against the kernel headers of two source trees (``fastattn/_cpu`` of
each, e.g. this checkout and a ``git worktree`` of another commit) at one instruction-set level, then
runs the two programs alternately, ``--rounds`` times, and reports each one's median and the paired
median of A's figure over B's (a noisy host slows a whole round: pairs cancel that).  A change to a
header compiles here in about 30 seconds, where ``setup.py build_ext`` rebuilds every level in
minutes; claims of speed still come from ``bench_cpu.py`` on built packages.

    git worktree add /tmp/before HEAD~1
    python benchmarks/kernel_ab.py /tmp/before . decode bfloat16 stream 5 --rounds 10
    python benchmarks/kernel_ab.py /tmp/before . forward 4 512 128 0 9 --level avx2
    python benchmarks/kernel_ab.py /tmp/before . forward 8 1024 64 1 11 float 2 bfloat16   # C2's shape, masked
    python benchmarks/kernel_ab.py /tmp/before . forward 32 2048 128 1 5 float 2 bfloat16 4   # C5's (GQA 4)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: The compiler flags of each level, as setup.py builds its kernel objects (``_X86_LEVELS``).
_AVX2_FLAGS = ["-march=x86-64", "-mtune=generic", "-mavx2", "-mfma", "-mf16c"]
_AVX512_FLAGS = [*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
LEVEL_FLAGS = {
    "generic": ["-march=x86-64", "-mtune=generic"],
    "avx2": _AVX2_FLAGS,
    "avx512": _AVX512_FLAGS,
    "avx512bf16": [*_AVX512_FLAGS, "-mavx512bf16"],
    "amx": [*_AVX512_FLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"],
}


def build(tree: Path, level: str, output: Path) -> None:
    """Compile kernel_ab.cpp against ``tree``'s kernel headers at ``level`` into ``output``."""
    headers = tree / "fastattn" / "_cpu"
    if not (headers / "forward_items.h").is_file():
        raise SystemExit(f"expected a fastattn source tree with fastattn/_cpu/forward_items.h, got {tree}")
    command = [
        "g++",
        "-O3",
        "-std=gnu++17",
        "-fopenmp",
        *LEVEL_FLAGS[level],
        f"-DFASTATTN_ISA_NAMESPACE=isa_{level}",
        f'-DFASTATTN_ISA_NAME="{level}"',
        f"-I{headers}",
        f"-I{tree / 'fastattn' / '_shared'}",
        str(HERE / "kernel_ab.cpp"),
        "-o",
        str(output),
    ]
    built = subprocess.run(command, capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"building against {tree} failed:\n{built.stderr[-3000:]}")


def figure(program: Path, arguments: list[str]) -> tuple[float, str]:
    """Run one program; its figure (the first number it prints) and its checksum."""
    line = subprocess.run([str(program), *arguments], capture_output=True, text=True, check=True).stdout.split()
    return float(line[0]), line[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path, help="source tree A (the baseline)")
    parser.add_argument("b", type=Path, help="source tree B (the change)")
    parser.add_argument(
        "run",
        nargs="+",
        help="kernel_ab.cpp's arguments: decode DTYPE PLACE REPS [QUERIES], or forward H S D CAUSAL REPS "
        "[MASK [THREADS [DTYPE]]]",
    )
    parser.add_argument("--level", choices=sorted(LEVEL_FLAGS), default="avx512")
    parser.add_argument("--rounds", type=int, default=10)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        programs = {"A": Path(scratch) / "a", "B": Path(scratch) / "b"}
        build(options.a, options.level, programs["A"])
        build(options.b, options.level, programs["B"])
        results: dict[str, list[float]] = {"A": [], "B": []}
        checksums: dict[str, set[str]] = {"A": set(), "B": set()}
        for _ in range(options.rounds):
            for name, program in programs.items():
                value, checksum = figure(program, options.run)
                results[name].append(value)
                checksums[name].add(checksum)
    unit = "ns a key" if options.run[0] == "decode" else "GFLOP/s"
    for name in programs:
        values = results[name]
        print(
            f"{name}: median {statistics.median(values):.3f} {unit} (range {min(values):.3f}-{max(values):.3f}), "
            f"checksum {' '.join(sorted(checksums[name]))}"
        )
    ratios = [a / b for a, b in zip(results["A"], results["B"])]
    wins = sum(r > 1 for r in ratios) if unit == "ns a key" else sum(r < 1 for r in ratios)
    print(f"A / B paired median {statistics.median(ratios):.3f} over {len(ratios)} rounds; B better in {wins}")
    if checksums["A"] != checksums["B"]:
        print("the two trees' outputs differ", file=sys.stderr)


if __name__ == "__main__":
    main()
