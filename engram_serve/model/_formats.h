/* The weight formats the linear kernel multiplies as stored, each decoded EXACTLY into float32: a scalar form (the
 * portable tile's, and the reference the vector forms equal), an AVX2 form of 8 lanes and an AVX-512 form of 16.
 * tests/kernels/test_formats.py decodes every code of every format through each form (the kernel's
 * `decode_formats`) against a float64 decoder of its own.
 *
 *   E2M1 (MXFP4's values)  4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and
 *                          their negatives (code 8 is -0). Packed two a byte, the lower nibble first.
 *   E8M0 (MX block scales) 8 bits of exponent: 2^(e - 127); e = 0 is 2^-127 (a float32 subnormal), 255 is NaN.
 *   MXFP4                  an E2M1 value times its block's E8M0 scale: one float32 multiply, exact (at most 2 + 1
 *                          significant bits, an exponent within float32's, subnormals included) but where it
 *                          overflows (6 x 2^127: inf, as the float32 product of the dequantized weight).
 *   E4M3 (FP8, "fn")       sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN.
 *   BF16                   the top half of a float32.
 *
 * The vector forms: E4M3 moved into float16 bit patterns (sign to bit 15, exponent and mantissa to bits 7..13: the
 * value times 2^-8, normal or subnormal alike), converted exactly (vcvtph2ps), times 2^8; the NaN codes then set
 * apart (`e4m3_*_finite` leaves them out: 480, for callers whose packer never writes them). E2M1 by a 16-float table
 * (AVX-512 vpermps of the code; AVX2 the 8 magnitudes by the code's low 3 bits, its sign bit moved to bit 31).
 * E8M0 as e << 23 (the float32 2^(e - 127) for 1 <= e <= 254), with 0 and 255 set apart.
 *
 * Include after _kernel_math.h (HAVE_X86_AVX2 and the intrinsics). */
#ifndef ENGRAM_SERVE_FORMATS_H
#define ENGRAM_SERVE_FORMATS_H

#include <stdint.h>
#include <string.h>

/* ---- scalar forms ------------------------------------------------------------------------------------------ */

static const float E2M1_VALUES[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float e2m1_value(unsigned code) { return E2M1_VALUES[code & 15]; }

/* code j (0 .. 2 * bytes) of nibbles packed two a byte, the lower nibble first */
static inline unsigned nibble(const uint8_t *p, Py_ssize_t j) { return (p[j >> 1] >> ((j & 1) * 4)) & 15; }

static inline float e8m0_value(unsigned e) {
    return bits_float(e == 0 ? 0x00400000u : e == 255 ? 0x7FC00000u : (uint32_t)e << 23);
}

static inline float mxfp4_value(unsigned code, unsigned e) { return e2m1_value(code) * e8m0_value(e); }

static inline float e4m3_value(unsigned b) {
    const unsigned e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return bits_float(0x7FC00000u | (uint32_t)(b & 0x80) << 24);
    /* normal: 2^(e - 7) (1 + m / 8); subnormal (e = 0): 2^-6 m / 8; as float32 bits, exactly */
    const uint32_t mag = e ? (e + 120) << 23 | m << 20 : 0;
    const float v = e ? bits_float(mag) : (float)m * 0.001953125f; /* m x 2^-9: exact */
    return b & 0x80 ? -v : v;
}

static inline float bf16_value(uint16_t h) { return bits_float((uint32_t)h << 16); }

#if HAVE_X86_AVX2
/* ---- AVX-512 forms: 16 lanes ------------------------------------------------------------------------------- */

/* 16 codes, one a byte, from 8 bytes of nibbles (lane 2j the lower nibble of byte j) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m128i nibbles16(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), low = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
}

/* the E2M1 values of 16 codes, one a 32-bit lane (its low 4 bits) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e2m1_16_lanes(__m512i codes) {
    return _mm512_permutexvar_ps(codes, _mm512_loadu_ps(E2M1_VALUES));
}

/* the E2M1 values of 16 codes (bytes) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e2m1_16(__m128i codes) {
    return e2m1_16_lanes(_mm512_cvtepu8_epi32(codes));
}

/* the E8M0 scales of 16 bytes */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e8m0_16(__m128i e) {
    const __m512i x = _mm512_cvtepu8_epi32(e);
    __m512i u = _mm512_slli_epi32(x, 23);
    u = _mm512_mask_mov_epi32(u, _mm512_cmpeq_epi32_mask(x, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    u = _mm512_mask_mov_epi32(u, _mm512_cmpeq_epi32_mask(x, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(u);
}

/* one MXFP4 row of 16 weights: codes times their scales (e8m0_16) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 mxfp4_16(__m128i codes, __m512 scale) {
    return _mm512_mul_ps(e2m1_16(codes), scale);
}

/* 16 E4M3 bytes as float16 patterns converted: each value times 2^-8 (exact but for the NaN codes: 480 x 2^-8).
 * The FP8 panels multiply it by their block's 2^(s + 8). */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e4m3_16_raw(const uint8_t *q) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(0x3F80)),
                                      _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16((short)0x8000)));
    return _mm512_cvtph_ps(h);
}

/* 16 E4M3 bytes, exact but for the NaN codes (S.1111.111 gives +-480) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e4m3_16_finite(const uint8_t *q) {
    return _mm512_mul_ps(e4m3_16_raw(q), _mm512_set1_ps(256.0f));
}

/* the E4M3 codes in byte u of 16 32-bit lanes as float32 of value v x 2^-120 (NaN for the NaN codes): the code moved to
 * bits 24..31, then shifted arithmetically to bits 20..27 keeps its sign in bit 31; its 7 bits of exponent and mantissa
 * at bits 20..26 are a float32 of value v x 2^-120 (a subnormal one for v's subnormals, exactly) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e4m3_16_tiny(__m512i g, const int u,
                                                                                       const int no_nan) {
    const __m512i h = u < 3 ? _mm512_slli_epi32(g, 24 - 8 * u) : g;
    const __m512 v = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srai_epi32(h, 4), _mm512_set1_epi32((int)0x87F00000)));
    if (no_nan) return v; /* the caller saw no NaN code among these bytes (e4m3_16_nan) */
    const __m512i nan = _mm512_set1_epi32(0x7F000000);
    return _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(_mm512_and_si512(h, nan), nan), _mm512_set1_ps(__builtin_nanf("")));
}

