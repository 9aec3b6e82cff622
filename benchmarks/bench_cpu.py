"""CPU benchmark: fastattn's cpu backend against torch SDPA and numpy, cases C1-C6 of DESIGN.md §5.

Every implementation runs in the same process on the same inputs, interleaved: after one warm-up
each, ``--repeats`` rounds time every implementation in turn (after a pause, untimed calls for
``--warmup-ms``, then the mean of back-to-back calls over ``--timed-ms``), and each quotes its median
(a noisy neighbour then slows all of them alike).  A float32 case that is not a decode also times
the sgemm in its rounds, and its "of sgemm" is against that one; a decode, two streaming reads of its
bytes, and its "of read" is against the faster, and a third read that also does the FMAs the
decode's FLOPs need ("read + its FMAs": what a one-pass kernel could reach on a core that overlaps
arithmetic and memory only in part; "of read+FMAs" in the summary).  The same run measures the
machine's ceilings: the best sgemm (numpy's under this environment's OpenBLAS, numpy's again in a
child process without ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` when either is set, torch's), and,
through ``machine_ceilings.c`` compiled with ``-march=native``, the float32 FMA peak of a
register-only loop and the DRAM read bandwidth, all on the same threads.  Each row shows its ratio to torch and to
those ceilings; the JSON names the CPU (model, family, ISA flags) and the kernels' level.
``--dtype bfloat16`` (or ``float16``) times the same cases in that dtype, against torch's SDPA in
it, with torch's gemm in that dtype as the gemm ceiling, or sgemm where that is faster (numpy naive
runs float32 only), and fastattn on the same inputs in float32 in the same rounds ("fastattn cpu
float32"; the ratio "vs float32" is float32's time over the dtype's); its decodes also stream their
bytes in the dtype, converting each vector to float32 and doing the FMAs ("read + convert + FMAs":
what a kernel that converts each element once could reach; "of read+convert+FMAs").
``--masks`` times masked variants of the cases (see ``MASKS``): each interleaves the masked call with
the same call unmasked and with torch's SDPA under the same mask (causal folded into it, as torch
takes no mask together with ``is_causal``), and reports the masked / unmasked time.
``--memory`` adds the (1, 8, 32768, 32768, 128) causal forward (and forward+backward) and reports
peak RSS beyond inputs, outputs and gradients, measured in a subprocess.

    python benchmarks/bench_cpu.py                 # table + benchmarks/results/cpu-<date>.json
    python benchmarks/bench_cpu.py --cases C1 C6 --repeats 7
    python benchmarks/bench_cpu.py --impls fastattn --passes forward   # one implementation only
    python benchmarks/bench_cpu.py --dtype bfloat16 --passes forward   # against torch's bf16 SDPA and gemm
    python benchmarks/bench_cpu.py --cases C1 C2 --masks bool-keys float-full   # what masks cost
    python benchmarks/bench_cpu.py --cases C6 --passes forward --layouts bhsd bshd kv-cache   # memory orders
    python benchmarks/bench_cpu.py --cases C6 C6q4 C6q16 C6mha64 --passes forward --dtype float16   # decodes
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

import fastattn
from fastattn._bench import numpy_naive_attention
from fastattn.nn import KVCache

#: The input dtypes a run may time (``--dtype``); numpy naive runs float32 only.
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

CASES: dict[str, tuple[int, int, int, int, int, int, bool]] = {
    "C1": (1, 8, 8, 1024, 1024, 64, False),
    "C2": (1, 8, 8, 1024, 1024, 64, True),
    "C3": (1, 16, 16, 2048, 2048, 64, True),
    "C4": (1, 8, 8, 4096, 4096, 128, True),
    "C5": (1, 32, 8, 2048, 2048, 128, True),
    "C6": (8, 32, 8, 1, 4096, 128, False),
    # Decodes of several query positions (speculative decoding's draft tokens, issue #23's Sq <= 16)
    # over C6's cache: 4 and 16 positions x GQA 4 = 16 and 64 rows a kv head.  Not causal: the drafts'
    # causal edge hides a few of 4096 keys, and torch's SDPA has no bottom-right causal flag.
    "C6q4": (8, 32, 8, 4, 4096, 128, False),
    "C6q16": (8, 32, 8, 16, 4096, 128, False),
    # A multi-head (no GQA) decode of head size 64, as GPT-2-sized models run: one row a kv head.
    "C6mha64": (8, 32, 32, 1, 2048, 64, False),
}
#: The cases a run times unless ``--cases`` names others: DESIGN.md §5's C1-C6.
DEFAULT_CASES = ["C1", "C2", "C3", "C4", "C5", "C6"]

#: How the inputs lie in memory (``--layouts``); every implementation indexes them (B, H, S, D), and
#: fastattn is called with ``layout="bshd"`` on the (B, S, H, D) views where that is the memory's order:
#: ``bhsd`` (numpy arrays as drawn), ``bshd`` (token-major: what a layer's projections give), and
#: ``kv-cache`` (K and V held in a full ``fastattn.nn.KVCache``, Q and dO token-major: the layer's decode).
LAYOUTS = ("bhsd", "bshd", "kv-cache")

#: Cases with at most this many query positions are decodes (issue #23): their rounds also time a
#: streaming read of their K and V's size.
DECODE_ROWS = 16

#: Mask variants (``--masks``), each random in its own way (``make_mask``); "none" is the plain case.
MASKS = {
    "none": "no mask",
    "bool-keys": "bool (B,1,1,Sk), ~10% of keys hidden at random positions",
    "bool-full": "bool (B,Hq,Sq,Sk), ~10% of entries hidden at random positions",
    "float-keys": "additive float (B,1,1,Sk) in the inputs' dtype, random values",
    "float-full": "additive float (B,Hq,Sq,Sk) in the inputs' dtype, random values",
    "prefix-keys": "bool (B,1,1,Sk) that is a key prefix per batch row (~90% of keys): run as key_lengths",
}


def make_mask(kind: str, batch: int, heads_q: int, seq_q: int, seq_k: int, dtype: Any, seed: int = 2) -> np.ndarray | None:
    """The ``kind`` of ``MASKS`` for a (batch, heads_q, seq_q, seq_k) problem, or None for "none"."""
    rng = np.random.default_rng(seed)
    full = (batch, heads_q, seq_q, seq_k)
    keys = (batch, 1, 1, seq_k)
    if kind == "none":
        return None
    if kind in ("bool-keys", "bool-full"):
        return rng.random(keys if kind == "bool-keys" else full) >= 0.1
    if kind in ("float-keys", "float-full"):
        return rng.standard_normal(keys if kind == "float-keys" else full, dtype=np.float32).astype(dtype)
    if kind == "prefix-keys":
        lengths = rng.integers(int(0.85 * seq_k), int(0.95 * seq_k) + 1, size=batch)
        return (np.arange(seq_k) < lengths[:, None]).reshape(keys)
    raise ValueError(f"mask kind must be one of {sorted(MASKS)}, got {kind!r}")


def causal_folded(mask: np.ndarray, seq_q: int, seq_k: int) -> np.ndarray:
    """``mask`` with top-left causal hiding folded in (what torch's SDPA needs: it takes no mask
    together with ``is_causal``)."""
    below = np.tril(np.ones((seq_q, seq_k), dtype=bool))
    if mask.dtype == bool:
        return np.ascontiguousarray(mask & below)
    return np.ascontiguousarray(np.where(below, mask, np.array(-np.inf, dtype=mask.dtype)))


def forward_flops(batch: int, heads_q: int, seq_q: int, seq_k: int, dim: int, causal: bool) -> float:
    """``4·B·Hq·Sq·Sk·D``, halved for causal with Sq = Sk (DESIGN.md §5)."""
    flops = 4.0 * batch * heads_q * seq_q * seq_k * dim
    return flops / 2 if causal and seq_q == seq_k else flops


def settle() -> None:
    """Let the previous implementation's thread pools go idle.

    OpenBLAS, torch's and our OpenMP runtimes spin for a while after their last parallel region,
    and would otherwise steal the cores from the one timed next.
    """
    time.sleep(0.3)


#: Untimed runs after each pause (``--warmups``).  One by default; on a small VM the calls just after
#: a pause can stay slow for longer (the idle vCPU's wake-up: measured 5.6 ms instead of 1.3 ms for
#: the first two bfloat16 C2 forwards after a pause on the 2-core Xeon, for torch's SDPA alike), so
#: a larger count measures the steady state of back-to-back calls.
WARMUPS = 1
#: ... and untimed runs go on until this many seconds have passed (``--warmup-ms``): the slow spell
#: after a pause is a matter of time, not of calls, so a count alone left short calls in it.  On the
#: 2-core Xeon model 207, C2's forward (4-5 ms) after 1, 4 and 10 untimed runs: 5.78, 5.61 and
#: 4.57 ms (median of 5 rounds each), the 58 ms sgemm of the same rounds 65, 58 and 58 ms.
WARMUP_SECONDS = 0.1
#: A round's time of an implementation is the mean of back-to-back calls over at least this many
#: seconds (``--timed-ms``; one call where a call takes longer): a single call of a few milliseconds
#: took whatever the host gave it in that instant (C2's forward: 4.4-5.9 ms over 9 rounds).
TIMED_SECONDS = 0.05


def timed(run: Callable[[], Any]) -> float:
    """Seconds a run takes, after the pools of whatever ran before went idle: the mean of the calls
    made back to back in ``TIMED_SECONDS``.

    Untimed runs (``WARMUPS``, and more until ``WARMUP_SECONDS`` have passed) come first: after
    the pause the cores' clocks and the OpenMP team are asleep, and waking them would be charged to
    whichever implementation runs first.
    """
    settle()
    warm_until = time.perf_counter() + WARMUP_SECONDS
    for _ in range(WARMUPS):
        run()
    while time.perf_counter() < warm_until:
        run()
    start = time.perf_counter()
    calls = 0
    while True:
        run()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= TIMED_SECONDS:
            return elapsed / calls


def median_seconds(run: Callable[[], Any], repeats: int) -> float:
    """Median of ``repeats`` timed runs after one warm-up (for one implementation alone)."""
    run()
    return statistics.median(timed(run) for _ in range(repeats))


def interleaved_medians(runs: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each run: one warm-up each, then ``repeats`` rounds running each once in turn."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(repeats):
        for label, run in runs.items():
            times[label].append(timed(run))
            print(f"    {label}: {1e3 * times[label][-1]:.2f} ms", file=sys.stderr, flush=True)
    return {label: statistics.median(values) for label, values in times.items()}


SGEMM_SIZE = 2048


def sgemm_gflops(repeats: int) -> float:
    """numpy's float32 matmul of two 2048 x 2048 matrices, in this process."""
    a = np.random.default_rng(0).standard_normal((SGEMM_SIZE, SGEMM_SIZE), dtype=np.float32)
    return 2 * SGEMM_SIZE**3 / median_seconds(lambda: a @ a, repeats) / 1e9


