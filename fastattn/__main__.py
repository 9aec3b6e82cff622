"""``python -m fastattn info | bench``: what this install is, and how fast it runs here.

``info`` prints the version, how the CPU kernels were built (compiler, OpenMP, SIMD width, thread
count), numpy's BLAS, the GPU, and every backend with why it is or is not available.  ``bench``
times fastattn against plain numpy attention and PyTorch (when installed), with each one's largest
error against float64, and optionally writes JSON and a PNG of time against sequence length.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys

import numpy as np

from . import __version__, _bench, _threads, backends

#: Exit status of a command that cannot run as asked (argparse's own for usage errors).
USAGE_ERROR = 2


def _cpu_build_lines() -> list[str]:
    """How the compiled CPU extension was built, or why it is missing."""
    try:
        from ._cpu import _runtime
    except ImportError as error:
        return [f"cpu kernels: not built or not importable ({error})"]
    from ._cpu import isa

    openmp = f"OpenMP {_runtime.openmp_version()}" if _runtime.openmp_enabled() else "no OpenMP (serial kernels)"
    active = next(level for level in isa.levels() if level.name == isa.active())
    built = ", ".join(level.name + ("" if level.runs else " (not on this CPU)") for level in isa.levels())
    return [
        f"cpu kernels: {_runtime.compiler()}, {openmp}",
        f"cpu instruction set: {active.name}, {active.vector_bytes}-byte vectors ({active.vector_bytes // 4} float32 "
        f"lanes); built: {built}; {isa.ENVIRONMENT_VARIABLE} forces a lower level",
        f"threads: {_threads.get_num_threads()} (fastattn.set_num_threads; default from OMP_NUM_THREADS), "
        f"{os.cpu_count()} logical CPUs",
    ]


def _blas_line() -> str:
    """numpy's BLAS library and thread count, through threadpoolctl when it is installed."""
    try:
        threadpoolctl = importlib.import_module("threadpoolctl")
    except ImportError:
        return "numpy BLAS: unknown (pip install threadpoolctl to see it); fastattn's kernels call no BLAS"
    pools = [pool for pool in threadpoolctl.threadpool_info() if pool.get("user_api") == "blas"]
    if not pools:
        return "numpy BLAS: none loaded"
    described = ", ".join(
        " ".join(str(part) for part in (pool.get("internal_api"), pool.get("version")) if part)
        + f" ({pool.get('num_threads')} threads)"
        for pool in pools
    )
    return f"numpy BLAS: {described}; fastattn's kernels call no BLAS"


def _optional_packages_line() -> str:
    """Versions of the optional packages fastattn works with, read from their metadata (no imports)."""
    found = []
    for name in ("torch", "cupy", "matplotlib", "threadpoolctl"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (installed)" if importlib.util.find_spec(name) else f"{name} (not installed)")
    return f"optional packages: {', '.join(found)}"


def _gpu_line() -> str:
    """The CUDA devices CuPy sees, or why there are none."""
    try:
        cupy = importlib.import_module("cupy")
    except ImportError:
        return "GPU: none visible (CuPy is not installed)"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        names = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(count)]
    except Exception as error:  # no driver or a broken one: CuPy raises its own runtime errors
        return f"GPU: none usable ({type(error).__name__}: {error})"
    return f"GPU: {', '.join(names)}" if names else "GPU: none found"


def _info() -> int:
    print(f"fastattn {__version__} on Python {platform.python_version()}, numpy {np.__version__}")
    print(f"machine: {platform.machine()} {platform.system()} {platform.release()}")
    for line in _cpu_build_lines():
        print(line)
    print(_blas_line())
    print(_optional_packages_line())
    print(_gpu_line())
    print("backends:")
    for name, status in backends.available().items():
        print(f"  {name:<10} {status!r}")
    return 0


def _fail(message: str) -> int:
    print(f"python -m fastattn bench: {message}", file=sys.stderr)
    return USAGE_ERROR


def _check_output_path(option: str, path: str | None) -> str | None:
    """Return why ``path`` cannot be written, before any timing starts; None when it can."""
    if path is None:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"{option}: expected a file path in an existing directory, received {path!r}"
    return None


def _bench_command(quick: bool, device: str, json_path: str | None, plot_path: str | None) -> int:
    if device == "cuda":
        status = backends.available().get("cuda")
        if status is None or not status.available:
            reason = status.detail if status is not None else "no backend named 'cuda' is registered"
            return _fail(
                f"--device cuda needs the cuda backend, which is unavailable here: {reason}\n"
                "(python -m fastattn info lists every backend and why)"
            )
    for option, path in (("--json", json_path), ("--plot", plot_path)):
        problem = _check_output_path(option, path)
        if problem:
            return _fail(problem)
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        return _fail("--plot needs matplotlib, which is not installed: pip install 'fastattn[plot]'")
    cases = _bench.QUICK_CASES if quick else _bench.FULL_CASES
    sweep = _bench.QUICK_SWEEP if quick else _bench.FULL_SWEEP
    rows = _bench.run_cases(cases + sweep, repeats=5 if quick else 7, device=device)
    print(_bench.format_table(rows, cases + sweep))
    if json_path is not None:
        _bench.write_json(rows, json_path, cases, sweep, device)
        print(f"wrote {json_path}")
    if plot_path is not None:
        _bench.write_plot(rows, sweep, plot_path, device)
        print(f"wrote {plot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m fastattn``.

    Parameters
    ----------
    argv : list of str, optional
        The arguments after ``python -m fastattn``; ``sys.argv[1:]`` when None.

    Returns
    -------
    int
        The exit status: 0 on success, 2 for a command that cannot run as asked.
    """
    parser = argparse.ArgumentParser(
        prog="python -m fastattn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="version, build and backends with why each is (un)available")
    bench = commands.add_parser("bench", help="time fastattn against numpy and torch attention")
    bench.add_argument("--quick", action="store_true", help="small cases, fewer repeats (under a minute)")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the inputs live")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="also draw time against sequence length as a PNG (matplotlib)")
    arguments = parser.parse_args(argv)
    if arguments.command == "info":
        return _info()
    return _bench_command(arguments.quick, arguments.device, arguments.json, arguments.plot)


if __name__ == "__main__":
    sys.exit(main())
