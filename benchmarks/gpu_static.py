"""The GPU kernels' instruction budget, read from their SASS without a GPU (issue #21).

For every kernel instance the cuda backend's kernel table can launch (``fastattn/_gpu/ops.py``),
compile it as CI does (nvcc, ``-arch=sm_90`` by default) and report, from ptxas and the SASS
(``cuobjdump -sass``, from the ``nvidia-cuda-cuobjdump`` wheel or the CUDA toolkit):

* registers, spill bytes and stack, dynamic shared memory (the launcher's), resident blocks per SM
  on an H100 (65,536 registers, 2,048 threads, 228 KiB of shared memory, 32 blocks);
* the main loop: the smallest loop of the SASS (a backward branch and its target) that holds
  HMMAs (tensor-core kernels) or, for the SIMT kernels, a block barrier (the tile loop); its static
  instruction count, the loops nested in it (counted once: a static count is then a lower bound on
  a trip), and in it the HMMA, MUFU, LDSM, LDGSTS and branch counts;
* the figure of merit: main-loop instructions per HMMA (tensor-core forward and backward), or per
  16 bytes of K/V (decode: the loop's instructions times the block's warps over the tile's K/V
  bytes / 16).

    python benchmarks/gpu_static.py                      # the table, every instance
    python benchmarks/gpu_static.py --only flash_forward --json benchmarks/results/gpu-static.json
    python benchmarks/gpu_static.py --only flash_forward,flash_decode --check   # exit 1 when a goal below is broken
    python benchmarks/gpu_static.py --only flash_forward,flash_decode --check --cubins DIR   # CI: its compile step's cubins

The goals ``--check`` holds (issue #21): the tensor-core forward's interior loop at <= 6
instructions per HMMA at head_dim 64 and 128 (without softcap or dropout); the decode's at <= 1
instruction per 16 bytes of K/V at every head_dim, tensor cores without softcap and float32 with 4
rows a block (with 8, the FMAs alone are 1 instruction per 16 bytes); no spill in any instance of
either.  The float32 decode's main loop is its lazy tile: the rescaling and exact tiles run outside
it (``flash_decode.cu``), only on the first tile, a row maximum rising past the slack, or a NaN.

Static counts are an upper bound on what a warp issues per loop trip (a branch skips part of the
body), and exact for straight-line bodies, which the compile-time masking of issue #21 makes them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

from fastattn._gpu import _launch, backward, decode, forward, fp32, ops

#: H100 SXM per-SM limits (CUDA occupancy rules).
H100 = {"registers": 65536, "threads": 2048, "shared": 228 * 1024, "blocks": 32, "reserved_shared": 1024}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_PTXAS_FUNCTION = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_STATS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


@dataclass
class KernelStats:
    """One kernel instance's row of the table."""

    kernel: str
    op: str
    threads: int
    registers: int
    spill_bytes: int
    stack_bytes: int
    shared_bytes: int
    blocks_per_sm: int
    instructions: int
    loop_instructions: int
    loop_hmma: int
    loop_mufu: int
    loop_ldsm: int
    loop_ldgsts: int
    loop_branches: int
    inner_loops: int
    per_hmma: float | None
    per_16_bytes: float | None


def cuobjdump() -> str:
    """The cuobjdump to use: on PATH, beside nvcc, or from the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    if nvcc and (Path(nvcc).parent / "cuobjdump").exists():
        return str(Path(nvcc).parent / "cuobjdump")
    try:
        import nvidia  # the wheels' namespace package

        for folder in nvidia.__path__:
            for candidate in Path(folder).glob("*/bin/cuobjdump"):
                return str(candidate)
    except ImportError:
        pass
    raise SystemExit("gpu_static: cuobjdump not found (pip install nvidia-cuda-cuobjdump)")


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> ``fastattn_gpu::flash_forward<__half, 64, 64, false>`` (c++filt, parameters dropped)."""
    filt = shutil.which("c++filt") or shutil.which("cu++filt")
    if filt is None:
        raise SystemExit("gpu_static: c++filt not found (binutils)")
    result = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True, check=True)
    plain = [line.strip() for line in result.stdout.splitlines()]
    return {name: re.sub(r"^void ", "", text).rsplit("(", 1)[0] for name, text in zip(names, plain)}


