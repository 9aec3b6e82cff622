/* Portable SIMD for the CPU kernels: GCC/Clang vector extensions, one native register wide.
 *
 * The kernels are written once over Vec<T>::type (T = float or double).  The width is the widest
 * register the compiler targets: 64 bytes with AVX-512 (16 floats), else 32 bytes (AVX2: 8 floats;
 * on other targets the compiler splits it into what the machine has).  setup.py compiles this
 * code once per instruction-set level (isa.h), so each level's kernels use its own registers.
 *
 * Also here: a vectorised exp for float (Cephes' polynomial with exact 2^n scaling, ~1 ulp, and
 * exactly 0 below the underflow threshold, so exp(-inf) = 0 as masking needs) and the bit-level
 * conversions between float and float16 / bfloat16 used to read and write half-precision arrays.
 */
#ifndef FASTATTN_SIMD_H
#define FASTATTN_SIMD_H

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "isa.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define FASTATTN_VECTOR_BYTES 64
#if defined(__AVX512BF16__)
#define FASTATTN_HAS_AVX512BF16 1 /* the avx512bf16 and amx levels: flash_bf16.h's pairs */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FASTATTN_HAS_AMX 1 /* the AMX level: flash_amx.h's bfloat16 forward */
#endif
#endif
#else
#define FASTATTN_VECTOR_BYTES 32
#endif

/* Before each loop over a micro-kernel's register block (MR x NV accumulators, their loads and
 * stores).  Without it GCC 12 unrolls those loops only after scalar replacement has run, so the
 * `acc[MR][NV]` arrays keep a home on the stack, and every call stored and reloaded its
 * accumulators there around the FMA loop.  With it, and vload/vstore below, the avx2 level's
 * qk_kernel<float, 6, 2>, pv_kernel and outer_kernel went from 36, 42 and 48 vector accesses to
 * the stack to none (115 -> 76, 138 -> 96, 158 -> 106 instructions); the backward's micro-kernels
 * took ~10% fewer samples (2-core Zen 3).  The arithmetic is the same: outputs are bit-identical. */
#define FASTATTN_UNROLL _Pragma("GCC unroll 16")

