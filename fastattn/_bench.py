"""The main job's benchmark: fastattn's backends against plain numpy attention and PyTorch.

Each case is timed as the median of repeated runs after a short pause and one warm-up, on float32
(or, for the ``-bf16`` cases, bfloat16) inputs in the ``(B, H, S, D)`` layout; the error column is
the largest absolute difference from the float64 reference on the same inputs.  fastattn's backends
appear as ``"fastattn <backend>"``; one that declines a case shows its first reason instead of a
time.  Besides the fixed cases, a sweep of causal self-attention over growing sequence lengths (B=1,
H=8, D=64) gives the curve that :func:`write_plot` draws.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from . import __version__, _arrays, _threads, backends, functional

#: Pause before timing each implementation: the previous one's thread pools (OpenBLAS, torch's and
#: OpenMP runtimes) spin for a while after their last parallel region and would steal the cores.
SETTLE_SECONDS = 0.5
#: Name of the plain (materialising, unfused) implementation on each device.
PLAIN = {"cpu": "numpy naive", "cuda": "cupy naive"}
TORCH = "torch sdpa"


@dataclass(frozen=True)
class BenchCase:
    """One benchmark shape (layout bhsd).

    Attributes
    ----------
    name : str
        Label in the table, the JSON and the plot.
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim : int
        ``B, Hq, Hkv, Sq, Sk, D`` (``Dv = D``).
    causal : bool
        Top-left causal mask.
    dtype : str
        The inputs' dtype: ``"float32"`` or ``"bfloat16"``.
    """

    name: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool
    dtype: str = "float32"

    @property
    def flops(self) -> float:
        """``4·B·Hq·Sq·Sk·D``, halved for causal with Sq = Sk (DESIGN.md §5)."""
        total = 4.0 * self.batch * self.heads_q * self.seq_q * self.seq_k * self.head_dim
        return total / 2 if self.causal and self.seq_q == self.seq_k else total

    def describe(self) -> str:
        """Return e.g. ``"B=1 Hq=8 Hkv=8 Sq=256 Sk=256 D=64 causal"``."""
        shape = (
            f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Sq={self.seq_q} Sk={self.seq_k} "
            f"D={self.head_dim}"
        )
        shape = f"{shape} causal" if self.causal else shape
        return shape if self.dtype == "float32" else f"{shape} {self.dtype}"


def sweep(lengths: Sequence[int]) -> tuple[BenchCase, ...]:
    """Return causal self-attention cases ``B=1, H=8, D=64`` at each sequence length."""
    return tuple(BenchCase(f"causal-{n}", 1, 8, 8, n, n, 64, True) for n in lengths)


QUICK_CASES = (
    BenchCase("mha-256", 1, 8, 8, 256, 256, 64, False),
    BenchCase("gqa-512", 1, 16, 4, 512, 512, 64, True),
    BenchCase("decode-2048", 4, 32, 8, 1, 2048, 128, False),
    BenchCase("gqa-512-bf16", 1, 16, 4, 512, 512, 64, True, "bfloat16"),
    BenchCase("decode-bf16", 4, 32, 8, 1, 2048, 128, False, "bfloat16"),
)
QUICK_SWEEP = sweep((128, 256, 512, 1024))
FULL_CASES = QUICK_CASES + (BenchCase("mha-1024", 1, 8, 8, 1024, 1024, 64, False),)
FULL_SWEEP = sweep((128, 256, 512, 1024, 2048, 4096))


@dataclass(frozen=True)
class BenchRow:
    """One measured (or declined) implementation on one case.

    Attributes
    ----------
    case, implementation : str
        The case's name; ``"numpy naive"``, ``"torch sdpa"`` or ``"fastattn <backend>"``.
    median_ms, gflops, max_abs_error : float or None
        None when the implementation declined the case.
    note : str
        Why it declined, or empty.
    """

    case: str
    implementation: str
    median_ms: float | None
    gflops: float | None
    max_abs_error: float | None
    note: str = ""


def numpy_naive_attention(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """Plain attention on numpy or CuPy arrays ``(B, H, S, D)``: materialise the scores, softmax, multiply.

    K and V are repeated over each grouped-query group; ``causal`` is top-left.
    """
    xp = _arrays.namespace(q)
    group = q.shape[1] // k.shape[1]
    k, v = xp.repeat(k, group, axis=1), xp.repeat(v, group, axis=1)
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(q.shape[-1])  # a Python float keeps q's dtype
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        scores = xp.where(xp.tri(seq_q, seq_k, dtype=bool), scores, -xp.inf)
    scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


def peak_rss_kib() -> int:
    """This process's peak resident memory in KiB (Linux's ``VmHWM``).

    Not ``getrusage``'s ``ru_maxrss`` where ``/proc`` has the figure: Linux carries a parent's peak
    across ``exec`` into ``ru_maxrss``, so a probe run in a child of a large process measures nothing.
    """
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def torch_available() -> bool:
    """Return True when PyTorch is installed (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def _array_module(device: str) -> ModuleType:
    return np if device == "cpu" else importlib.import_module("cupy")


def _synchronizer(device: str) -> Callable[[], None]:
    """Return a function that waits for the device's queued work (nothing to wait for on the CPU)."""
    if device == "cpu":
        return lambda: None
    return importlib.import_module("cupy").cuda.Device().synchronize


def _time(run: Callable[[], Any], repeats: int, synchronize: Callable[[], None]) -> tuple[float, Any]:
    """Return the median wall time of ``repeats`` runs after a pause and a warm-up, in ms, and the last result."""
    time.sleep(SETTLE_SECONDS)
    result = run()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times), result