_SGEMM_CHILD = (
    "import sys; sys.path.insert(0, sys.argv[1]); import bench_cpu; print(bench_cpu.sgemm_gflops(int(sys.argv[2])))"
)
OPENBLAS_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def torch_tensor(torch: Any, array: np.ndarray) -> Any:
    """A torch tensor sharing ``array``'s memory (bfloat16 through an int16 view: torch.from_numpy
    does not know ml_dtypes)."""
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def ceilings(torch: Any, repeats: int, threads: int, dtype: str = "float32") -> dict[str, float]:
    """The machine's ceilings, measured now: sgemm three ways, FMA peak and read bandwidth (GFLOP/s,
    GB/s); for a half-precision ``dtype`` also torch's gemm in it.  ``gemm`` is the dtype's best."""
    found = {"sgemm numpy": sgemm_gflops(repeats)}
    if any(name in os.environ for name in OPENBLAS_VARIABLES):
        clean = {key: value for key, value in os.environ.items() if key not in OPENBLAS_VARIABLES}
        child = subprocess.run(
            [sys.executable, "-c", _SGEMM_CHILD, str(Path(__file__).parent), str(repeats)],
            env=clean, capture_output=True, text=True, check=True,
        )
        found["sgemm numpy without OPENBLAS_* settings"] = float(child.stdout.strip().splitlines()[-1])
    if torch is not None:
        a = torch.randn(SGEMM_SIZE, SGEMM_SIZE)
        found["sgemm torch"] = 2 * SGEMM_SIZE**3 / median_seconds(lambda: torch.mm(a, a), repeats) / 1e9
    native = _machine_ceilings()
    if native is not None:
        native.fma_peak_gflops(10**6, threads)
        found["fma peak"] = statistics.median(native.fma_peak_gflops(2 * 10**7, threads) for _ in range(repeats))
        buffer = np.ones(1 << 28, dtype=np.float32)  # 1 GiB, far beyond any cache
        address = buffer.ctypes.data
        for ahead, label in ((0, "read bandwidth, no prefetch"), (READ_AHEAD_BYTES, "read bandwidth, prefetch ahead")):
            native.read_gbytes_per_s(address, buffer.size, threads, ahead)
            found[label] = statistics.median(
                native.read_gbytes_per_s(address, buffer.size, threads, ahead) for _ in range(repeats)
            )
        found["read bandwidth"] = max(found["read bandwidth, no prefetch"], found["read bandwidth, prefetch ahead"])
    found["sgemm"] = max(value for key, value in found.items() if key.startswith("sgemm"))
    found["gemm"] = found["sgemm"]
    if dtype != "float32" and torch is not None:
        found[f"{dtype} gemm torch"] = half_gemm_gflops(torch, dtype, repeats)
        # A half-precision product can always run as float32 after a conversion: where torch's gemm
        # in the dtype is slower than sgemm (float16 without AVX512_FP16), sgemm is the ceiling.
        found["gemm"] = max(found[f"{dtype} gemm torch"], found["sgemm"])
    return found


