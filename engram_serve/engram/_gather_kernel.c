/* The Engram staging gather (docs/contract.md §7) for CPU tables: rows of a host table, by id, decoded straight
 * into the staging buffer in one pass, with the step's repeated ids read and decoded once.
 *
 * Plain CPython C API and the buffer protocol only (see _kernel_buffers.h), like _hash_kernel.c.
 *
 *   gather_rows(table, scale, ids, out, dedup) -> number of rows read from the table
 *       table  [rows, hd] uint8 (F8_E4M3 bytes) with scale [rows, hd/32] uint8 (F8_E8M0 codes),
 *              or [rows, hd] float32 with scale None;
 *       ids    [n] int64, every one in [0, rows) (checked before anything is written: IndexError);
 *       out    [n, hd] float32, or int16 holding bfloat16 bits; out[i] = the decoded row ids[i];
 *       dedup  true: each distinct id is read and decoded once (at its first position), its later
 *              positions copy that staged row; false: every position reads the table.
 *   gather_rows_cached(table, scale, ids, out, keys, ref, hand, slab) -> (read, hits)
 *       the same with dedup, behind a hot-row cache (see Cache): each distinct id is looked up; hits are
 *       decoded from the cached stored row, misses are read and decoded as above, then admitted. read = misses.
 *   The GIL is released while rows are read (a row of a memory-mapped table may fault in from disk).
 *
 * Test hooks, not part of the module: the same shared object holds a second module, `_gather_hooks`
 * (PyInit__gather_hooks), which only tests load (tests/support/kernel_hooks.py, from this file's path, so it
 * shares this file's statics): set_prefetch_distance(rows), set_stream_bytes(bytes) and
 * set_decode_path(level) (see below; staged values never depend on them), and set_trust(slots, keys),
 * the negative controls of the key checks: with slots, a filled slot of the dedup set is taken for the
 * id without comparing keys; with keys, a filled way 0 of the hot-row cache counts as a hit.
 *
 * Exactness (bit for bit the plain definition value = e4m3 * 2^(code - 127), rounded once to float32):
 * the E4M3 byte is first made into its exact float32 value with integer operations, then multiplied
 * by the float32 2^(code - 127) (exact, a subnormal for code 0; NaN for code 255): one IEEE multiply,
 * so one rounding of the exact product. E4M3 bits s eeee mmm: for e >= 1 the float32 with sign s,
 * exponent e + 120 and mantissa mmm is 2^(e-7) (1 + m/8), the E4M3 value. For e = 0 (zero and the
 * subnormals m/8 * 2^-6) the same construction with exponent 121 gives (1 + m/8) 2^-6, and subtracting
 * 2^-6 is exact (Sterbenz), so no float32 subnormal is an operand. (That matters: the shorter route
 * through e4m3 * 2^-120, a float32 subnormal for e = 0, measured 4x slower on this x86, from the
 * microcode assists of subnormal operands.) The bytes 0x7f / 0xff are NaN. The VBMI path takes the same
 * exact float32 values from byte tables built with that construction, and the same multiply.
 * bfloat16 staging rounds that float32 to nearest even (NaN -> 0x7fc0),
 * as torch's float32 -> bfloat16 cast does. Built without -ffast-math: the rounding is IEEE.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kernel_buffers.h"

#define GROUP 32 /* columns per E8M0 scale */

static float scale_of_code[256]; /* 2^(code - 127), exact (a subnormal for code 0); NaN for 255 */

