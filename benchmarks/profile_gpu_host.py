"""Where the host time of a cuda-backend call goes: cProfile over back-to-back calls on torch tensors.

bench_gpu.py's per-call time (CUDA events around one call) exceeds its kernel-only time wherever
the host's work between the events (Python, argument checks, DLPack, launches) outlasts the
kernels; this script shows that work, per case: the wall time per call with the device synchronised
once at the end (so it is the host's time whenever the kernels are shorter), then the functions
that take it, by their own time.  Needs a CUDA device.

    python benchmarks/profile_gpu_host.py                 # G1 forward, G7 decode, bfloat16
    python benchmarks/profile_gpu_host.py --calls 500 --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from typing import Any

import fastattn

CASES = {  # name: (B, Hq, Hkv, Sq, Sk, D, causal)
    "G1": (8, 16, 16, 1024, 1024, 64, False),
    "G7": (32, 32, 8, 1, 4096, 128, False),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=25)
    arguments = parser.parse_args(argv)
    import torch

    dtype = getattr(torch, arguments.dtype)
    for name in arguments.cases:
        b, hq, hkv, sq, sk, d, causal = CASES[name]
        q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype) for _ in range(2))

        def call(q: Any = q, k: Any = k, v: Any = v, causal: bool = causal) -> Any:
            return fastattn.attention(q, k, v, causal=causal, backend="cuda")

        for _ in range(5):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(arguments.calls):
            call()
        torch.cuda.synchronize()
        per_call = (time.perf_counter() - start) / arguments.calls
        print(f"{name} {arguments.dtype}: {per_call * 1e3:.3f} ms per call, back to back", flush=True)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(arguments.calls):
            call()
        torch.cuda.synchronize()
        profile.disable()
        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(arguments.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
