// Flash attention forward for NVIDIA tensor cores (sm_80+), float16 / bfloat16 in, float32 math.
//
// STATUS: compiled by nvcc for sm_80 and sm_90 in CI; it has NOT yet run on a GPU (issue #6 owes
// the H100 runs).  The cuda backend registers it only on a machine with a CUDA device, and the
// conformance suite then checks it against the float64 oracle like every other backend.
//
// Algorithm (FlashAttention-2): one thread block per (64 query rows, query head, batch row);
// 4 warps, each owning 16 query rows for the whole key loop, so the online softmax needs only
// shuffles inside a quad of lanes.  Per key tile of BLOCK_N keys:
//   S = Q K^T      mma.sync.m16n8k16 (A = Q rows via ldmatrix, B = K rows via ldmatrix)
//   online softmax in registers: running max m, sum l, exp2 with scale*log2(e) folded in
//   O += P V       (A = P re-packed from the S accumulators, B = V via ldmatrix.trans)
// K and V tiles are double-buffered in shared memory with cp.async (16-byte copies, zero-filled
// past the sequence end), so the next tile loads while the tensor cores work on this one.
// Shared-memory rows are padded by 8 elements so that ldmatrix's 8 row addresses hit distinct
// banks.  Tile sizes: BLOCK_M = 64 (4 warps x m16), BLOCK_N = 64 keys (32 for head_dim 256, to
// keep two K/V stages within the shared memory an SM can give one block).
//
// Contract features, all in-kernel: GQA (query head h reads kv head h / group), causal with both
// alignments (`offset` = key position of query 0), sliding window, key_lengths (the key loop stops
// at the last visible tile; fully masked tiles are never loaded), bool or float mask read by
// strides, softcap, any strides with a contiguous last axis (16-byte aligned rows).  A row that sees
// no key writes 0 and lse = -inf.
#include "flash_common.cuh"