static inline float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7fc0 (torch's rule). */
static inline uint16_t bf16_of_f32(float f) {
    uint32_t u = bits_of_f32(f);
    uint32_t nan = 0u - (uint32_t)((u & 0x7fffffffu) > 0x7f800000u);
    return (uint16_t)((((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & ~nan) | (0x7fc0u & nan));
}

/* The row loops are compiled for AVX-512, AVX2 and baseline x86-64, picked at load time by the CPU
 * (gcc/clang function multiversioning, Linux ifunc); one plain build elsewhere. The arithmetic is the
 * same IEEE float32 operations in every clone (no FMA: -ffp-contract=off), so the results are too. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || defined(__GNUC__))
#define ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default"), noinline))
#else
#define ROW_CLONES
#endif

/* One E4M3 row w[hd] with its scales s[hd/32] -> float32 o[hd]. Branch-free in the inner loop, so the
 * compiler vectorises it. */
ROW_CLONES static void decode_fp8_row(const uint8_t *restrict w, const uint8_t *restrict s, float *restrict o,
                                      Py_ssize_t hd) {
    for (Py_ssize_t g = 0; g < hd / GROUP; g++) {
        const float sc = scale_of_code[s[g]];
        const uint8_t *wg = w + g * GROUP;
        float *og = o + g * GROUP;
        for (int j = 0; j < GROUP; j++) { /* integer selects only: the loop vectorises */
            uint32_t b = wg[j];
            uint32_t mag = b & 0x7fu;
            uint32_t is_sub = (mag & 0x78u) == 0;                                /* exponent bits 0 */
            uint32_t u = (mag << 20) + ((120u + is_sub) << 23);                 /* exponent e + 120, or 121 */
            float v = f32_of_bits(u) - f32_of_bits(is_sub * 0x3c800000u);      /* - 2^-6 or - 0: exact |e4m3| */
            uint32_t x = bits_of_f32(f32_of_bits(bits_of_f32(v) | ((b & 0x80u) << 24)) * sc); /* one rounding */
            uint32_t nan = 0u - (uint32_t)(mag == 0x7fu);
            og[j] = f32_of_bits((x & ~nan) | (0x7fc00000u & nan));
        }
    }
}

/* The same decode written with AVX-512F intrinsics, 16 values a vector: the same integer construction
 * and the same two IEEE float32 operations per value (the exact subtraction of 2^-6 for E4M3 exponent 0,
 * then the one rounding multiply by the scale), so the same bits as decode_fp8_row for every byte and
 * scale code (subnormal scales and results, NaN). The compiler's vectorisation of decode_fp8_row works
 * in 8-lane vectors with byte/word widening shuffles and spills (~213 ns a row of 256 here); this
 * path widens each byte once (vpmovzxbd) and needs no shuffle. Picked at load time (have_avx512). */
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#include <immintrin.h>
#define HAVE_X86_DECODE 1
static int have_avx512; /* set once in PyInit: the CPU has AVX-512F */

__attribute__((target("avx512f"))) static void decode_fp8_row_avx512(const uint8_t *restrict w,
                                                                   const uint8_t *restrict s, float *restrict o,
                                                                   Py_ssize_t hd) {
    const __m512i k7f = _mm512_set1_epi32(0x7f), k78 = _mm512_set1_epi32(0x78), ksign = _mm512_set1_epi32((int)0x80000000u);
    const __m512i bias = _mm512_set1_epi32(120 << 23), bias_sub = _mm512_set1_epi32(121 << 23);
    const __m512i qnan = _mm512_set1_epi32(0x7fc00000);
    const __m512 two_m6 = _mm512_castsi512_ps(_mm512_set1_epi32(0x3c800000)); /* 2^-6 */
    for (Py_ssize_t g = 0; g < hd / GROUP; g++) {
        const __m512 sc = _mm512_set1_ps(scale_of_code[s[g]]);
        for (int h = 0; h < GROUP; h += 16) {
            const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + g * GROUP + h)));
            const __m512i mag = _mm512_and_si512(b, k7f);
            const __mmask16 is_sub = _mm512_testn_epi32_mask(b, k78); /* exponent bits 0 */
            const __m512i u = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_mask_blend_epi32(is_sub, bias, bias_sub));
            const __m512 v = _mm512_mask_sub_ps(_mm512_castsi512_ps(u), is_sub, _mm512_castsi512_ps(u), two_m6);
            /* v | (b << 24 & sign bit): the E4M3 sign onto the exact |e4m3| */
            const __m512i sv = _mm512_ternarylogic_epi32(_mm512_castps_si512(v), _mm512_slli_epi32(b, 24), ksign, 0xF8);
            const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(sv), sc); /* one rounding */
            const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, k7f);
            _mm512_storeu_ps(o + g * GROUP + h, _mm512_castsi512_ps(_mm512_mask_mov_epi32(_mm512_castps_si512(x), nan, qnan)));
        }
    }
}
/* The same decode, 64 values a step, through byte tables (AVX-512 VBMI + BW): the float32 bits of the
 * exact |e4m3| value of every 7-bit magnitude have their low 16 bits zero (3 mantissa bits), so two
 * 128-entry byte tables (vpermi2b) give the high and the low byte of the upper half, for 64 bytes at
 * once; the E4M3 sign is ORed into the high byte (not for the NaN magnitude 0x7f, whose entry is the
 * quiet NaN 0x7fc00000, as decode_fp8_row gives); bytes are then interleaved into 32-bit lanes, and
 * the one rounding multiply by the scale is the same IEEE operation on the same operands as in
 * decode_fp8_row, so the bits are the same (tested on every byte under every scale code). The input
 * dwords are first transposed in 4 x 4 blocks (vpermd) so that the in-lane unpacks leave the values
 * in order. ~20 instructions per 64 values against ~52 for decode_fp8_row_avx512. Built in PyInit
 * (tables from decode_fp8_row); picked at load time (have_vbmi). */
static uint8_t mag_hi[128], mag_lo[128]; /* bits 31..24 and 23..16 of the float32 |e4m3| of each magnitude */
static int have_vbmi; /* set once in PyInit: the CPU has AVX-512 VBMI and BW */

__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void decode_fp8_row_vbmi(
    const uint8_t *restrict w, const uint8_t *restrict s, float *restrict o, Py_ssize_t hd) {
    const __m512i thi0 = _mm512_loadu_si512(mag_hi), thi1 = _mm512_loadu_si512(mag_hi + 64);
    const __m512i tlo0 = _mm512_loadu_si512(mag_lo), tlo1 = _mm512_loadu_si512(mag_lo + 64);
    const __m512i k80 = _mm512_set1_epi8((char)0x80), kff = _mm512_set1_epi8((char)0xff), zero = _mm512_setzero_si512();
    /* dword 4l + q of the input goes to 4q + l: after the unpacks, lane l's k-th quarter holds bytes 16k + 4l .. + 3 */
    const __m512i transpose = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    Py_ssize_t g = 0;
    for (; g + 2 <= hd / GROUP; g += 2) {
        const __m512i x = _mm512_permutexvar_epi32(transpose, _mm512_loadu_si512(w + g * GROUP));
        const __mmask64 nan = _mm512_cmpeq_epi8_mask(_mm512_or_si512(x, k80), kff); /* magnitude 0x7f */
        const __m512i t = _mm512_permutex2var_epi8(thi0, x, thi1);
        const __m512i h = _mm512_mask_blend_epi8(nan, _mm512_ternarylogic_epi32(t, x, k80, 0xF8), t); /* t | (x & 0x80); NaN: t */
        const __m512i l = _mm512_permutex2var_epi8(tlo0, x, tlo1);
        const __m512i w0 = _mm512_unpacklo_epi8(l, h), w1 = _mm512_unpackhi_epi8(l, h);
        const __m512 sc0 = _mm512_set1_ps(scale_of_code[s[g]]), sc1 = _mm512_set1_ps(scale_of_code[s[g + 1]]);
        float *og = o + g * GROUP;
        _mm512_storeu_ps(og, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w0)), sc0));
        _mm512_storeu_ps(og + 16, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w0)), sc0));
        _mm512_storeu_ps(og + 32, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w1)), sc1));
        _mm512_storeu_ps(og + 48, _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w1)), sc1));
    }
    if (g < hd / GROUP) decode_fp8_row_avx512(w + g * GROUP, s + g, o + g * GROUP, GROUP); /* an odd last group */
}