def half_gemm_gflops(torch: Any, dtype: str, repeats: int) -> float:
    """torch's gemm in ``dtype``: SGEMM_SIZE square where it runs at speed; where a 512 x 512 probe
    says one such product would take over a second (torch's float16 gemm on CPUs without
    AVX512_FP16 runs at a few GFLOP/s), the 512 x 512 product instead."""
    def rate(size: int, rounds: int) -> float:
        values = np.random.default_rng(0).standard_normal((size, size)).astype(DTYPES[dtype])
        # In torch's own (64-byte aligned) memory: numpy's is 16-byte aligned, and torch's bfloat16
        # gemm on AMX ran at 1393-1419 GFLOP/s there against 2525-2570 on a copy (Xeon model 167).
        half = torch_tensor(torch, values).clone()
        return 2 * size**3 / median_seconds(lambda: torch.mm(half, half), rounds) / 1e9

    probe = rate(512, 3)
    if 2 * SGEMM_SIZE**3 / (probe * 1e9) > 1.0:
        return probe
    return rate(SGEMM_SIZE, repeats)


@functools.lru_cache(maxsize=1)
def _machine_ceilings() -> Any:
    """machine_ceilings.c built for this CPU and loaded (once), or None without a C compiler with OpenMP."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return None
    library = Path(tempfile.mkdtemp()) / "machine_ceilings.so"
    source = Path(__file__).parent / "machine_ceilings.c"
    built = subprocess.run(
        [compiler, "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(library)],
        capture_output=True, text=True,
    )
    if built.returncode != 0:
        print(f"machine_ceilings.c did not build: {built.stderr.strip()[:300]}", file=sys.stderr)
        return None
    native = ctypes.CDLL(str(library))
    native.fma_peak_gflops.restype = native.read_gbytes_per_s.restype = ctypes.c_double
    native.fma_peak_gflops.argtypes = [ctypes.c_long, ctypes.c_int]
    native.read_gbytes_per_s.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_long]
    native.read_with_fmas_gbytes_per_s.restype = ctypes.c_double
    native.read_with_fmas_gbytes_per_s.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_long, ctypes.c_int,
    ]
    native.read_half_with_fmas_gbytes_per_s.restype = ctypes.c_double
    native.read_half_with_fmas_gbytes_per_s.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_int,
    ]
    return native


#: The rows of a decode case that stream a buffer of its K and V's size (``run_case``): with the
#: hardware's prefetchers alone, and with a prefetch into L2 READ_AHEAD_BYTES ahead of the loads
#: (machine_ceilings.c).  A case's "of read" is against the faster of the two.
STREAMING_READ = "streaming read"
STREAMING_READ_AHEAD = "read, prefetch ahead"
READ_AHEAD_BYTES = 16384
#: The row of a decode case that streams the same bytes (prefetching READ_AHEAD_BYTES ahead) and
#: feeds each loaded vector the FMAs the case's FLOPs need per vector of its K and V
#: (``fmas_per_vector``): not a ceiling of the "of read" column but what any one-pass kernel that
#: does that arithmetic could reach on this core.  A 2-core Xeon model 207 overlaps the two so
#: little that 8 FMAs a 64-byte vector (a bfloat16 C6's) streamed at ~0.85 of the read and 32
#: (C6q4's) at ~0.58, where the FMAs alone take 33% and 133% of the read's time at the FMA peak.
STREAMING_READ_FMAS = "read + its FMAs"
#: With a half-precision ``--dtype``, the row of a decode case that streams a buffer of its K and V
#: in the dtype, converts each vector to float32 as the converting levels do (bfloat16: a shift and
#: a mask; float16: F16C) and feeds every float vector the FMAs the case needs
#: (``fmas_per_vector`` of 2-byte elements): what a one-pass kernel that converts each element once
#: could reach.  Where the conversion takes the FMA pipes it is below "read + its FMAs" (2-core Zen 1,
#: family 23 model 1, results/cpu-2026-12-02-zen1-decode-float16.json: a float16 C6's bytes in 8.93
#: ms against 7.37 without the conversion).
STREAMING_READ_CONVERT_FMAS = "read + convert + FMAs"
STREAMING_ROWS = (STREAMING_READ, STREAMING_READ_AHEAD, STREAMING_READ_FMAS, STREAMING_READ_CONVERT_FMAS)
#: The row of a float32 compute case (Sq > DECODE_ROWS) that times the ceiling's sgemm in the case's
#: own rounds (``same_round_sgemm``): its "of sgemm" is then measured under the same conditions.  The
#: 2-core VMs' hosts slow everything by 10-40% for minutes at a time, and against the sgemm of the
#: ceilings, timed once before the cases, a case's ratio swung with them (2-core Xeon model 207:
#: C1's forward 8.3-15.7 ms within one run of 7 rounds).
SAME_ROUND_SGEMM = "sgemm"
#: With a half-precision ``--dtype``, fastattn on the same case's inputs in float32 (the same draws,
#: before rounding), timed in the same rounds: the dtype's speed against float32's.
FLOAT32_BASELINE = "fastattn cpu float32"


def streaming_read(nbytes: int, threads: int, ahead_bytes: int = 0, fmas: int = 0) -> Callable[[], Any] | None:
    """A runner of machine_ceilings.c's streaming sum over a fresh buffer of ``nbytes`` on ``threads``
    threads, prefetching ``ahead_bytes`` ahead where > 0, with ``fmas`` multiply-adds on each loaded
    vector where > 0 (None without the library): timed in a decode case's rounds, it is
    the read bandwidth of the same bytes under the same conditions (the host's bandwidth drifts by
    tens of percent over minutes, so a ceiling measured before the cases can differ from the one the
    case met)."""
    native = _machine_ceilings()
    if native is None:
        return None
    buffer = np.ones(nbytes // 4, dtype=np.float32)
    if fmas > 0:
        return lambda: native.read_with_fmas_gbytes_per_s(buffer.ctypes.data, buffer.size, threads, ahead_bytes, fmas)
    return lambda: native.read_gbytes_per_s(buffer.ctypes.data, buffer.size, threads, ahead_bytes)


def converting_read(nbytes: int, dtype: str, threads: int, ahead_bytes: int, fmas: int) -> Callable[[], Any] | None:
    """A runner of machine_ceilings.c's streaming walk over a fresh ``dtype`` (bfloat16 or float16)
    buffer of ``nbytes``: each vector converted to float32, each float vector feeding ``fmas``
    multiply-adds (None without the library, or for float16 where it was built without F16C)."""
    native = _machine_ceilings()
    if native is None:
        return None
    is_float16 = int(dtype == "float16")
    buffer = np.full(nbytes // 2, 0x3C00 if is_float16 else 0x3F80, dtype=np.uint16)  # ones
    # Only float16 can be missing (no F16C): the library then returns 0 for any buffer.
    if is_float16 and native.read_half_with_fmas_gbytes_per_s(buffer.ctypes.data, 4096, 1, 1, 0, 1) == 0.0:
        return None
    return lambda: native.read_half_with_fmas_gbytes_per_s(
        buffer.ctypes.data, buffer.size, is_float16, threads, ahead_bytes, fmas
    )


def fmas_per_vector(flops: float, kv_bytes: int, element_bytes: int = 4) -> int:
    """The vector FMAs a decode's ``flops`` need per float32 vector of its ``kv_bytes``, read as
    elements of ``element_bytes`` (any width: L lanes hold L elements, an FMA does 2 L FLOPs; 2 for
    a vector converted from bfloat16/float16), rounded, at least 1."""
    return max(1, round(element_bytes * flops / (2 * kv_bytes)))


def same_round_sgemm(torch: Any, ceiling: dict[str, float]) -> Callable[[], Any]:
    """A runner of the SGEMM_SIZE square float32 product by whichever of torch and numpy was faster
    in ``ceiling`` (the ceilings' sgemm), for a case's rounds (``SAME_ROUND_SGEMM``)."""
    a = np.random.default_rng(0).standard_normal((SGEMM_SIZE, SGEMM_SIZE), dtype=np.float32)
    if torch is not None and ceiling.get("sgemm torch", 0.0) >= ceiling.get("sgemm numpy", 0.0):
        matrix = torch.from_numpy(a)
        return lambda: torch.mm(matrix, matrix)
    return lambda: a @ a


def machine_description() -> dict[str, Any]:
    """The CPU's model, family and vector ISA (from /proc/cpuinfo on Linux), and the kernels' level."""
    from fastattn._cpu import isa

    described: dict[str, Any] = {
        "processor": platform.processor(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "fastattn_isa": isa.active(),
        "fastattn_isa_levels": [level.name for level in isa.levels()],
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return described
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    described.update(
        model_name=fields.get("model name"),
        vendor=fields.get("vendor_id"),
        family=fields.get("cpu family"),
        model=fields.get("model"),
        vector_isa=sorted(flag for flag in flags if flag.startswith(("avx", "amx")) or flag in ("fma", "f16c")),
    )
    return described


def blas_description() -> list[dict[str, Any]]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return [{"note": "threadpoolctl not installed"}]
    return [
        {key: info.get(key) for key in ("internal_api", "version", "architecture", "num_threads")}
        for info in threadpool_info()
        if info.get("user_api") == "blas"
    ]


def numpy_naive_backward(q, k, v, dout, causal):
    """Plain numpy forward + analytic backward, materialising P (K/V repeated for GQA, then summed)."""
    group = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = np.float32(1 / math.sqrt(q.shape[-1]))
    scores = q @ kr.swapaxes(-1, -2) * scale
    if causal:
        scores = np.where(np.tri(*scores.shape[-2:], dtype=bool), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ vr
    dv = p.swapaxes(-1, -2) @ dout
    dp = dout @ vr.swapaxes(-1, -2)
    ds = p * (dp - (dout * out).sum(axis=-1, keepdims=True)) * scale
    dq = ds @ kr
    dk = ds.swapaxes(-1, -2) @ q
    fold = (k.shape[0], k.shape[1], group) + k.shape[2:]
    return dq, dk.reshape(fold).sum(axis=2), dv.reshape(fold[:3] + dv.shape[2:]).sum(axis=2)


def implementations(torch: Any, direction: str) -> dict[str, Callable[..., Callable[[], Any]]]:
    """Each entry takes (q, k, v, dout, causal, mask) as numpy arrays (mask None or a ``MASKS``
    array) and returns a zero-argument runner of the forward, or of forward + backward."""

    def fastattn_cpu(q, k, v, dout, causal, mask=None, layout="bhsd"):
        options: dict[str, Any] = dict(causal=causal, mask=mask, backend="cpu")
        if layout != "bhsd":
            q, k, v, dout = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dout))
            options["layout"] = "bshd"
        if direction == "forward":
            return lambda: fastattn.attention(q, k, v, **options)

        def both():
            out, lse = fastattn.attention(q, k, v, return_lse=True, **options)
            return fastattn.attention_backward(dout, q, k, v, out, lse, **options)

        return both

    def numpy_naive(q, k, v, dout, causal, mask=None, layout="bhsd"):
        if mask is not None:
            raise ValueError("numpy naive runs unmasked cases only")
        if direction == "forward":
            return lambda: numpy_naive_attention(q, k, v, causal)
        return lambda: numpy_naive_backward(q, k, v, dout, causal)

    found = {"fastattn cpu": fastattn_cpu, "numpy naive": numpy_naive}
    if torch is not None:

        def torch_sdpa(q, k, v, dout, causal, mask=None, layout="bhsd"):
            sdpa = torch.nn.functional.scaled_dot_product_attention
            options: dict[str, Any] = dict(is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
            if mask is not None:
                folded = causal_folded(mask, q.shape[2], k.shape[2]) if causal else mask
                options.update(is_causal=False, attn_mask=torch_tensor(torch, folded))
            if direction == "forward":
                tq, tk, tv = (torch_tensor(torch, x) for x in (q, k, v))
                return lambda: sdpa(tq, tk, tv, **options)
            leaves = [torch_tensor(torch, x).requires_grad_() for x in (q, k, v)]
            grad = torch_tensor(torch, dout)

            def both():
                for leaf in leaves:
                    leaf.grad = None
                sdpa(*leaves, **options).backward(grad)

            return both

        found["torch sdpa"] = torch_sdpa
    return found


def laid_out(layout: str, q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray) -> list[np.ndarray]:
    """(B, H, S, D) views of copies of q, k, v, dout in ``layout``'s memory order (``LAYOUTS``)."""
    if layout == "bhsd":
        return [q, k, v, dout]
    token_major = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, dout)]
    if layout == "kv-cache":
        batch, seq_k, heads_kv, dim = token_major[1].shape
        cache = KVCache(batch, seq_k, heads_kv, dim, dtype=k.dtype)
        cache.append(token_major[1], token_major[2])
        token_major[1:3] = cache.view()
    return [x.transpose(0, 2, 1, 3) for x in token_major]


