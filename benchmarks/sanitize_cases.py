"""Small calls of every cuda kernel for compute-sanitizer (run by sanitize_gpu.sh).

Each case is chosen to touch an edge: one key, tile edges, odd lengths, a row of length 0, many
splits, chunked GQA packs, masks, head_dim 32 to 256, Dv != D, strided inputs; the prefill cases
(Sq > 16) run the tensor-core forward.  Forward for every case, then the backward in both modes
(dQ by atomics and deterministic; float32 takes the flag and is deterministic anyway).  Prints one
line per case; exits non-zero on a CUDA error.

``--passes 2`` runs the cases twice and compares the device memory in use after each pass: the
second pass loads no new kernel, so any growth is memory the backend kept.  This is the leak check:
memcheck's own (``--leak-check full``) lists every allocation of the cases at exit, and under it the
memory in use grows by the cases' allocations each pass, while the same two passes without the
sanitizer hold it flat and CuPy alone (an array allocated and dropped) shows no leak under it
(H100, CUDA 13.0, CuPy 14.2; results/gpu-check-2026-11-26-h100-2/).
"""

from __future__ import annotations

import argparse
import gc
import sys
from typing import Any

import cupy
import numpy as np

import fastattn

# (name, dtype, B, Hq, Hkv, Sq, Sk, D, Dv, options)
CASES = [
    ("decode-one-key", "float16", 2, 8, 2, 1, 1, 128, 128, {"causal": "bottom_right"}),
    ("decode-ragged", "bfloat16", 3, 32, 8, 1, 4097, 128, 128, {"causal": "bottom_right", "lengths": (4097, 1001, 0)}),
    ("decode-chunks", "float16", 2, 16, 1, 16, 777, 64, 64, {"causal": "top_left", "lengths": (777, 5)}),
    ("decode-mask", "float32", 2, 8, 2, 3, 333, 256, 256, {"mask": "bool", "window": (50, 0)}),
    ("decode-d32-softcap", "bfloat16", 1, 4, 4, 1, 4096, 32, 32, {"softcap": 4.0}),
    ("fp32-forward", "float32", 2, 4, 2, 130, 131, 80, 24, {"causal": "bottom_right", "lengths": (131, 0)}),
    ("fp32-d256-mask", "float32", 1, 2, 1, 70, 65, 256, 256, {"mask": "float", "softcap": 3.0}),
    ("fp32-strided", "float32", 1, 4, 4, 33, 47, 16, 48, {"strided": True, "window": (3, 2)}),
    ("prefill-d64-gqa", "float16", 2, 8, 2, 77, 131, 64, 64,
     {"causal": "bottom_right", "lengths": (131, 0), "mask": "bool", "softcap": 30.0}),
    ("prefill-d32-window", "bfloat16", 1, 4, 4, 150, 150, 32, 32, {"causal": "top_left", "window": (40, 0)}),
    ("prefill-d96-float-mask", "float16", 1, 4, 1, 70, 90, 96, 96, {"mask": "float"}),
    ("prefill-d128", "bfloat16", 2, 4, 2, 130, 129, 128, 128, {"causal": "bottom_right", "lengths": (129, 60)}),
    ("prefill-d256", "float16", 1, 2, 1, 70, 65, 256, 256, {"softcap": 3.0, "window": (20, 5)}),
]


def inputs(dtype, batch, heads_q, heads_kv, seq_q, seq_k, dim, dim_v, options):
    rng = np.random.default_rng(0)
    element = {"float16": np.float16, "bfloat16": fastattn._arrays.numpy_dtype("bfloat16"), "float32": np.float32}[dtype]

    def array(heads, seq, width):
        if options.get("strided"):
            base = rng.standard_normal((batch, heads, 2 * seq, width + 3)).astype(element)
            return cupy.asarray(base)[:, :, ::2, :width]
        return cupy.asarray(rng.standard_normal((batch, heads, seq, width)).astype(element))

    q, k, v = array(heads_q, seq_q, dim), array(heads_kv, seq_k, dim), array(heads_kv, seq_k, dim_v)
    kwargs = {name: options[name] for name in ("causal", "window", "softcap") if name in options}
    if "lengths" in options:
        kwargs["key_lengths"] = cupy.asarray(options["lengths"])
    if options.get("mask") == "bool":
        kwargs["mask"] = cupy.asarray(rng.random((batch, heads_q, seq_q, seq_k)) < 0.7)
    elif options.get("mask") == "float":
        kwargs["mask"] = cupy.asarray(rng.standard_normal((seq_q, seq_k)).astype(np.float32))
    return q, k, v, kwargs


def run_case(name: str, dtype: str, *sizes_and_options: Any) -> None:
    """Forward and both backward modes of one case; its arrays are freed on return."""
    *sizes, options = sizes_and_options
    q, k, v, kwargs = inputs(dtype, *sizes, options)
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend="cuda", **kwargs)
    for deterministic in (False, True):
        fastattn.attention_backward(
            cupy.ones_like(out), q, k, v, out, lse, backend="cuda", deterministic=deterministic, **kwargs
        )
    cupy.cuda.Device().synchronize()
    print(f"{name}: ok", flush=True)


#: Growth of the device memory in use from the first pass to the last that counts as kept memory
#: (the driver reports free memory in 2 MiB pages).
KEPT_BYTES_ALLOWED = 8 << 20


def used_device_bytes() -> tuple[int, int, int]:
    """Device memory in use with the device idle, before and after the cycle collector ran, and the
    number of unreachable objects it found (arrays in reference cycles are freed only by it)."""
    cupy.cuda.Device().synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    unreachable = gc.collect()
    cupy.cuda.Device().synchronize()
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    return int(total - free), int(total - free_after), unreachable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=1, help="runs of every case; 2 or more checks for kept memory")
    arguments = parser.parse_args(argv)
    # No memory pools: every array's memory is cudaMalloc'd for it and cudaFree'd when it dies, so
    # the memory in use after a pass is what the backend still holds, not blocks a pool keeps.
    cupy.cuda.set_allocator(None)
    cupy.cuda.set_pinned_memory_allocator(None)
    used = []
    for number in range(arguments.passes):
        for case in CASES:
            run_case(*case)
        before, after, unreachable = used_device_bytes()
        print(f"device memory in use after pass {number + 1}: {before / 2**20:.1f} MiB, {after / 2**20:.1f} MiB once "
              f"gc.collect() found {unreachable} unreachable objects", flush=True)
        used.append(after)
    if used[-1] - used[0] > KEPT_BYTES_ALLOWED:
        print(f"kept memory: {(used[-1] - used[0]) / 2**20:.1f} MiB more in use after the last pass than after the first")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