/* The same decode in AVX2 (for CPUs without AVX-512), 32 values (one scale group) a step, through
 * 16-entry byte tables (vpshufb), the AVX2 form of decode_fp8_row_vbmi: the high and the low byte of
 * the upper half of the float32 |e4m3| (its low half is zero) are, for an exponent field e >= 1, a
 * table of e (the low byte ORed with the mantissa m << 4), and for e = 0 (zero and the subnormals) a
 * table of m; the E4M3 sign is ORed into the high byte, the NaN magnitude 0x7f gets the quiet NaN
 * 0x7fc00000, bytes are interleaved into 32-bit lanes (the input dwords permuted first so that the
 * in-lane unpacks leave the values in order), and the one rounding multiply by the scale is the same
 * IEEE operation on the same operands as in decode_fp8_row, so the bits are the same (tested on every
 * byte under every scale code). ~37 instructions per 32 values against ~68 for widening each byte to
 * 32 bits and constructing the value there. Tables built in PyInit from mag_hi / mag_lo; picked at
 * load time (have_avx2). */
static uint8_t exp_hi[32], exp_lo[32], sub_hi[32], sub_lo[32]; /* [e] for e >= 1, [m] for e = 0; both lanes */
static int have_avx2; /* set once in PyInit: the CPU has AVX2 */

__attribute__((target("avx2"))) static void decode_fp8_row_avx2(const uint8_t *restrict w, const uint8_t *restrict s,
                                                               float *restrict o, Py_ssize_t hd) {
    const __m256i ehi = _mm256_loadu_si256((const __m256i *)exp_hi), elo = _mm256_loadu_si256((const __m256i *)exp_lo);
    const __m256i shi = _mm256_loadu_si256((const __m256i *)sub_hi), slo = _mm256_loadu_si256((const __m256i *)sub_lo);
    const __m256i k0f = _mm256_set1_epi8(0x0f), k07 = _mm256_set1_epi8(0x07), k70 = _mm256_set1_epi8(0x70);
    const __m256i k80 = _mm256_set1_epi8((char)0x80), kff = _mm256_set1_epi8((char)0xff), zero = _mm256_setzero_si256();
    const __m256i nan_hi = _mm256_set1_epi8(0x7f), nan_lo = _mm256_set1_epi8((char)0xc0);
    /* dword q of the input goes to lane q % 2, place q / 2: after the unpacks, values stay in order */
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (Py_ssize_t g = 0; g < hd / GROUP; g++) {
        const __m256i x = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(w + g * GROUP)), order);
        const __m256i e = _mm256_and_si256(_mm256_srli_epi16(x, 3), k0f), m = _mm256_and_si256(x, k07);
        const __m256i sub = _mm256_cmpeq_epi8(e, zero);
        const __m256i mant = _mm256_and_si256(_mm256_slli_epi16(x, 4), k70); /* m << 4 */
        __m256i h = _mm256_blendv_epi8(_mm256_shuffle_epi8(ehi, e), _mm256_shuffle_epi8(shi, m), sub);
        __m256i l = _mm256_blendv_epi8(_mm256_or_si256(_mm256_shuffle_epi8(elo, e), mant), _mm256_shuffle_epi8(slo, m), sub);
        const __m256i nan = _mm256_cmpeq_epi8(_mm256_or_si256(x, k80), kff); /* magnitude 0x7f */
        h = _mm256_blendv_epi8(_mm256_or_si256(h, _mm256_and_si256(x, k80)), nan_hi, nan);
        l = _mm256_blendv_epi8(l, nan_lo, nan);
        const __m256i w0 = _mm256_unpacklo_epi8(l, h), w1 = _mm256_unpackhi_epi8(l, h);
        const __m256 sc = _mm256_set1_ps(scale_of_code[s[g]]);
        float *og = o + g * GROUP;
        _mm256_storeu_ps(og, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w0)), sc)); /* one rounding */
        _mm256_storeu_ps(og + 8, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w0)), sc));
        _mm256_storeu_ps(og + 16, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w1)), sc));
        _mm256_storeu_ps(og + 24, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w1)), sc));
    }
}

#endif

/* decode_fp8_row through the fastest path this CPU has. */
static int decode_path = 3; /* the best path up to: 3 VBMI, 2 AVX-512F, 1 AVX2, 0 decode_fp8_row (test hook set_decode_path) */
static int trust_slots = 0, trust_keys = 0; /* the key checks off: negative controls only (test hook set_trust) */

static inline void decode_row(const uint8_t *w, const uint8_t *s, float *o, Py_ssize_t hd) {
#ifdef HAVE_X86_DECODE
    if (have_vbmi && decode_path >= 3) {
        decode_fp8_row_vbmi(w, s, o, hd);
        return;
    }
    if (have_avx512 && decode_path >= 2) {
        decode_fp8_row_avx512(w, s, o, hd);
        return;
    }
    if (have_avx2 && decode_path >= 1) {
        decode_fp8_row_avx2(w, s, o, hd);
        return;
    }
#endif
    decode_fp8_row(w, s, o, hd);
}

ROW_CLONES static void bf16_of_row(const float *restrict x, uint16_t *restrict o, Py_ssize_t hd) {
    for (Py_ssize_t j = 0; j < hd; j++) o[j] = bf16_of_f32(x[j]);
}

typedef struct {
    const uint8_t *table, *scale; /* scale NULL: a float32 table */
    const int64_t *ids;
    uint8_t *out;
    Py_ssize_t n, hd, out_item; /* out_item: 4 (float32) or 2 (bfloat16) */
    int trust_slots;            /* a negative control only: a filled slot counts as the id (no key check) */
    int stream;                 /* write FP8 rows decoded into float32 staging with non-temporal stores (see put_row) */
} Gather;