def run_case(
    name: str,
    direction: str,
    impls: dict[str, Callable[..., Callable[[], Any]]],
    repeats: int,
    dtype: str = "float32",
    mask_kind: str = "none",
    layout: str = "bhsd",
    sgemm: Callable[[], Any] | None = None,
) -> list[dict[str, Any]]:
    """Time one case: every implementation in ``impls``, interleaved, on inputs in ``layout``'s
    memory order.  With a ``mask_kind`` other than "none" each runs under that mask, and fastattn
    also runs unmasked ("fastattn cpu unmasked") in the same rounds, the baseline of the mask's cost.
    ``sgemm`` (``same_round_sgemm``), where given, runs in the rounds of a case that is not a decode
    (row ``SAME_ROUND_SGEMM``)."""
    batch, heads_q, heads_kv, seq_q, seq_k, dim, causal = CASES[name]
    rng = np.random.default_rng(1)
    drawn = [
        rng.standard_normal(shape, dtype=np.float32)
        for shape in ((batch, heads_q, seq_q, dim), (batch, heads_kv, seq_k, dim), (batch, heads_kv, seq_k, dim),
                      (batch, heads_q, seq_q, dim))
    ]
    q, k, v, dout = laid_out(layout, *(x.astype(DTYPES[dtype]) for x in drawn))
    mask = make_mask(mask_kind, batch, heads_q, seq_q, seq_k, DTYPES[dtype])
    flops = forward_flops(batch, heads_q, seq_q, seq_k, dim, causal) * (3.5 if direction == "forward+backward" else 1)
    kv_bytes = {label: k.nbytes + v.nbytes for label in (*impls, "fastattn cpu unmasked", *STREAMING_ROWS)}
    print(f"  {name} {direction}" + ("" if mask is None else f" mask {mask_kind}") +
          ("" if layout == "bhsd" else f" layout {layout}"), file=sys.stderr, flush=True)
    runs = {label: make(q, k, v, dout, causal, mask, layout) for label, make in impls.items()}
    if mask is not None and "fastattn cpu" in impls:
        runs["fastattn cpu unmasked"] = impls["fastattn cpu"](q, k, v, dout, causal, None, layout)
    if dtype != "float32" and "fastattn cpu" in impls:
        baseline = laid_out(layout, *drawn)
        float32_mask = make_mask(mask_kind, batch, heads_q, seq_q, seq_k, np.float32)
        runs[FLOAT32_BASELINE] = impls["fastattn cpu"](*baseline, causal, float32_mask, layout)
        kv_bytes[FLOAT32_BASELINE] = baseline[1].nbytes + baseline[2].nbytes
    if direction == "forward" and seq_q <= DECODE_ROWS and "fastattn cpu" in impls:
        work = fmas_per_vector(flops, kv_bytes[STREAMING_READ_FMAS])
        for label, ahead, fmas in ((STREAMING_READ, 0, 0), (STREAMING_READ_AHEAD, READ_AHEAD_BYTES, 0),
                                   (STREAMING_READ_FMAS, READ_AHEAD_BYTES, work)):
            read = streaming_read(kv_bytes[label], fastattn.get_num_threads(), ahead, fmas)
            if read is not None:
                runs[label] = read
        if dtype != "float32":
            label = STREAMING_READ_CONVERT_FMAS
            read = converting_read(kv_bytes[label], dtype, fastattn.get_num_threads(), READ_AHEAD_BYTES,
                                   fmas_per_vector(flops, kv_bytes[label], element_bytes=2))
            if read is not None:
                runs[label] = read
    if sgemm is not None and seq_q > DECODE_ROWS:
        runs[SAME_ROUND_SGEMM] = sgemm
    medians = interleaved_medians(runs, repeats)
    rates = {label: flops / seconds / 1e9 for label, seconds in medians.items()}
    if SAME_ROUND_SGEMM in medians:
        rates[SAME_ROUND_SGEMM] = 2 * SGEMM_SIZE**3 / medians[SAME_ROUND_SGEMM] / 1e9
    return [
        {
            "case": name,
            "pass": direction,
            "mask": mask_kind,
            "layout": layout,
            "implementation": label,
            "median_ms": 1e3 * seconds,
            "gflops": None if label in STREAMING_ROWS else rates[label],
            "kv_gbytes_per_s": kv_bytes[label] / seconds / 1e9 if label in kv_bytes else None,
        }
        for label, seconds in medians.items()
    ]