def implementations(device: str) -> list[str]:
    """Return the implementations timed on ``device``: plain, each available backend's name, torch.

    Backends that exist for testing (``for_testing = True``: the SIMT emulator) are not timed.
    """
    names = [
        name
        for name, status in backends.available().items()
        if status.available
        and device in backends.get(name).devices
        and not getattr(backends.get(name), "for_testing", False)
    ]
    return [PLAIN[device], *names] + ([TORCH] if torch_available() else [])


def _torch_runner(device: str, q: Any, k: Any, v: Any, causal: bool) -> Callable[[], Any] | str:
    """Return a closure running torch's SDPA on the same memory, or why it cannot run here."""
    torch = importlib.import_module("torch")
    if device == "cuda" and not torch.cuda.is_available():
        return "this torch build has no CUDA"
    def tensor(x: Any) -> Any:
        if device == "cpu" and _arrays.is_bfloat16(x.dtype):  # numpy exports no bfloat16 DLPack
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(x)

    tq, tk, tv = (tensor(x) for x in (q, k, v))
    gqa = tq.shape[1] != tk.shape[1]

    def run() -> Any:
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=gqa)

    return run


def _runner(
    name: str, device: str, inputs: tuple[Any, Any, Any], causal: bool, reasons: list[str]
) -> Callable[[], Any] | str:
    """Return a closure running implementation ``name`` on ``inputs``, or why it does not run."""
    q, k, v = inputs
    if name == PLAIN[device]:
        if q.dtype != np.float32:
            return f"float32 only ({_arrays.dtype_name(q.dtype)}: numpy and CuPy have no matmul kernels for it)"
        return lambda: numpy_naive_attention(q, k, v, causal)
    if name == TORCH:
        return _torch_runner(device, q, k, v, causal)
    if reasons:
        return f"declined: {reasons[0]}"
    return lambda: functional.attention(q, k, v, causal=causal, backend=name)


def run_cases(
    cases: Sequence[BenchCase], repeats: int, device: str = "cpu", progress: bool = True
) -> list[BenchRow]:
    """Time every implementation on each case.

    Parameters
    ----------
    cases : sequence of BenchCase
        The shapes to time, in order.
    repeats : int
        Timed runs per implementation and case (after one warm-up); the median is reported.
    device : {"cpu", "cuda"}
        Where the inputs live; the caller checks that the device's backend is available.
    progress : bool
        Show a tqdm progress bar on stderr.

    Returns
    -------
    list of BenchRow
        One row per case and implementation, in the order of ``cases`` and :func:`implementations`.
    """
    # Imported when timing starts: benchmarks/bench_cpu.py imports this module for numpy_naive_attention
    # alone, and keeps working in environments installed before tqdm became a dependency.
    from tqdm import tqdm

    xp = _array_module(device)
    synchronize = _synchronizer(device)
    rng = np.random.default_rng(0)
    names = implementations(device)
    rows: list[BenchRow] = []
    bar = tqdm(total=len(cases) * len(names), desc="bench", unit="timing", disable=not progress, file=sys.stderr)
    with bar:
        for case in cases:
            shapes = {
                "q": (case.batch, case.heads_q, case.seq_q, case.head_dim),
                "k": (case.batch, case.heads_kv, case.seq_k, case.head_dim),
                "v": (case.batch, case.heads_kv, case.seq_k, case.head_dim),
            }
            dtype = _arrays.numpy_dtype(case.dtype)
            host = {name: rng.standard_normal(shape, dtype=np.float32).astype(dtype) for name, shape in shapes.items()}
            q, k, v = (xp.asarray(host[name]) for name in ("q", "k", "v"))
            exact = functional.attention(
                *(xp.asarray(host[name], dtype=xp.float64) for name in ("q", "k", "v")),
                causal=case.causal,
                backend="reference",
            )
            reasons = functional.explain(q, k, v, causal=case.causal).reasons
            for name in names:
                label = name if name in (PLAIN[device], TORCH) else f"fastattn {name}"
                bar.set_postfix_str(f"{case.name}: {label}")
                run = _runner(name, device, (q, k, v), case.causal, reasons.get(name, []))
                if isinstance(run, str):
                    rows.append(BenchRow(case.name, label, None, None, None, run))
                else:
                    milliseconds, result = _time(run, repeats, synchronize)
                    native, _ = _arrays.to_native(result, name)
                    error = float(xp.max(xp.abs(native.astype(xp.float64) - exact)))
                    rows.append(BenchRow(case.name, label, milliseconds, case.flops / milliseconds / 1e6, error))
                bar.update()
    return rows


