"""Compile every template instance the cuda backend can run with NVRTC, in parallel, on a GPU machine.

Each instance of the kernel table (``fastattn._gpu.ops.OPS``) is compiled by the same call the
backend makes (``_launch._device_kernel``), so CuPy's on-disk kernel cache then holds every kernel
and the tests that follow compile nothing.  Prints one line per instance (compile seconds, registers,
local memory = spills, static shared memory) and writes them as JSON; exits 1 when any instance fails
to compile or load, naming it and NVRTC's log.  Needs a CUDA device (``gpu_check.sh compile``).

    python benchmarks/gpu_compile_all.py --json benchmarks/results/gpu-compile.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def compile_one(source: str, name: str) -> dict[str, Any]:
    """Compile and load one instance; its attributes, or the error NVRTC or the driver gave."""
    from fastattn._gpu import _launch

    start = time.perf_counter()
    row: dict[str, Any] = {"source": source, "name": name}
    try:
        function = _launch._device_kernel(source, name, 0)
        attributes = function.attributes
        row.update(
            registers=attributes.get("num_regs"),
            local_bytes=attributes.get("local_size_bytes"),
            static_shared_bytes=attributes.get("shared_size_bytes"),
            max_threads_per_block=attributes.get("max_threads_per_block"),
        )
    except Exception as error:  # any failure is reported with the instance's name, not raised
        row["error"] = f"{type(error).__name__}: {error}"
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="where to write the rows")
    arguments = parser.parse_args(argv)

    from fastattn._gpu.ops import OPS

    work = list(dict.fromkeys((op.source, name) for op in OPS for name in op.all_instances()))
    print(f"{len(work)} instances on {arguments.workers} workers", flush=True)
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")  # no CUDA state crosses a fork
    with ProcessPoolExecutor(arguments.workers, mp_context=context) as pool:
        rows = list(pool.map(compile_one, *zip(*work)))
    failed = [row for row in rows if "error" in row]
    for row in rows:
        if "error" in row:
            print(f"FAILED {row['source']} {row['name']}: {row['error']}", flush=True)
        else:
            print(
                f"{row['seconds']:6.1f} s  regs {row['registers']:3}  local {row['local_bytes']:4}  "
                f"smem {row['static_shared_bytes']:6}  {row['name']}",
                flush=True,
            )
    spilled = [row for row in rows if row.get("local_bytes")]
    print(f"{len(rows) - len(failed)} compiled, {len(failed)} failed, {len(spilled)} with local memory, "
          f"{time.perf_counter() - start:.0f} s wall")
    if arguments.json:
        arguments.json.parent.mkdir(parents=True, exist_ok=True)
        arguments.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