_MEMORY_PROBE = r"""
import json, sys, time
import numpy as np
import fastattn
from fastattn._bench import peak_rss_kib

backward = sys.argv[1] == "forward+backward"
batch, heads, seq, dim = 1, 8, 32768, 128
q, k, v = (np.random.default_rng(i).standard_normal((batch, heads, seq, dim), dtype=np.float32) for i in range(3))
dout = np.random.default_rng(3).standard_normal((batch, heads, seq, dim), dtype=np.float32) if backward else None
small = slice(0, 128)
fastattn.attention(q[:, :, small], k[:, :, small], v[:, :, small], causal=True, backend="cpu")
# Raise the high-water mark with output-sized buffers, then free them: what the call adds beyond
# that is the kernels' own memory.
outputs = [np.ones_like(q), np.ones((batch, heads, seq), np.float32)] + ([np.ones_like(q) for _ in range(3)] if backward else [])
del outputs
before = peak_rss_kib()
start = time.perf_counter()
out, lse = fastattn.attention(q, k, v, causal=True, backend="cpu", return_lse=True)
if backward:
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cpu")
seconds = time.perf_counter() - start
after = peak_rss_kib()
print(json.dumps({"extra_mib_beyond_outputs": (after - before) / 1024, "seconds": seconds}))
"""