/* The hot-row cache (engram/row_cache.py HotRowCache owns the arrays): WAYS-way set associative over
 * `sets` sets, in anonymous memory apart from the table's mapping. Way w of set s is slot s*WAYS + w:
 * key[slot] the row id or -1 (empty), slab[slot] that row's stored bytes (264 for an FP8 row of 256: a
 * hit is decoded from the slab like a miss from the table, 3.9x more rows than decoded float32 would
 * hold, and 4x fewer bytes read per hit), ref[slot] its CLOCK bit, hand[s] the set's CLOCK hand. A row id lives only in set
 * set_of(id). Invariant: key[slot] = r >= 0 implies slab[slot] == the stored bytes of row r (E4M3 row
 * then its E8M0 scales, or the float32 row) once the call that admitted r has returned. Lookups happen
 * after the step's dedup (each distinct id once). A hit sets the ref bit; a miss is staged from the
 * table, then admitted: into an empty way, else the first way under the CLOCK hand whose ref bit is
 * clear (bits passed over are cleared). Admitted rows start with the bit clear, so a row seen once
 * is the next victim of its set, and a row hit again survives one sweep: a frequency filter that
 * keeps Zipfian heads. Deterministic: the state depends only on the ids in order. */
#define WAYS 8

typedef struct {
    int64_t *key;
    uint8_t *ref, *hand, *slab;
    Py_ssize_t sets;
    int trust_keys; /* a negative control only: a filled way 0 counts as a hit, no key check */
    Py_ssize_t hits;
} Cache;

static inline Py_ssize_t set_of(int64_t r, Py_ssize_t sets) {
    uint64_t h = ((uint64_t)r * 0xD6E8FEB86659FD93ull) >> 32; /* 32 mixed bits, then onto [0, sets) */
    return (Py_ssize_t)((h * (uint64_t)sets) >> 32);
}

/* The slot of row r in the cache, or -1. */
static inline Py_ssize_t cache_find(const Cache *c, int64_t r) {
    const Py_ssize_t base = set_of(r, c->sets) * WAYS;
    if (c->trust_keys) return c->key[base] != -1 ? base : -1;
    for (int w = 0; w < WAYS; w++)
        if (c->key[base + w] == r) return base + w;
    return -1;
}

/* The slot row r (not cached) is admitted into (see Cache). */
static inline Py_ssize_t cache_victim(Cache *c, int64_t r) {
    const Py_ssize_t s = set_of(r, c->sets), base = s * WAYS;
    for (int w = 0; w < WAYS; w++)
        if (c->key[base + w] == -1) return base + w;
    if (c->hand[s] >= WAYS) c->hand[s] = 0; /* a corrupt hand would index past its set (checked where used:
                                               a check of every set per call took ~12% of a cached gather) */
    for (;;) {
        const Py_ssize_t slot = base + c->hand[s];
        c->hand[s] = (uint8_t)((c->hand[s] + 1) % WAYS);
        if (!c->ref[slot]) return slot;
        c->ref[slot] = 0;
    }
}

/* Rows from the table are staged in blocks of BLOCK: first the stored bytes of the block's rows (E4M3
 * row and E8M0 scales, or a float32 row) are copied into a small local buffer, all loads independent,
 * so that the block's page walks and cache misses overlap; then the block is decoded from that buffer,
 * which is in L1. (Decoding straight from the mapping with software prefetches 4 to 64 rows ahead
 * measured 1.6x to 3x slower here, on the 35 GiB bench file: perf puts the time on the instruction
 * after each prefetch, so a prefetch that misses holds up retirement, and with a ~200-instruction
 * decode between prefetches only one or two rows are in flight.) Hits of the hot-row cache, whose
 * slab is anonymous memory on huge pages, are decoded straight from their slots with their lines
 * prefetched `prefetch_distance` rows ahead, and the cache's key sets are prefetched as far ahead in
 * the lookups: there the loop is light enough, and it saved 15 to 25% of a cached gather. Default
 * DISTANCE; the test hook set_prefetch_distance changes it, 0 for no prefetch.
 * Prefetches are hints: they never change a staged value. */
#define BLOCK 16
#define DISTANCE 16
#define LINE 64
static Py_ssize_t prefetch_distance = DISTANCE;

/* Prefetch the lines of [p, p + len) (len > 0) into the L2 (prefetcht1: on this AMD, 10 to 25% faster
 * than into the L1 with prefetcht0, which measured as holding up the loop on the L1's few miss buffers). */
static inline void prefetch_read(const uint8_t *p, Py_ssize_t len) {
    for (Py_ssize_t o = 0; o < len; o += LINE) __builtin_prefetch(p + o, 0, 2);
    __builtin_prefetch(p + len - 1, 0, 2); /* a row need not start on a line */
}

typedef struct {
    uint8_t *raw;  /* [BLOCK, row_bytes] stored rows */
    float *row32;  /* [hd] float32 row before the bfloat16 rounding */
    Py_ssize_t row_bytes, scale_bytes; /* a stored row (E4M3 row + E8M0 scales, or float32 row); its scales */
} Scratch;

/* Stage the stored row at src (its scales at its end, if any) into staging row pos: decoded (FP8),
 * copied (float32 into float32) or rounded to bfloat16. */
static inline void stage_row(const Gather *a, const Scratch *sc, const uint8_t *src, Py_ssize_t pos) {
    const Py_ssize_t hd = a->hd, sb = sc->scale_bytes;
    if (a->out_item == 4) {
        float *dst = (float *)(a->out + pos * hd * 4);
        if (sb) decode_row(src, src + sc->row_bytes - sb, dst, hd);
        else memcpy(dst, src, (size_t)hd * 4);
        return;
    }
    const float *f = (const float *)src;
    if (sb) {
        decode_row(src, src + sc->row_bytes - sb, sc->row32, hd);
        f = sc->row32;
    }
    bf16_of_row(f, (uint16_t *)(a->out + pos * hd * 2), hd);
}