namespace fastattn {
inline namespace FASTATTN_ISA_NAMESPACE {

template <typename T> struct Vec;

template <> struct Vec<float> {
    typedef float type __attribute__((vector_size(FASTATTN_VECTOR_BYTES)));
    typedef int32_t itype __attribute__((vector_size(FASTATTN_VECTOR_BYTES)));
    static constexpr int lanes = FASTATTN_VECTOR_BYTES / 4;
};

template <> struct Vec<double> {
    typedef double type __attribute__((vector_size(FASTATTN_VECTOR_BYTES)));
    typedef int64_t itype __attribute__((vector_size(FASTATTN_VECTOR_BYTES)));
    static constexpr int lanes = FASTATTN_VECTOR_BYTES / 8;
};

/* Unaligned vector access through a may_alias type.  A memcpy into a register block's element
 * (pv_kernel's and outer_kernel's accumulators start from memory) kept the block on the stack even
 * with its loops unrolled. */
template <typename V> static inline V vload(const void* p) {
    typedef V Unaligned __attribute__((aligned(1), may_alias));
    return *static_cast<const Unaligned*>(p);
}

template <typename V> static inline void vstore(void* p, V v) {
    typedef V Unaligned __attribute__((aligned(1), may_alias));
    *static_cast<Unaligned*>(p) = v;
}

/* x - 0 is exactly x for every x (-0 included), so the compiler folds it into one broadcast. */
template <typename T> static inline typename Vec<T>::type vbroadcast(T x) {
    return x - typename Vec<T>::type{};
}

/* Sum of the lanes. */
template <typename T> static inline T vsum(typename Vec<T>::type v) {
    T total = 0;
    for (int i = 0; i < Vec<T>::lanes; ++i) total += v[i];
    return total;
}

/* ---- sums of L vectors at once (transpose-reduce) -------------------------------------------
 *
 * reduce_lanes(x) turns L vectors x[0..L-1] into one vector whose lanes are their L lane sums,
 * in L - 1 "folds" instead of L horizontal sums: each fold adds the lower and upper halves of
 * every segment of two vectors, so segment width halves while the number of vectors halves.
 * The result's lane order is a fixed permutation (ReducedOrder below; reduce_lanes_in_order undoes it). */
template <int L, int W, int HIGH, int I> constexpr int fold_index() {
    return ((I / (W / 2)) % 2) * L + ((I / (W / 2)) / 2) * W + I % (W / 2) + (HIGH ? W / 2 : 0);
}

template <typename V, int L, int W, int HIGH, int... I>
static inline V fold_pick(V a, V b, std::integer_sequence<int, I...>) {
    return __builtin_shufflevector(a, b, fold_index<L, W, HIGH, I>()...);
}

template <typename V, int L, int W> struct FoldLevels {
    __attribute__((always_inline)) static inline void run(V* x) {
        using Lanes = std::make_integer_sequence<int, L>;
        for (int i = 0; i < W / 2; ++i)
            x[i] = fold_pick<V, L, W, 0>(x[2 * i], x[2 * i + 1], Lanes{}) +
                   fold_pick<V, L, W, 1>(x[2 * i], x[2 * i + 1], Lanes{});
        FoldLevels<V, L, W / 2>::run(x);
    }
};
template <typename V, int L> struct FoldLevels<V, L, 1> {
    static inline void run(V*) {}
};

template <typename T> static inline typename Vec<T>::type reduce_lanes(typename Vec<T>::type* x) {
    FoldLevels<typename Vec<T>::type, Vec<T>::lanes, Vec<T>::lanes>::run(x);
    return x[0];
}

/* Where reduce_lanes leaves each input vector's sum (the folds replayed at compile time):
 * lane[source vector] = lane. */
template <int L> struct ReducedOrder {
    int lane[L] = {};
    constexpr ReducedOrder() {
        int segment_key[L][L] = {}; /* [vector][segment] */
        for (int v = 0; v < L; ++v) segment_key[v][0] = v;
        for (int width = L, count = L; width > 1; width /= 2, count /= 2) {
            const int segments = L / width;
            for (int i = 0; i < count / 2; ++i) {
                int merged[L] = {};
                for (int t = 0; t < 2 * segments; ++t) merged[t] = segment_key[2 * i + t % 2][t / 2];
                for (int t = 0; t < 2 * segments; ++t) segment_key[i][t] = merged[t];
            }
        }
        for (int l = 0; l < L; ++l) lane[segment_key[0][l]] = l;
    }
};

template <typename V, int L, int... I> static inline V source_order(V sums, std::integer_sequence<int, I...>) {
    constexpr ReducedOrder<L> order{};
    return __builtin_shufflevector(sums, sums, order.lane[I]...);
}

/* The sums of eight vectors of eight floats, lane i holding x[i]'s, folded within 128-bit halves
 * first (pair_sums: two in-half shuffles and an add a pair of vectors, as x86's shufps does them)
 * and across the halves once, at the end.  reduce_lanes folds across the halves first, four times
 * (vperm2f128, 8 micro-ops on Zen 1), and permutes the result back into order.  The 4-row bfloat16
 * decode in cache ran 1.012x faster so on a 2-core Zen 1 (EPYC family 23 model 1), though the old
 * reduction had 14% of dot_tile's samples (probably waiting on the FMAs before it). */
template <typename V> static inline V pair_sums(V a, V b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

template <typename V> static inline V reduce_eight_in_order(const V* x) {
    const V first = pair_sums(pair_sums(x[0], x[1]), pair_sums(x[2], x[3]));
    const V second = pair_sums(pair_sums(x[4], x[5]), pair_sums(x[6], x[7]));
    return __builtin_shufflevector(first, second, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(first, second, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* reduce_lanes' result with lane i holding the sum of x[i] (one permute); eight float lanes by
 * reduce_eight_in_order. */
template <typename T> static inline typename Vec<T>::type reduce_lanes_in_order(typename Vec<T>::type* x) {
    constexpr int L = Vec<T>::lanes;
    if constexpr (std::is_same<T, float>::value && L == 8)
        return reduce_eight_in_order(x);
    else
        return source_order<typename Vec<T>::type, L>(reduce_lanes<T>(x), std::make_integer_sequence<int, L>{});
}

/* Makes the compiler hold v in a register from here on: an empty asm that "changes" it.  For a
 * vector loaded once and used by several FMAs, where GCC (its generic tuning) would load it again as
 * a memory operand of each FMA instead: on cores that move one or two 32-byte vectors a cycle from
 * L1 (Zen 1: one) those extra loads, not the FMAs, set a loop's pace.  Elsewhere (no AVX) a no-op. */
template <typename V> static inline void hold_in_register(V& v) {
#if defined(__AVX512F__)
    __asm__("" : "+v"(v));
#elif defined(__AVX__)
    __asm__("" : "+x"(v));
#else
    (void)v;
#endif
}

/* Bitwise select: lanes of a where mask is all ones, else b (mask from a vector comparison). */
template <typename V, typename M> static inline V vselect(M mask, V a, V b) {
    return (V)(((M)a & mask) | ((M)b & ~mask));
}

/* a > b ? a : b per lane (b where either is NaN): GCC and Clang make it x86's maxps, one
 * instruction on the critical path of a running maximum. */
template <typename V> static inline V vmax(V a, V b) { return a > b ? a : b; }

/* Whether every lane of a equals b's (false where either is NaN): one compare and a mask test. */
static inline bool vequal_all(Vec<float>::type a, Vec<float>::type b) {
#if FASTATTN_VECTOR_BYTES == 64
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_NEQ_UQ) == 0;
#elif defined(__AVX__)
    return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_NEQ_UQ)) == 0;
#else
    bool equal = true;
    for (int lane = 0; lane < Vec<float>::lanes; ++lane) equal = equal && a[lane] == b[lane];
    return equal;
#endif
}

static inline bool vequal_all(Vec<double>::type a, Vec<double>::type b) {
#if FASTATTN_VECTOR_BYTES == 64
    return _mm512_cmp_pd_mask((__m512d)a, (__m512d)b, _CMP_NEQ_UQ) == 0;
#elif defined(__AVX__)
    return _mm256_movemask_pd(_mm256_cmp_pd((__m256d)a, (__m256d)b, _CMP_NEQ_UQ)) == 0;
#else
    bool equal = true;
    for (int lane = 0; lane < Vec<double>::lanes; ++lane) equal = equal && a[lane] == b[lane];
    return equal;
#endif
}

/* exp for float lanes: Cephes expf (range reduction by n = round(x log2 e), degree-6 polynomial,
 * 2^n built in the exponent bits); inputs below ln(FLT_MIN) give exactly 0, -inf included.  The
 * clamping compares keep a NaN input NaN (a NaN score must poison its row, as in the reference). */
static inline Vec<float>::type vexp(Vec<float>::type x) {
    typedef Vec<float>::type V;
    typedef Vec<float>::itype I;
    const V high = vbroadcast(88.3762626647949f);
    const V low = vbroadcast(-87.3365447504019f);
    I underflow = x < low;
    x = vselect(underflow, low, x);
    x = vselect(x > high, high, x);
    const V magic = vbroadcast(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    V shifted = x * 1.44269504088896341f + magic;
    V n = shifted - magic;
    I exponent = (I)shifted - (I)magic;
    V r = x - n * 0.693359375f + n * 2.12194440e-4f;
    V y = vbroadcast(1.9875691500E-4f);
    y = y * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * r * r + r + 1.0f;
    V scale = (V)((exponent + 127) << 23);
    return (V)((I)(y * scale) & ~underflow);
}

/* 2^t for the softmax's float lanes: t = (score - running max) log2(e), formed by the caller in one
 * FMA as score * log2(e) - max * log2(e) (as FlashAttention does), so t <= 0 up to rounding (the
 * result is not clamped above: t must stay below 128), -inf, or NaN.  Below t = -126 the result is
 * exactly 0 (-inf gives 0 as masking needs, and no subnormal ever reaches the P.V products); NaN
 * stays NaN.  The reduction need not be exact: the error of t is absolute, ulp(max * log2(e)), and a
 * probability's error matters relative to the row's largest one (1), not to itself.
 *   AVX-512: t = r + f with r = round(32 t) / 32 (|f| <= 1/64); 2^r = 2^floor(r) 2^(j/32), j the low
 *   five bits of the rounded value, 2^(j/32) from a 32-entry table held in two registers (vpermt2ps),
 *   2^f by a degree-2 polynomial fitted for relative error, 2^floor(r) and the zeroing of underflowed
 *   lanes by one vscalefps: 9 instructions, relative error <= 1.7e-7 (measured over t in [-126, 0]).
 *   AVX2: t = r + f with r = round(8 t) / 8 (|f| <= 1/16); 2^r = 2^floor(r) 2^(j/8), j the low three
 *   bits of the rounded value, 2^(j/8) from an 8-entry table in one register (vpermps), 2^f - 1 by a
 *   degree-3 polynomial fitted for relative error, times 2^floor(r) built in the exponent bits:
 *   14 instructions, 8 of them on the FMA units (the degree-6 polynomial below had 11), relative
 *   error <= 1.2e-7 (measured over t in [-126, 0]).  The softmax's exponentials ran 7% faster in a
 *   loop over one 64-row x 128-key tile (2-core Zen 3).
 *   Elsewhere: t = n + f (n = round(t), |f| <= 1/2), 2^f by a degree-6 polynomial (<= 1e-7),
 *   times 2^n built in the exponent bits: about 13 instructions. */
static inline Vec<float>::type vexp2_softmax(Vec<float>::type t) {
    typedef Vec<float>::type V;
#if FASTATTN_VECTOR_BYTES == 64
    alignas(64) static const float powers[32] = {
        1.000000000e+00f, 1.021897197e+00f, 1.044273734e+00f, 1.067140460e+00f, 1.090507746e+00f, 1.114386797e+00f,
        1.138788581e+00f, 1.163724899e+00f, 1.189207077e+00f, 1.215247393e+00f, 1.241857767e+00f, 1.269050956e+00f,
        1.296839595e+00f, 1.325236678e+00f, 1.354255557e+00f, 1.383909941e+00f, 1.414213538e+00f, 1.445180774e+00f,
        1.476826191e+00f, 1.509164453e+00f, 1.542210817e+00f, 1.575980902e+00f, 1.610490322e+00f, 1.645755529e+00f,
        1.681792855e+00f, 1.718619347e+00f, 1.756252170e+00f, 1.794709086e+00f, 1.834008098e+00f, 1.874167681e+00f,
        1.915206552e+00f, 1.957144141e+00f}; /* 2^(j/32), rounded to float */
    const __m512 x = (__m512)t;
    const __m512 magic = _mm512_set1_ps(393216.0f); /* 1.5 * 2^18: adding it rounds to a multiple of 1/32 */
    const __m512 shifted = _mm512_add_ps(x, magic);
    const __m512 r = _mm512_sub_ps(shifted, magic);
    const __m512 f = _mm512_sub_ps(x, r);
    const __m512 power = _mm512_permutex2var_ps(_mm512_load_ps(powers), _mm512_castps_si512(shifted),
                                                _mm512_load_ps(powers + 16));
    const __m512 poly = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_set1_ps(0.24022676f), f, _mm512_set1_ps(0.6931573f)), f);
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
    return (V)_mm512_maskz_scalef_ps(kept, _mm512_fmadd_ps(poly, power, power), r);
#elif defined(__AVX2__)
    typedef Vec<float>::itype I;
    alignas(32) static const float powers[8] = {1.000000000e+00f, 1.090507746e+00f, 1.189207077e+00f,
                                                1.296839595e+00f, 1.414213538e+00f, 1.542210817e+00f,
                                                1.681792855e+00f, 1.834008098e+00f}; /* 2^(j/8), rounded to float */
    const V magic = vbroadcast(1572864.0f); /* 1.5 * 2^20: adding it rounds to a multiple of 1/8 */
    const V shifted = t + magic;
    const V r = shifted - magic;
    const V f = t - r;
    const V power = (V)_mm256_permutevar8x32_ps(_mm256_load_ps(powers), (__m256i)shifted);
    const V poly = f * ((f * 5.549622e-2f + 2.4025764e-1f) * f + 6.9314724e-1f); /* 2^f - 1 */
    const I underflow = t < vbroadcast(-126.0f);
    /* The rounded value's low bits are 8 r (two's complement): shifted left by 20, its bits above the
     * three of j are floor(r) in the exponent's place. */
    const V scale = (V)((((I)shifted << 20) & (int)0xff800000u) + 0x3f800000);
    return (V)((I)((poly * power + power) * scale) & ~underflow);
#else
    typedef Vec<float>::itype I;
    const V magic = vbroadcast(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const V shifted = t + magic;
    const V n = shifted - magic;
    const V f = t - n;
    V y = vbroadcast(1.534578768769279e-4f);
    y = y * f + 1.3399930903688073e-3f;
    y = y * f + 9.618489071726799e-3f;
    y = y * f + 5.550328642129898e-2f;
    y = y * f + 2.4022646248340607e-1f;
    y = y * f + 6.931471824645996e-1f;
    y = y * f + 1.0f;
    const I underflow = t < vbroadcast(-126.0f);
    const V scale = (V)(((I)shifted - (I)magic + 127) << 23);
    return (V)((I)(y * scale) & ~underflow);
#endif
}

/* exp for double lanes: libm, lane by lane (float64 is the exact path, not the fast one). */
static inline Vec<double>::type vexp(Vec<double>::type x) {
    for (int i = 0; i < Vec<double>::lanes; ++i) x[i] = std::exp(x[i]);
    return x;
}

/* 2^t for double lanes (the float64 path's softmax): libm. */
static inline Vec<double>::type vexp2_softmax(Vec<double>::type t) {
    for (int i = 0; i < Vec<double>::lanes; ++i) t[i] = std::exp2(t[i]);
    return t;
}

/* Storage types of half-precision inputs (raw 16-bit patterns). */
struct half_bits { uint16_t bits; };
struct bfloat16_bits { uint16_t bits; };

static inline float to_float(float x) { return x; }
static inline double to_double(double x) { return x; }

static inline float to_float(bfloat16_bits x) {
    uint32_t bits = (uint32_t)x.bits << 16;
    float result;
    std::memcpy(&result, &bits, 4);
    return result;
}

/* float16 -> float, exact.  With F16C one instruction, as from_float_half's way back; else integer
 * steps.  forward_block packs Q and writes O element by element: with the integer steps at the avx2
 * level, float16 C1 ran 6-8% slower than float32, with F16C 2-3% (2-core Zen 3). */
static inline float to_float(half_bits x) {
#if defined(__F16C__)
    return _cvtsh_ss(x.bits);
#else
    uint32_t sign = (uint32_t)(x.bits & 0x8000u) << 16;
    uint32_t exponent = (x.bits >> 10) & 0x1fu;
    uint32_t mantissa = x.bits & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal half: normalise */
        int shift = 0;
        while ((mantissa & 0x400u) == 0) {
            mantissa <<= 1;
            ++shift;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float result;
    std::memcpy(&result, &bits, 4);
    return result;
#endif
}

/* float -> bfloat16, round to nearest even (nan stays nan). */
static inline bfloat16_bits from_float_bf16(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return bfloat16_bits{(uint16_t)((bits >> 16) | 0x40u)};
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return bfloat16_bits{(uint16_t)(bits >> 16)};
}

/* float -> float16, round to nearest even, overflow to inf, gradual underflow. */
static inline half_bits from_float_half(float x) {
#if defined(__F16C__)
    return half_bits{(uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)};
#else
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return half_bits{(uint16_t)(sign | 0x7e00u)};
    if (magnitude >= 0x477ff000u) return half_bits{(uint16_t)(sign | 0x7c00u)}; /* rounds past 65504 */
    if (magnitude < 0x38800000u) {                                                /* subnormal or zero */
        if (magnitude < 0x33000000u) return half_bits{sign};
        uint32_t exponent = magnitude >> 23;
        uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - exponent; /* 14 .. 24 */
        uint32_t half_mantissa = mantissa >> shift;
        uint32_t rest = mantissa & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1u);
        if (rest > halfway || (rest == halfway && (half_mantissa & 1u))) ++half_mantissa;
        return half_bits{(uint16_t)(sign | half_mantissa)};
    }
    uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return half_bits{(uint16_t)(sign | ((rounded - 0x38000000u) >> 13))};
#endif
}

template <typename Out> struct Store;
template <> struct Store<float> { static inline float from(float x) { return x; } };
template <> struct Store<double> { static inline double from(double x) { return x; } };
template <> struct Store<half_bits> { static inline half_bits from(float x) { return from_float_half(x); } };
template <> struct Store<bfloat16_bits> { static inline bfloat16_bits from(float x) { return from_float_bf16(x); } };

template <typename T, typename In> static inline T load_as(In x) { return (T)to_float(x); }
template <> inline double load_as<double, double>(double x) { return x; }

/* Whether load_vector converts In to T in registers (else one element at a time). */
template <typename T, typename In> constexpr bool converts_in_registers() {
    constexpr bool widened = std::is_same<T, float>::value && std::is_same<In, bfloat16_bits>::value;
    if constexpr (std::is_same<T, In>::value || widened) return true;
#if defined(__AVX512F__) || defined(__F16C__)
    return std::is_same<T, float>::value && std::is_same<In, half_bits>::value;
#else
    return false;
#endif
}

/* L consecutive stored elements as one vector of T, converted in registers: bfloat16's bits are a
 * float's high half (a widening and a shift); float16 through AVX-512's or F16C's conversion where
 * the level has one, else one element at a time. */
template <typename T, typename In> static inline typename Vec<T>::type load_vector(const In* src) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    constexpr bool to_float = std::is_same<T, float>::value;
    if constexpr (std::is_same<T, In>::value) {
        return vload<V>(src);
    } else if constexpr (to_float && std::is_same<In, bfloat16_bits>::value) {
#if defined(__AVX512F__)
        return (V)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
#elif defined(__AVX2__)
        return (V)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16);
#else
        typedef uint16_t Halves __attribute__((vector_size(2 * L)));
        typedef uint32_t Words __attribute__((vector_size(4 * L)));
        return (V)(__builtin_convertvector(vload<Halves>(src), Words) << 16);
#endif
#if defined(__AVX512F__) || defined(__F16C__)
    } else if constexpr (to_float && std::is_same<In, half_bits>::value) {
#if defined(__AVX512F__)
        return (V)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#else
        return (V)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#endif
#endif
    } else {
        T converted[L];
        for (int i = 0; i < L; ++i) converted[i] = load_as<T>(src[i]);
        return vload<V>(converted);
    }
}

/* Pair order: a row read 2L bfloat16 elements at a time as one vector of L words, whose low halves
 * are the even elements and whose high halves the odd ones.  Where the other operand of a dot
 * product (q) and the accumulators of a weighted sum of rows (O) are kept in the same order, each
 * 2L-element block's even elements first, then its odd ones, the words need no widening: a shift
 * and a mask make two vectors of floats, 1 instruction per L elements where load_vector takes 2
 * (a widening shuffle and a shift).  For T = float over bfloat16 rows. */
template <typename T, typename In> constexpr bool reads_in_pair_order() {
    return std::is_same<T, float>::value && std::is_same<In, bfloat16_bits>::value;
}

/* The 2L bfloat16 elements at src as floats: even = src[0], src[2], ...; odd = src[1], src[3], ... */
template <typename T>
static inline void load_pair_order(const bfloat16_bits* src, typename Vec<T>::type& even, typename Vec<T>::type& odd) {
    typedef typename Vec<T>::type V;
    typedef uint32_t Words __attribute__((vector_size(FASTATTN_VECTOR_BYTES)));
    const Words words = vload<Words>(src);
    even = (V)(words << 16);
    odd = (V)(words & 0xFFFF0000u);
}

/* src[0 : count] (count a multiple of 2L) as floats in pair order into dst. */
template <typename T> static inline void convert_row_in_pairs(const bfloat16_bits* src, T* dst, int64_t count) {
    constexpr int L = Vec<T>::lanes;
    for (int64_t c = 0; c < count; c += 2 * L) {
        typename Vec<T>::type even, odd;
        load_pair_order<T>(src + c, even, odd);
        vstore(dst + c, even);
        vstore(dst + c + L, odd);
    }
}

/* row[0 : count] (count a multiple of 2L) from natural order into pair order, or back (`back`). */
template <typename T> static inline void reorder_pairs(T* row, int64_t count, bool back) {
    constexpr int L = Vec<T>::lanes;
    T block[2 * L];
    for (int64_t c = 0; c < count; c += 2 * L) {
        std::memcpy(block, row + c, sizeof(block));
        for (int i = 0; i < L; ++i) {
            if (back) {
                row[c + 2 * i] = block[i];
                row[c + 2 * i + 1] = block[L + i];
            } else {
                row[c + i] = block[2 * i];
                row[c + L + i] = block[2 * i + 1];
            }
        }
    }
}

/* One vector of T stored as L elements of Out, rounded as Store<Out> rounds one: bfloat16 to
 * nearest even with NaN kept NaN (from_float_bf16's integer steps, lane-wise), float16 by the
 * level's conversion where it has one. */
template <typename T, typename Out> static inline void store_vector(Out* dst, typename Vec<T>::type value) {
    constexpr int L = Vec<T>::lanes;
    if constexpr (std::is_same<T, Out>::value) {
        vstore(dst, value);
    } else if constexpr (std::is_same<T, float>::value && std::is_same<Out, bfloat16_bits>::value) {
        typedef uint32_t U __attribute__((vector_size(FASTATTN_VECTOR_BYTES)));
        const U bits = (U)value;
        const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
        const U word = vselect((bits & 0x7fffffffu) > 0x7f800000u, (bits >> 16) | 0x40u, rounded);
#if defined(__AVX512F__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16((__m512i)word));
#elif defined(__AVX2__)
        const __m256i words = (__m256i)word; /* each <= 0xffff: the unsigned saturation is exact */
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                         _mm_packus_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
#else
        for (int i = 0; i < L; ++i) std::memcpy(dst + i, &word[i], sizeof(Out));
#endif
#if defined(__AVX512F__) || defined(__F16C__)
    } else if constexpr (std::is_same<T, float>::value && std::is_same<Out, half_bits>::value) {
#if defined(__AVX512F__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph((__m512)value, _MM_FROUND_TO_NEAREST_INT));
#else
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph((__m256)value, _MM_FROUND_TO_NEAREST_INT));
#endif
#endif
    } else {
        for (int i = 0; i < L; ++i) dst[i] = Store<Out>::from(value[i]);
    }
}

