/* Philox4x32-10 (Salmon, Moraes, Dror and Shaw, SC 2011) and the attention-dropout mask built on it.
 *
 * Counter-based: the keep/drop decision of score element (b, h, i, j) is a pure function of
 * (seed, offset, b, h, i, j), so the forward and the backward regenerate the same mask without
 * storing it, whatever the tiling or thread count, and any other implementation of the same
 * function (fastattn/_dropout.py for the reference backend, the CUDA kernels) gives the same bits:
 *   key     = (seed mod 2^32, seed div 2^32)
 *   counter = (j div 4, i, b * Hq + h, offset)
 *   word    = output[j mod 4]
 *   keep   <=> word >= threshold,  threshold = floor(dropout_p * 2^32)  (2^32, nothing kept, at p = 1)
 * and a kept probability is multiplied by 1 / (1 - dropout_p).
 *
 * Plain C types only (no <cstdint>): this header also compiles under NVRTC.
 */
#ifndef FASTATTN_PHILOX_H
#define FASTATTN_PHILOX_H

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FASTATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTATTN_HOST_DEVICE static inline
#endif

namespace fastattn_philox {

/* Ten rounds of Philox4x32 on `counter` under `key` (Random123's constants). */
FASTATTN_HOST_DEVICE void philox4x32_10(const unsigned int counter[4], const unsigned int key[2],
                                        unsigned int out[4]) {
    unsigned int c0 = counter[0], c1 = counter[1], c2 = counter[2], c3 = counter[3];
    unsigned int k0 = key[0], k1 = key[1];
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned long long p0 = 0xD2511F53ull * c0;
        const unsigned long long p1 = 0xCD9E8D57ull * c2;
        const unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
        const unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

/* The four random words of keys 4*block .. 4*block+3 for one query row. */
FASTATTN_HOST_DEVICE void dropout_words(const unsigned int key[2], unsigned int offset, unsigned int head_row,
                                        unsigned int query, unsigned int block, unsigned int out[4]) {
    const unsigned int counter[4] = {block, query, head_row, offset};
    philox4x32_10(counter, key, out);
}

}  // namespace fastattn_philox

#endif
