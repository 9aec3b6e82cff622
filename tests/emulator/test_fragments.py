"""The emulated PTX warp instructions against a numpy model of the PTX ISA's documented layouts
("Matrix Fragments for mma.m16n8k16 with floating point type"; "Warp-level matrix load
instruction: ldmatrix"), and the half/bfloat16 conversions against numpy's and ml_dtypes'."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fastattn._gpu import emulator

SOURCE = r"""
#include "ptx.cuh"
namespace t {
// Lane l passes registers a[l][0..3], b[l][0..1], c[l][0..3] and gets d[l][0..3].
template <int BF16>
__global__ void mma(const unsigned* a, const unsigned* b, const float* c, float* d) {
    const int l = threadIdx.x;
    unsigned ra[4], rb[2];
    float rc[4];
    for (int i = 0; i < 4; ++i) { ra[i] = a[4 * l + i]; rc[i] = c[4 * l + i]; }
    rb[0] = b[2 * l]; rb[1] = b[2 * l + 1];
    if (BF16) fastattn_gpu::mma_m16n8k16_bf16(rc, ra, rb); else fastattn_gpu::mma_m16n8k16_f16(rc, ra, rb);
    for (int i = 0; i < 4; ++i) d[4 * l + i] = rc[i];
}
// Four 8x8 matrices of 16-bit words, matrix j's row r at row 8j + r of a 32 x (8 + 8) padded tile.
template <int TRANS>
__global__ void ldmatrix(const unsigned short* m, unsigned* r) {
    extern __shared__ __align__(16) unsigned char bytes[];
    unsigned short* tile = reinterpret_cast<unsigned short*>(bytes);
    const int l = threadIdx.x;
    for (int c = 0; c < 8; ++c) tile[l * 16 + c] = m[l * 8 + c];
    __syncthreads();
    unsigned out[4];
    const auto at = fastattn_gpu::shared_address(tile + l * 16);
    if (TRANS) fastattn_gpu::ldmatrix_x4_trans(out, at); else fastattn_gpu::ldmatrix_x4(out, at);
    for (int j = 0; j < 4; ++j) r[4 * l + j] = out[j];
}
__global__ void convert(const float* x, unsigned short* h, unsigned short* b, float* back_h, float* back_b) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const __half half = __float2half_rn(x[i]);
    const __nv_bfloat16 brain = __float2bfloat16_rn(x[i]);
    h[i] = *reinterpret_cast<const unsigned short*>(&half);
    b[i] = *reinterpret_cast<const unsigned short*>(&brain);
    back_h[i] = __half2float(half);
    back_b[i] = __bfloat162float(brain);
}
}  // namespace t
"""
NAMES = ("t::mma<0>", "t::mma<1>", "t::ldmatrix<0>", "t::ldmatrix<1>", "t::convert")
LANES = np.arange(32)
GROUP, THREAD = LANES // 4, LANES % 4


@pytest.fixture(scope="module")
def module() -> emulator.EmulatedModule:
    return emulator.compile_source(SOURCE, NAMES)


def _pack(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """32-bit registers of two 16-bit elements: the lower-indexed one in the low half."""
    return low.view(np.uint16).astype(np.uint32) | (high.view(np.uint16).astype(np.uint32) << 16)


def _a_registers(a: np.ndarray) -> np.ndarray:
    """A (16 x 16, row-major): a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)."""
    g, t = GROUP, THREAD
    pairs = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
    return np.stack([_pack(a[row, col], a[row, col + 1]) for row, col in pairs], axis=1)


def _b_registers(b: np.ndarray) -> np.ndarray:
    """B (16 x 8, K x N, column-major operand): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)."""
    g, t = GROUP, THREAD
    return np.stack([_pack(b[2 * t + 8 * i, g], b[2 * t + 8 * i + 1, g]) for i in range(2)], axis=1)


def _c_registers(c: np.ndarray) -> np.ndarray:
    """C/D (16 x 8 float): c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)."""
    g, t = GROUP, THREAD
    return np.stack([c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1]], axis=1)


@pytest.mark.parametrize(("kernel", "dtype"), [("t::mma<0>", np.float16), ("t::mma<1>", ml_dtypes.bfloat16)])
def test_mma_follows_the_fragment_layout(module: emulator.EmulatedModule, kernel: str, dtype: type) -> None:
    rng = np.random.default_rng()
    a = rng.standard_normal((16, 16)).astype(dtype)
    b = rng.standard_normal((16, 8)).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((32, 4), np.nan, np.float32)
    args = (np.ascontiguousarray(_a_registers(a)), np.ascontiguousarray(_b_registers(b)), _c_registers(c).copy(), d)
    module.get_function(kernel)((1,), (32,), args)
    expected = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, _c_registers(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transpose", [False, True])
def test_ldmatrix_follows_the_fragment_layout(module: emulator.EmulatedModule, transpose: bool) -> None:
    words = np.random.default_rng().integers(0, 2**16, size=(4, 8, 8), dtype=np.uint16)
    r = np.zeros((32, 4), np.uint32)
    module.get_function(f"t::ldmatrix<{int(transpose)}>")(
        (1,), (32,), (words.reshape(32, 8).copy(), r), shared_mem=32 * 32
    )
    matrices = words.transpose(0, 2, 1) if transpose else words
    for j in range(4):
        low, high = matrices[j, GROUP, 2 * THREAD], matrices[j, GROUP, 2 * THREAD + 1]
        np.testing.assert_array_equal(r[:, j], low.astype(np.uint32) | (high.astype(np.uint32) << 16))


def test_conversions_round_to_nearest_even(module: emulator.EmulatedModule) -> None:
    rng = np.random.default_rng()
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 6e-8, 2.98e-8, 2.99e-8, 1e-40, -3e38]
    ties = np.float32(1.0) + np.float32(2.0**-11) * np.arange(1, 8, 2)  # halfway between halves
    values = np.concatenate([special, ties, rng.standard_normal(1000) * 10.0 ** rng.integers(-9, 6, 1000)])
    x = np.resize(values.astype(np.float32), 1024)
    h, b = np.zeros(1024, np.uint16), np.zeros(1024, np.uint16)
    back_h, back_b = np.zeros(1024, np.float32), np.zeros(1024, np.float32)
    module.get_function("t::convert")((8,), (128,), (x, h, b, back_h, back_b))
    finite = ~np.isnan(x)
    with np.errstate(over="ignore"):  # numpy warns when it rounds past 65504 to infinity, as it should
        as_half = x[finite].astype(np.float16)
    np.testing.assert_array_equal(h[finite], as_half.view(np.uint16))
    np.testing.assert_array_equal(b[finite], x[finite].astype(ml_dtypes.bfloat16).view(np.uint16))
    assert np.isnan(back_h[~finite]).all() and np.isnan(back_b[~finite]).all()
    np.testing.assert_array_equal(back_h[finite], as_half.astype(np.float32))
    np.testing.assert_array_equal(back_b[finite], x[finite].astype(ml_dtypes.bfloat16).astype(np.float32))