/* Copy staging row pos to the later positions of its id (next[p]: the next position of the id at p, or -1). */
static inline void copy_repeats(const Gather *a, const Py_ssize_t *next, Py_ssize_t pos) {
    const Py_ssize_t ob = a->hd * a->out_item;
    const uint8_t *row = a->out + pos * ob;
    for (Py_ssize_t j = next[pos]; j >= 0; j = next[j]) memcpy(a->out + j * ob, row, (size_t)ob);
}

/* A call whose float32 staging is at least stream_bytes (default STREAM_BYTES) writes its decoded FP8
 * rows with non-temporal stores (AVX2, staging 32-byte aligned): each row is decoded once into the L1
 * scratch row32, then streamed to its position and to the repeats of its id. Such staging outgrows the
 * CPU caches anyway; regular stores would first read every line they write (16 a row), holding the
 * miss buffers the row reads need, and fill the caches with it, evicting the hot-row cache's lines
 * (measured at 512 decode requests, 24,576 rows a step: 1.16-1.22x). Smaller staging stays in the
 * caches for the layer that reads it, so it is written as usual (streamed, 64 requests measured 0.84x).
 * Stores never change a staged value. */
#define STREAM_BYTES (8 << 20)
static Py_ssize_t stream_bytes = STREAM_BYTES; /* the test hook set_stream_bytes changes it */

