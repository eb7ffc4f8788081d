/* Arithmetic shared by the C kernels of the forward (_linear_kernel.c, _token_kernel.c): every
 * function here is the same IEEE operations in the same order whatever the call, so a value's bits do
 * not depend on where it sits in a loop or on the loop's length.
 *
 *   CLONES        the function is compiled for AVX-512, AVX2 and baseline x86-64 and picked at load
 *                 time (gcc/clang function multiversioning); the same operations in every clone.
 *   dot(a, b, d)  sum of a[i] * b[i]: lane l (of 16) sums the products of indices l, l + 16, ... in
 *                 order, then the lanes are added pairwise in a fixed tree (l + 8, l + 4, l + 2, l + 1).
 *                 For d a multiple of 16 the same operations run as GCC/clang vector types (lane-wise
 *                 IEEE operations, lowered to whatever the target has), which keeps the lanes in registers:
 *                 one 16-lane vector for a d known at compile time (the loop unrolled), two 8-lane ones
 *                 otherwise (lanes 0-7 and 8-15, added lane by lane first, as the tree does).
 *   exp_fixed(x)  e^x in float32 from plain IEEE operations only (Cephes' expf: the range reduction
 *                 x = n ln2 + r with n rounded to nearest by the 1.5 * 2^23 trick, a degree-6 polynomial
 *                 in r, the power of two put in the exponent bits). Within 2 ulp of e^x for normal
 *                 results (0.97 measured); x > 88.72 gives +inf, x < -87.33 gives 0 (no subnormal
 *                 results), a NaN gives a NaN. No table and no branch: a loop of it vectorises, and an
 *                 element in the vector body or the scalar tail goes through the same operations.
 *   exp8_fixed(x) exp_fixed on 8 lanes in AVX2 intrinsics, the same operations (for loops the compiler
 *                 vectorises poorly, e.g. a short one inside a tile).
 *   swiglu_value(g, u, limit)  V4.1's clamped SwiGLU of one value (exp_fixed inside).
 *
 * Built with -ffp-contract=off (setup.py): no multiply-add is contracted, in any clone; and with
 * -fno-trapping-math, so that exp_fixed's selects if-convert in the AVX2 clones (no value changes).
 */
#ifndef ENGRAM_SERVE_KERNEL_MATH_H
#define ENGRAM_SERVE_KERNEL_MATH_H

/* The linear kernel's linear_packed arguments (_kernel_buffers.h's X-macro list): its Python form's and its raw
 * entry's, and the slots the token kernel's hc_next fills for its matmul (linear_bf16's raw entry reads the first
 * seven: x, ldx, w, y, m, k, n). */
#define LINEAR_PACKED_FIELDS(X)                                                                            \
    X(ADDR, x, "[m, k] float32, rows ldx floats apart")                                                     \
    X(SIZE, ldx, "floats between two rows of x (>= k)")                                                     \
    X(ADDR, panels, "the weight w [k, n] packed as [ceil(n / 16), k, 16] float32, zero beyond n")           \
    X(ADDR, y, "[m, n] float32, contiguous, written")                                                       \
    X(SIZE, m, "rows")                                                                                      \
    X(SIZE, k, "inputs (>= 1)")                                                                             \
    X(SIZE, n, "outputs")                                                                                   \
    X(SIZE, kc, "inputs of a block of the accumulation order (>= 1)")                                       \
    X(SIZE, simd, "0 the portable tile, 1 AVX2 at most, 2 AVX-512 where the CPU has it (the same bits)")
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || defined(__GNUC__))
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default"), noinline))
#else
#define CLONES
#endif

/* AVX2 intrinsics in functions marked target("avx2"), called where __builtin_cpu_supports says so. */
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define HAVE_X86_AVX2 1
#include <immintrin.h>
#else
#define HAVE_X86_AVX2 0
#endif

#define LANES 16

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

/* *s8 = dot's 16 lanes after its first tree level (lane l + 8 added to lane l), d a multiple of 16: lanes
 * 0-7 and 8-15 as two 8-lane vectors, the same lane-wise operations as one 16-lane accumulator. */
