"""Single-threaded BLAS throughput on flash-attention tile shapes.

The CPU kernel could compute its Q·Kᵀ and P·V tiles with a single-threaded BLAS gemm per tile
(scipy's cython_blas) instead of its own register-blocked micro-kernels.  This measures what such a
gemm reaches on those shapes, one thread, many tiles per call (numpy's batched matmul loops over the
tiles in C, so call overhead is as low as from Cython).  Compare with bench_cpu.py's fastattn
GFLOP/s divided by the thread count: the whole kernel, softmax included, per thread.

    python benchmarks/tile_gemm_ceiling.py
"""

import numpy as np
from bench_cpu import median_seconds  # benchmarks/ is the script's directory, so on sys.path
from threadpoolctl import threadpool_info, threadpool_limits


def main():
    rng = np.random.default_rng(0)
    print("BLAS:", [(info.get("internal_api"), info.get("architecture")) for info in threadpool_info()])
    with threadpool_limits(1):
        for rows, cols, depth in [(64, 128, 64), (64, 128, 128), (64, 64, 128), (128, 128, 128)]:
            a = rng.standard_normal((2000, rows, depth), dtype=np.float32)
            b = rng.standard_normal((2000, depth, cols), dtype=np.float32)
            seconds = median_seconds(lambda: np.matmul(a, b), 5)
            print(f"tile {rows}x{cols}x{depth}: {2 * rows * cols * depth * 2000 / seconds / 1e9:.1f} GFLOP/s, 1 thread")


if __name__ == "__main__":
    main()