#ifdef HAVE_X86_DECODE
__attribute__((target("avx2"))) static void stream_row(float *dst, const float *src, Py_ssize_t hd) {
    for (Py_ssize_t j = 0; j < hd; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
}
#endif

/* Stage the stored row at src into staging row pos and, with next (dedup), into the later positions of
 * its id. */
static inline void put_row(const Gather *a, const Scratch *sc, const uint8_t *src, const Py_ssize_t *next,
                           Py_ssize_t pos) {
#ifdef HAVE_X86_DECODE
    if (a->stream) {
        decode_row(src, src + sc->row_bytes - sc->scale_bytes, sc->row32, a->hd);
        for (Py_ssize_t j = pos; j >= 0; j = next ? next[j] : -1) stream_row((float *)a->out + j * a->hd, sc->row32, a->hd);
        return;
    }
#endif
    stage_row(a, sc, src, pos);
    if (next) copy_repeats(a, next, pos);
}

/* Stage the table rows ids[pos[k]] into staging rows pos[k], k < count (count <= BLOCK). With a cache
 * c, put[k] is the slot row k was admitted into: its stored bytes are written there, in order of k.
 * With next (dedup), each staged row is then copied to the later positions of its id. */
static void stage_block(const Gather *a, const Py_ssize_t *pos, int count, Scratch *sc, Cache *c,
                        const Py_ssize_t *put, const Py_ssize_t *next) {
    const Py_ssize_t rb = sc->row_bytes, sb = sc->scale_bytes, wb = rb - sb;
    const int direct = !sb && a->out_item == 4; /* float32 rows into float32 staging: copied where they go */
    for (int k = 0; k < count; k++) { /* independent loads */
        const int64_t r = a->ids[pos[k]];
        uint8_t *dst = direct ? a->out + pos[k] * rb : sc->raw + k * rb;
        memcpy(dst, a->table + r * wb, (size_t)wb);
        if (sb) memcpy(dst + wb, a->scale + r * sb, (size_t)sb);
    }
    for (int k = 0; c && k < count; k++)
        memcpy(c->slab + put[k] * rb, direct ? a->out + pos[k] * rb : sc->raw + k * rb, (size_t)rb);
    for (int k = 0; !direct && k < count; k++) put_row(a, sc, sc->raw + k * rb, next, pos[k]);
    for (int k = 0; direct && next && k < count; k++) copy_repeats(a, next, pos[k]);
}

/* Every position reads the table. */
static void gather_all(const Gather *a, Scratch *sc) {
    Py_ssize_t pos[BLOCK];
    for (Py_ssize_t i = 0; i < a->n; i += BLOCK) {
        int count = a->n - i < BLOCK ? (int)(a->n - i) : BLOCK;
        for (int k = 0; k < count; k++) pos[k] = i + k;
        stage_block(a, pos, count, sc, NULL, NULL, NULL);
    }
}

/* Each distinct id is read once, at its first position (open addressing over 2n..4n slots keyed by
 * id, beside its latest position; `next` chains its positions in order), and its staged row is
 * copied to its later positions while it is in L1. With a cache, all distinct ids are looked up
 * first, in order (a hit sets its bit, a miss is admitted: the cache ends as if they were looked up
 * one by one); then the hits are decoded from their slots, one after another with the slots' lines
 * prefetched `distance` rows ahead; then the misses are staged from the table in blocks, and their
 * stored bytes written into the slots they were given, in order. So every hit reads its slot before
 * any slot is rewritten, and a slot given to two misses ends with the later one, as its key says.
 * Returns the rows read from the table (the distinct count; the misses with a cache), or -1 if the
 * scratch cannot be allocated. */
static Py_ssize_t gather_dedup(const Gather *a, Scratch *sc, Cache *cache) {
    size_t cap = 16;
    while (cap < (size_t)a->n * 2) cap <<= 1;
    const size_t n1 = (size_t)a->n + 1;
    struct {
        int64_t key;     /* the id, or -1: empty (ids are >= 0) */
        Py_ssize_t last; /* its latest position */
    } *set = PyMem_RawMalloc(cap * sizeof *set); /* key and position side by side: one line a lookup */
    Py_ssize_t *next = PyMem_RawMalloc(n1 * sizeof(Py_ssize_t));  /* [n] next position of the same id, or -1 */
    Py_ssize_t *fresh = PyMem_RawMalloc(n1 * sizeof(Py_ssize_t)); /* [distinct] first positions, in order */
    Py_ssize_t *lists = cache ? PyMem_RawMalloc(3 * n1 * sizeof(Py_ssize_t)) : NULL; /* hit slots, miss positions, miss slots */
    Py_ssize_t distinct = -1;
    if (!set || !next || !fresh || (cache && !lists)) goto done;
    memset(set, 0xff, cap * sizeof *set); /* every key -1 */
    distinct = 0;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        const int64_t r = a->ids[i];
        size_t h = (size_t)(((uint64_t)r * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
        while (set[h].key != -1 && set[h].key != r && !a->trust_slots) h = (h + 1) & (cap - 1);
        next[i] = -1;
        if (set[h].key == r || (a->trust_slots && set[h].key != -1)) {
            next[set[h].last] = i;
            set[h].last = i;
            continue;
        }
        set[h].key = r;
        set[h].last = i;
        fresh[distinct++] = i;
    }
    const Py_ssize_t d = prefetch_distance, rb = sc->row_bytes;
    Py_ssize_t nhit = 0, nmiss = distinct, *miss_pos = fresh, *miss_slot = NULL;
    if (cache) {
        Py_ssize_t *hit_slot = lists, *hit_pos = fresh; /* hits compact into the front of fresh */
        miss_pos = lists + n1;
        miss_slot = lists + 2 * n1;
        nmiss = 0;
        for (Py_ssize_t k = 0; k < distinct; k++) { /* the lookups, in order */
            if (d && k + d < distinct) {
                const Py_ssize_t base = set_of(a->ids[fresh[k + d]], cache->sets) * WAYS;
                __builtin_prefetch(cache->key + base, 1, 3); /* a set's 8 keys: one line */
                __builtin_prefetch(cache->ref + base, 1, 3);
            }
            const Py_ssize_t pos = fresh[k];
            const int64_t r = a->ids[pos];
            Py_ssize_t s = cache_find(cache, r);
            if (s >= 0) {
                cache->ref[s] = 1;
                hit_slot[nhit] = s;
                hit_pos[nhit++] = pos; /* nhit <= k: fresh[k] already read */
                continue;
            }
            s = cache_victim(cache, r);
            cache->key[s] = r;
            cache->ref[s] = 0;
            miss_pos[nmiss] = pos;
            miss_slot[nmiss++] = s;
        }
        cache->hits += nhit;
        for (Py_ssize_t k = 0; k < nhit; k++) { /* the hits, from their slots */
            if (d && k + d < nhit) prefetch_read(cache->slab + hit_slot[k + d] * rb, rb);
            put_row(a, sc, cache->slab + hit_slot[k] * rb, next, hit_pos[k]);
        }
    }
    for (Py_ssize_t k0 = 0; k0 < nmiss; k0 += BLOCK) /* the rest, from the table */
        stage_block(a, miss_pos + k0, nmiss - k0 < BLOCK ? (int)(nmiss - k0) : BLOCK, sc, cache,
                    miss_slot ? miss_slot + k0 : NULL, next);
    if (cache) distinct = nmiss; /* rows read from the table */
done:
    PyMem_RawFree(set);
    PyMem_RawFree(next);
    PyMem_RawFree(fresh);
    PyMem_RawFree(lists);
    return distinct;
}

/* The cache arrays (keys, ref, hand, slab; see Cache) of a staging row of row_bytes, held in views. */
typedef struct {
    Py_buffer key, ref, hand, slab;
} CacheViews;

static void release_cache(CacheViews *v) {
    PyBuffer_Release(&v->slab);
    PyBuffer_Release(&v->hand);
    PyBuffer_Release(&v->ref);
    PyBuffer_Release(&v->key);
}

static int get_cache(const char *fn, PyObject *key_o, PyObject *ref_o, PyObject *hand_o, PyObject *slab_o,
                     CacheViews *v) {
    const ArraySpec spec[] = {{"cache keys", key_o, K_I64, 1, 1, &v->key}, {"cache ref", ref_o, K_U8, 1, 1, &v->ref},
                              {"cache hand", hand_o, K_U8, 1, 1, &v->hand}, {"cache slab", slab_o, K_U8, 2, 1, &v->slab}};
    if (get_arrays(fn, spec, 4) < 0) return -1;
    const Py_ssize_t slots = SHAPE(v->key, 0);
    if (slots < WAYS || slots % WAYS || SHAPE(v->ref, 0) != slots || SHAPE(v->hand, 0) != slots / WAYS ||
        SHAPE(v->slab, 0) != slots) {
        PyErr_Format(PyExc_ValueError, "%s: cache keys [%zd], ref [%zd], hand [%zd], slab [%zd, ...] do not fit (keys "
                     "a positive multiple of %d, ref and slab as many, hand keys / %d)", fn, slots,
                     SHAPE(v->ref, 0), SHAPE(v->hand, 0), SHAPE(v->slab, 0), WAYS, WAYS);
        goto fail;
    }
    return 0;
fail:
    release_cache(v);
    return -1;
}

static PyObject *gather_common(const char *fn, PyObject *table_o, PyObject *scale_o, PyObject *ids_o, PyObject *out_o,
                               int dedup, CacheViews *cv) {
    const int fp8 = scale_o != Py_None;
    Py_buffer table, scale, ids, out;
    int held = 0; /* buffers held, in the order table, ids, out, scale */
    PyObject *result = NULL;
    if (get_array(fn, "table", table_o, fp8 ? K_U8 : K_F32, 2, 0, &table) < 0) return NULL;
    held++;
    if (get_array(fn, "ids", ids_o, K_I64, 1, 0, &ids) < 0) goto done;
    held++;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_STRIDES) < 0) goto done;
    held++;
    {
        const enum kind out_kind = out.itemsize == 2 ? K_I16 : K_F32;
        if (!kind_matches(&out, out_kind) || out.ndim != 2 || !PyBuffer_IsContiguous(&out, 'C')) {
            PyErr_Format(PyExc_ValueError, "%s: out must be a writable C-contiguous 2-D float32 array or int16 "
                         "array of bfloat16 bits (got format '%s', itemsize %zd, ndim %d)", fn,
                         out.format ? out.format : "B", out.itemsize, out.ndim);
            goto done;
        }
    }
    if (fp8) {
        if (get_array(fn, "scale", scale_o, K_U8, 2, 0, &scale) < 0) goto done;
        held++;
    }
    const Py_ssize_t rows = SHAPE(table, 0), hd = SHAPE(table, 1), n = SHAPE(ids, 0);
    if (SHAPE(out, 0) != n || SHAPE(out, 1) != hd) {
        PyErr_Format(PyExc_ValueError, "%s: out has shape [%zd, %zd], expected [len(ids), head_dim] = [%zd, %zd]",
                     fn, SHAPE(out, 0), SHAPE(out, 1), n, hd);
        goto done;
    }
    if (fp8 && (hd % GROUP || SHAPE(scale, 0) != rows || SHAPE(scale, 1) != hd / GROUP)) {
        PyErr_Format(PyExc_ValueError, "%s: table [%zd, %zd] and scale [%zd, %zd] do not fit (scale must be "
                     "[rows, head_dim / %d], head_dim a multiple of %d)", fn, rows, hd, SHAPE(scale, 0),
                     SHAPE(scale, 1), GROUP, GROUP);
        goto done;
    }
    if (cv && SHAPE(cv->slab, 1) != (fp8 ? hd + hd / GROUP : hd * 4)) {
        PyErr_Format(PyExc_ValueError, "%s: cache slab rows of %zd bytes do not hold a stored row of %zd bytes", fn,
                     SHAPE(cv->slab, 1), fp8 ? hd + hd / GROUP : hd * 4);
        goto done;
    }
    const int64_t *id = (const int64_t *)ids.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (id[i] < 0 || id[i] >= rows) {
            PyErr_Format(PyExc_IndexError, "%s: ids[%zd] = %lld is out of range for a table of %zd rows", fn, i,
                         (long long)id[i], rows);
            goto done;
        }
    }
    Gather a = {(const uint8_t *)table.buf, fp8 ? (const uint8_t *)scale.buf : NULL, id, (uint8_t *)out.buf, n, hd,
                out.itemsize, trust_slots, 0};
