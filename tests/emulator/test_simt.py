"""The SIMT emulator's execution model: barriers, warp collectives, cp.async, shared memory, and
the errors that a kernel bug must turn into (never a hang, never a silent pass)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastattn._gpu import emulator

SOURCE = r"""
#include "ptx.cuh"
namespace t {
// y[i] = the sum over the warp of tile[(lane + 1) % 32], tile = a * x of this warp.
__global__ void rotate_sum(const float* __restrict__ x, float* __restrict__ y, float a, int synced) {
    extern __shared__ float tile[];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = x[i] * a;
    if (synced) __syncthreads();
    float v = tile[(threadIdx.x + 1) % blockDim.x];
    for (int s = 16; s > 0; s /= 2) v += __shfl_xor_sync(0xffffffff, v, s);
    y[i] = v;
}
__global__ void early_exit(float* y) {
    if (threadIdx.x == 3) return;
    __syncthreads();
    y[threadIdx.x] = 1.f;
}
__global__ void half_warp_shuffle(float* y) {
    float v = 1.f;
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffff, v, 1);
    y[threadIdx.x] = v;
}
__global__ void overrun(float* y, int n) {
    extern __shared__ float tile[];
    tile[threadIdx.x + n] = 1.f;
    y[threadIdx.x] = 0.f;
}
// before[i]: the shared word read before the wait; after[i]: after it; zero[i]: a zero-filled copy.
__global__ void copies(const float* __restrict__ x, float* before, float* after, float* zero) {
    extern __shared__ __align__(16) unsigned char bytes[];
    float* tile = reinterpret_cast<float*>(bytes);
    const int i = threadIdx.x;
    fastattn_gpu::cp_async_4(tile + i, x + i, true);
    fastattn_gpu::cp_async_4(tile + 32 + i, x + i, false);
    fastattn_gpu::cp_async_commit();
    before[i] = tile[i];
    fastattn_gpu::cp_async_wait<0>();
    after[i] = tile[i];
    zero[i] = tile[32 + i];
}
// One warp: y[lane] = the neighbour's slot of a shared word, written before __syncwarp (or not);
// any[lane] = whether some lane's x is negative (__any_sync).
__global__ void warp_sync(const float* __restrict__ x, float* y, int* any, int synced) {
    extern __shared__ float tile[];
    const int lane = threadIdx.x;
    tile[lane] = x[lane];
    if (synced) __syncwarp();
    y[lane] = tile[(lane + 1) % 32];
    any[lane] = __any_sync(0xffffffff, x[lane] < 0.f);
}
}  // namespace t
"""
NAMES = ("t::rotate_sum", "t::early_exit", "t::half_warp_shuffle", "t::overrun", "t::copies", "t::warp_sync")


@pytest.fixture(scope="module")
def module() -> emulator.EmulatedModule:
    return emulator.compile_source(SOURCE, NAMES)


def _rotate_sum(module: emulator.EmulatedModule, x: np.ndarray, synced: bool, seed: int) -> np.ndarray:
    y = np.full_like(x, np.nan)
    kernel = module.get_function("t::rotate_sum")
    kernel((x.size // 32,), (32,), (x, y, np.float32(3), np.int32(synced)), shared_mem=32 * 4, seed=seed)
    return y


def _butterfly_sums(x: np.ndarray, a: float) -> np.ndarray:
    """What the device computes for rotate_sum, bit for bit: each warp's rotated tile summed by the
    xor butterfly in float32. Every lane ends with the same value, since a + b == b + a exactly."""
    lanes = np.arange(32)
    values = np.roll((np.float32(a) * x).reshape(-1, 32), -1, axis=1)
    for stride in (16, 8, 4, 2, 1):
        values = values + values[:, lanes ^ stride]
    return values.reshape(-1)


def test_barriers_and_shuffles_compute_what_the_device_does(module: emulator.EmulatedModule) -> None:
    x = np.random.default_rng().standard_normal(96).astype(np.float32)
    expected = _butterfly_sums(x, 3.0)
    for seed in range(4):
        np.testing.assert_array_equal(_rotate_sum(module, x, True, seed), expected)


def test_a_missing_barrier_reads_poison(module: emulator.EmulatedModule) -> None:
    """Without __syncthreads a thread may read its neighbour's slot before it is written: shared
    memory starts as NaN, and some thread order of the seeds shows it."""
    x = np.random.default_rng().standard_normal(32).astype(np.float32)
    results = [_rotate_sum(module, x, False, seed) for seed in range(8)]
    assert any(np.isnan(result).any() for result in results)


def test_a_thread_that_exits_before_a_barrier_is_an_error(module: emulator.EmulatedModule) -> None:
    y = np.zeros(64, np.float32)
    with pytest.raises(emulator.EmulationError, match="1 threads exited while 63 wait at __syncthreads"):
        module.get_function("t::early_exit")((1,), (64,), (y,))


def test_a_lane_missing_from_a_warp_collective_is_an_error(module: emulator.EmulatedModule) -> None:
    y = np.zeros(32, np.float32)
    with pytest.raises(emulator.EmulationError, match="16 lanes exited while 16 wait in a warp collective"):
        module.get_function("t::half_warp_shuffle")((1,), (32,), (y,))


def test_a_write_past_dynamic_shared_memory_is_an_error(module: emulator.EmulatedModule) -> None:
    y = np.zeros(32, np.float32)
    kernel = module.get_function("t::overrun")
    kernel((1,), (32,), (y, np.int32(0)), shared_mem=32 * 4)
    with pytest.raises(emulator.EmulationError, match="outside the 128 bytes of dynamic shared memory"):
        kernel((1,), (32,), (y, np.int32(1)), shared_mem=32 * 4)


def test_cp_async_data_lands_at_the_wait(module: emulator.EmulatedModule) -> None:
    x = np.random.default_rng().standard_normal(32).astype(np.float32)
    before, after, zero = (np.full(32, 7.0, np.float32) for _ in range(3))
    module.get_function("t::copies")((1,), (32,), (x, before, after, zero), shared_mem=64 * 4)
    assert np.isnan(before).all()
    np.testing.assert_array_equal(after, x)
    np.testing.assert_array_equal(zero, 0)


def test_arguments_are_checked_against_the_parameters(module: emulator.EmulatedModule) -> None:
    x = np.zeros(32, np.float32)
    kernel = module.get_function("t::rotate_sum")
    assert kernel.parameter_sizes == (8, 8, 4, 4)
    with pytest.raises(TypeError, match="argument 2 is a float64 of 8 bytes; the parameter has 4"):
        kernel((1,), (32,), (x, x, np.float64(3), np.int32(1)), shared_mem=128)
    with pytest.raises(TypeError, match="expected 4 arguments, received 3"):
        kernel((1,), (32,), (x, x, np.float32(3)), shared_mem=128)


def _warp_sync(
    module: emulator.EmulatedModule, x: np.ndarray, synced: bool, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    y, any_negative = np.full(32, 7.0, np.float32), np.full(32, -1, np.int32)
    kernel = module.get_function("t::warp_sync")
    kernel((1,), (32,), (x, y, any_negative, np.int32(synced)), shared_mem=32 * 4, seed=seed)
    return y, any_negative


def test_syncwarp_orders_the_lanes_and_any_sync_votes(module: emulator.EmulatedModule) -> None:
    """__syncwarp makes every lane's earlier shared-memory write visible to the others (without it,
    some lane order of the seeds reads poison); __any_sync gives every lane the warp's vote."""
    x = np.random.default_rng().uniform(0.5, 1.0, 32).astype(np.float32)
    for seed in range(4):
        y, any_negative = _warp_sync(module, x, True, seed)
        np.testing.assert_array_equal(y, np.roll(x, -1))
        np.testing.assert_array_equal(any_negative, 0)
    x[17] = -x[17]
    assert (_warp_sync(module, x, True, 0)[1] == 1).all()
    assert any(np.isnan(_warp_sync(module, x, False, seed)[0]).any() for seed in range(8))