static inline __attribute__((always_inline)) void dot_lanes8(const float *restrict a, const float *restrict b,
                                                             Py_ssize_t d, v8 *restrict s8) {
    v8 lo = {0}, hi = {0}, x, y;
    for (Py_ssize_t i = 0; i < d; i += LANES) {
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        lo = lo + x * y;
        memcpy(&x, a + i + 8, sizeof x);
        memcpy(&y, b + i + 8, sizeof y);
        hi = hi + x * y;
    }
    *s8 = lo + hi;
}

/* dot's tree after its first level: s8 = lanes l + (l + 8), then l + 4, l + 2 and l + 1 */
static inline __attribute__((always_inline)) float dot_tree8(v8 s8) {
    const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b, Py_ssize_t d) {
    if (d % LANES == 0 && !__builtin_constant_p(d)) {
        /* a length known only at run time: two 8-lane vectors (a 16-lane accumulator in a loop of unknown
         * trip count was kept in memory by GCC's AVX2 clone, a store-to-load chain per iteration:
         * engram_gate 2x slower) */
        v8 s8;
        dot_lanes8(a, b, d, &s8);
        return dot_tree8(s8);
    }
    if (d % LANES == 0) {
        v16 acc = {0}, x, y;
        for (Py_ssize_t i = 0; i < d; i += LANES) {
            memcpy(&x, a + i, sizeof x);
            memcpy(&y, b + i, sizeof y);
            acc = acc + x * y;
        }
        return dot_tree8(__builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                         __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15));
    }
    float acc[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    for (int l = 0; i + l < d; l++) acc[l] = acc[l] + a[i + l] * b[i + l];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

static inline float exp_fixed(float x) {
    const float hi = 88.7228317f, lo = -87.3365479f;
    const float xc = x > hi ? hi : (x < lo ? lo : x); /* a NaN passes through */
    const float magic = 12582912.0f;                  /* 1.5 * 2^23: adding it rounds to an integer */
    const float t = xc * 1.44269504088896341f + magic;
    uint32_t tb;
    memcpy(&tb, &t, 4);
    const float n = t - magic;
    const float r = xc - n * 0.693359375f - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const uint32_t eb = (tb - 0x4B400000u + 127u) << 23; /* 2^n as float bits */
    float scale;
    memcpy(&scale, &eb, 4);
    const float y = p * scale;
    return x > hi ? INFINITY : (x < lo ? 0.0f : y);
}

/* silu(min(g, L)) * clamp(u, -L, L), no clamp when L <= 0, silu(x) = x / (1 + exp(-x)): V4.1's SwiGLU of one
 * value, the same operations wherever it runs (the token kernel's `swiglu`, the linear kernel's `moe_experts`). */
static inline float swiglu_value(float g, float u, float limit) {
    if (limit > 0.0f) {
        g = g > limit ? limit : g;
        u = u > limit ? limit : (u < -limit ? -limit : u);
    }
    return g / (1.0f + exp_fixed(-g)) * u;
}

#if HAVE_X86_AVX2
/* exp_fixed of 8 lanes: the same IEEE operations in the same order on each lane (explicit multiplies
 * and adds, no fused multiply-add; the selects as blends), so each lane has exp_fixed's bits. */
__attribute__((target("avx2"), always_inline)) static inline __m256 exp8_fixed(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.7228317f), lo = _mm256_set1_ps(-87.3365479f);
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 above = _mm256_cmp_ps(x, hi, _CMP_GT_OQ), below = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* NaN: neither */
    const __m256 xc = _mm256_blendv_ps(_mm256_blendv_ps(x, lo, below), hi, above);
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), magic);
    const __m256 n = _mm256_sub_ps(t, magic);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
    const __m256i eb = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000)), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(eb));
    return _mm256_blendv_ps(_mm256_blendv_ps(y, _mm256_setzero_ps(), below), _mm256_set1_ps(INFINITY), above);
}
#endif
#endif