#ifdef HAVE_X86_DECODE
    a.stream = have_avx2 && fp8 && out.itemsize == 4 && hd % 8 == 0 && (uintptr_t)out.buf % 32 == 0 &&
               n * hd * 4 >= stream_bytes;
#endif
    const Py_ssize_t scale_bytes = fp8 ? hd / GROUP : 0, row_bytes = (fp8 ? hd : hd * 4) + scale_bytes;
    Scratch sc = {PyMem_RawMalloc((size_t)(BLOCK * row_bytes + 1)), PyMem_RawMalloc((size_t)(hd + 1) * sizeof(float)),
                  row_bytes, scale_bytes};
    if (!sc.raw || !sc.row32) {
        PyMem_RawFree(sc.raw);
        PyMem_RawFree(sc.row32);
        PyErr_NoMemory();
        goto done;
    }
    Cache cache = {0};
    if (cv) {
        cache = (Cache){(int64_t *)cv->key.buf, (uint8_t *)cv->ref.buf, (uint8_t *)cv->hand.buf,
                        (uint8_t *)cv->slab.buf, SHAPE(cv->key, 0) / WAYS, trust_keys, 0};
    }
    Py_ssize_t read = n;
    Py_BEGIN_ALLOW_THREADS
    if (dedup || cv) read = gather_dedup(&a, &sc, cv ? &cache : NULL);
    else gather_all(&a, &sc);
#ifdef HAVE_X86_DECODE
    if (a.stream) _mm_sfence(); /* the streamed rows are visible before the call returns */
#endif
    Py_END_ALLOW_THREADS
    PyMem_RawFree(sc.raw);
    PyMem_RawFree(sc.row32);
    if (read < 0) result = PyErr_NoMemory();
    else result = cv ? Py_BuildValue("nn", read, cache.hits) : PyLong_FromSsize_t(read);
done:
    if (held >= 4) PyBuffer_Release(&scale);
    if (held >= 3) PyBuffer_Release(&out);
    if (held >= 2) PyBuffer_Release(&ids);
    PyBuffer_Release(&table);
    return result;
}

static PyObject *py_gather_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *table_o, *scale_o, *ids_o, *out_o;
    int dedup;
    if (!PyArg_ParseTuple(args, "OOOOp", &table_o, &scale_o, &ids_o, &out_o, &dedup)) return NULL;
    return gather_common("gather_rows", table_o, scale_o, ids_o, out_o, dedup, NULL);
}

static PyObject *py_gather_rows_cached(PyObject *Py_UNUSED(self), PyObject *args) {
    static const char *fn = "gather_rows_cached";
    PyObject *table_o, *scale_o, *ids_o, *out_o, *key_o, *ref_o, *hand_o, *slab_o;
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &table_o, &scale_o, &ids_o, &out_o, &key_o, &ref_o, &hand_o, &slab_o))
        return NULL;
    CacheViews cv;
    if (get_cache(fn, key_o, ref_o, hand_o, slab_o, &cv) < 0) return NULL;
    PyObject *result = gather_common(fn, table_o, scale_o, ids_o, out_o, 1, &cv);
    release_cache(&cv);
    return result;
}