def compile_source(source: str, arch: str, work: Path, cubins: Path | None = None) -> tuple[Path, str]:
    """nvcc the table's instantiation unit of ``source`` into a cubin; returns it and ptxas' report.

    With ``cubins``, the cubin and report that CI's compile step wrote there with the same flags
    (``<stem>-<arch>.cubin`` and ``<stem>-<arch>.ptxas``) are read instead of compiling again.
    """
    if cubins is not None:
        stem = cubins / f"{source.removesuffix('.cu')}-{arch}"
        return stem.with_suffix(".cubin"), stem.with_suffix(".ptxas").read_text()
    unit = work / source.replace(".cu", "-instances.cu")
    unit.write_text(ops.instantiation_unit(source))
    cubin = unit.with_suffix(".cubin")
    command = [
        "nvcc", f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v",
        "-I", str(_launch.KERNELS), "-I", str(_launch.SHARED), str(unit), "-o", str(cubin),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"gpu_static: nvcc failed on {source}:\n{result.stderr[-3000:]}")
    return cubin, result.stderr


def ptxas_report(text: str) -> dict[str, dict[str, int]]:
    """Mangled name -> registers, spill bytes (stores) and stack bytes, from ``-Xptxas -v``."""
    report: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        function = _PTXAS_FUNCTION.search(line)
        if function:
            current = function.group(1)
            report[current] = {"registers": 0, "spill_bytes": 0, "stack_bytes": 0}
            continue
        if current is None:
            continue
        stats = _PTXAS_STATS.search(line)
        if stats:
            report[current]["stack_bytes"] = int(stats.group(1))
            report[current]["spill_bytes"] = int(stats.group(2))
        registers = _PTXAS_REGISTERS.search(line)
        if registers:
            report[current]["registers"] = int(registers.group(1))
    return report