namespace fastattn_gpu {

constexpr int kWarps = 4;
constexpr int kBlockM = 16 * kWarps;

template <typename Elem, int HEAD_DIM, int BLOCK_N>
__global__ void __launch_bounds__(kWarps * 32)
flash_forward(const Elem* __restrict__ q, const Elem* __restrict__ k, const Elem* __restrict__ v,
              Elem* __restrict__ out, float* __restrict__ lse, long long q_sb, long long q_sh, long long q_ss,
              long long k_sb, long long k_sh, long long k_ss, long long v_sb, long long v_sh, long long v_ss,
              long long o_sb, long long o_sh, long long o_ss, long long lse_sb, long long lse_sh, int seq_q,
              int seq_k, int group, float scale, float softcap, int causal, int offset, int window_left,
              int window_right, const void* __restrict__ mask, int mask_kind, long long m_sb, long long m_sh,
              long long m_sq, long long m_sk, const long long* __restrict__ key_lengths) {
    constexpr int kRow = HEAD_DIM + kPad;
    constexpr int kSteps = HEAD_DIM / 16;  // k16 steps of Q K^T
    constexpr int kKeyBlocks = BLOCK_N / 8;
    constexpr int kOutBlocks = HEAD_DIM / 8;
    extern __shared__ __align__(16) unsigned char shared_bytes[];
    Elem* q_tile = reinterpret_cast<Elem*>(shared_bytes);
    Elem* k_tiles = q_tile + kBlockM * kRow;         // [2][BLOCK_N][kRow]
    Elem* v_tiles = k_tiles + 2 * BLOCK_N * kRow;    // [2][BLOCK_N][kRow]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m0 = blockIdx.x * kBlockM, h = blockIdx.y, b = blockIdx.z, kvh = h / group;
    const Elem* q_base = q + b * q_sb + h * q_sh;
    const Elem* k_base = k + b * k_sb + kvh * k_sh;
    const Elem* v_base = v + b * v_sb + kvh * v_sh;

    const ScoreRule rule{{causal, offset, window_left, window_right, mask, mask_kind, m_sb, m_sh, m_sq, m_sk,
                          key_lengths},
                         seq_q, scale, softcap};
    // Keys any row of this block can see.
    int lo, hi;
    rule.rules.key_range(b, seq_k, m0, min(m0 + kBlockM, seq_q) - 1, &lo, &hi);
    lo = max(lo, 0) / BLOCK_N * BLOCK_N;

    load_tile<Elem, HEAD_DIM, kBlockM, kWarps * 32>(q_tile, q_base, q_ss, m0, seq_q);
    if (lo < hi) load_tile<Elem, HEAD_DIM, BLOCK_N, kWarps * 32>(k_tiles, k_base, k_ss, lo, hi);
    if (lo < hi) load_tile<Elem, HEAD_DIM, BLOCK_N, kWarps * 32>(v_tiles, v_base, v_ss, lo, hi);
    cp_async_commit();

    const int group_id = lane / 4, pair = (lane % 4) * 2;
    const int rows[2] = {m0 + warp * 16 + group_id, m0 + warp * 16 + group_id + 8};
    float row_max[2] = {negative_infinity(), negative_infinity()}, row_sum[2] = {0.f, 0.f};
    float acc[kOutBlocks][4];
#pragma unroll
    for (int nb = 0; nb < kOutBlocks; ++nb) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.f;

    int stage = 0;
    for (int kt = lo; kt < hi; kt += BLOCK_N, stage ^= 1) {
        if (kt + BLOCK_N < hi) {  // prefetch the next tile into the other stage
            load_tile<Elem, HEAD_DIM, BLOCK_N, kWarps * 32>(k_tiles + (stage ^ 1) * BLOCK_N * kRow, k_base, k_ss, kt + BLOCK_N, hi);
            load_tile<Elem, HEAD_DIM, BLOCK_N, kWarps * 32>(v_tiles + (stage ^ 1) * BLOCK_N * kRow, v_base, v_ss, kt + BLOCK_N, hi);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const Elem* k_tile = k_tiles + stage * BLOCK_N * kRow;
        const Elem* v_tile = v_tiles + stage * BLOCK_N * kRow;

        // S = Q K^T for this warp's 16 rows and BLOCK_N keys.
        float s[kKeyBlocks][4];
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
        for (int step = 0; step < kSteps; step += 2) {
            unsigned int a[2][4];
            ldmatrix_x4(a[0], q_tile + (warp * 16 + (lane & 15)) * kRow + step * 16 + (lane >> 4) * 8);
            if (step + 1 < kSteps)
                ldmatrix_x4(a[1], q_tile + (warp * 16 + (lane & 15)) * kRow + (step + 1) * 16 + (lane >> 4) * 8);
#pragma unroll
            for (int nb = 0; nb < kKeyBlocks; ++nb) {
                unsigned int bk[4];  // b fragments for k-steps `step` (bk[0..1]) and `step + 1` (bk[2..3])
                ldmatrix_x4(bk, k_tile + (nb * 8 + (lane & 7)) * kRow + step * 16 + (lane >> 3) * 8);
                Pack<Elem>::mma(s[nb], a[0], bk);
                if (step + 1 < kSteps) Pack<Elem>::mma(s[nb], a[1], bk + 2);
            }
        }

        // Softcap, masks, then the online softmax (exp2 with the scale folded in).
        float tile_max[2] = {negative_infinity(), negative_infinity()};
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float slope;
                s[nb][e] = rule.log2_score(s[nb][e], b, h, rows[e / 2], kt + nb * 8 + pair + (e % 2), hi, &slope);
                tile_max[e / 2] = fmaxf(tile_max[e / 2], s[nb][e]);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
            tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
            const float new_max = fmaxf(row_max[r], tile_max[r]);
            const float shift = new_max == negative_infinity() ? 0.f : new_max;
            alpha[r] = exp2f(row_max[r] - shift);
            row_max[r] = new_max;
            row_sum[r] *= alpha[r];
        }
#pragma unroll
        for (int nb = 0; nb < kOutBlocks; ++nb) {
            acc[nb][0] *= alpha[0];
            acc[nb][1] *= alpha[0];
            acc[nb][2] *= alpha[1];
            acc[nb][3] *= alpha[1];
        }
        unsigned int p[kKeyBlocks / 2][4];
#pragma unroll
        for (int nb = 0; nb < kKeyBlocks; ++nb) {
            float prob[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float shift = row_max[e / 2] == negative_infinity() ? 0.f : row_max[e / 2];
                prob[e] = exp2f(s[nb][e] - shift);
                row_sum[e / 2] += prob[e];
            }
            // S accumulators (m16n8) -> A fragment (m16k16) of P: block 2t fills a0/a1, 2t+1 a2/a3.
            p[nb / 2][(nb % 2) * 2 + 0] = Pack<Elem>::two(prob[0], prob[1]);
            p[nb / 2][(nb % 2) * 2 + 1] = Pack<Elem>::two(prob[2], prob[3]);
        }

        // O += P V: k = keys (16 per step), n = head_dim (two 8-column blocks per ldmatrix.x4.trans).
#pragma unroll
        for (int ks = 0; ks < kKeyBlocks / 2; ++ks) {
#pragma unroll
            for (int nb = 0; nb < kOutBlocks; nb += 2) {
                unsigned int bv[4];
                ldmatrix_x4_trans(bv, v_tile + (ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kRow + nb * 8 +
                                          (lane >> 4) * 8);
                Pack<Elem>::mma(acc[nb], p[ks], bv);
                Pack<Elem>::mma(acc[nb + 1], p[ks], bv + 2);
            }
        }
        __syncthreads();  // this stage is overwritten by the prefetch of the tile after next
    }
    cp_async_wait<0>();

    // Normalise, write out and lse (natural log); rows that saw nothing get 0 and -inf.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float total = row_sum[r];
        total += __shfl_xor_sync(0xffffffff, total, 1);
        total += __shfl_xor_sync(0xffffffff, total, 2);
        const int row = rows[r];
        if (row >= seq_q) continue;
        const float inverse = total > 0.f ? 1.f / total : 0.f;
        Elem* dst = out + b * o_sb + h * o_sh + row * o_ss;
#pragma unroll
        for (int nb = 0; nb < kOutBlocks; ++nb) {
            dst[nb * 8 + pair] = Convert<Elem>::from_float(acc[nb][r * 2] * inverse);
            dst[nb * 8 + pair + 1] = Convert<Elem>::from_float(acc[nb][r * 2 + 1] * inverse);
        }
        if ((lane % 4) == 0)
            lse[b * lse_sb + h * lse_sh + row] = total > 0.f ? (row_max[r] + log2f(total)) * 0.6931471805599453f : negative_infinity();
    }
}

}  // namespace fastattn_gpu

#ifdef FASTATTN_INSTANTIATE
// nvcc compile check (CI): instantiate every configuration the launcher can request.
#define FASTATTN_FORWARD(ELEM, D, N) template __global__ void fastattn_gpu::flash_forward<ELEM, D, N>( \
    const ELEM*, const ELEM*, const ELEM*, ELEM*, float*, long long, long long, long long, long long, long long, \
    long long, long long, long long, long long, long long, long long, long long, long long, long long, int, int, \
    int, float, float, int, int, int, int, const void*, int, long long, long long, long long, long long, \
    const long long*);
FASTATTN_FORWARD(__half, 32, 64) FASTATTN_FORWARD(__half, 64, 64) FASTATTN_FORWARD(__half, 96, 64)
FASTATTN_FORWARD(__half, 128, 64) FASTATTN_FORWARD(__half, 256, 32)
FASTATTN_FORWARD(__nv_bfloat16, 32, 64) FASTATTN_FORWARD(__nv_bfloat16, 64, 64) FASTATTN_FORWARD(__nv_bfloat16, 96, 64)
FASTATTN_FORWARD(__nv_bfloat16, 128, 64) FASTATTN_FORWARD(__nv_bfloat16, 256, 32)
#endif