/* whether any of the 64 E4M3 codes of 16 32-bit lanes is a NaN code (its low 7 bits all ones: + 1 carries into bit 7) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline int e4m3_16_nan(__m512i g) {
    const __m512i low = _mm512_and_si512(g, _mm512_set1_epi32(0x7F7F7F7F));
    return _mm512_test_epi32_mask(_mm512_add_epi32(low, _mm512_set1_epi32(0x01010101)),
                                  _mm512_set1_epi32((int)0x80808080)) != 0;
}

/* the E4M3 codes in byte u of 16 32-bit lanes, exact for every code (NaN for the NaN codes): e4m3_16_tiny times 2^120 */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e4m3_16_byte(__m512i g, const int u) {
    return _mm512_mul_ps(e4m3_16_tiny(g, u, 0), _mm512_set1_ps(0x1p120f));
}

__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 e4m3_16(const uint8_t *q) {
    const __m512 v = e4m3_16_finite(q);
    const __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF)));
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(mag, _mm512_set1_ps(480.0f), _CMP_EQ_OQ),
                              _mm512_set1_ps(__builtin_nanf("")));
}

__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 bf16_16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* ---- AVX2 forms: 8 lanes ----------------------------------------------------------------------------------- */

/* 16 codes, one a byte, from 8 bytes of nibbles (as nibbles16, in SSE2) */
__attribute__((target("avx2,fma"), always_inline)) static inline __m128i nibbles16_sse(const uint8_t *p) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)p), low = _mm_set1_epi8(15);
    return _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
}

/* the E2M1 values of 8 codes, one a 32-bit lane (its low 4 bits) */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 e2m1_8_lanes(__m256i c) {
    const __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1_VALUES), c); /* the low 3 bits index */
    const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(c, 3), 31);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}

/* the E2M1 values of the 8 codes in the low 8 bytes of `codes` */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 e2m1_8(__m128i codes) {
    return e2m1_8_lanes(_mm256_cvtepu8_epi32(codes));
}

/* the E8M0 scales of the low 8 bytes of e */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 e8m0_8(__m128i e) {
    const __m256i x = _mm256_cvtepu8_epi32(e);
    __m256i u = _mm256_slli_epi32(x, 23);
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(x, _mm256_setzero_si256()));
    u = _mm256_blendv_epi8(u, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(x, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(u);
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 mxfp4_8(__m128i codes, __m256 scale) {
    return _mm256_mul_ps(e2m1_8(codes), scale);
}

/* 8 E4M3 bytes (F16C's conversion), exact for every code */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 e4m3_8(const uint8_t *q) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)q));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3F80)),
                                   _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16((short)0x8000)));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
    const __m256 mag = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF)));
    return _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), _mm256_cmp_ps(mag, _mm256_set1_ps(480.0f), _CMP_EQ_OQ));
}

/* e4m3_16_byte in AVX2: the codes in byte u of 8 32-bit lanes */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 e4m3_8_byte(__m256i g, const int u) {
    const __m256i mag = _mm256_and_si256(u < 3 ? _mm256_slli_epi32(g, 20 - 8 * u) : _mm256_srli_epi32(g, 4),
                                         _mm256_set1_epi32(0x07F00000));
    const __m256i sign = _mm256_and_si256(u < 3 ? _mm256_slli_epi32(g, 24 - 8 * u) : g, _mm256_set1_epi32((int)0x80000000));
    const __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(sign, mag)), _mm256_set1_ps(0x1p120f));
    const __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x07F00000));
    return _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), _mm256_castsi256_ps(nan));
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 bf16_8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#endif
