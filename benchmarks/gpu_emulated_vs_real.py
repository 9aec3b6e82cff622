"""The same calls on the ``cuda`` backend (a GPU) and on ``cuda-emulated`` (the SIMT emulator),
forward and backward, every kernel family: prints each case's largest difference relative to the
outputs' magnitude and exits 1 when one exceeds the dtype's tolerance.  Needs a CUDA device.

    python benchmarks/gpu_emulated_vs_real.py
"""

from __future__ import annotations

import sys

import cupy
import numpy as np

import fastattn

TOLERANCE = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 2e-2}
CASES = [  # dtype, (B, Hq, Hkv, Sq, Sk, D), options
    ("float16", (2, 8, 2, 200, 300, 64), {"causal": True}),
    ("bfloat16", (1, 4, 4, 130, 130, 128), {"window": (32, 0), "softcap": 20.0}),
    ("float16", (2, 8, 2, 1, 1000, 128), {"key_lengths": np.array([700, 1000])}),
    ("float32", (1, 4, 2, 100, 150, 64), {"causal": "bottom_right"}),
    # dropout (issue #20): the device's Philox masks must equal the emulated ones exactly
    ("bfloat16", (2, 4, 2, 150, 150, 64), {"causal": True, "dropout_p": 0.2, "dropout_seed": 5, "dropout_offset": 3}),
    ("float32", (1, 4, 2, 100, 150, 64), {"dropout_p": 0.1, "dropout_seed": 2**40 + 9}),
]


def main() -> int:
    rng = np.random.default_rng(0)
    worst = 0.0
    failed = False
    for dtype, (b, hq, hkv, sq, sk, d), options in CASES:
        numpy_dtype = np.float32 if dtype == "float32" else fastattn._arrays.numpy_dtype(dtype)
        host = {
            "q": rng.standard_normal((b, hq, sq, d)).astype(numpy_dtype),
            "k": rng.standard_normal((b, hkv, sk, d)).astype(numpy_dtype),
            "v": rng.standard_normal((b, hkv, sk, d)).astype(numpy_dtype),
            "dout": rng.standard_normal((b, hq, sq, d)).astype(numpy_dtype),
        }
        device = {name: cupy.asarray(value) for name, value in host.items()}
        device_options = {**options, **({"key_lengths": cupy.asarray(options["key_lengths"])} if "key_lengths" in options else {})}
        real = fastattn.attention(device["q"], device["k"], device["v"], return_lse=True, backend="cuda", **device_options)
        emulated = fastattn.attention(host["q"], host["k"], host["v"], return_lse=True, backend="cuda-emulated", **options)
        results = [("out", real[0], emulated[0]), ("lse", real[1], emulated[1])]
        if sq > 16:
            real_grads = fastattn.attention_backward(device["dout"], device["q"], device["k"], device["v"], *real, backend="cuda", **device_options)
            emulated_grads = fastattn.attention_backward(host["dout"], host["q"], host["k"], host["v"], *emulated, backend="cuda-emulated", **options)
            results += list(zip(("dq", "dk", "dv"), real_grads, emulated_grads))
        for name, got, want in results:
            got64, want64 = cupy.asnumpy(got).astype(np.float64), np.asarray(want).astype(np.float64)
            seen = np.isfinite(want64)
            difference = float(np.abs(got64[seen] - want64[seen]).max() / max(np.abs(want64[seen]).max(), 1e-30))
            worst = max(worst, difference)
            bad = difference > TOLERANCE[dtype] or not np.array_equal(np.isfinite(got64), seen)
            failed |= bad
            print(f"{dtype:9s} {(b, hq, hkv, sq, sk, d)} {options} {name}: {difference:.2e}{'  FAIL' if bad else ''}")
    print(f"worst relative difference {worst:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