def sass_functions(cubin: Path) -> dict[str, list[tuple[int, str, str]]]:
    """Mangled name -> its instructions as (address, opcode, operands)."""
    tool = cuobjdump()
    # cuobjdump runs nvdisasm: the wheels put both in one folder, which may not be on PATH.
    environment = {**os.environ, "PATH": f"{Path(tool).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise SystemExit(f"gpu_static: cuobjdump failed on {cubin.name}:\n{result.stderr[-2000:]}")
    text = result.stdout
    functions: dict[str, list[tuple[int, str, str]]] = {}
    current: list[tuple[int, str, str]] | None = None
    for line in text.splitlines():
        header = re.search(r"Function : (\S+)", line)
        if header:
            current = functions.setdefault(header.group(1), [])
            continue
        instruction = _INSTRUCTION.search(line)
        if instruction and current is not None:
            current.append((int(instruction.group(1), 16), instruction.group(3), instruction.group(4)))
    return functions


def loops(instructions: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """Every loop as (first, last) instruction indices: a branch back to an earlier address."""
    found = []
    for index, (address, opcode, operands) in enumerate(instructions):
        if opcode.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", operands)
            if target and int(target.group(1), 16) <= address:
                start = next(i for i, (a, _, _) in enumerate(instructions) if a >= int(target.group(1), 16))
                found.append((start, index))
    return found


def main_loop(instructions: list[tuple[int, str, str]], tensor_cores: bool) -> tuple[list[tuple[int, str, str]], int]:
    """The main loop's instructions and how many loops it holds.

    Tensor-core kernels: the smallest loop with an HMMA (with masking specialised at compile time,
    the interior-tile loop).  SIMT kernels: the smallest loop with a block barrier (the tile loop;
    its inner loops are counted once, so its count is a lower bound on a trip's instructions).
    """
    every = loops(instructions)
    wanted = ("HMMA",) if tensor_cores else ("BAR.SYNC", "BAR.SYNC.DEFER_BLOCKING")
    holding = [(a, b) for a, b in every if any(op.startswith(wanted) for _, op, _ in instructions[a : b + 1])]
    if not holding:
        return [], 0
    first, last = min(holding, key=lambda span: span[1] - span[0])
    inner = sum(1 for a, b in every if first <= a and b < last)
    return instructions[first : last + 1], inner


def shared_bytes_of(kernel: str) -> int:
    """The launcher's dynamic shared memory for one instance (0 for the helper kernels)."""
    arguments = [part.strip() for part in kernel[kernel.index("<") + 1 : -1].split(",")] if "<" in kernel else []
    name = kernel.split("::")[1].split("<")[0]
    if name == "flash_forward":
        return forward.shared_bytes(int(arguments[1]))
    if name == "flash_backward_kv":
        return backward.kv_shared_bytes(int(arguments[1]))
    if name == "flash_backward_dq":
        return backward.dq_shared_bytes(int(arguments[1]))
    if name == "flash_decode":
        dtype = {"__half": "float16", "__nv_bfloat16": "bfloat16"}[arguments[0]]
        return decode.shared_bytes(dtype, int(arguments[1]), decode.TENSOR_CORE_ROWS)
    if name == "flash_decode_fp32":
        return decode.shared_bytes("float32", int(arguments[0]), int(arguments[1]))
    if name == "fp32_forward":
        return fp32.forward_shared_bytes(int(arguments[0]))
    if name == "fp32_backward_kv":
        return fp32.kv_shared_bytes(int(arguments[0]))
    if name == "fp32_backward_q":
        return fp32.q_shared_bytes(int(arguments[0]))
    return 0


def threads_of(kernel: str) -> int:
    """Threads per block of an instance, as its launcher launches it."""
    name = kernel.split("::")[1].split("<")[0]
    return {
        "flash_forward": forward.WARPS * 32,
        "flash_backward_kv": backward.KV_WARPS * 32,
        "flash_backward_dq": backward.DQ_WARPS * 32,
        "flash_backward_prepare": backward.PREPARE_THREADS,
        "flash_backward_dq_convert": backward.CONVERT_THREADS,
        "flash_decode": decode.THREADS,
        "flash_decode_fp32": decode.THREADS,
        "decode_combine": decode.THREADS,
    }.get(name, fp32.THREADS)


def blocks_per_sm(registers: int, threads: int, shared: int) -> int:
    """Resident blocks per H100 SM (registers allocated per warp in units of 256)."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    by_registers = H100["registers"] // (per_warp * warps)
    by_threads = H100["threads"] // threads
    by_shared = H100["shared"] // (shared + H100["reserved_shared"]) if shared else H100["blocks"]
    return min(by_registers, by_threads, by_shared, H100["blocks"])


def decode_tile_bytes(kernel: str) -> int:
    """K and V bytes of one tile of a decode instance."""
    arguments = [part.strip() for part in kernel[kernel.index("<") + 1 : -1].split(",")]
    if kernel.split("::")[1].startswith("flash_decode_fp32"):
        head_dim, rows = int(arguments[0]), int(arguments[1])
        return 2 * decode.block_keys("float32", head_dim, rows) * head_dim * 4
    head_dim = int(arguments[1])
    return 2 * decode.block_keys("float16", head_dim, decode.TENSOR_CORE_ROWS) * head_dim * 2


def analyse(arch: str, only: set[str] | None, cubins: Path | None = None) -> list[KernelStats]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        wanted = [op for op in ops.OPS if only is None or op.name in only or any(name in only for name in
                  {instance.split("::")[1].split("<")[0] for instance in op.all_instances()})]
        for source in sorted({op.source for op in wanted}):
            cubin, report = compile_source(source, arch, Path(folder), cubins)
            ptxas = ptxas_report(report)
            functions = sass_functions(cubin)
            names = demangle(list(functions))
            op_of = {name: op.name for op in ops.OPS for name in op.all_instances()}
            for mangled, instructions in functions.items():
                kernel = names[mangled]
                family = kernel.split("::")[1].split("<")[0]
                if only and family not in only and op_of.get(kernel) not in only:
                    continue
                tensor_cores = any(op.startswith("HMMA") for _, op, _ in instructions)
                loop, inner_loops = main_loop(instructions, tensor_cores)
                count = {p: sum(op.startswith(p) for _, op, _ in loop) for p in ("HMMA", "MUFU", "LDSM", "LDGSTS")}
                branches = sum(op.startswith(("BRA", "BRX", "JMX")) for _, op, _ in loop)
                stats = ptxas.get(mangled, {"registers": 0, "spill_bytes": 0, "stack_bytes": 0})
                threads = threads_of(kernel)
                shared = shared_bytes_of(kernel)
                per_16 = None
                if family in ("flash_decode", "flash_decode_fp32") and loop:
                    per_16 = len(loop) * (threads // 32) / (decode_tile_bytes(kernel) / 16)
                rows.append(
                    KernelStats(
                        kernel=kernel, op=op_of.get(kernel, "?"), threads=threads, registers=stats["registers"],
                        spill_bytes=stats["spill_bytes"], stack_bytes=stats["stack_bytes"], shared_bytes=shared,
                        blocks_per_sm=blocks_per_sm(stats["registers"], threads, shared),
                        instructions=len(instructions), loop_instructions=len(loop), loop_hmma=count["HMMA"],
                        loop_mufu=count["MUFU"], loop_ldsm=count["LDSM"], loop_ldgsts=count["LDGSTS"],
                        loop_branches=branches, inner_loops=inner_loops,
                        per_hmma=round(len(loop) / count["HMMA"], 2) if count["HMMA"] else None,
                        per_16_bytes=round(per_16, 3) if per_16 is not None else None,
                    )
                )  # fmt: skip
    return sorted(rows, key=lambda row: row.kernel)


def print_table(rows: list[KernelStats]) -> None:
    header = (
        f"{'kernel':62s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'blk/SM':>6s} {'insts':>6s} {'loop':>6s} "
        f"{'HMMA':>4s} {'MUFU':>4s} {'LDSM':>4s} {'LDGSTS':>6s} {'BRA':>4s} {'inner':>5s} {'/HMMA':>6s} {'/16B':>6s}"
    )
    print(header)
    for row in rows:
        per_hmma = f"{row.per_hmma:6.2f}" if row.per_hmma is not None else "     -"
        per_16 = f"{row.per_16_bytes:6.2f}" if row.per_16_bytes is not None else "     -"
        print(
            f"{row.kernel[14:76]:62s} {row.registers:4d} {row.spill_bytes:5d} {row.shared_bytes:6d} "
            f"{row.blocks_per_sm:6d} {row.instructions:6d} {row.loop_instructions:6d} {row.loop_hmma:4d} "
            f"{row.loop_mufu:4d} {row.loop_ldsm:4d} {row.loop_ldgsts:6d} {row.loop_branches:4d} {row.inner_loops:5d} "
            f"{per_hmma} {per_16}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--only", default="", help="comma-separated kernel or op names (default: all)")
    parser.add_argument("--json", type=Path, help="write the rows and the toolchain here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal of the module docstring fails")
    parser.add_argument(
        "--cubins", type=Path, help="read <source>-<arch>.cubin and .ptxas from here (CI's compile step) instead of compiling"
    )
    args = parser.parse_args()
    if shutil.which("nvcc") is None:
        print("gpu_static: nvcc not found: nothing to analyse")
        return 0
    only = {name for name in args.only.split(",") if name} or None
    rows = analyse(args.arch, only, args.cubins)
    print_table(rows)
    if args.json:
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        document = {
            "date": date.today().isoformat(), "arch": args.arch, "nvcc": nvcc, "host": platform.node(),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "rows": [asdict(row) for row in rows],
        }  # fmt: skip
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    if args.check:
        broken = goals_broken(rows)
        print("\n".join(["gpu_static: goals broken:", *broken]) if broken else "gpu_static: goals hold")
        return 1 if broken else 0
    return 0


def goals_broken(rows: list[KernelStats]) -> list[str]:
    """The rows that break a goal ``--check`` holds, as lines."""
    broken = []
    for row in rows:
        family = row.kernel.split("::")[1].split("<")[0]
        if family not in ("flash_forward", "flash_decode", "flash_decode_fp32"):
            continue
        if row.spill_bytes:
            broken.append(f"{row.kernel}: spills {row.spill_bytes} bytes")
        if family == "flash_decode_fp32":
            # 4 rows a block; at 8 the FMAs alone are 1 instruction per 16 bytes.  The RERUN
            # instances run only for blocks whose outputs came out non-finite.
            if row.kernel.endswith(", 4, false>") and (row.per_16_bytes is None or row.per_16_bytes > 1):
                broken.append(f"{row.kernel}: {row.per_16_bytes} instructions per 16 bytes of K/V (goal <= 1)")
            continue
        head_dim = int(row.kernel.split(",")[1])
        if family == "flash_forward":
            plain = row.kernel.endswith("false, false>")
            if plain and head_dim in (64, 128) and (row.per_hmma is None or row.per_hmma > 6):
                broken.append(f"{row.kernel}: {row.per_hmma} instructions per HMMA in its interior loop (goal <= 6)")
        elif row.kernel.endswith("false>") and (row.per_16_bytes is None or row.per_16_bytes > 1):
            broken.append(f"{row.kernel}: {row.per_16_bytes} instructions per 16 bytes of K/V (goal <= 1)")
    return broken


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