def format_table(rows: Sequence[BenchRow], cases: Sequence[BenchCase]) -> str:
    """Render rows as a fixed-width text table, the cases' shapes above it.

    The ``x numpy`` column is the plain implementation's time divided by the row's (higher is faster).
    """
    lines = [f"{case.name:<13} {case.describe()}" for case in cases] + [""]
    header = (
        f"{'case':<13} {'implementation':<18} {'median ms':>10} {'GFLOP/s':>8} {'x numpy':>8} {'max |err|':>10}  note"
    )
    lines += [header, "-" * len(header)]
    plain_ms = {row.case: row.median_ms for row in rows if row.implementation in PLAIN.values()}
    for row in rows:
        if row.median_ms is None or row.gflops is None or row.max_abs_error is None:
            lines.append(
                f"{row.case:<13} {row.implementation:<18} {'-':>10} {'-':>8} {'-':>8} {'-':>10}  {row.note}"
            )
            continue
        plain = plain_ms.get(row.case)
        speedup = f"{plain / row.median_ms:.2f}" if plain else "-"
        lines.append(
            f"{row.case:<13} {row.implementation:<18} {row.median_ms:>10.2f} {row.gflops:>8.1f} {speedup:>8} "
            f"{row.max_abs_error:>10.2e}  {row.note}"
        )
    return "\n".join(lines)


#: The vector extensions worth naming next to a CPU figure (as /proc/cpuinfo spells them).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and its vector extensions (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model": platform.processor(), "isa": []}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "model": fields.get("model name", ""),
        "family": fields.get("cpu family", ""),
        "isa": [flag for flag in _ISA_FLAGS if flag in flags],
    }


def environment(device: str) -> dict[str, Any]:
    """Return what the results depend on: versions, machine, CPU, thread count, backends."""
    facts: dict[str, Any] = {
        "fastattn": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": f"{platform.machine()} {platform.system()}",
        "cpu": cpu_description(),
        "device": device,
        "threads": _threads.get_num_threads(),
        "backends": {name: repr(status) for name, status in backends.available().items()},
    }
    if torch_available():
        torch = importlib.import_module("torch")
        facts["torch"] = torch.__version__
        facts["torch_threads"] = torch.get_num_threads()
    return facts


def write_json(
    rows: Sequence[BenchRow],
    path: str,
    cases: Sequence[BenchCase],
    sweep_cases: Sequence[BenchCase],
    device: str,
) -> None:
    """Write the environment, the cases' definitions and the rows to ``path``.

    The file holds ``environment``, ``cases`` and ``sweep`` (lists of case definitions) and
    ``rows`` (one object per :class:`BenchRow`).
    """
    document = {
        "environment": environment(device),
        "cases": [asdict(case) for case in cases],
        "sweep": [asdict(case) for case in sweep_cases],
        "rows": [asdict(row) for row in rows],
    }
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)


def write_plot(rows: Sequence[BenchRow], sweep_cases: Sequence[BenchCase], path: str, device: str) -> None:
    """Draw median time against sequence length, one line per implementation, log-log, as a PNG.

    Parameters
    ----------
    rows : sequence of BenchRow
        Results that include the sweep's cases; other rows are ignored.
    sweep_cases : sequence of BenchCase
        The sweep, whose ``seq_q`` is the x axis.
    path : str
        Where to write the PNG.
    device : str
        Named in the title.

    Raises
    ------
    ImportError
        matplotlib is not installed (``pip install 'fastattn[plot]'``).
    """
    from matplotlib.figure import Figure

    lengths = {case.name: case.seq_q for case in sweep_cases}
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row.case in lengths and row.median_ms is not None:
            series.setdefault(row.implementation, []).append((lengths[row.case], row.median_ms))
    figure = Figure(figsize=(7, 5), layout="constrained")
    axes = figure.add_subplot()
    for implementation, points in series.items():
        x, y = zip(*sorted(points))
        axes.plot(x, y, marker="o", label=implementation)
    first = sweep_cases[0]
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xticks(sorted(lengths.values()), [str(n) for n in sorted(lengths.values())])
    axes.set_xlabel("sequence length (Sq = Sk)")
    axes.set_ylabel("median time (ms)")
    axes.set_title(
        f"causal attention forward, float32, {device}: B={first.batch}, H={first.heads_q}, D={first.head_dim}"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)