static PyMethodDef methods[] = {
    {"gather_rows", py_gather_rows, METH_VARARGS,
     "gather_rows(table, scale, ids, out, dedup) -> rows read: out[i] = row ids[i] of the table, decoded "
     "(FP8 E4M3 bytes + E8M0 codes, or float32 with scale None) into float32 or bfloat16 bits (int16)."},
    {"gather_rows_cached", py_gather_rows_cached, METH_VARARGS,
     "gather_rows_cached(table, scale, ids, out, keys, ref, hand, slab) -> (rows read from the table, "
     "cache hits): gather_rows with dedup, behind the hot-row cache held in keys/ref/hand/slab (updated in place)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gather_kernel",
    "Engram staging gather for CPU tables (FP8 or float32 rows into float32/bfloat16 staging); see "
    "engram_serve/engram/staging.py.", -1, methods,
};

/* The decode tables and the CPU's features, once (either module's init may come first). */
static void init_tables(void) {
    static int done = 0;
    if (done) return;
    done = 1;
    for (int c = 0; c < 255; c++) scale_of_code[c] = ldexpf(1.0f, c - 127);
    scale_of_code[255] = NAN;
#ifdef HAVE_X86_DECODE
    __builtin_cpu_init();
    have_avx512 = __builtin_cpu_supports("avx512f");
    have_avx2 = __builtin_cpu_supports("avx2");
    have_vbmi = have_avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
    for (int m = 0; m < 128; m++) { /* the exact float32 |e4m3| of each magnitude: decode_fp8_row at scale 1 */
        uint8_t row[GROUP] = {(uint8_t)m}, one = 127;
        float v[GROUP];
        decode_fp8_row(row, &one, v, GROUP);
        const uint32_t u = bits_of_f32(v[0]);
        mag_hi[m] = (uint8_t)(u >> 24);
        mag_lo[m] = (uint8_t)(u >> 16);
    }
    for (int i = 0; i < 16; i++) { /* the AVX2 tables, in both 128-bit lanes */
        exp_hi[i] = exp_hi[i + 16] = i ? mag_hi[i << 3] : 0;
        exp_lo[i] = exp_lo[i + 16] = i ? mag_lo[i << 3] : 0;
        sub_hi[i] = sub_hi[i + 16] = i < 8 ? mag_hi[i] : 0;
        sub_lo[i] = sub_lo[i + 16] = i < 8 ? mag_lo[i] : 0;
    }
#endif
}

PyMODINIT_FUNC PyInit__gather_kernel(void) {
    init_tables();
    return PyModule_Create(&module);
}

/* ---- the test hooks: a second module in this shared object (see the header) ---------------------- */

/* *var = the one non-negative integer in args (a hook named fn); returns the old value. */
static PyObject *set_size(PyObject *args, const char *fn, Py_ssize_t *var) {
    Py_ssize_t v;
    if (!PyArg_ParseTuple(args, "n", &v)) return NULL;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd is negative", fn, v);
        return NULL;
    }
    const Py_ssize_t old = *var;
    *var = v;
    return PyLong_FromSsize_t(old);
}

static PyObject *py_set_prefetch_distance(PyObject *Py_UNUSED(self), PyObject *args) {
    return set_size(args, "set_prefetch_distance", &prefetch_distance);
}

static PyObject *py_set_stream_bytes(PyObject *Py_UNUSED(self), PyObject *args) {
    return set_size(args, "set_stream_bytes", &stream_bytes);
}

static PyObject *py_set_decode_path(PyObject *Py_UNUSED(self), PyObject *args) {
    int level;
    if (!PyArg_ParseTuple(args, "i", &level)) return NULL;
    if (level < 0 || level > 3) {
        PyErr_Format(PyExc_ValueError, "set_decode_path: level %d is not 0, 1, 2 or 3", level);
        return NULL;
    }
    const int old = decode_path;
    decode_path = level;
#ifdef HAVE_X86_DECODE
    const int best = have_vbmi ? 3 : have_avx512 ? 2 : have_avx2 ? 1 : 0;
#else
    const int best = 0;
#endif
    return Py_BuildValue("ii", old, level < best ? level : best);
}

static PyObject *py_set_trust(PyObject *Py_UNUSED(self), PyObject *args) {
    int slots, keys;
    if (!PyArg_ParseTuple(args, "pp", &slots, &keys)) return NULL;
    PyObject *old = Py_BuildValue("OO", trust_slots ? Py_True : Py_False, trust_keys ? Py_True : Py_False);
    trust_slots = slots;
    trust_keys = keys;
    return old;
}

static PyMethodDef hook_methods[] = {
    {"set_prefetch_distance", py_set_prefetch_distance, METH_VARARGS,
     "set_prefetch_distance(rows) -> the previous distance: how many rows ahead the gather prefetches (0: none); "
     "staged values never depend on it."},
    {"set_stream_bytes", py_set_stream_bytes, METH_VARARGS,
     "set_stream_bytes(bytes) -> the previous threshold: calls whose float32 staging of FP8 rows is at least this "
     "many bytes write it with non-temporal stores; staged values never depend on it."},
    {"set_decode_path", py_set_decode_path, METH_VARARGS,
     "set_decode_path(level) -> (previous level, the path now used): decode FP8 rows through the best path up to "
     "level (3 AVX-512 VBMI, 2 AVX-512F, 1 AVX2, 0 the portable loop) that this CPU has; every path gives the same "
     "bits."},
    {"set_trust", py_set_trust, METH_VARARGS,
     "set_trust(slots, keys) -> the previous (slots, keys). Negative controls only: the dedup set (slots) or the "
     "hot-row cache (keys) takes a filled slot for the id without comparing keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hook_module = {
    PyModuleDef_HEAD_INIT, "_gather_hooks",
    "Test hooks of _gather_kernel (tuning and the key checks); loaded from the kernel's file by tests only.",
    -1, hook_methods,
};

PyMODINIT_FUNC PyInit__gather_hooks(void) {
    init_tables();
    return PyModule_Create(&hook_module);
}