/* dst[i] = factor * src[i] for `count` elements, stored as Out (store_vector, then one element at
 * a time); returns whether all are finite. */
template <typename T, typename Out>
static inline bool store_row(const T* src, T factor, Out* dst, int64_t count) {
    typedef typename Vec<T>::type V;
    constexpr int L = Vec<T>::lanes;
    V poison{}; /* value * 0 is 0, or NaN for an infinity or a NaN */
    int64_t i = 0;
    for (; i + L <= count; i += L) {
        const V value = vload<V>(src + i) * factor;
        poison += value * T(0);
        store_vector<T, Out>(dst + i, value);
    }
    bool finite = true;
    for (int l = 0; l < L; ++l) finite &= poison[l] == T(0);
    for (; i < count; ++i) {
        const T value = factor * src[i];
        finite &= std::isfinite(value);
        dst[i] = Store<Out>::from(value);
    }
    return finite;
}

/* `count` elements of src into dst in the compute type T: L at a time through load_vector where the
 * level converts in registers (AVX-512, AVX2 with F16C), the rest one element at a time. */
template <typename T, typename In> static inline void convert_row(const In* src, T* dst, int64_t count) {
    int64_t i = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
    if constexpr (!std::is_same<T, In>::value)
        for (; i + Vec<T>::lanes <= count; i += Vec<T>::lanes) vstore(dst + i, load_vector<T>(src + i));
#endif
    for (; i < count; ++i) dst[i] = load_as<T>(src[i]);
}

}  // namespace FASTATTN_ISA_NAMESPACE
}  // namespace fastattn

#endif