def write_report(report: dict[str, Any], path: Path | None, prefix: str) -> Path:
    """Write a benchmark's JSON report, dated, to ``path`` or ``benchmarks/results/<prefix>-<date>.json``."""
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), **report}
    path = path or Path(__file__).parent / "results" / f"{prefix}-{datetime.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path


def memory_case(direction: str) -> dict[str, Any]:
    """Peak RSS of the (1, 8, 32768, 32768, 128) causal call beyond its inputs and outputs.

    Run in a subprocess; the high-water mark is first raised by output-sized buffers (out, lse and,
    for the backward, dq/dk/dv) that are then freed, so the growth measured during the call is
    what the kernels need beyond inputs, outputs and gradients.
    """
    result = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, direction], capture_output=True, text=True, check=True
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]), direction=direction)


def _key(row: dict[str, Any]) -> tuple[str, str, str, str]:
    return row["case"], row["pass"], row.get("mask", "none"), row.get("layout", "bhsd")


def format_table(rows: list[dict[str, Any]], ceiling: dict[str, float], dtype: str = "float32") -> str:
    """One line per (case, mask, pass, implementation): time, rates, and the ratios to torch (under
    the same mask) and to the ceilings (the gemm column: sgemm for float32, torch's gemm in the dtype
    otherwise, the case's own sgemm in its rounds where it has one; the read column: the case's own
    streaming read where it has one)."""
    torch_ms = {_key(r): r["median_ms"] for r in rows if r["implementation"] == "torch sdpa"}
    streamed: dict[tuple[str, str, str, str], float] = {}
    for r in rows:
        if r["implementation"] in (STREAMING_READ, STREAMING_READ_AHEAD):
            streamed[_key(r)] = max(streamed.get(_key(r), 0.0), r["kv_gbytes_per_s"])
    same_round = {_key(r): r["gflops"] for r in rows if r["implementation"] == SAME_ROUND_SGEMM}
    gemm = "of sgemm" if dtype == "float32" else "of gemm"
    header = (
        f"{'case':<15} {'pass':<16} {'implementation':<21} {'ms':>9} {'GFLOP/s':>8} {'KV GB/s':>8} "
        f"{'vs torch':>9} {gemm:>9} {'of FMA':>7} {'of read':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = torch_ms.get(_key(row), math.nan) / row["median_ms"]
        gflops = math.nan if row["gflops"] is None else row["gflops"]
        fma = gflops / ceiling.get("fma peak", math.nan)
        kv_rate = math.nan if row["kv_gbytes_per_s"] is None else row["kv_gbytes_per_s"]
        read = kv_rate / streamed.get(_key(row), ceiling.get("read bandwidth", math.nan))
        gemm_rate = same_round.get(_key(row), ceiling["gemm"])
        mask, layout = row.get("mask", "none"), row.get("layout", "bhsd")
        case = row["case"] + ("" if mask == "none" else f"/{mask}") + ("" if layout == "bhsd" else f"/{layout}")
        lines.append(
            f"{case:<15} {row['pass']:<16} {row['implementation']:<21} {row['median_ms']:>9.2f} "
            f"{gflops:>8.1f} {kv_rate:>8.1f} {ratio:>8.2f}x {gflops / gemm_rate:>8.0%} "
            f"{fma:>7.0%} {read:>8.0%}"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """fastattn / torch time ratios per (case, pass); for masked cases, per mask, the masked /
    unmasked time ("cost"); for decodes the share of the streaming read ("of read"), of the read
    with the decode's FMAs ("of read+FMAs") and, in half precision, of the read that also converts
    ("of read+convert+FMAs"); for half precisions float32's time over the dtype's ("vs
    float32"); for cases with an sgemm in their rounds fastattn's GFLOP/s over its ("of sgemm");
    geomeans and minima over the unmasked C1-C5."""
    by_key = {(_key(r), r["implementation"]): r["median_ms"] for r in rows}
    rate = {(_key(r), r["implementation"]): r["gflops"] for r in rows}
    ratios: dict[str, float] = {}
    for (key, label), ms in by_key.items():
        case, direction, mask, layout = key
        name = f"{case} {direction}" + ("" if mask == "none" else f" {mask}") + ("" if layout == "bhsd" else f" {layout}")
        if label == "fastattn cpu" and (key, "torch sdpa") in by_key:
            ratios[name] = by_key[(key, "torch sdpa")] / ms
        if label == "fastattn cpu" and (key, "fastattn cpu unmasked") in by_key:
            ratios[f"{name} cost"] = ms / by_key[(key, "fastattn cpu unmasked")]
        reads = [by_key[(key, read)] for read in (STREAMING_READ, STREAMING_READ_AHEAD) if (key, read) in by_key]
        if label == "fastattn cpu" and reads:
            ratios[f"{name} of read"] = min(reads) / ms
        if label == "fastattn cpu" and (key, STREAMING_READ_FMAS) in by_key:
            ratios[f"{name} of read+FMAs"] = by_key[(key, STREAMING_READ_FMAS)] / ms
        if label == "fastattn cpu" and (key, STREAMING_READ_CONVERT_FMAS) in by_key:
            ratios[f"{name} of read+convert+FMAs"] = by_key[(key, STREAMING_READ_CONVERT_FMAS)] / ms
        if label == "fastattn cpu" and (key, FLOAT32_BASELINE) in by_key:
            ratios[f"{name} vs float32"] = by_key[(key, FLOAT32_BASELINE)] / ms
        if label == "fastattn cpu" and (key, SAME_ROUND_SGEMM) in rate:
            ratios[f"{name} of sgemm"] = rate[(key, label)] / rate[(key, SAME_ROUND_SGEMM)]
    for direction in ("forward", "forward+backward"):
        chosen = [ratios[f"{c} {direction}"] for c in ("C1", "C2", "C3", "C4", "C5") if f"{c} {direction}" in ratios]
        if chosen:
            ratios[f"geomean C1-C5 {direction}"] = math.exp(sum(map(math.log, chosen)) / len(chosen))
            ratios[f"lowest C1-C5 {direction}"] = min(chosen)
    return ratios


def main(argv: list[str] | None = None) -> int:
    global WARMUPS, WARMUP_SECONDS, TIMED_SECONDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--passes", nargs="+", default=["forward", "forward+backward"], choices=["forward", "forward+backward"]
    )
    parser.add_argument("--no-numpy", action="store_true", help="skip numpy naive (slow on C3-C5)")
    parser.add_argument(
        "--impls", nargs="+", default=["fastattn", "torch", "numpy"], choices=["fastattn", "torch", "numpy"],
        help="implementations to time (default all)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=list(DTYPES),
        help="input dtype (default float32); half precisions add torch's gemm in that dtype as the ceiling",
    )
    parser.add_argument(
        "--masks", nargs="+", default=["none"], choices=list(MASKS),
        help="mask variants to time (default none); each also times fastattn unmasked in the same rounds",
    )
    parser.add_argument(
        "--warmups", type=int, default=WARMUPS, help=f"untimed runs after each pause (default {WARMUPS})"
    )
    parser.add_argument(
        "--warmup-ms", type=float, default=1e3 * WARMUP_SECONDS,
        help=f"untimed runs after each pause go on for at least this long (default {1e3 * WARMUP_SECONDS:.0f})",
    )
    parser.add_argument(
        "--timed-ms", type=float, default=1e3 * TIMED_SECONDS,
        help=f"a round times back-to-back calls over at least this long, their mean (default {1e3 * TIMED_SECONDS:.0f})",
    )
    parser.add_argument(
        "--layouts", nargs="+", default=["bhsd"], choices=LAYOUTS,
        help="memory orders of the inputs to time (default bhsd; see LAYOUTS)",
    )
    parser.add_argument("--memory", action="store_true", help="also run the 32768-token memory case")
    parser.add_argument("--json", type=Path, help="output path (default benchmarks/results/cpu-<date>.json)")
    arguments = parser.parse_args(argv)
    WARMUPS = max(1, arguments.warmups)
    WARMUP_SECONDS = max(0.0, arguments.warmup_ms / 1e3)
    TIMED_SECONDS = max(0.0, arguments.timed_ms / 1e3)

    try:
        import torch

        torch.set_num_threads(fastattn.get_num_threads())
    except ImportError:
        torch = None
    ceiling = ceilings(torch, arguments.repeats, fastattn.get_num_threads(), arguments.dtype)
    sgemm = same_round_sgemm(torch, ceiling) if arguments.dtype == "float32" else None
    wanted = {"fastattn cpu": "fastattn", "torch sdpa": "torch", "numpy naive": "numpy"}
    rows = []
    for direction in arguments.passes:
        impls = {
            label: make
            for label, make in implementations(torch, direction).items()
            if wanted[label] in arguments.impls
            and not ((arguments.no_numpy or arguments.dtype != "float32") and label == "numpy naive")
        }
        for name in arguments.cases:
            if direction == "forward+backward" and CASES[name][3] <= DECODE_ROWS:
                continue  # decodes are an inference path: forward only
            for mask_kind in arguments.masks:
                chosen = {label: make for label, make in impls.items() if mask_kind == "none" or label != "numpy naive"}
                for layout in arguments.layouts:
                    rows.extend(
                        run_case(name, direction, chosen, arguments.repeats, arguments.dtype, mask_kind, layout, sgemm)
                    )
    machine = machine_description()
    print(f"CPU: {machine.get('model_name')} (family {machine.get('family')}, model {machine.get('model')}), "
          f"{machine['cores']} logical CPUs, {fastattn.get_num_threads()} threads; fastattn level {machine['fastattn_isa']}")
    print(f"dtype: {arguments.dtype}")
    print(format_table(rows, ceiling, arguments.dtype))
    print("ceilings: " + ", ".join(f"{key} {value:.1f}" for key, value in ceiling.items()) + f"; BLAS: {blas_description()}")
    ratios = summary(rows)
    print("fastattn cpu / torch: " + ", ".join(f"{key} {value:.2f}x" for key, value in ratios.items()))
    report: dict[str, Any] = {
        "machine": machine,
        "threads": fastattn.get_num_threads(),
        "dtype": arguments.dtype,
        "torch": None if torch is None else torch.__version__,
        "numpy": np.__version__,
        "blas": blas_description(),
        "openblas_env": {key: os.environ.get(key) for key in OPENBLAS_VARIABLES},
        "ceilings": ceiling,
        "sgemm_gflops": ceiling["sgemm"],
        "repeats": arguments.repeats,
        "warmups": WARMUPS,
        "warmup_ms": 1e3 * WARMUP_SECONDS,
        "timed_ms": 1e3 * TIMED_SECONDS,
        "masks": {kind: MASKS[kind] for kind in arguments.masks},
        "rows": rows,
        "ratios_vs_torch": ratios,
    }
    if arguments.memory:
        report["memory_cases"] = [memory_case(direction) for direction in arguments.passes]
        for case in report["memory_cases"]:
            print(f"memory case (1, 8, 32768, 32768, 128) causal: {case}")
    write_report(report, arguments.json, "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