#: Run in a child with FASTATTN_EMULATOR_SANITIZE=1 and the ASan runtime preloaded: clean launches
#: (barriers, shuffles and a failing launch, so fibers switch and unwind), then a global read past
#: the end of x, which must abort.
_SANITIZED_CHILD = r'''
import sys
import numpy as np
from fastattn._gpu import emulator
from tests.emulator.test_simt import NAMES, SOURCE

READ_PAST = """
__global__ void read_past(const float* x, float* y, int past) {
    __syncthreads();
    y[threadIdx.x] = x[threadIdx.x + past];
}
"""
module = emulator.compile_source(SOURCE + READ_PAST, NAMES + ("read_past",))
x = np.random.default_rng().standard_normal(64).astype(np.float32)
y = np.full_like(x, np.nan)
module.get_function("t::rotate_sum")((2,), (32,), (x, y, np.float32(3), np.int32(1)), shared_mem=32 * 4)
try:
    module.get_function("t::early_exit")((1,), (64,), (y,))
except emulator.EmulationError:
    pass
module.get_function("read_past")((1,), (64,), (x, y, np.int32(0)))
print("clean", flush=True)
module.get_function("read_past")((1,), (64,), (x, y, np.int32(int(sys.argv[1]))))
print("no report", flush=True)
'''


def test_the_sanitized_build_reports_a_read_past_a_global_array(tmp_path: Path) -> None:
    """CI's sanitized stage relies on it: AddressSanitizer follows the emulated threads' fiber stacks
    (no false report from a switch or an unwind) and stops a kernel that reads past an array."""
    # The ASan runtime first, then libstdc++ (ASan's throw interceptor needs the real __cxa_throw).
    runtimes = [
        subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        for name in ("libasan.so", "libstdc++.so")
    ]
    if not all(os.path.isabs(runtime) for runtime in runtimes):
        pytest.skip(f"no AddressSanitizer runtime for gcc: {runtimes}")
    environment = {
        **os.environ,
        "LD_PRELOAD": ":".join(runtimes),
        "ASAN_OPTIONS": "detect_leaks=0",
        "FASTATTN_EMULATOR_SANITIZE": "1",
        "FASTATTN_EMULATOR_CACHE": str(tmp_path),
    }
    child = subprocess.run(
        [sys.executable, "-c", _SANITIZED_CHILD, "1"],
        env=environment,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
    )
    assert "clean" in child.stdout, child.stderr[-3000:]
    assert "no report" not in child.stdout and child.returncode != 0
    assert "heap-buffer-overflow" in child.stderr and "read_past" in child.stderr, child.stderr[-3000:]
    assert "False positive" not in child.stderr, child.stderr[-3000:]
