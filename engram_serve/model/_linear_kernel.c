/* The CPU matmuls of model/exactness.py: float32 weights packed in panels (linear_packed), MXFP4 weights as stored
 * (linear_stored), FP8 E4M3 weights with block scales (linear_fp8), weights exactly bfloat16 on AMX tiles
 * (linear_bf16), the BLAS call torch makes
 * (blas_mm), and the MoE's routed experts in one call (moe_experts). The float32 one, in a fixed accumulation order: every
 * output y[i][j] is the k products x[i][t] * w[t][j] summed as blocks of kc inputs: within a block one
 * fused multiply-add chain over the inputs in order, from 0 (one rounding per step); the blocks' sums
 * then added in order, the first one taken as is. That is the order of MKL's blocked sgemm kernel for
 * the right kc, so exactness.py uses it for a weight only where a probe on this CPU shows it gives the
 * bits of torch's matmul (`small_call_kc`). The same operations for every row whatever the call's row
 * count, its tile or the tile's place: a row's bits do not depend on its batch mates, by construction.
 * So no call pads, and a call of one row costs one row.
 *
 * Blocked for the cache: the weight comes packed in panels of 16 columns ([panels][k][16], zero
 * beyond n, layers.py `pack_panels`, once per weight); tiles of 6 rows x 16 columns keep their 12
 * accumulators in AVX2 registers (a tile of 1 row takes 4 panels, of 2 rows 2, for 8 independent chains),
 * or with AVX-512 tiles of 6 rows x two panels (1 row x 8, 2 x 4; a call of 7 to 16 rows, a routed expert's,
 * one tile of all of them x one panel, so each weight is read once) their 16-lane ones (a portable tile with
 * fmaf elsewhere; the same bits); a pass over the rows reuses a group of panels that stays in L2. A weight of
 * 1 MiB or more streams from memory: AVX-512 tiles prefetch its panels 64 inputs (4 KiB) ahead.
 *
 * Plain CPython C API. The arrays come as addresses (torch's `data_ptr()`), not through the buffer
 * protocol: numpy conversions around each call cost more than the arithmetic of a one-row call
 * (~5 us against ~1 us at [128, 128]). The callers, model/exactness.py `matmul_kernel`, `matmul_bf16`,
 * `matmul_fp8`, `blas_linear` and `moe_experts` (and model/ops_c.py `hc_next_packed`, through linear_packed's or
 * linear_bf16's raw entry), check dtype, device, shapes and strides and keep the tensors alive; the kernel checks
 * sizes only. Every kernel takes its arguments by position or by name: one X-macro list each
 * (_kernel_buffers.h) makes its struct, parser, raw entry and docstring.
 *
 *   linear_packed(x, ldx, panels, y, m, k, n, kc, simd) -> None
 *       x  [m, k] float32, rows ldx floats apart;
 *       panels [ceil(n / 16), k, 16] float32: the weight w [k, n] (an input-major weight's transpose);
 *       y  [m, n] float32, contiguous, written;
 *       simd: 0 the portable tile, 1 AVX2 at most, 2 AVX-512 where the CPU has it (tests: all give the same
 *       bits).
 *   The GIL is released during the arithmetic.
 *   blas_mm(sgemm, x, wt, y, m, k, n) -> None
 *       y [m, n] = x [m, k] @ wt [k, n], all contiguous float32, by the BLAS sgemm at address `sgemm` (Fortran
 *       interface, 32-bit integers) called with the arguments torch's CPU matmul gives it for these layouts
 *       (column-major: y^T = wt^T x^T, no transposes, alpha 1, beta 0): torch's bits without torch's dispatch,
 *       for the weights no fixed-order kernel reproduces (exactness.py `blas_linear` probes that it does).
 *   simd_level() -> 0, 1 or 2: the level that simd 2 (what exactness.py passes) runs at on this CPU.
 *   spin_adds(n) -> int or None: n rounds of 8 dependent integer adds (a cycle each on x86-64 cores: ~8 n
 *       cycles; the benchmarks time it for the core's clock), None on other CPUs.
 *   linear_stored(x, ldx, format, data, scales, y, ldy, m, k, n, kc, simd[, block]) -> None
 *       linear_packed's product of a weight as its checkpoint stores it, read in place (a memory map: no copy):
 *       format 2 MXFP4 (E2M1 codes [n, k / 2], E8M0 scales [n, k / 32]), 4 FP8 (E4M3 [n, k], E8M0 scales per
 *       block x block tile), 5 BF16 ([n, k]), decoded exactly in registers (_formats.h) inside the very accumulation loops of the
 *       float panels (instantiated per format, the section "weight formats" below): the bits of linear_packed over
 *       the dequantized weight. Formats 10, 12 and 13: MXFP4, FP8 and BF16 rows repacked panel-major at load
 *       (panel_words: a permutation of the bytes, so that 16 rows' word at an input is one load), the same bits.
 *       Any of them + 16 (WF_AMX, AMX CPUs): decoded block by block into the bfloat16 tiles linear_bf16 would take
 *       of the dequantized weight, and multiplied so: linear_bf16's bits (kc unused).
 *   panel_words(data, words, n, k, fp8) -> bool: that repack, in one pass (False where fp8 and a code is NaN).
 *   decode_formats(format, data, y, n, simd[, scales]) -> level: the decoders of _formats.h, for their test.
 *   moe_experts(xs, rows, counts, e, d, inter, panels13, kc13, panels2, kc2, limit, h, g, ys, simd[, format,
 *               scales13, scales2, w3, scales3, tiles, prefetch]) -> None
 *       DeepSeek-V4.1's routed experts in one call (model/deepseek_v41.py MoE): xs [rows, d] the (token, expert)
 *       pairs grouped by expert, counts [e] int64 the rows of each expert in order; for each expert x with
 *       rows, h = its rows @ w13[x] (panels13[x], kc13: [2 inter] outputs, w1 then w3), g = the clamped SwiGLU
 *       of h (_kernel_math.h `swiglu_value`), its rows of ys = g @ w2[x] (panels2[x], kc2). The very products
 *       and SwiGLU the MoE computes call by call (`linear`, `swiglu`), so the same bits, without a host read
 *       of the counts (a decode step's CPU graph replays it). simd as linear_packed's (0, 1 or 2). format 1
 *       (or tiles=True): the addresses are of bfloat16 tiles, multiplied by linear_bf16 (kc13, kc2 and simd
 *       unused); format 2: of MXFP4 panels' codes, with scales13 / scales2 their scales' addresses
 *       (linear_stored's product: the same bits as format 0 over the dequantized weights); format 10: those codes
 *       repacked panel-major (panel_words), the same bits; formats 18 and 26: those on the AMX tiles (format 1's
 *       bits over the dequantized weights). prefetch (formats 2 and 18: codes read where a file's map has them):
 *       the pages of every expert with rows read ahead first (`will_need`).
 *   linear_bf16(x, ldx, w, y, m, k, n) -> None, amx_supported() -> bool
 *       y [m, n] = x @ w on the AMX tile unit, w every value a bfloat16, packed as tiles (the section below):
 *       the inputs split exactly in three bfloat16 pieces, the products exact, the sums in float32; where
 *       amx_supported() (AMX-BF16, AVX-512, the tile data granted by Linux).
 *
 * A call of more than DECODE_ROWS rows decodes each group of stored panels once into float panels (decode_panel) and
 * runs the float tiles over them for every tile of rows: the same bits, one decode a weight.
 *
 * Threads: each product runs on the kernels' pool (_thread_pool.h) partitioned along its output panels (16
 * columns; the bfloat16 tiles' column pairs of 32), and along its rows in whole tiles where the panels are too few:
 * the section "threads" below; the experts along (expert, output panel) pairs. Never inside an output's sum, so
 * the bits do not depend on the thread count. `linear_panels_range` computes a range of panels for all rows.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation is the IEEE one written
 * (fmaf and the vector fused multiply-add round once).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernel_buffers.h"
#include "_kernel_math.h"
#include "_formats.h"
#include "_thread_pool.h"

#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || defined(__GNUC__))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__unix__)
#include <sys/mman.h>
#include <unistd.h>
#endif

/* ---- the blocked form: panels of 16 columns, tiles of up to 6 rows (16 for a few rows) ---------------- */

#define NR 16 /* columns of a panel: the packed weight is [panels][k][NR], zero beyond n */
#define PF_AHEAD 64 /* inputs ahead that AVX-512 tiles prefetch a weight too big for L2 (4 KiB of a panel) */
#define PF_BYTES (1 << 20) /* weights of at least this many bytes stream from memory: prefetched */
#define ROW_PF_EVERY 64   /* stored rows: inputs between two prefetches of each row (a cache line of FP8) */
#define ROW_PF_AHEAD 512  /* stored rows: inputs ahead that a row is prefetched */
#define MR 6  /* rows of a tile: 6 x 16 accumulators fill 12 of AVX2's 16 vector registers */
#define FEW_ROWS 16 /* the most rows of AVX-512's one-panel tile (16 accumulators of its 32 registers) */
#define DECODE_ROWS 12 /* calls of more rows decode stored panels once (decode_panel; measured on Zen 4) */
#define PANEL_BYTES (192 * 1024) /* the panels one pass over the rows reuses: they stay in L2 */

/* ---- weight formats: how a panel's row of 16 weights is decoded (_formats.h), instantiated per format ---------
 *
 * Every accumulation loop below takes its format as a constant first argument (the loops are always inlined
 * into one function per format and tile shape, so the format's test folds away): WF_F32 reads a row of a float
 * panel, WF_MXFP4, WF_FP8 and WF_BF16 from the rows of a weight as stored, WF_FP8_PANELS from E4M3 bytes and a power
 * of two. The decode gives the very float32 weights of the float panels of the dequantized weight (an exact decoder), and
 * the fused multiply-adds and adds that follow are one code for all formats: so the same bits.
 *
 *   WF_F32        panel [k][16] float32 (pack_panels)
 *   WF_FP8_PANELS [k][16] E4M3 bytes (never a NaN code), scales [ceil(k / 64)] float32 2^(s + 8) (pack_fp8)
 *   WF_MXFP4      the weight as a checkpoint stores it, read in place (a memory map): codes [n][k / 2] (input 2i
 *                 the lower nibble of byte i), E8M0 scales [n][k / 32]: 0.53 bytes a weight; a panel is 16 rows
 *   WF_FP8        as stored too: E4M3 [n][k], one E8M0 scale per block x block tile [ceil(n / block)][ceil(k /
 *                 block)] (block a multiple of 16: a panel's rows share their scale row)
 *
 * The stored rows are read 16 at a time by one gather a few inputs wide (8 E2M1 codes, 4 E4M3 bytes, 2 bfloat16 a row), the
 * lanes of the rows beyond n masked off (zero weights, as the padding of a panel). A panel is (data, scales, and
 * for the stored rows their strides): struct panel_ref; a weight is its format, addresses and shape: weight_ref. */
enum weight_format { WF_F32 = 0, WF_TILES = 1, WF_MXFP4 = 2, WF_FP8_PANELS = 3, WF_FP8 = 4, WF_BF16 = 5 };

/* A flag of a stored format: its rows repacked panel-major, [panels][words][16][4 bytes] (each row's 32-bit words
 * intact, a panel's 16 rows side by side, zero rows beyond n: a permutation of the stored bytes), so that the 16 rows'
 * word at an input is one 64-byte load, not a transpose of 16 rows (load_rows16). The scales stay as stored. Every
 * stored format has its words form (FORMAT | WF_WORDS: linear_stored's 10, 12 and 13, moe_experts' 10); FP8 words
 * never hold a NaN code (the repack checks). */
#define WF_WORDS 8
/* A flag of a stored format: multiplied on the AMX tiles, each block of 32 inputs of a pair of panels decoded into
 * the bfloat16 tiles that pack_bf16 would make of the dequantized weight (the section "bf16 tiles" below). */
#define WF_AMX 16
/* A flag of FP8, MXFP4 or BF16 words on the tiles (FP8 | WORDS | AMX, k and the block multiples of 32; MXFP4 | WORDS
 * | AMX; BF16 | WORDS | AMX, k a multiple of 32): each panel's bytes of a block of 32 inputs put in the order its
 * bfloat16 tile rows are decoded in (panel_words' `tiled`): FP8's load q (64 bytes) holds the codes of tile rows 2q
 * and 2q + 1 as the table lookups and byte unpacks of fp8_tiled_block take them; MXFP4's load q (32 bytes) holds in
 * byte e row 2q's code of element e (the lower nibble) and row 2q + 1's (mxfp4_tiled_block); BF16's block is its
 * tile itself (pack_bf16's), which the tile loads read in place. A permutation of the words within each block
 * (tiled_at), so the same products. */
#define WF_TILED 32
#define AMX_K 32 /* inputs of a tile's row: 16 pairs */
#define BASE(fmt) ((fmt) & 7)
static inline int words_of(const int fmt) { return fmt & WF_WORDS; }

/* every panel format, X(name, format): each gets its tiles (TILES_OF, tile_plain_NAME), the stored ones their
 * decode_panel (DECODE_PANEL) */
#define STORED_FORMATS(X)                                                                                          \
    X(mxfp4, WF_MXFP4) X(fp8, WF_FP8) X(bf16, WF_BF16) X(mxfp4w, WF_MXFP4 | WF_WORDS) X(fp8w, WF_FP8 | WF_WORDS)     \
    X(bf16w, WF_BF16 | WF_WORDS)
#define PANEL_FORMATS(X) X(f32, WF_F32) STORED_FORMATS(X)

#define MX_G 32 /* inputs of an E8M0 scale of an MXFP4 panel */
#define SB 64   /* input rows of a scale block of an FP8 panel */

typedef struct {
    const void *data;  /* the panel's first row (stored rows: the first of its 16 rows) */
    const void *scale; /* its scales (MXFP4, FP8: the panel's; stored rows: those of its first row), else unused */
    Py_ssize_t ld;     /* stored rows: bytes between two rows of data */
    Py_ssize_t sld;    /* WF_MXFP4: bytes between two rows of scales */
    int rows;          /* stored rows: the panel's rows within n (1..16) */
    int group;         /* WF_FP8: inputs sharing a scale (the block) */
} panel_ref;

typedef struct {
    int fmt;
    const void *data, *scales;
    Py_ssize_t k, n;  /* inputs, outputs */
    Py_ssize_t block; /* WF_FP8: the scales' block */
    Py_ssize_t row0;  /* WF_FP8: the first row's place in its block of scales (a slice of rows; a multiple of 16) */
    int decoded;      /* WF_F32: panels decode_panel just wrote (in L2) */
    Py_ssize_t gn;    /* groups (a block-diagonal weight, e.g. V4.1's grouped wo_a): outputs a group (0: one group),
                       * group g's outputs reading x's inputs from g gx on */
    Py_ssize_t gx;
} weight_ref;

/* the inputs' offset in a row of x of the group of output column c */
static inline Py_ssize_t group_x(const weight_ref *w, Py_ssize_t c) { return w->gn ? c / w->gn * w->gx : 0; }

/* the end of the run of output units (of `cols` columns) from u (before u1) in u's group */
static inline Py_ssize_t units_end(const weight_ref *w, Py_ssize_t u, Py_ssize_t u1, int cols) {
    if (!w->gn) return u1;
    const Py_ssize_t e = (u * cols / w->gn + 1) * w->gn / cols;
    return e < u1 ? e : u1;
}

static inline int stored_rows(const int fmt) {
    return BASE(fmt) == WF_MXFP4 || BASE(fmt) == WF_FP8 || BASE(fmt) == WF_BF16;
}

/* the byte of input t in a stored row */
static inline Py_ssize_t row_byte(const int fmt, Py_ssize_t t) {
    return BASE(fmt) == WF_MXFP4 ? t / 2 : BASE(fmt) == WF_BF16 ? 2 * t : t;
}

/* panel p of weight w: its data and scales */
static inline panel_ref panel_at(const weight_ref *w, Py_ssize_t p) {
    const int fmt = w->fmt;
    const Py_ssize_t k = w->k;
    panel_ref r = {0};
    if (fmt == WF_FP8_PANELS) {
        r.data = (const uint8_t *)w->data + p * k * NR;
        r.scale = (const float *)w->scales + p * ((k + SB - 1) / SB);
    } else if (stored_rows(fmt)) {
        const int mx = BASE(fmt) == WF_MXFP4;
        r.ld = row_byte(fmt, k); /* (words: a panel takes the same bytes, its rows padded) */
        r.data = (const uint8_t *)w->data + p * NR * r.ld;
        r.rows = w->n - p * NR < NR ? (int)(w->n - p * NR) : NR;
        if (mx) {
            r.sld = k / MX_G;
            r.scale = (const uint8_t *)w->scales + p * NR * r.sld;
        } else if (BASE(fmt) == WF_FP8) {
            r.group = (int)w->block;
            r.scale = (const uint8_t *)w->scales + ((w->row0 + p * NR) / w->block) * ((k + w->block - 1) / w->block);
        }
    } else {
        r.data = (const float *)w->data + p * k * NR;
    }
    return r;
}

/* the bytes of one panel (for the L2 grouping and the prefetch decision) */
static inline size_t panel_bytes(const int fmt, Py_ssize_t k) {
    return BASE(fmt) == WF_MXFP4 ? (size_t)k * NR / 2 + (size_t)k / MX_G * NR
           : fmt == WF_FP8_PANELS || BASE(fmt) == WF_FP8 ? (size_t)k * NR
           : BASE(fmt) == WF_BF16                        ? (size_t)k * NR * 2
                                                   : (size_t)k * NR * 4;
}

/* the end of input t's scale group (inputs that share one scale), within [t, ke): all of them for float panels */
static inline Py_ssize_t group_end(const int fmt, panel_ref b, Py_ssize_t t, Py_ssize_t ke) {
    const Py_ssize_t g = BASE(fmt) == WF_MXFP4 ? MX_G : fmt == WF_FP8_PANELS ? SB
                         : BASE(fmt) == WF_FP8             ? b.group
                                                                : 0;
    if (!g) return ke;
    const Py_ssize_t e = (t / g + 1) * g;
    return e < ke ? e : ke;
}

/* the inputs one gather of stored rows covers (0: not stored rows) */
static inline int gather_inputs(const int fmt) {
    return BASE(fmt) == WF_MXFP4 ? 8 : BASE(fmt) == WF_FP8 ? 4 : BASE(fmt) == WF_BF16 ? 2 : 0;
}

/* stored rows: the address of the word holding input t of a panel's rows (words only: its 16 rows' 64 bytes) */
static inline const uint8_t *word_at(const int fmt, panel_ref b, Py_ssize_t t) {
    return (const uint8_t *)b.data + row_byte(fmt, t) / 4 * 64;
}

/* Tiled words (WF_TILED): the offset of the byte holding input t of row j within its panel (BF16: its first byte).
 * Tile row v = t % 16 of t's block pairs inputs v and v + 16 of each row: element e = 2 j + (t % 32 >= 16). FP8: byte
 * p of load v / 2 (64 bytes) is element 8 (p / 16) + p % 8 of tile row 2 (v / 2) + p % 16 / 8 (LANE_AT below);
 * MXFP4: byte e of load v / 2 (32 bytes), t's the nibble t % 2; BF16: element e of tile row v (64 bytes). */
static inline Py_ssize_t tiled_at(const int fmt, Py_ssize_t t, int j) {
    const int u = (int)(t % 32), v = u % 16, e = 2 * j + u / 16;
    if (BASE(fmt) == WF_MXFP4) return t / 32 * 256 + 32 * (v / 2) + e;
    if (BASE(fmt) == WF_BF16) return t / 32 * 1024 + 64 * v + 2 * e;
    return t / 32 * 512 + 64 * (v / 2) + 16 * (e / 8) + 8 * (v % 2) + e % 8;
}

/* stored rows: the address of the byte holding input t of the panel's row j */
static inline const uint8_t *byte_at(const int fmt, panel_ref b, Py_ssize_t t, int j) {
    if (fmt & WF_TILED) return (const uint8_t *)b.data + tiled_at(fmt, t, j);
    const Py_ssize_t rb = row_byte(fmt, t);
    return words_of(fmt) ? word_at(fmt, b, t) + j * 4 + rb % 4 : (const uint8_t *)b.data + j * b.ld + rb;
}

/* the scalar weight at input t, column j of a panel (the portable tile's decode) */
static inline float weight_at(const int fmt, panel_ref b, Py_ssize_t t, int j) {
    if (stored_rows(fmt) && j >= b.rows) return 0.0f;
    if (BASE(fmt) == WF_MXFP4)
        return mxfp4_value((*byte_at(fmt, b, t, j) >> (t & 1) * 4) & 15, ((const uint8_t *)b.scale)[j * b.sld + t / MX_G]);
    if (BASE(fmt) == WF_FP8)
        return e4m3_value(*byte_at(fmt, b, t, j)) * e8m0_value(((const uint8_t *)b.scale)[t / b.group]);
    if (BASE(fmt) == WF_BF16) return bf16_value(*(const uint16_t *)(const void *)byte_at(fmt, b, t, j));
    if (fmt == WF_FP8_PANELS) /* 2^(s + 8) / 2^8: exact */
        return e4m3_value(((const uint8_t *)b.data)[t * NR + j]) * (((const float *)b.scale)[t / SB] * 0.00390625f);
    return ((const float *)b.data)[t * NR + j];
}

/* the E8M0 scales of input t's group of a panel of stored MXFP4 rows, one a row (127, a scale of 1, beyond its
 * rows) */
static inline void row_scales(panel_ref b, Py_ssize_t t, uint8_t *e) {
    for (int r = 0; r < NR; r++) e[r] = r < b.rows ? ((const uint8_t *)b.scale)[r * b.sld + t / MX_G] : 127;
}

#if HAVE_X86_AVX2
/* Stored rows, AVX-512: the 16 rows' 32 bits at input t (the lanes beyond the panel's rows zero), and the 16 weights
 * of input t + u of such a gather (u < gather_inputs) times the scales */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512i gather16(const int fmt, panel_ref b,
                                                                                      Py_ssize_t t) {
    if (words_of(fmt)) return _mm512_loadu_si512((const void *)word_at(fmt, b, t));
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)b.ld));
    const uint8_t *p = (const uint8_t *)b.data + row_byte(fmt, t);
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), (__mmask16)((1u << b.rows) - 1), at, p, 1);
}

/* the next 4 gathers' worth of a full panel (16 rows) at input t, by plain loads: each row's 16 bytes (MXFP4: 32
 * inputs, FP8: 16), a 4 x 4 transpose of 32-bit words within each 128-bit lane (lane L holding rows 4L..4L+3): g[j]
 * is gather16's at input t + j * gather_inputs */
__attribute__((target("avx512f,avx2"), always_inline)) static inline void rows16x4(const int fmt, panel_ref b,
                                                                                  Py_ssize_t t, __m512i *g) {
    const uint8_t *p = (const uint8_t *)b.data + row_byte(fmt, t);
    __m512i z[4];
    for (int i = 0; i < 4; i++) { /* lane L: row 4L + i */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + i * b.ld)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (4 + i) * b.ld)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (8 + i) * b.ld)), 2);
        z[i] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (12 + i) * b.ld)), 3);
    }
    const __m512i a = _mm512_unpacklo_epi32(z[0], z[1]), c = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i e = _mm512_unpacklo_epi32(z[2], z[3]), d = _mm512_unpackhi_epi32(z[2], z[3]);
    g[0] = _mm512_unpacklo_epi64(a, e), g[1] = _mm512_unpackhi_epi64(a, e);
    g[2] = _mm512_unpacklo_epi64(c, d), g[3] = _mm512_unpackhi_epi64(c, d);
}

__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 lane16(const int fmt, __m512i g, int u,
                                                                                   __m512 scale) {
    if (BASE(fmt) == WF_MXFP4) return _mm512_mul_ps(e2m1_16_lanes(_mm512_srli_epi32(g, 4 * u)), scale);
    if (BASE(fmt) == WF_BF16) /* input t (u 0): the lower half of the word; t + 1: the upper */
        return _mm512_castsi512_ps(u ? _mm512_and_si512(g, _mm512_set1_epi32((int)0xFFFF0000)) : _mm512_slli_epi32(g, 16));
    return _mm512_mul_ps(e4m3_16_byte(g, u), scale);
}

/* MXFP4 stored rows, AVX-512: each row's scales of input t's group and the 3 groups after it (t / 32 + 4 <= the
 * row's groups), one 32-bit word a row by one gather (127, a scale of 1, beyond the panel's rows); the scale
 * vector of the group `i` (0..3) of such words */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512i mx_words16(panel_ref b, Py_ssize_t t) {
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)b.sld));
    return _mm512_mask_i32gather_epi32(_mm512_set1_epi32(0x7F7F7F7F), (__mmask16)((1u << b.rows) - 1), at,
                                       (const uint8_t *)b.scale + t / MX_G, 1);
}

__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 mx_scale16(__m512i words, int i) {
    const __m512i e = _mm512_and_si512(_mm512_srl_epi32(words, _mm_cvtsi32_si128(8 * i)), _mm512_set1_epi32(255));
    return e8m0_16(_mm512_cvtepi32_epi8(e));
}

/* AVX-512: the scale vector of input t's group, and the row of 16 weights at input t */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 scale16(const int fmt, panel_ref b,
                                                                                    Py_ssize_t t) {
    if (BASE(fmt) == WF_MXFP4) {
        if (t / MX_G + 4 <= b.sld) return mx_scale16(mx_words16(b, t), 0);
        uint8_t e[NR];
        row_scales(b, t, e);
        return e8m0_16(_mm_loadu_si128((const __m128i *)e));
    }
    if (BASE(fmt) == WF_FP8) return _mm512_set1_ps(e8m0_value(((const uint8_t *)b.scale)[t / b.group]));
    if (fmt == WF_FP8_PANELS) return _mm512_set1_ps(((const float *)b.scale)[t / SB]);
    return _mm512_setzero_ps(); /* unused */
}

/* an FP8 row: E4M3 bytes moved into float16 patterns (the value times 2^-8), times 2^(s + 8): a power of two */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512 row16(const int fmt, panel_ref b,
                                                                                  Py_ssize_t t, __m512 scale) {
    if (fmt == WF_FP8_PANELS) return _mm512_mul_ps(e4m3_16_raw((const uint8_t *)b.data + t * NR), scale);
    return _mm512_loadu_ps((const float *)b.data + t * NR);
}

/* AVX2: the two scale vectors of input t's group (columns 0-7, 8-15), the row's two halves */
__attribute__((target("avx2,fma"), always_inline)) static inline void scale8x2(const int fmt, panel_ref b, Py_ssize_t t,
                                                                              __m256 *s0, __m256 *s1) {
    if (BASE(fmt) == WF_MXFP4) {
        uint8_t rs[NR];
        row_scales(b, t, rs);
        const __m128i e = _mm_loadu_si128((const __m128i *)rs);
        *s0 = e8m0_8(e), *s1 = e8m0_8(_mm_srli_si128(e, 8));
    } else if (BASE(fmt) == WF_FP8) {
        *s0 = *s1 = _mm256_set1_ps(e8m0_value(((const uint8_t *)b.scale)[t / b.group]));
    } else {
        *s0 = *s1 = _mm256_setzero_ps(); /* unused (no AVX2 FP8 path) */
    }
}

__attribute__((target("avx2,fma"), always_inline)) static inline void row8x2(const int fmt, panel_ref b, Py_ssize_t t,
                                                                            __m256 s0, __m256 s1, __m256 *w0,
                                                                            __m256 *w1) {
    (void)fmt, (void)s0, (void)s1; /* the float panels' (the stored rows take lane8) */
    *w0 = _mm256_loadu_ps((const float *)b.data + t * NR), *w1 = _mm256_loadu_ps((const float *)b.data + t * NR + 8);
}

/* Stored rows, AVX2: gather16's bits as two halves of 8 rows, and lane16's weights */
__attribute__((target("avx2,fma"), always_inline)) static inline void gather8x2(const int fmt, panel_ref b,
                                                                               Py_ssize_t t, __m256i *g0,
                                                                               __m256i *g1) {
    if (words_of(fmt)) {
        *g0 = _mm256_loadu_si256((const __m256i *)(const void *)word_at(fmt, b, t));
        *g1 = _mm256_loadu_si256((const __m256i *)(const void *)(word_at(fmt, b, t) + 32));
        return;
    }
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)b.ld));
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const uint8_t *p = (const uint8_t *)b.data + row_byte(fmt, t);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(b.rows), lanes);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(b.rows - 8), lanes);
    *g0 = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(const void *)p, at, m0, 1);
    *g1 = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(const void *)(p + 8 * b.ld), at, m1, 1);
}

/* rows16x4 in AVX2: g0[j] rows 0-7, g1[j] rows 8-15 (a 128-bit lane L of g?[j] holding 4 rows) */
__attribute__((target("avx2,fma"), always_inline)) static inline void rows8x2x4(const int fmt, panel_ref b,
                                                                               Py_ssize_t t, __m256i *g0,
                                                                               __m256i *g1) {
    const uint8_t *p = (const uint8_t *)b.data + row_byte(fmt, t);
    for (int h = 0; h < 2; h++) {
        __m256i z[4], *g = h ? g1 : g0;
        for (int i = 0; i < 4; i++) /* lane L: row 8h + 4L + i */
            z[i] = _mm256_loadu2_m128i((const __m128i *)(p + (8 * h + 4 + i) * b.ld),
                                       (const __m128i *)(p + (8 * h + i) * b.ld));
        const __m256i a = _mm256_unpacklo_epi32(z[0], z[1]), c = _mm256_unpackhi_epi32(z[0], z[1]);
        const __m256i e = _mm256_unpacklo_epi32(z[2], z[3]), d = _mm256_unpackhi_epi32(z[2], z[3]);
        g[0] = _mm256_unpacklo_epi64(a, e), g[1] = _mm256_unpackhi_epi64(a, e);
        g[2] = _mm256_unpacklo_epi64(c, d), g[3] = _mm256_unpackhi_epi64(c, d);
    }
}

/* Stored rows: the bits of 4 gathers' worth of inputs from t by plain loads where the panel is full (`full`) and they
 * lie before te, else of one gather; how many (4 or 1) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline int load_rows16(const int fmt, panel_ref b,
                                                                                     Py_ssize_t t, Py_ssize_t te,
                                                                                     int full, __m512i *g) {
    if (full && !words_of(fmt) && te - t >= 4 * gather_inputs(fmt)) { /* (words: one load each, fewer registers) */
        rows16x4(fmt, b, t, g);
        return 4;
    }
    g[0] = gather16(fmt, b, t);
    return 1;
}

/* load_rows16 in AVX2: g0 rows 0-7, g1 rows 8-15 */
__attribute__((target("avx2,fma"), always_inline)) static inline int load_rows8x2(const int fmt, panel_ref b,
                                                                                 Py_ssize_t t, Py_ssize_t te, int full,
                                                                                 __m256i *g0, __m256i *g1) {
    if (full && !words_of(fmt) && te - t >= 4 * gather_inputs(fmt)) { /* (as load_rows16) */
        rows8x2x4(fmt, b, t, g0, g1);
        return 4;
    }
    gather8x2(fmt, b, t, &g0[0], &g1[0]);
    return 1;
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline __m256 lane8(const int fmt, __m256i g, int u,
                                                                                   __m256 scale) {
    if (BASE(fmt) == WF_MXFP4) return _mm256_mul_ps(e2m1_8_lanes(_mm256_srli_epi32(g, 4 * u)), scale);
    if (BASE(fmt) == WF_BF16)
        return _mm256_castsi256_ps(u ? _mm256_and_si256(g, _mm256_set1_epi32((int)0xFFFF0000)) : _mm256_slli_epi32(g, 16));
    return _mm256_mul_ps(e4m3_8_byte(g, u), scale);
}

/* out[r][0..16) for r < mr: the formula above over x rows (ldx apart) and one panel bp; out rows ldo apart.
 * Each block of kc inputs: a chain from 0, stored (the first block) or added. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
tile_avx2(const int fmt, const int mr, const float *restrict x, Py_ssize_t ldx, panel_ref bp, Py_ssize_t k,
          Py_ssize_t kc, float *restrict out, Py_ssize_t ldo) {
    for (Py_ssize_t k0 = 0; k0 < k; k0 += kc) {
        const Py_ssize_t ke = k - k0 < kc ? k : k0 + kc;
        __m256 c[MR][2];
        for (int r = 0; r < mr; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
        for (Py_ssize_t t = k0; t < ke;) {
            const Py_ssize_t te = group_end(fmt, bp, t, ke);
            __m256 s0, s1;
            scale8x2(fmt, bp, t, &s0, &s1);
            while (gather_inputs(fmt) && t < te) { /* stored rows: as wide_avx512's */
                const int gi = gather_inputs(fmt);
                __m256i g0[4], g1[4];
                const int cols = load_rows8x2(fmt, bp, t, te, bp.rows == NR, g0, g1);
                for (int j = 0; j < cols; j++)
#pragma GCC unroll 8
                    for (int u = 0; u < gi; u++, t++) {
                        const __m256 b0 = lane8(fmt, g0[j], u, s0), b1 = lane8(fmt, g1[j], u, s1);
                        for (int r = 0; r < mr; r++) {
                            const __m256 a = _mm256_broadcast_ss(x + r * ldx + t);
                            c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
                            c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
                        }
                    }
            }
#pragma GCC unroll 4
            for (; t < te; t++) {
                __m256 b0, b1;
                row8x2(fmt, bp, t, s0, s1, &b0, &b1);
                for (int r = 0; r < mr; r++) {
                    const __m256 a = _mm256_broadcast_ss(x + r * ldx + t);
                    c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
                    c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
                }
            }
        }
        for (int r = 0; r < mr; r++) {
            float *o = out + r * ldo;
            if (k0) {
                c[r][0] = _mm256_add_ps(_mm256_loadu_ps(o), c[r][0]);
                c[r][1] = _mm256_add_ps(_mm256_loadu_ps(o + 8), c[r][1]);
            }
            _mm256_storeu_ps(o, c[r][0]);
            _mm256_storeu_ps(o + 8, c[r][1]);
        }
    }
}

/* What the caller of a wide tile knows: whether to prefetch the next tile's panels (words), and for MXFP4 the
 * greatest exponent field of the tile's inputs (mx_inputs; -1: not read). */
typedef struct {
    int pf, xe;
} tile_hints;
#define NO_HINTS ((tile_hints){0, -1})

/* np panels at once in AVX2 for a tile of one or two rows: o[q] [r][0..16) (rows ldo apart) from the panel b[q],
 * two 8-lane accumulators per row and panel, so that such a tile has 4 or 8 independent chains (tile_avx2 of one
 * row: 2, each latency-bound, which left a matrix-vector product at about half the memory bandwidth). The panels
 * need not be adjacent (the SwiGLU's gate and up panels). Each output's chain is tile_avx2's operations in the
 * same order: the same bits. (h, the AVX-512 tiles' hints, is not used here.) */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
wide_avx2(const int fmt, const int mr, const int np, const float *restrict x, Py_ssize_t ldx, const panel_ref *b,
          Py_ssize_t k, Py_ssize_t kc, float *const *o, Py_ssize_t ldo, Py_ssize_t ldl, tile_hints h) {
    int full = 1; /* as wide_avx512's */
    for (int q = 0; q < np; q++) full &= b[q].rows == NR;
    for (Py_ssize_t k0 = 0; k0 < k; k0 += kc) {
        const Py_ssize_t ke = k - k0 < kc ? k : k0 + kc;
        __m256 c[4][2]; /* mr * np <= 4 */
        for (int i = 0; i < mr * np; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
        for (Py_ssize_t t = k0; t < ke;) {
            const Py_ssize_t te = group_end(fmt, b[0], t, ke);
            __m256 s[4][2];
            for (int q = 0; q < np; q++) scale8x2(fmt, b[q], t, &s[q][0], &s[q][1]);
            while (gather_inputs(fmt) && t < te) { /* stored rows: as wide_avx512's */
                const int gi = gather_inputs(fmt);
                __m256i g[4][2][4];
                int cols = 1;
                for (int q = 0; q < np; q++) cols = load_rows8x2(fmt, b[q], t, te, full, g[q][0], g[q][1]);
                for (int j = 0; j < cols; j++)
#pragma GCC unroll 8
                    for (int u = 0; u < gi; u++, t++) {
                        __m256 w[4][2];
                        for (int q = 0; q < np; q++)
                            w[q][0] = lane8(fmt, g[q][0][j], u, s[q][0]), w[q][1] = lane8(fmt, g[q][1][j], u, s[q][1]);
                        for (int r = 0; r < mr; r++) {
                            const __m256 a = _mm256_broadcast_ss(x + r * ldx + t);
                            for (int q = 0; q < np; q++) {
                                c[r * np + q][0] = _mm256_fmadd_ps(a, w[q][0], c[r * np + q][0]);
                                c[r * np + q][1] = _mm256_fmadd_ps(a, w[q][1], c[r * np + q][1]);
                            }
                        }
                    }
            }
#pragma GCC unroll 2
            for (; t < te; t++) {
                __m256 w[4][2];
                for (int q = 0; q < np; q++) row8x2(fmt, b[q], t, s[q][0], s[q][1], &w[q][0], &w[q][1]);
                for (int r = 0; r < mr; r++) {
                    const __m256 a = _mm256_broadcast_ss(x + r * ldx + t);
                    for (int q = 0; q < np; q++) {
                        c[r * np + q][0] = _mm256_fmadd_ps(a, w[q][0], c[r * np + q][0]);
                        c[r * np + q][1] = _mm256_fmadd_ps(a, w[q][1], c[r * np + q][1]);
                    }
                }
            }
        }
        for (int r = 0; r < mr; r++)
            for (int q = 0; q < np; q++) {
                float *d = o[q] + r * (q == np - 1 ? ldl : ldo);
                if (k0) {
                    c[r * np + q][0] = _mm256_add_ps(_mm256_loadu_ps(d), c[r * np + q][0]);
                    c[r * np + q][1] = _mm256_add_ps(_mm256_loadu_ps(d + 8), c[r * np + q][1]);
                }
                _mm256_storeu_ps(d, c[r * np + q][0]);
                _mm256_storeu_ps(d + 8, c[r * np + q][1]);
            }
    }
}

/* FP8 stored rows, AVX-512: xs[i] = x[i] * f for n <= XS inputs of one scale block, f its E8M0 scale (code e) times
 * 2^120, where every product is exact; 0 elsewhere (a scale of 2^8 or more, or NaN; a finite nonzero input whose
 * product overflows or falls below the normal range). Then x[i] (v s) = xs[i] (v 2^-120) exactly, so a fused
 * multiply-add of xs[i] and e4m3_16_tiny's weights rounds the very sums of x[i] and lane16's: the same bits, without
 * lane16's two multiplies per 16 weights. A zero, an infinity or a NaN input stays one. */
#define XS 128
__attribute__((target("avx512f,avx2"), always_inline)) static inline int fp8_prescale(const float *x, Py_ssize_t n,
                                                                                     unsigned e, float *xs) {
    if (e > 134) return 0;
    const __m512 f = _mm512_set1_ps(bits_float((e + 120) << 23)), inf = _mm512_set1_ps(INFINITY);
    const __m512i mag = _mm512_set1_epi32(0x7FFFFFFF);
    __mmask16 bad = 0;
    for (Py_ssize_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i), y = _mm512_mul_ps(v, f);
        const __m512 av = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), mag));
        const __m512 ay = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(y), mag));
        const __mmask16 finite_nonzero = _mm512_cmp_ps_mask(av, _mm512_setzero_ps(), _CMP_NEQ_OQ) &
                                         _mm512_cmp_ps_mask(av, inf, _CMP_LT_OQ);
        const __mmask16 normal = _mm512_cmp_ps_mask(ay, _mm512_set1_ps(0x1p-126f), _CMP_GE_OQ) &
                                 _mm512_cmp_ps_mask(ay, inf, _CMP_LT_OQ);
        bad |= finite_nonzero & ~normal;
        _mm512_mask_storeu_ps(xs + i, m, y);
    }
    return !bad;
}

/* MXFP4, AVX-512: scaled accumulators. A chain of fused multiply-adds c += (v s_g) x (v an E2M1 value, s_g = 2^E_g
 * the scale of input group g) gives the same bits kept as c' = c / (s_g 2^MX_B): the products (v 2^-MX_B) x (a table
 * of the values times 2^-MX_B), c' multiplied by s_g / s_g+1 as the group changes and by s_g 2^MX_B at the block's
 * end: one multiply a group instead of one a weight. Rounding to nearest commutes with a power of two wherever both
 * results are normal floats; with every E_g >= -MX_B, c' is no larger than c, so where c' is normal so is c, and
 * where c' is below the normal range, rounded exactly, so is c. Where a result of c's chain overflows, or c' rounds
 * below the normal range (the underflow flag), the tile computes the block again with each weight times its scale.
 * The block is proven where no result underflowed and every scale met has -MX_B <= E_g <= 126 - MX_B (each ratio
 * and factor a normal power of two, no scale a subnormal or NaN) and E_g <= 249 - hi - lk, so that no sum of c's
 * chain, at most 2 * 6 * 2^E_g * 2^lk * 2^(hi - 126) (hi: the greatest exponent field of the inputs, mx_inputs,
 * below 255: none infinite or NaN; 2^lk > the block's inputs), overflows (mx_scale_bounds). */
#define MX_B 32
static int mx_proof = 1; /* 0 (set_mx_proof, a negative control): every scaled block taken unproven */
static const float E2M1_TINY[16] = {0.0f,  0x1p-33f,  0x1p-32f,  0x1.8p-32f,  0x1p-31f,  0x1.8p-31f,  0x1p-30f,
                                    0x1.8p-30f, -0.0f, -0x1p-33f, -0x1p-32f, -0x1.8p-32f, -0x1p-31f, -0x1.8p-31f,
                                    -0x1p-30f, -0x1.8p-30f};

/* A block's scaled accumulators: each panel's scales of the last group, the float32 bits of the least and greatest
 * scale the block may meet (mx_scale_bounds), whether it met one outside them */
typedef struct {
    float last[8 * NR] __attribute__((aligned(64)));
    uint32_t lo, hi;
    int bad;
} mx_state;

/* the greatest exponent field of mr rows of k inputs */
__attribute__((target("avx512f,avx2"))) static int mx_inputs(const float *x, Py_ssize_t ldx, int mr, Py_ssize_t k) {
    __m512i mx = _mm512_setzero_si512();
    for (int r = 0; r < mr; r++)
        for (Py_ssize_t i = 0; i < k; i += 16) {
            const __mmask16 m = k - i >= 16 ? 0xFFFF : (__mmask16)((1u << (k - i)) - 1);
            const __m512i v = _mm512_maskz_loadu_epi32(m, x + r * ldx + i);
            mx = _mm512_max_epu32(mx, _mm512_srli_epi32(_mm512_slli_epi32(v, 1), 24)); /* the sign shifted out */
        }
    return (int)_mm512_reduce_max_epu32(mx);
}

/* The float32 bits of the least and greatest scale a block of `inputs` inputs whose greatest exponent field is hi
 * may meet for scaled accumulators (see above), into ms; 0 where none may. */
static inline int mx_scale_bounds(int hi, Py_ssize_t inputs, mx_state *ms) {
    int lk = 0;
    while (((Py_ssize_t)1 << lk) <= inputs) lk++;
    const int e_hi = 249 - hi - lk < 126 - MX_B ? 249 - hi - lk : 126 - MX_B;
    if (hi >= 255 || e_hi < -MX_B) return 0;
    ms->lo = (uint32_t)(127 - MX_B) << 23, ms->hi = (uint32_t)(127 + e_hi) << 23;
    return 1;
}

/* One block [k0, ke) of wide_avx512's tile into its accumulators c (zeroed here); sc: MXFP4's scaled accumulators,
 * their state in ms. */
__attribute__((target("avx512f,avx2"), always_inline)) static inline void
wide_block(const int fmt, const int mr, const int np, const float *restrict x, Py_ssize_t ldx, const panel_ref *b,
           Py_ssize_t k0, Py_ssize_t ke, int full, __m512i *mw, Py_ssize_t *mw_at, const tile_hints h, const int sc,
           __m512 *c, mx_state *ms) {
    for (int i = 0; i < mr * np; i++) c[i] = _mm512_setzero_ps();
    const __m512 tiny = _mm512_loadu_ps(E2M1_TINY);
    for (Py_ssize_t t = k0; t < ke;) {
        Py_ssize_t te = group_end(fmt, b[0], t, ke);
        __m512 s[8];
        if (BASE(fmt) == WF_MXFP4 && t / MX_G + 4 <= b[0].sld) { /* one gather of scales every 4 groups */
            if (t / MX_G < *mw_at || t / MX_G >= *mw_at + 4)
                for (int q = 0; q < np; q++) mw[q] = mx_words16(b[q], t), *mw_at = t / MX_G;
            for (int q = 0; q < np; q++) s[q] = mx_scale16(mw[q], (int)(t / MX_G - *mw_at));
        } else {
            for (int q = 0; q < np; q++) s[q] = scale16(fmt, b[q], t);
        }
        if (sc) /* the accumulators from the last group's scale to this one's: times last / s (1 / s: its
                 * float32 bits (254 << 23) - s's) */
            for (int q = 0; q < np; q++) {
                const __m512i sb = _mm512_castps_si512(s[q]);
                ms->bad |= _mm512_cmplt_epu32_mask(sb, _mm512_set1_epi32((int)ms->lo)) |
                           _mm512_cmpgt_epu32_mask(sb, _mm512_set1_epi32((int)ms->hi));
                if (t > k0) {
                    const __m512 ratio = _mm512_mul_ps(
                        _mm512_load_ps(ms->last + q * NR),
                        _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_set1_epi32(254 << 23), sb)));
                    for (int r = 0; r < mr; r++) c[r * np + q] = _mm512_mul_ps(c[r * np + q], ratio);
                }
                _mm512_store_ps(ms->last + q * NR, s[q]);
            }
        /* FP8 stored rows: the inputs times each panel's scale (fp8_prescale, panels of one scale share them) */
        const float *xp[8];
        float xsb[FEW_ROWS * XS];
        const Py_ssize_t ts = t;
        int pre = BASE(fmt) == WF_FP8;
        if (pre) {
            te = te - t > XS ? t + XS : te;
            unsigned prev = 0; /* a panel of the previous panel's scale shares its inputs */
            for (int q = 0, d = 0; q < np && pre; q++) {
                const unsigned e = ((const uint8_t *)b[q].scale)[t / b[q].group];
                if (q && e == prev) {
                    xp[q] = xp[q - 1];
                    continue;
                }
                float *xs = xsb + d++ * mr * XS;
                for (int r = 0; r < mr && pre; r++) pre = fp8_prescale(x + r * ldx + t, te - t, e, xs + r * XS);
                xp[q] = xs, prev = e;
            }
        }
        while (gather_inputs(fmt) && t < te) { /* stored rows: 4 gathers' worth by plain loads where it can */
            const int gi = gather_inputs(fmt);
            __m512i g[8][4];
            int cols = 1;
            for (int q = 0; q < np; q++) cols = load_rows16(fmt, b[q], t, te, full, g[q]);
            if (h.pf && words_of(fmt)) /* the same line of the next tile's panel (np panels on, in L2) */
                for (int q = 0; q < np; q++)
                    _mm_prefetch((const char *)word_at(fmt, b[q], t) + np * NR * b[q].ld, _MM_HINT_T1);
            else if (h.pf && !(t % ROW_PF_EVERY))
                for (int q = 0; q < np; q++)
                    for (int r = 0; r < b[q].rows; r++)
                        _mm_prefetch((const char *)b[q].data + r * b[q].ld +
                                         (t + ROW_PF_AHEAD) * (Py_ssize_t)panel_bytes(fmt, 1) / NR,
                                     _MM_HINT_T0);
            int clean = pre; /* no NaN code in these bytes: e4m3_16_tiny leaves its NaN test out */
            for (int q = 0; q < np && clean && !words_of(fmt); q++) /* (words: never one) */
                for (int j = 0; j < cols; j++) clean &= !e4m3_16_nan(g[q][j]);
            for (int j = 0; j < cols; j++)
#pragma GCC unroll 8
                for (int u = 0; u < gi; u++, t++) {
                    __m512 w[8];
                    if (pre) {
                        for (int q = 0; q < np; q++)
                            w[q] = clean ? e4m3_16_tiny(g[q][j], u, 1) : e4m3_16_tiny(g[q][j], u, 0);
                        for (int r = 0; r < mr; r++)
                            for (int q = 0; q < np; q++)
                                c[r * np + q] = _mm512_fmadd_ps(_mm512_set1_ps(xp[q][r * XS + t - ts]), w[q],
                                                                c[r * np + q]);
                        continue;
                    }
                    for (int q = 0; q < np; q++)
                        w[q] = sc ? _mm512_permutexvar_ps(_mm512_srli_epi32(g[q][j], 4 * u), tiny)
                                  : lane16(fmt, g[q][j], u, s[q]);
                    for (int r = 0; r < mr; r++) {
                        const __m512 a = _mm512_set1_ps(x[r * ldx + t]);
                        for (int q = 0; q < np; q++) c[r * np + q] = _mm512_fmadd_ps(a, w[q], c[r * np + q]);
                    }
                }
        }
#pragma GCC unroll 2
        for (; t < te; t++) {
            __m512 w[8];
            for (int q = 0; q < np; q++) w[q] = row16(fmt, b[q], t, s[q]);
            if (h.pf) /* (a loop-invariant test; a prefetch past the panel's end does not fault) */
                for (int q = 0; q < np; q++)
                    _mm_prefetch((const char *)b[q].data + (t + PF_AHEAD) * (Py_ssize_t)panel_bytes(fmt, 1),
                                 _MM_HINT_T0);
            for (int r = 0; r < mr; r++) {
                const __m512 a = _mm512_set1_ps(x[r * ldx + t]);
                for (int q = 0; q < np; q++) c[r * np + q] = _mm512_fmadd_ps(a, w[q], c[r * np + q]);
            }
        }
    }
}

/* np panels at once in AVX-512 (where the CPU has it): o[q] [r][0..16) from the panel b[q], with one 16-lane
 * accumulator per row and panel, so each broadcast of x feeds np 16-lane fused multiply-adds (AVX2's tile: two
 * 8-lane ones), and a tile of few rows still has 8 or more independent chains (a chain is latency-bound). Each
 * output's chain is the same operations in the same order as tile_avx2's: the same bits. */
__attribute__((target("avx512f,avx2"), always_inline)) static inline void
wide_avx512(const int fmt, const int mr, const int np, const float *restrict x, Py_ssize_t ldx, const panel_ref *b,
            Py_ssize_t k, Py_ssize_t kc, float *const *o, Py_ssize_t ldo, Py_ssize_t ldl, const tile_hints h) {
    int full = 1; /* stored rows: every panel has its 16 rows (else only masked gathers read them) */
    for (int q = 0; q < np; q++) full &= b[q].rows == NR;
    __m512i mw[8] = {0}; /* MXFP4: each panel's scale words of groups mw_at .. mw_at + 3 (mx_words16) */
    Py_ssize_t mw_at = -8;
    for (Py_ssize_t k0 = 0; k0 < k; k0 += kc) {
        const Py_ssize_t ke = k - k0 < kc ? k : k0 + kc;
        __m512 c[FEW_ROWS]; /* mr * np <= 16 */
        mx_state ms = {.bad = 0};
        int done = 0;
        if (BASE(fmt) == WF_MXFP4 && h.xe >= 0 && (mx_scale_bounds(h.xe, ke - k0, &ms) || !mx_proof)) {
            const unsigned csr = _mm_getcsr();
            _mm_setcsr(csr & ~_MM_EXCEPT_UNDERFLOW);
            __asm__ volatile("" ::: "memory"); /* the block's loads (and so its arithmetic) after the clear */
            wide_block(fmt, mr, np, x, ldx, b, k0, ke, full, mw, &mw_at, h, 1, c, &ms);
            for (int i = 0; i < mr * np; i++) __asm__ volatile("" : "+v"(c[i])); /* its arithmetic done */
            done = (!(_mm_getcsr() & _MM_EXCEPT_UNDERFLOW) && !ms.bad) || !mx_proof;
            _mm_setcsr(csr);
            if (done)
                for (int q = 0; q < np; q++) { /* times s_g 2^MX_B: its bits plus MX_B << 23 */
                    const __m512i sb = _mm512_castps_si512(_mm512_load_ps(ms.last + q * NR));
                    const __m512 f = _mm512_castsi512_ps(_mm512_add_epi32(sb, _mm512_set1_epi32(MX_B << 23)));
                    for (int r = 0; r < mr; r++) c[r * np + q] = _mm512_mul_ps(c[r * np + q], f);
                }
            else
                mw_at = -8; /* not proven: the block again, each weight times its scale */
        }
        if (!done) wide_block(fmt, mr, np, x, ldx, b, k0, ke, full, mw, &mw_at, h, 0, c, &ms);
        for (int r = 0; r < mr; r++)
            for (int q = 0; q < np; q++) {
                float *d = o[q] + r * (q == np - 1 ? ldl : ldo);
                if (k0) c[r * np + q] = _mm512_add_ps(_mm512_loadu_ps(d), c[r * np + q]);
                _mm512_storeu_ps(d, c[r * np + q]);
            }
    }
}

/* The panels a wide tile of mr rows takes at once, at most: enough for 8 chains (two FMA units, 4 cycles each);
 * with AVX2 (level 1) tiles of one or two rows only. */
static inline int wide_panels(int level, int mr) {
    if (level == 1) return mr == 1 ? 4 : 2;
    return mr == 1 ? 8 : mr == 2 ? 4 : mr <= MR ? 2 : 1;
}

/* The tiles of one format, each of constant rows and panels (its accumulators stay in registers): tile_x86_FMT
 * (AVX2, one panel), wide2_x86_FMT (AVX2's wide tiles: one row of 2 or 4 panels, two rows of 2; three or more
 * rows already have 6 or more chains in tile_avx2), wide_x86_FMT (AVX-512). */
#define FEW(F, r) case r * 16 + 1: wide_avx512(F, r, 1, x, ldx, b, k, kc, o, ldo, ldl, h); break;
#define TILES_OF(NAME, FMT)                                                                                        \
    __attribute__((target("avx2,fma,f16c"))) static void tile_x86_##NAME(int mr, const float *x, Py_ssize_t ldx,       \
                                                                    panel_ref bp, Py_ssize_t k, Py_ssize_t kc,     \
                                                                    float *out, Py_ssize_t ldo) {                  \
        switch (mr) {                                                                                              \
        case 6: tile_avx2(FMT, 6, x, ldx, bp, k, kc, out, ldo); break;                                             \
        case 5: tile_avx2(FMT, 5, x, ldx, bp, k, kc, out, ldo); break;                                             \
        case 4: tile_avx2(FMT, 4, x, ldx, bp, k, kc, out, ldo); break;                                             \
        case 3: tile_avx2(FMT, 3, x, ldx, bp, k, kc, out, ldo); break;                                             \
        case 2: tile_avx2(FMT, 2, x, ldx, bp, k, kc, out, ldo); break;                                             \
        default: tile_avx2(FMT, 1, x, ldx, bp, k, kc, out, ldo); break;                                            \
        }                                                                                                          \
    }                                                                                                              \
    __attribute__((target("avx2,fma,f16c"))) static void wide2_x86_##NAME(int mr, int np, const float *x,              \
                                                                     Py_ssize_t ldx, const panel_ref *b,           \
                                                                     Py_ssize_t k, Py_ssize_t kc, float *const *o, \
                                                                     Py_ssize_t ldo, Py_ssize_t ldl, tile_hints h) {\
        if (mr == 2)                                                                                               \
            wide_avx2(FMT, 2, 2, x, ldx, b, k, kc, o, ldo, ldl, h);                                               \
        else if (np == 2)                                                                                          \
            wide_avx2(FMT, 1, 2, x, ldx, b, k, kc, o, ldo, ldl, h);                                               \
        else                                                                                                       \
            wide_avx2(FMT, 1, 4, x, ldx, b, k, kc, o, ldo, ldl, h);                                               \
    }                                                                                                              \
    __attribute__((target("avx512f,avx2"))) static void wide_x86_##NAME(int mr, int np, const float *x,           \
                                                                        Py_ssize_t ldx, const panel_ref *b,        \
                                                                        Py_ssize_t k, Py_ssize_t kc,               \
                                                                        float *const *o, Py_ssize_t ldo,           \
                                                                        Py_ssize_t ldl, tile_hints h) {           \
        switch (mr * 16 + np) {                                                                                    \
        FEW(FMT, 16) FEW(FMT, 15) FEW(FMT, 14) FEW(FMT, 13) FEW(FMT, 12) FEW(FMT, 11) FEW(FMT, 10) FEW(FMT, 9)     \
        FEW(FMT, 8) FEW(FMT, 7)                                                                                    \
        case 6 * 16 + 2: wide_avx512(FMT, 6, 2, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 5 * 16 + 2: wide_avx512(FMT, 5, 2, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 4 * 16 + 2: wide_avx512(FMT, 4, 2, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 3 * 16 + 2: wide_avx512(FMT, 3, 2, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 2 * 16 + 4: wide_avx512(FMT, 2, 4, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 2 * 16 + 2: wide_avx512(FMT, 2, 2, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 1 * 16 + 8: wide_avx512(FMT, 1, 8, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 1 * 16 + 4: wide_avx512(FMT, 1, 4, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        case 1 * 16 + 1: wide_avx512(FMT, 1, 1, x, ldx, b, k, kc, o, ldo, ldl, h); break;                        \
        default: wide_avx512(FMT, 1, 2, x, ldx, b, k, kc, o, ldo, ldl, h); break;                                 \
        }                                                                                                          \
    }
PANEL_FORMATS(TILES_OF)
#undef FEW
#endif

typedef void (*tile_fn)(int, const float *, Py_ssize_t, panel_ref, Py_ssize_t, Py_ssize_t, float *, Py_ssize_t);
typedef void (*wide_fn)(int, int, const float *, Py_ssize_t, const panel_ref *, Py_ssize_t, Py_ssize_t,
                        float *const *, Py_ssize_t, Py_ssize_t, tile_hints);

/* The same tile in portable C (fmaf: one rounding, as the vector fused multiply-add; the scalar decoders). */
static inline __attribute__((always_inline)) void tile_plain(const int fmt, int mr, const float *restrict x,
                                                             Py_ssize_t ldx, panel_ref bp, Py_ssize_t k,
                                                             Py_ssize_t kc, float *restrict out, Py_ssize_t ldo) {
    for (int r = 0; r < mr; r++)
        for (Py_ssize_t k0 = 0; k0 < k; k0 += kc) {
            const Py_ssize_t ke = k - k0 < kc ? k : k0 + kc;
            float c[NR] = {0};
            for (Py_ssize_t t = k0; t < ke; t++)
                for (int j = 0; j < NR; j++) c[j] = fmaf(x[r * ldx + t], weight_at(fmt, bp, t, j), c[j]);
            for (int j = 0; j < NR; j++) out[r * ldo + j] = k0 ? out[r * ldo + j] + c[j] : c[j];
        }
}

#define PLAIN_TILE(NAME, FMT)                                                                                      \
    static void tile_plain_##NAME(int mr, const float *x, Py_ssize_t ldx, panel_ref bp, Py_ssize_t k, Py_ssize_t kc, \
                                  float *out, Py_ssize_t ldo) {                                                    \
        tile_plain(FMT, mr, x, ldx, bp, k, kc, out, ldo);                                                          \
    }
PANEL_FORMATS(PLAIN_TILE)
#undef PLAIN_TILE

/* The tiles of each panel format (WF_F32 and the stored rows): the portable one, and on x86 AVX2's
 * (one panel, and wide) and AVX-512's (wide) */
typedef struct {
    tile_fn plain;
#if HAVE_X86_AVX2
    tile_fn avx2;
    wide_fn wide_avx2, wide_avx512;
#endif
} format_tiles;

#if HAVE_X86_AVX2
#define FORMAT_TILES(NAME) {tile_plain_##NAME, tile_x86_##NAME, wide2_x86_##NAME, wide_x86_##NAME}
#else
#define FORMAT_TILES(NAME) {tile_plain_##NAME}
#endif
static const format_tiles *tiles_of(const int fmt) {
#define TILES_CASE(NAME, FMT)                                                                                      \
    case FMT: {                                                                                                    \
        static const format_tiles t = FORMAT_TILES(NAME);                                                          \
        return &t;                                                                                                 \
    }
    switch (fmt) { STORED_FORMATS(TILES_CASE) }
#undef TILES_CASE
    static const format_tiles f32 = FORMAT_TILES(f32);
    return &f32;
}
#undef FORMAT_TILES

/* ---- decoding a panel of stored rows once, for the calls of many rows ---------------------------------------
 *
 * A call whose rows take several tiles would decode each stored weight once a tile. decode_panel writes panel p's
 * weights as a float panel instead ([k][16], the very values the stored tiles decode in registers, lanes beyond n
 * zero or their decode of zero codes); the float tiles then read it for every tile of rows: the same products in
 * the same order, so the same bits, with one decode a weight. */
static inline __attribute__((always_inline)) void decode_panel_plain(const int fmt, panel_ref b, Py_ssize_t k,
                                                                     float *dst) {
    for (Py_ssize_t t = 0; t < k; t++)
        for (int j = 0; j < NR; j++) dst[t * NR + j] = weight_at(fmt, b, t, j);
}

#if HAVE_X86_AVX2
/* the panel's inputs [t, k) decoded into dst [k - t][16] (t a multiple of the format's gather) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline void decode_panel_avx512(const int fmt,
                                                                                           panel_ref b, Py_ssize_t t,
                                                                                           Py_ssize_t k, float *dst) {
    const int gi = gather_inputs(fmt);
    for (const Py_ssize_t t0 = t; t < k;) {
        const Py_ssize_t te = group_end(fmt, b, t, k);
        const __m512 s = scale16(fmt, b, t);
        while (t < te) {
            __m512i g[4];
            const int cols = load_rows16(fmt, b, t, te, b.rows == NR, g);
            for (int j = 0; j < cols; j++)
#pragma GCC unroll 8
                for (int u = 0; u < gi; u++, t++) _mm512_storeu_ps(dst + (t - t0) * NR, lane16(fmt, g[j], u, s));
        }
    }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void decode_panel_avx2(const int fmt, panel_ref b,
                                                                                         Py_ssize_t k, float *dst) {
    const int gi = gather_inputs(fmt);
    for (Py_ssize_t t = 0; t < k;) {
        const Py_ssize_t te = group_end(fmt, b, t, k);
        __m256 s0, s1;
        scale8x2(fmt, b, t, &s0, &s1);
        while (t < te) {
            __m256i g0[4], g1[4];
            const int cols = load_rows8x2(fmt, b, t, te, b.rows == NR, g0, g1);
            for (int j = 0; j < cols; j++)
#pragma GCC unroll 8
                for (int u = 0; u < gi; u++, t++) {
                    _mm256_storeu_ps(dst + t * NR, lane8(fmt, g0[j], u, s0));
                    _mm256_storeu_ps(dst + t * NR + 8, lane8(fmt, g1[j], u, s1));
                }
        }
    }
}

#endif

/* each stored format's decode_panel at every level (portable, AVX2, AVX-512) */
typedef void (*decode_fn)(panel_ref, Py_ssize_t, float *);
#if HAVE_X86_AVX2
#define DECODE_PANEL(NAME, FMT)                                                                                    \
    static void decode_plain_##NAME(panel_ref b, Py_ssize_t k, float *d) { decode_panel_plain(FMT, b, k, d); }       \
    __attribute__((target("avx2,fma,f16c"))) static void decode256_##NAME(panel_ref b, Py_ssize_t k, float *d) {   \
        decode_panel_avx2(FMT, b, k, d);                                                                           \
    }                                                                                                              \
    __attribute__((target("avx512f,avx2"))) static void decode512_##NAME(panel_ref b, Py_ssize_t k, float *d) {     \
        decode_panel_avx512(FMT, b, 0, k, d);                                                                      \
    }                                                                                                              \
    static const decode_fn decoders_##NAME[3] = {decode_plain_##NAME, decode256_##NAME, decode512_##NAME};
#else
#define DECODE_PANEL(NAME, FMT)                                                                                    \
    static void decode_plain_##NAME(panel_ref b, Py_ssize_t k, float *d) { decode_panel_plain(FMT, b, k, d); }       \
    static const decode_fn decoders_##NAME[3] = {decode_plain_##NAME, decode_plain_##NAME, decode_plain_##NAME};
#endif
STORED_FORMATS(DECODE_PANEL)
#undef DECODE_PANEL

static void decode_panel(const weight_ref *w, Py_ssize_t p, int level, float *dst) {
#define DECODE_CASE(NAME, FMT)                                                                                     \
    case FMT: decoders_##NAME[level](panel_at(w, p), w->k, dst); return;
    switch (w->fmt) { STORED_FORMATS(DECODE_CASE) }
#undef DECODE_CASE
}

/* *buf with at least `bytes` bytes, a pool thread's own buffer (grown, kept): 64-byte aligned, whole lines (for the
 * tiles, each tile row and each split store one line: malloc's 16 bytes made tile loads of A up to 1.5x slower);
 * NULL if it cannot be had */
static void *thread_buffer(void **buf, size_t *cap, size_t bytes) {
    if (bytes > *cap) {
        free(*buf);
        *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        *cap = *buf ? bytes : 0;
    }
    return *buf;
}

static __thread void *panel_buf; /* each pool thread's decoded panels */
static __thread size_t panel_cap;

static float *decoded_panels(size_t floats) { return thread_buffer(&panel_buf, &panel_cap, floats * sizeof(float)); }

/* The product (see the header) of checked arguments for all m rows and the output panels [p_begin, p_end) only
 * (columns 16 p_begin .. min(n, 16 p_end)), y = x @ the weight w, a panel format (WF_F32, the stored rows), y's
 * rows ldy floats apart; runs without the GIL. The work is split along the rows' tiles and the output panels only:
 * never inside an output's sum, so an output's bits do not depend on the range it was computed in. */
static void linear_panels_range(const weight_ref *w, const float *xp, Py_ssize_t ldx, float *yp, Py_ssize_t ldy,
                                Py_ssize_t m, Py_ssize_t kc, int simd, Py_ssize_t p_begin, Py_ssize_t p_end) {
    const int fmt = w->fmt;
    const Py_ssize_t k = w->k, n = w->n;
    const format_tiles *ft = tiles_of(fmt);
    tile_fn tile = ft->plain;
    wide_fn wide = NULL; /* several panels at once: AVX-512 (level 2), or AVX2 for one or two rows (1) */
    int level = 0, wide_rows = 0;
#if HAVE_X86_AVX2
    if (simd >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        tile = ft->avx2, wide = ft->wide_avx2, level = 1, wide_rows = 2;
        if (simd >= 2 && __builtin_cpu_supports("avx512f")) wide = ft->wide_avx512, level = 2, wide_rows = MR;
    }
#endif
    const Py_ssize_t panels = (n + NR - 1) / NR;
    const size_t pb = panel_bytes(fmt, k);
    const Py_ssize_t group = PANEL_BYTES / pb > 1 ? (Py_ssize_t)(PANEL_BYTES / pb) : 1;
    /* A call of 7 to 16 rows (a routed expert's) with AVX-512: one wide tile of all its rows and one panel
     * (wide_panels), so each weight is read once (from memory, for an expert's cold weights) for every row, not
     * once per 6-row tile */
    /* a tile's rows: all of a call of 7 to 16 (each weight read once from memory), but for decoded panels (in L2) */
    const int rows = level == 2 && m > MR && m <= FEW_ROWS && !w->decoded ? (int)m : MR;
    if (stored_rows(fmt) && m > DECODE_ROWS) { /* each group of panels decoded once for all the rows */
        const Py_ssize_t fg = PANEL_BYTES / ((size_t)k * NR * sizeof(float)) > 1 ? PANEL_BYTES / ((size_t)k * NR * sizeof(float)) : 1;
        float *buf = decoded_panels((size_t)fg * k * NR);
        if (buf) {
            if (p_end > panels) p_end = panels;
            for (Py_ssize_t p0 = p_begin; p0 < p_end; p0 += fg) {
                const Py_ssize_t p1 = p0 + fg < p_end ? p0 + fg : p_end;
                for (Py_ssize_t p = p0; p < p1; p++) decode_panel(w, p, level, buf + (p - p0) * k * NR);
                const Py_ssize_t cols = n - p0 * NR < (p1 - p0) * NR ? n - p0 * NR : (p1 - p0) * NR;
                const weight_ref f = {.fmt = WF_F32, .data = buf, .k = k, .n = cols, .decoded = 1};
                linear_panels_range(&f, xp, ldx, yp + p0 * NR, ldy, m, kc, simd, 0, p1 - p0);
            }
            return;
        }
    }
    const int pf = level == 2 && (words_of(fmt) || (size_t)panels * pb >= PF_BYTES);
    int xes[FEW_ROWS]; /* MXFP4, AVX-512: each tile of rows' inputs' greatest exponent (mx_inputs), -1: not read */
    for (Py_ssize_t i = 0; i < m && i / rows < FEW_ROWS; i += rows) {
        xes[i / rows] = -1;
#if HAVE_X86_AVX2
        if (level == 2 && BASE(fmt) == WF_MXFP4 && m <= FEW_ROWS)
            xes[i / rows] = mx_inputs(xp + i * ldx, ldx, m - i < rows ? (int)(m - i) : rows, k);
#endif
    }
    if (rows > MR) wide_rows = rows;
    float part[FEW_ROWS * NR]; /* a partial panel's tile */
    if (p_end > panels) p_end = panels;
    for (Py_ssize_t p0 = p_begin; p0 < p_end; p0 += group) {
        const Py_ssize_t p1 = p0 + group < p_end ? p0 + group : p_end;
        for (Py_ssize_t i = 0; i < m; i += rows) {
            const int mr = m - i < rows ? (int)(m - i) : rows;
            const int xe = i / rows < FEW_ROWS ? xes[i / rows] : -1;
            for (Py_ssize_t p = p0; p < p1; p++) {
                const Py_ssize_t j = p * NR, nv = n - j < NR ? n - j : NR;
                float *out = yp + i * ldy + j;
                if (wide && mr <= wide_rows) { /* full panels, and the last, partial one (into part, rows NR apart) */
                    const Py_ssize_t full = (n - j) / NR;
                    int np = wide_panels(level, mr);
                    while (np > 2 && np > p1 - p) np /= 2;
                    if (np <= p1 - p) {
                        panel_ref b[8];
                        float *o[8];
                        for (int q = 0; q < np; q++) b[q] = panel_at(w, p + q), o[q] = q < full ? out + q * NR : part;
                        const tile_hints th = {pf && p + 2 * np <= p_end, xe}; /* (the next tile's: this range's) */
                        wide(mr, np, xp + i * ldx, ldx, b, k, kc, o, ldy, np > full ? NR : ldy, th);
                        if (np > full)
                            for (int r = 0; r < mr; r++)
                                memcpy(out + r * ldy + full * NR, part + r * NR, (n - j - full * NR) * sizeof(float));
                        p += np - 1;
                        continue;
                    }
                }
                tile(mr, xp + i * ldx, ldx, panel_at(w, p), k, kc, nv == NR ? out : part, nv == NR ? ldy : NR);
                if (nv < NR)
                    for (int r = 0; r < mr; r++) memcpy(out + r * ldy, part + r * NR, nv * sizeof(float));
            }
        }
    }
}

/* ---- threads: a product's output panels (and, for a few panels, its rows) across the kernels' pool ------------
 *
 * The items of a product are rectangles: row chunk r (rows [r rc, (r + 1) rc), rc a multiple of the tiles' MR) x
 * one output unit u (a panel of 16 columns; a pair of 32 for the bfloat16 tiles), item r * units + u; a part of
 * the pool (_thread_pool.h) takes a contiguous range of items, runs as one range call per row chunk. Rows are
 * chunked only where the units are too few for the threads (the mHC's mix product: 2 panels; on the tiles, fewer
 * than TILE_UNITS_A_THREAD pairs a thread), so a weight is mostly read by one thread alone. Every output is computed
 * whole, in its own order, by the thread of its item. */

#define UNITS_A_THREAD 4 /* units a thread at least, before rows are chunked too */
/* the same on the bfloat16 tiles (the Xeon, a 64-token prompt's products of 4 to 32 column pairs, two threads):
 * split by columns, each thread splits every row into its pieces and reads every row, 1.47-1.80x one thread; split
 * by rows, each decodes every pair, 1.69-2.0x; a 64-token prompt 1.89-1.91x at 32 a thread, 1.78-1.79x at 16,
 * 1.80-1.89x at 64 */
#define TILE_UNITS_A_THREAD 32

typedef struct {
    Py_ssize_t units, rows_per, row_chunks, items;
    int parts;
} grid;

/* The items of a product of m rows and `units` output units costing `cost` (multiply-adds), for the pool's parts */
static grid grid_of(Py_ssize_t m, Py_ssize_t units, double cost, Py_ssize_t row_step, Py_ssize_t per_thread) {
    grid g = {units, m, 1, units, 1};
    if (m < 1 || units < 1) return g;
    const int t = pool_parts(units * ((m + row_step - 1) / row_step), cost);
    if (t <= 1) return g;
    if (units < (Py_ssize_t)t * per_thread && m > row_step) {
        Py_ssize_t want = ((Py_ssize_t)t * per_thread + units - 1) / units, most = (m + row_step - 1) / row_step;
        if (want > most) want = most;
        g.rows_per = ((m + want - 1) / want + row_step - 1) / row_step * row_step;
        g.row_chunks = (m + g.rows_per - 1) / g.rows_per;
    }
    g.items = g.row_chunks * units;
    g.parts = g.items < t ? (int)g.items : t;
    return g;
}

/* The next piece of items [*it, e) of grid g (m rows): one row chunk's first row *r0, its rows *mr and its units
 * [*u0, *u1); advances *it past it. 0 when none is left. */
static inline int grid_next(const grid *g, Py_ssize_t m, int64_t *it, int64_t e, Py_ssize_t *r0, Py_ssize_t *mr,
                            Py_ssize_t *u0, Py_ssize_t *u1) {
    if (*it >= e) return 0;
    *r0 = (Py_ssize_t)(*it / g->units) * g->rows_per;
    *mr = m - *r0 < g->rows_per ? m - *r0 : g->rows_per;
    *u0 = (Py_ssize_t)(*it % g->units);
    *u1 = *u0 + (e - *it) < g->units ? *u0 + (Py_ssize_t)(e - *it) : g->units;
    *it += *u1 - *u0;
    return 1;
}

typedef struct {
    weight_ref w;
    int simd;
    const float *x;
    Py_ssize_t ldx, ldy, m, kc;
    float *y;
    grid g;
} panels_job;

/* linear_panels_range for the panels [u0, u1), a run a group */
static void panels_units(const weight_ref *w, const float *xp, Py_ssize_t ldx, float *yp, Py_ssize_t ldy,
                         Py_ssize_t m, Py_ssize_t kc, int simd, Py_ssize_t u0, Py_ssize_t u1) {
    for (Py_ssize_t e; u0 < u1; u0 = e) {
        e = units_end(w, u0, u1, NR);
        linear_panels_range(w, xp + group_x(w, u0 * NR), ldx, yp, ldy, m, kc, simd, u0, e);
    }
}

static void panels_part(void *c, int64_t b, int64_t e) {
    const panels_job *j = c;
    Py_ssize_t r0, mr, u0, u1;
    while (grid_next(&j->g, j->m, &b, e, &r0, &mr, &u0, &u1))
        panels_units(&j->w, j->x + r0 * j->ldx, j->ldx, j->y + r0 * j->ldy, j->ldy, mr, j->kc, j->simd, u0, u1);
}

static void k_halves_product(const weight_ref *w, const float *xp, Py_ssize_t ldx, float *yp, Py_ssize_t ldy,
                             Py_ssize_t m);

/* linear_panels_range over every panel, y's rows ldy apart, on the kernels' pool where the product is big enough
 * (the items above); runs without the GIL. */
static void linear_panels(const weight_ref *w, const float *xp, Py_ssize_t ldx, float *yp, Py_ssize_t ldy,
                          Py_ssize_t m, Py_ssize_t kc, int simd) {
    const Py_ssize_t k = w->k, n = w->n, panels = (n + NR - 1) / NR;
    if (pool_k_halves() && m && n && pool_parts(2, INFINITY) >= 2) { /* the negative control (tests only) */
        k_halves_product(w, xp, ldx, yp, ldy, m);
        return;
    }
    const grid g = grid_of(m, panels, (double)m * (double)k * (double)n, MR, UNITS_A_THREAD);
    if (g.parts <= 1) {
        panels_units(w, xp, ldx, yp, ldy, m, kc, simd, 0, panels);
        return;
    }
    panels_job j = {*w, simd, xp, ldx, ldy, m, kc, yp, g};
    parallel_run(g.items, g.parts, panels_part, &j);
}

/* ---- the negative control of the threading rule (tests only: _thread_pool_hooks set_k_halves) ------------------
 * Every output's sum is cut in two halves of its inputs, [0, k / 2) and [k / 2, k), each a plain fused multiply-add
 * chain computed by another thread, then added: the partition runs inside the sum, which the rule forbids, and a
 * model's logits at two threads differ from those at one (tests/test_threads.py). */

typedef struct {
    weight_ref w;
    const float *x;
    Py_ssize_t ldx, ldy, m;
    float *y, *other;
} halves_job;

static void halves_part(void *c, int64_t b, int64_t e) {
    const halves_job *j = c;
    for (int64_t half = b; half < e; half++) {
        const Py_ssize_t k = j->w.k, n = j->w.n, t0 = half ? k / 2 : 0, t1 = half ? k : k / 2;
        for (Py_ssize_t i = 0; i < j->m; i++)
            for (Py_ssize_t c = 0; c < n; c++) {
                const panel_ref pr = panel_at(&j->w, c / NR);
                float acc = 0.0f;
                const float *x = j->x + i * j->ldx + group_x(&j->w, c);
                for (Py_ssize_t t = t0; t < t1; t++) acc = fmaf(x[t], weight_at(j->w.fmt, pr, t, c % NR), acc);
                if (half) j->other[i * n + c] = acc;
                else j->y[i * j->ldy + c] = acc;
            }
    }
}

static void k_halves_product(const weight_ref *w, const float *xp, Py_ssize_t ldx, float *yp, Py_ssize_t ldy,
                             Py_ssize_t m) {
    const Py_ssize_t n = w->n;
    float *other = malloc((size_t)m * (size_t)n * sizeof(float));
    if (!other) {
        for (Py_ssize_t i = 0; i < m; i++)
            for (Py_ssize_t c = 0; c < n; c++) yp[i * ldy + c] = NAN;
        return;
    }
    halves_job j = {*w, xp, ldx, ldy, m, yp, other};
    parallel_run(2, 2, halves_part, &j);
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t c = 0; c < n; c++) yp[i * ldy + c] = yp[i * ldy + c] + other[i * n + c];
    free(other);
}

static void linear_packed(const float *xp, Py_ssize_t ldx, const float *bp, float *yp, Py_ssize_t m, Py_ssize_t k,
                          Py_ssize_t n, Py_ssize_t kc, int simd) {
    const weight_ref w = {WF_F32, bp, NULL, k, n, 0};
    linear_panels(&w, xp, ldx, yp, n, m, kc, simd);
}


/* Each kernel's arguments are one X-macro list (_kernel_buffers.h; linear_packed's in _kernel_math.h, whose
 * struct the token kernel's hc_next fills): its struct, parser (positional and keyword arguments), raw entry and
 * docstring come from it. */
KERNEL_ARGS(linear_packed, LINEAR_PACKED_FIELDS,
            "y = x @ w in fma chains of kc inputs, the chains then added in order (addresses of float32 data).")
static void run_linear_packed(const struct linear_packed_args *a) {
    linear_packed(CF(a->x), a->ldx, CF(a->panels), F(a->y), a->m, a->k, a->n, a->kc, (int)a->simd);
}
RAW_ENTRY(linear_packed)
KERNEL_PY(linear_packed) {
    PARSE(linear_packed);
    if (a.m < 0 || a.k < 1 || a.n < 0 || a.kc < 1 || a.ldx < a.k || (a.m && a.n && (!a.x || !a.panels || !a.y))) {
        PyErr_Format(PyExc_ValueError, "linear_packed: m %zd, k %zd, n %zd, kc %zd, ldx %zd do not fit (k and kc at "
                     "least 1, ldx >= k, non-null addresses)", (Py_ssize_t)a.m, (Py_ssize_t)a.k, (Py_ssize_t)a.n,
                     (Py_ssize_t)a.kc, (Py_ssize_t)a.ldx);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    run_linear_packed(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- weights as a checkpoint stores them (WF_MXFP4, WF_FP8), read in place ------------------------ */

static int amx_supported(void);
#if HAVE_X86_AVX2 && defined(__linux__)
static int linear_bf16(const float *xp, Py_ssize_t ldx, const uint16_t *wp, const weight_ref *src, float *yp,
                       Py_ssize_t ldy, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n);
#endif

#define LINEAR_STORED_FIELDS(X)                                                                                \
    X(ADDR, x, "[m, k] float32, rows ldx floats apart")                                                        \
    X(SIZE, ldx, "floats between two rows of x (>= k)")                                                        \
    X(SIZE, format, "2 MXFP4 (E2M1 codes [n, k / 2], the even input the lower nibble; E8M0 scales [n, k / 32]), " \
                    "4 FP8 (E4M3 [n, k]; E8M0 scales [ceil(n / block), ceil(k / block)]), 5 BF16 ([n, k]), "     \
                    "or one of them | 8, its rows repacked panel-major (panel_words: [ceil(n / 16), k' / 4, 16, 4] " \
                    "bytes of rows of k' bytes, the rows' 4-byte words side by side, no NaN code for FP8; the "     \
                    "scales as stored); + 16: on the AMX tiles; FP8 or MXFP4 + 8 + 16 + 32: words in the tiles' order "\
                    "(panel_words tiled)")                                                                  \
    X(ADDR, data, "the weight's codes as stored (e.g. in its checkpoint's memory map)")                        \
    X(ADDR, scales, "its E8M0 scales as stored (MXFP4, FP8; BF16: 0)")                                                               \
    X(ADDR, y, "[m, n] float32, rows ldy floats apart, written")                                               \
    X(SIZE, ldy, "floats between two rows of y (>= n)")                                                        \
    X(SIZE, m, "rows")                                                                                         \
    X(SIZE, k, "inputs (MXFP4: a multiple of 32; FP8: of 4; BF16: of 2)")                                                 \
    X(SIZE, n, "outputs")                                                                                      \
    X(SIZE, kc, "inputs of a block of the accumulation order (MXFP4: a multiple of 8; FP8: of 4; BF16: of 2)")            \
    X(SIZE, simd, "0 the portable tile, 1 AVX2 at most, 2 AVX-512 where the CPU has it (the same bits)")      \
    X(OPTSIZE, block, "FP8: the scales' block (a multiple of 16)")                                             \
    X(OPTSIZE, row0, "FP8: rows r0.. of a weight (data from row r0, scales from block row r0 / block): r0 % block, "  \
                     "a multiple of 16")                                                                     \
    X(OPTSIZE, groups, "a block-diagonal weight of G groups (0 or 1: one): the n outputs in G groups of n / G (a "    \
                       "multiple of 32), group g's reading x's inputs [g k, (g + 1) k) (ldx >= G k)")
KERNEL_ARGS(linear_stored, LINEAR_STORED_FIELDS,
            "linear_packed's product of a weight as its checkpoint stores it (MXFP4 or block-scaled FP8 rows), "
            "decoded exactly in registers: the bits of linear_packed over the dequantized weight's panels.")
static void run_linear_stored(const struct linear_stored_args *a) { /* (tiles with no buffer: y all NaN) */
    const weight_ref w = {(int)a->format, U8(a->data), U8(a->scales), a->k, a->n, a->block, a->row0, 0,
                          a->groups > 1 ? a->n / a->groups : 0, a->k};
#if HAVE_X86_AVX2 && defined(__linux__)
    if ((w.fmt & WF_AMX) && a->m && a->n) {
        if (pool_k_halves() && pool_parts(2, INFINITY) >= 2) { /* the negative control (tests only) */
            weight_ref plain = w;
            plain.fmt &= ~WF_AMX;
            k_halves_product(&plain, CF(a->x), a->ldx, F(a->y), a->ldy, a->m);
        } else if (linear_bf16(CF(a->x), a->ldx, NULL, &w, F(a->y), a->ldy, a->m, a->k, a->n))
            for (Py_ssize_t i = 0; i < a->m; i++)
                for (Py_ssize_t c = 0; c < a->n; c++) F(a->y)[i * a->ldy + c] = NAN;
        return;
    }
#endif
    linear_panels(&w, CF(a->x), a->ldx, F(a->y), a->ldy, a->m, a->kc, (int)a->simd);
}
RAW_ENTRY(linear_stored)

/* whether a stored weight's shape, block and kc fit its format; 0 if so, else a ValueError set */
static int stored_misfit(const char *fn, Py_ssize_t format, Py_ssize_t k, Py_ssize_t kc, Py_ssize_t block) {
    const int amx = format >= 0 && (format & WF_AMX); /* (kc unused) */
    if (amx && !amx_supported()) {
        PyErr_Format(PyExc_RuntimeError, "%s: format %zd (+ 16: on the AMX tiles) needs amx_supported()", fn, format);
        return 1;
    }
    if (amx) format &= ~WF_AMX, kc = 8;
    if (format >= 0 && (format & WF_TILED)) { /* tiled words: whole blocks of 32 inputs (FP8: of one scale) */
        if (!amx || (format != (WF_FP8 | WF_WORDS | WF_TILED) && format != (WF_MXFP4 | WF_WORDS | WF_TILED) &&
                     format != (WF_BF16 | WF_WORDS | WF_TILED)) ||
            k % AMX_K || (BASE((int)format) == WF_FP8 && block % AMX_K)) {
            PyErr_Format(PyExc_ValueError, "%s: format %zd (+ 32: tiled words) needs FP8, MXFP4 or BF16 + 8 + 16 + 32, "
                         "k (and FP8's block) multiples of 32 (k %zd, block %zd)", fn, format, k, block);
            return 1;
        }
        format &= ~WF_TILED;
    }
    const int base = format >= 0 && format <= (WF_BF16 | WF_WORDS) ? BASE((int)format) : -1; /* (no other flag) */
    if ((base == WF_MXFP4 && k >= MX_G && k % MX_G == 0 && kc >= 8 && kc % 8 == 0) ||
        (base == WF_FP8 && k >= 4 && k % 4 == 0 && kc >= 4 && kc % 4 == 0 && block >= NR && block % NR == 0) ||
        (base == WF_BF16 && k >= 2 && k % 2 == 0 && kc >= 2 && kc % 2 == 0))
        return 0;
    PyErr_Format(PyExc_ValueError, "%s: format %zd, k %zd, kc %zd, block %zd do not fit (format 2: MXFP4, k a multiple "
                 "of 32, kc of 8; format 4: FP8, k and kc multiples of 4, block of 16; format 5: BF16, k and kc even; "
                 "each of them + 8: its rows panel-major; + 16: on the AMX tiles)",
                 fn, format, k, kc, block);
    return 1;
}

KERNEL_PY(linear_stored) {
    PARSE(linear_stored);
    if (stored_misfit("linear_stored", a.format, a.k, a.kc, a.block)) return NULL;
    if (a.row0 < 0 || a.row0 % NR || (BASE(a.format) == WF_FP8 && a.row0 >= a.block))
        return misfit("linear_stored", "row0 a multiple of 16 below the block");
    const Py_ssize_t groups = a.groups > 1 ? a.groups : 1;
    if (a.groups < 0 || a.n % groups || (groups > 1 && a.n / groups % 32))
        return misfit("linear_stored", "groups >= 0, n a multiple of 32 groups");
    if (a.m < 0 || a.n < 0 || a.ldx < groups * a.k || a.ldy < a.n ||
        (a.m && a.n && (!a.x || !a.data || !a.y || (BASE(a.format) != WF_BF16 && !a.scales))))
        return misfit("linear_stored", "m, n >= 0, ldx >= groups k, ldy >= n, non-null addresses (scales but for BF16)");
    Py_BEGIN_ALLOW_THREADS
    run_linear_stored(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- stored rows repacked panel-major (WF_WORDS), once at load ------------------------------------------------ */
#if HAVE_X86_AVX2 && defined(__linux__)
static void tile_order(uint8_t *words, Py_ssize_t np, Py_ssize_t k, int fmt);
#endif

/* panel_words' words of 16 full rows (k bytes apart) 4 at a time where the CPU has AVX-512 (rows16x4's loads and
 * transposes), written from o on; the words done (the rest: the caller's loop). *nan gets the NaN-code test's bits. */
#if HAVE_X86_AVX2
__attribute__((target("avx512f,avx2"))) static Py_ssize_t words16x4_avx512(const uint8_t *rows, Py_ssize_t k,
                                                                         uint8_t *o, uint32_t *nan) {
    const panel_ref b = {.data = rows, .ld = k, .rows = NR};
    Py_ssize_t t = 0;
    for (; t + 16 <= k; t += 16) {
        __m512i g[4];
        rows16x4(WF_FP8, b, t, g);
        for (int j = 0; j < 4; j++, o += 64) {
            *nan |= e4m3_16_nan(g[j]);
            _mm512_storeu_si512((void *)o, g[j]);
        }
    }
    return t / 4;
}
#endif

static Py_ssize_t words16x4(const uint8_t *rows, Py_ssize_t k, uint8_t *o, uint32_t *nan) {
#if HAVE_X86_AVX2
    if (__builtin_cpu_supports("avx512f")) return words16x4_avx512(rows, k, o, nan);
#endif
    (void)rows, (void)k, (void)o, (void)nan;
    return 0;
}

#define PANEL_WORDS_FIELDS(X)                                                                                  \
    X(ADDR, data, "the rows as stored [n, k] uint8, k bytes apart (e.g. a checkpoint's memory map)")          \
    X(ADDR, words, "[ceil(n / 16), k / 4, 16, 4] uint8, written: word w of row 16 p + r at words[p][w][r]")   \
    X(SIZE, n, "rows")                                                                                         \
    X(SIZE, k, "bytes a row (a multiple of 4)")                                                                \
    X(SIZE, fp8, "1: the bytes are E4M3 codes, checked for NaN ones")                                        \
    X(OPTFLAG, tiled, "1 (an AMX CPU): each block of 32 inputs in the tiles' order (linear_stored's format + 32): "\
                      "FP8's (fp8; k a multiple of 32), BF16's (bf16; k a multiple of 64 bytes), else MXFP4's (k a "  \
                      "multiple of 16 bytes)")                                                                   \
    X(OPTFLAG, bf16, "1: the bytes are BF16 values, two an input (with tiled)")
KERNEL_ARGS(panel_words, PANEL_WORDS_FIELDS,
            "Repacks stored rows panel-major for the WF_WORDS formats (linear_stored's 10, 12 and 13, moe_experts' "
            "10): a permutation of the bytes, zero rows beyond n. Returns False, words partly written, where fp8 and "
            "a code is NaN (S.1111.111: format 12's decode leaves its NaN test out), else True. One pass, without "
            "the GIL.")
KERNEL_PY(panel_words) {
    PARSE(panel_words);
    if (a.n < 0 || a.k < 0 || a.k % 4 || (a.n && a.k && (!a.data || !a.words)))
        return misfit("panel_words", "n >= 0, k a multiple of 4, non-null addresses");
    const int fmt = a.fp8 ? WF_FP8 : a.bf16 ? WF_BF16 : WF_MXFP4;
    if (a.tiled && (a.k % row_byte(fmt, AMX_K) || (a.fp8 && a.bf16) || !amx_supported()))
        return misfit("panel_words", "tiled: k a multiple of 32 (FP8), 64 (BF16) or 16 (MXFP4), an AMX CPU "
                                     "(amx_supported())");
    const Py_ssize_t n = a.n, kw = a.k / 4, panels = (n + NR - 1) / NR;
    const uint8_t *src = U8(a.data);
    uint8_t *dst = (uint8_t *)(uintptr_t)a.words;
    uint32_t nan = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < panels; p++) { /* each word of the panel's 16 rows in turn: the writes in order */
        const Py_ssize_t rows = n - p * NR < NR ? n - p * NR : NR;
        const uint8_t *i = src + p * NR * a.k;
        uint8_t *o = dst + p * kw * NR * 4;
        Py_ssize_t w = rows == NR ? words16x4(i, a.k, o, &nan) : 0;
        for (o += w * NR * 4; w < kw; w++, o += NR * 4) {
            uint32_t v[NR] = {0};
            for (Py_ssize_t r = 0; r < rows; r++) memcpy(&v[r], i + r * a.k + 4 * w, 4);
            for (int r = 0; r < NR; r++) nan |= ((v[r] & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u; /* low 7 bits all ones */
            memcpy(o, v, sizeof v);
        }
    }
#if HAVE_X86_AVX2 && defined(__linux__)
    if (a.tiled) tile_order(dst, panels, a.k, fmt);
#endif
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(!(a.fp8 && nan));
}

/* ---- the decoders of _formats.h, for their test: every code through each form ------------------------------- */

enum { DF_E2M1, DF_E8M0, DF_E4M3, DF_BF16, DF_MXFP4 };

static void decode_plain(int fmt, const uint8_t *d, const uint8_t *sc, float *y, Py_ssize_t i) {
    for (int j = 0; j < 16; j++) {
        const Py_ssize_t v = i + j;
        y[v] = fmt == DF_E2M1    ? e2m1_value(nibble(d, v))
               : fmt == DF_E8M0  ? e8m0_value(d[v])
               : fmt == DF_E4M3  ? e4m3_value(d[v])
               : fmt == DF_BF16  ? bf16_value(((const uint16_t *)(const void *)d)[v])
                                 : mxfp4_value(nibble(d, v), sc[v / MX_G]);
    }
}

#if HAVE_X86_AVX2
__attribute__((target("avx512f,avx2"))) static void decode_avx512(int fmt, const uint8_t *d, const uint8_t *sc,
                                                                  float *y, Py_ssize_t i) {
    __m512 v;
    switch (fmt) {
    case DF_E2M1: v = e2m1_16(nibbles16(d + i / 2)); break;
    case DF_E8M0: v = e8m0_16(_mm_loadu_si128((const __m128i *)(d + i))); break;
    case DF_E4M3: v = e4m3_16(d + i); break;
    case DF_BF16: v = bf16_16((const uint16_t *)(const void *)d + i); break;
    default: v = mxfp4_16(nibbles16(d + i / 2), e8m0_16(_mm_set1_epi8((char)sc[i / MX_G]))); break;
    }
    _mm512_storeu_ps(y + i, v);
}

__attribute__((target("avx2,fma,f16c"))) static void decode_avx2(int fmt, const uint8_t *d, const uint8_t *sc,
                                                                 float *y, Py_ssize_t i) {
    __m256 v0, v1;
    switch (fmt) {
    case DF_E2M1: {
        const __m128i c = nibbles16_sse(d + i / 2);
        v0 = e2m1_8(c), v1 = e2m1_8(_mm_srli_si128(c, 8));
        break;
    }
    case DF_E8M0: {
        const __m128i e = _mm_loadu_si128((const __m128i *)(d + i));
        v0 = e8m0_8(e), v1 = e8m0_8(_mm_srli_si128(e, 8));
        break;
    }
    case DF_E4M3: v0 = e4m3_8(d + i), v1 = e4m3_8(d + i + 8); break;
    case DF_BF16:
        v0 = bf16_8((const uint16_t *)(const void *)d + i), v1 = bf16_8((const uint16_t *)(const void *)d + i + 8);
        break;
    default: {
        const __m128i c = nibbles16_sse(d + i / 2);
        const __m256 s = e8m0_8(_mm_set1_epi8((char)sc[i / MX_G]));
        v0 = mxfp4_8(c, s), v1 = mxfp4_8(_mm_srli_si128(c, 8), s);
    }
    }
    _mm256_storeu_ps(y + i, v0);
    _mm256_storeu_ps(y + i + 8, v1);
}
#endif

#define DECODE_FORMATS_FIELDS(X)                                                                               \
    X(SIZE, format, "0 E2M1 (codes packed two a byte, the lower nibble first), 1 E8M0, 2 E4M3, 3 BF16, 4 MXFP4") \
    X(ADDR, data, "the codes (uint8; BF16: uint16)")                                                          \
    X(ADDR, y, "[n] float32, written")                                                                         \
    X(SIZE, n, "values (a multiple of 32)")                                                                    \
    X(SIZE, simd, "0 the scalar decoders, 1 the AVX2 ones, 2 the AVX-512 ones (where the CPU has them)")       \
    X(OPTADDR, scales, "MXFP4: one E8M0 byte per 32 values")
KERNEL_ARGS(decode_formats, DECODE_FORMATS_FIELDS,
            "y = the float32 values of n codes of a weight format, by the decoders of _formats.h at one SIMD level "
            "(their test).")
KERNEL_PY(decode_formats) {
    PARSE(decode_formats);
    if (a.format < 0 || a.format > DF_MXFP4 || a.n < 0 || a.n % 32 || (a.n && (!a.data || !a.y)) ||
        (a.format == DF_MXFP4 && a.n && !a.scales))
        return misfit("decode_formats", "format 0..4, n a multiple of 32, non-null addresses (MXFP4: scales too)");
    int level = 0;
#if HAVE_X86_AVX2
    if (a.simd >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        level = a.simd >= 2 && __builtin_cpu_supports("avx512f") ? 2 : 1;
#endif
    const int fmt = (int)a.format;
    for (Py_ssize_t i = 0; i < a.n; i += 16) {
#if HAVE_X86_AVX2
        if (level == 2) {
            decode_avx512(fmt, U8(a.data), U8(a.scales), F(a.y), i);
            continue;
        }
        if (level == 1) {
            decode_avx2(fmt, U8(a.data), U8(a.scales), F(a.y), i);
            continue;
        }
#endif
        decode_plain(fmt, U8(a.data), U8(a.scales), F(a.y), i);
    }
    return PyLong_FromLong(level);
}

typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);

#define BLAS_MM_FIELDS(X)                                                                                      \
    X(ADDR, sgemm, "the BLAS sgemm's address (Fortran interface, 32-bit integers)")                            \
    X(ADDR, x, "[m, k] float32, contiguous")                                                                   \
    X(ADDR, wt, "[k, n] float32, contiguous")                                                                  \
    X(ADDR, y, "[m, n] float32, written")                                                                      \
    X(SIZE, m, "rows (1 to 2^31 - 1)")                                                                         \
    X(SIZE, k, "inputs (1 to 2^31 - 1)")                                                                       \
    X(SIZE, n, "outputs (1 to 2^31 - 1)")
KERNEL_ARGS(blas_mm, BLAS_MM_FIELDS,
            "y [m, n] = x [m, k] @ wt [k, n] (contiguous float32) by the BLAS sgemm at address sgemm, called as torch's "
            "CPU matmul calls it.")
KERNEL_PY(blas_mm) {
    PARSE(blas_mm);
    const Py_ssize_t m = a.m, k = a.k, n = a.n;
    if (!a.sgemm || !a.x || !a.wt || !a.y || m < 1 || k < 1 || n < 1 || m > INT32_MAX || k > INT32_MAX || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "blas_mm: m %zd, k %zd, n %zd must be in [1, 2^31) with non-null addresses", m,
                     k, n);
        return NULL;
    }
    const int rows = (int)m, depth = (int)k, cols = (int)n;
    const float one = 1.0f, zero = 0.0f;
    Py_BEGIN_ALLOW_THREADS
    ((sgemm_fn)(uintptr_t)a.sgemm)("N", "N", &cols, &rows, &depth, &one, CF(a.wt), &cols, CF(a.x), &depth, &zero,
                                   F(a.y), &cols);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- FP8 panels: one row of a product whose weight is E4M3 times a power of two per block ----------------- */

#if HAVE_X86_AVX2
/* o[q][0..16) for q < np: one row x times the FP8 panels b[q] (WF_FP8_PANELS): the accumulation of every panel format
 * (wide_avx512) over the same float32 weights, decoded exactly (e4m3_16_raw times 2^(s + 8)), so the same bits,
 * reading a quarter of the bytes. */
__attribute__((target("avx512f,avx2"))) static void wide_fp8_x86(int np, const float *x, const panel_ref *b,
                                                                 Py_ssize_t k, Py_ssize_t kc, float *const *o) {
    switch (np) { /* constant panels: the accumulators stay in registers */
    case 8: wide_avx512(WF_FP8_PANELS, 1, 8, x, k, b, k, kc, o, NR, NR, NO_HINTS); break;
    case 4: wide_avx512(WF_FP8_PANELS, 1, 4, x, k, b, k, kc, o, NR, NR, NO_HINTS); break;
    case 2: wide_avx512(WF_FP8_PANELS, 1, 2, x, k, b, k, kc, o, NR, NR, NO_HINTS); break;
    default: wide_avx512(WF_FP8_PANELS, 1, 1, x, k, b, k, kc, o, NR, NR, NO_HINTS); break;
    }
}

/* y = x @ w row by row for the output panels [p_begin, p_end), w as FP8 panels qp [panels][k][16] bytes with scales
 * sp [panels][ceil(k / SB)] (checked arguments, an AVX-512 CPU), y's rows ldy apart; runs without the GIL. */
static void linear_fp8_range(const float *xp, Py_ssize_t ldx, const uint8_t *qp, const float *sp, float *yp,
                             Py_ssize_t ldy, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t kc,
                             Py_ssize_t p_begin, Py_ssize_t p_end) {
    float part[NR]; /* the last, partial panel's outputs */
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t p = p_begin; p < p_end;) {
            const Py_ssize_t j = p * NR, full = (n - j) / NR;
            int np = 8;
            while (np > 1 && np > p_end - p) np /= 2;
            const weight_ref w = {WF_FP8_PANELS, qp, sp, k, n, 0, 0};
            panel_ref b[8];
            float *o[8];
            for (int q = 0; q < np; q++)
                b[q] = panel_at(&w, p + q), o[q] = q < full ? yp + i * ldy + j + q * NR : part;
            wide_fp8_x86(np, xp + i * ldx, b, k, kc, o);
            if (np > full) memcpy(yp + i * ldy + j + full * NR, part, (n - j - full * NR) * sizeof(float));
            p += np;
        }
}

typedef struct {
    const float *x;
    Py_ssize_t ldx, m, k, n, kc;
    const uint8_t *q;
    const float *s;
    float *y;
    grid g;
} fp8_job;

static void fp8_part(void *c, int64_t b, int64_t e) {
    const fp8_job *j = c;
    Py_ssize_t r0, mr, u0, u1;
    while (grid_next(&j->g, j->m, &b, e, &r0, &mr, &u0, &u1))
        linear_fp8_range(j->x + r0 * j->ldx, j->ldx, j->q, j->s, j->y + r0 * j->n, j->n, mr, j->k, j->n, j->kc, u0, u1);
}

/* y [m, n] = x @ w, linear_fp8_range over every panel, on the kernels' pool where the product is big enough */
static void linear_fp8(const float *xp, Py_ssize_t ldx, const uint8_t *qp, const float *sp, float *yp, Py_ssize_t m,
                       Py_ssize_t k, Py_ssize_t n, Py_ssize_t kc) {
    const Py_ssize_t panels = (n + NR - 1) / NR;
    if (pool_k_halves() && m && n && pool_parts(2, INFINITY) >= 2) { /* the negative control (tests only) */
        const weight_ref w = {WF_FP8_PANELS, qp, sp, k, n, 0, 0};
        k_halves_product(&w, xp, ldx, yp, n, m);
        return;
    }
    const grid g = grid_of(m, panels, (double)m * (double)k * (double)n, 1, UNITS_A_THREAD);
    if (g.parts <= 1) {
        linear_fp8_range(xp, ldx, qp, sp, yp, n, m, k, n, kc, 0, panels);
        return;
    }
    fp8_job j = {xp, ldx, m, k, n, kc, qp, sp, yp, g};
    parallel_run(g.items, g.parts, fp8_part, &j);
}
#endif

static int fp8_supported(void) {
#if HAVE_X86_AVX2
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

#define LINEAR_FP8_FIELDS(X)                                                                                   \
    X(ADDR, x, "[m, k] float32, rows ldx floats apart")                                                        \
    X(SIZE, ldx, "floats between two rows of x (>= k)")                                                        \
    X(ADDR, fp8, "the weight as E4M3 bytes [ceil(n / 16), k, 16]")                                            \
    X(ADDR, scales, "[ceil(n / 16), ceil(k / 64)] float32 (2^(s + 8))")                                       \
    X(ADDR, y, "[m, n] float32, contiguous, written")                                                          \
    X(SIZE, m, "rows")                                                                                         \
    X(SIZE, k, "inputs (>= 1)")                                                                                \
    X(SIZE, n, "outputs")                                                                                      \
    X(SIZE, kc, "inputs of a block of the accumulation order (>= 1)")
KERNEL_ARGS(linear_fp8, LINEAR_FP8_FIELDS,
            "linear_packed's product, row by row, of a weight packed as E4M3 bytes with a power-of-two scale a block: "
            "the same bits (AVX-512 CPUs only).")
#if HAVE_X86_AVX2
static void run_linear_fp8(const struct linear_fp8_args *a) {
    linear_fp8(CF(a->x), a->ldx, (const uint8_t *)(uintptr_t)a->fp8, CF(a->scales), F(a->y), a->m, a->k, a->n, a->kc);
}
RAW_ENTRY(linear_fp8)
#endif
KERNEL_PY(linear_fp8) {
    PARSE(linear_fp8);
    if (!fp8_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "linear_fp8: this CPU has no AVX-512 (fp8_supported() is False)");
        return NULL;
    }
    if (a.m < 0 || a.k < 1 || a.n < 0 || a.kc < 1 || a.ldx < a.k || (a.m && a.n && (!a.x || !a.fp8 || !a.scales || !a.y))) {
        PyErr_Format(PyExc_ValueError, "linear_fp8: m %zd, k %zd, n %zd, kc %zd, ldx %zd do not fit (k and kc at "
                     "least 1, ldx >= k, non-null addresses)", (Py_ssize_t)a.m, (Py_ssize_t)a.k, (Py_ssize_t)a.n,
                     (Py_ssize_t)a.kc, (Py_ssize_t)a.ldx);
        return NULL;
    }
#if HAVE_X86_AVX2
    Py_BEGIN_ALLOW_THREADS
    run_linear_fp8(&a);
    Py_END_ALLOW_THREADS
#endif
    Py_RETURN_NONE;
}

static PyObject *py_fp8_supported(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyBool_FromLong(fp8_supported());
}

/* ---- bf16 tiles (AMX): weights that are exactly bfloat16, inputs split in three bfloat16 pieces -------------- */

/* A weight whose every value is a bfloat16 (an FP8 block-scaled one rebuilt, a BF16 checkpoint's) comes packed
 * as [ceil(n / 32) * 2][kp / 2][16][2] bfloat16 (kp = k rounded up to 32, zero beyond k and n: the AMX layout of
 * a tile's pairs of inputs, exactness.py `pack_bf16`). Each input x is split exactly into three bfloat16 pieces
 * by truncation (hi = x's top 8 significant bits, mid = the next 8 of x - hi, lo = the rest: x = hi + mid + lo,
 * a float32 having 24), so every product piece * weight is exact in float32 and y[i][j] is the sum of the 3 k
 * exact products, accumulated by the tile unit in float32: for each block of 32 inputs in order, the hi, mid
 * and lo pieces' dot products in that order (TDPBF16PS, whose rounding inside a block is the unit's own: the
 * measured error is below a float32 loop's, tests/test_layers.py). A row's operations do not depend on the
 * call's other rows or on its place in a tile (the unit computes each row of a tile alone), so a row gets the
 * same bits in any call. Tiles: up to 32 rows (two row tiles) x 32 columns (two panels). */

#define AMX_ROWS 16    /* rows of a tile */
#define AMX_BLOCK 32   /* rows split and computed together (two row tiles) */
#define AMX_SPLIT (768 * 1024) /* bytes of split rows that the stored rows' column pairs reuse (in L2) */
/* bytes of split rows that one column pair takes split whole, before its products: no split's stores among them,
 * whose tile loads would wait for them ([1, 4096 -> 24], the mHC mix: 4.8 -> 3.5 us) */
#define AMX_SPLIT_L1 (32 * 1024)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_ok = -1; /* -1 not asked yet */

/* Whether this CPU has AMX-BF16 (and the AVX-512 of the split) and the kernel lets the process use the tile
 * data (Linux asks for it once: arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA). */
static int amx_supported(void) {
#if HAVE_X86_AVX2 && defined(__linux__)
    if (amx_ok < 0) {
        unsigned a, b, c, d;
        amx_ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24)) &&
                 __builtin_cpu_supports("avx512f") &&
                 syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return amx_ok;
#else
    return 0;
#endif
}

#if HAVE_X86_AVX2 && defined(__linux__)
/* rows x [r][0..k) (ldx apart) as the three pieces buf [r][3][kp] bfloat16 bits, zero from k to kp; within each
 * block of 32 inputs, pair j (a 32-bit lane of the tile's row) holds inputs j and j + 16 (the weight's tiles pair
 * them alike), so a piece is the top halves of two vectors' lanes put side by side: no shuffle */
__attribute__((target("avx512f"))) static void split3(const float *x, Py_ssize_t ldx, int r, Py_ssize_t k,
                                                   Py_ssize_t kp, uint16_t *buf) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000);
    for (int i = 0; i < r; i++) {
        const float *row = x + i * ldx;
        uint16_t *o = buf + (Py_ssize_t)i * 3 * kp;
        for (Py_ssize_t t = 0; t < kp; t += 32) {
            __m512 v0, v1;
            if (t + 32 <= k) {
                v0 = _mm512_loadu_ps(row + t), v1 = _mm512_loadu_ps(row + t + 16);
            } else {
                const __mmask16 m0 = t >= k ? 0 : k - t >= 16 ? 0xffff : (__mmask16)((1u << (k - t)) - 1);
                const __mmask16 m1 = t + 16 >= k ? 0 : (__mmask16)((1u << (k - t - 16)) - 1);
                v0 = _mm512_maskz_loadu_ps(m0, row + t), v1 = _mm512_maskz_loadu_ps(m1, row + t + 16);
            }
            for (int p = 0; p < 3; p++) {
                const __m512i h0 = _mm512_and_si512(_mm512_castps_si512(v0), top);
                const __m512i h1 = _mm512_and_si512(_mm512_castps_si512(v1), top);
                _mm512_storeu_si512(o + p * kp + t, _mm512_or_si512(_mm512_srli_epi32(h0, 16), h1));
                v0 = _mm512_sub_ps(v0, _mm512_castsi512_ps(h0)); /* exact */
                v1 = _mm512_sub_ps(v1, _mm512_castsi512_ps(h1));
            }
        }
    }
}

/* Stored rows on the tiles (WF_AMX): the B tile of panel b (16 columns) for inputs [k0, k0 + 32), laid out as
 * pack_bf16 lays out the dequantized weight's: [16 pairs][16 columns][2] bfloat16, pair p holding inputs k0 + p and
 * k0 + 16 + p, zero beyond k. Each weight is lane16's exact float32 (the float panels' value), and its top 16 bits
 * are its bfloat16 where the weight is one: the caller admits only weights whose every value is (exactness.py
 * `tiles_admit`, by their scales), so the tiles hold the very bits of pack_bf16's, and so do the products. */
#define AMX_TILE 512 /* bfloat16 values of a tile: 16 pairs x 16 columns x 2 */
__attribute__((target("avx512f,avx2"), always_inline)) static inline void
bf16_tile_avx512(const int fmt, panel_ref b, Py_ssize_t k0, Py_ssize_t k, uint16_t *dst) {
    float f[AMX_K * NR] __attribute__((aligned(64))); /* [32 inputs][16 columns] */
    const Py_ssize_t ke = k0 + AMX_K < k ? k0 + AMX_K : k;
    decode_panel_avx512(fmt, b, k0, ke, f);
    memset(f + (ke - k0) * NR, 0, (size_t)(k0 + AMX_K - ke) * NR * sizeof(float));
    const __m512i top = _mm512_set1_epi32((int)0xffff0000);
    for (int p = 0; p < AMX_K / 2; p++) { /* (top & input p + 16) | input p >> 16: both bfloat16 in one lane */
        const __m512i lo = _mm512_load_si512((const void *)(f + p * NR));
        const __m512i hi = _mm512_load_si512((const void *)(f + (p + 16) * NR));
        _mm512_store_si512((void *)(dst + p * 32), _mm512_ternarylogic_epi32(top, hi, _mm512_srli_epi32(lo, 16), 0xEA));
    }
}

/* The words' fast forms (FP8 and MXFP4 rows panel-major, a whole block of 32 inputs): the codes of a tile's rows are
 * picked from the 16 rows' words at inputs t and t + 16 by one byte permutation, and turned into bfloat16 bits by
 * table lookups and integer operations alone (no float32 multiply: Intel cores take a slow assist for each vector
 * holding a subnormal, which E4M3's small codes make before their scale). A value's bfloat16 is its magnitude's, its
 * scale 2^(s - 127) added to the exponent field (the admitted scales keep every nonzero value normal and finite),
 * and its sign. */
#define PAIR_AT(o, j) ((o) % 32 / 2 * 4 + (j) + (o) / 32 + (o) % 2 * 64)
/* MXFP4: a tile row's codes from the 16 rows' bytes j (a byte holding both of a column's codes): byte 2e (element
 * e's 16-bit lane) is column e / 2's byte j */
#define BOTH_AT(o, j) ((o) / 4 * 4 + (j))
/* FP8: two rows' codes laid out so that unpacking bytes (low with high) gives each row's words in order: byte p of
 * the 64 is element 8 (p / 16) + p % 8 of row (p % 16) / 8, rows j and j + 1 */
#define LANE_AT(p, j) PAIR_AT((p) / 16 * 8 + (p) % 8 + 32 * ((p) % 16 / 8), j)
#define IDX8(M, o, j) M(o, j), M(o + 1, j), M(o + 2, j), M(o + 3, j), M(o + 4, j), M(o + 5, j), M(o + 6, j), M(o + 7, j)
#define IDX64(M, j) IDX8(M, 0, j), IDX8(M, 8, j), IDX8(M, 16, j), IDX8(M, 24, j), IDX8(M, 32, j), IDX8(M, 40, j),       \
                    IDX8(M, 48, j), IDX8(M, 56, j)
/* for _mm512_permutex2var_epi8(a, LANE_INDEX[h], b), a and b 16 rows' 4-byte words (a row's byte j at lane 4 c + j),
 * and for _mm512_maskz_permutexvar_epi8(even bytes, BOTH_INDEX[j], such words) */
static const uint8_t LANE_INDEX[2][64] __attribute__((aligned(64))) = {{IDX64(LANE_AT, 0)}, {IDX64(LANE_AT, 2)}};
static const uint8_t BOTH_INDEX[4][64] __attribute__((aligned(64))) = {
    {IDX64(BOTH_AT, 0)}, {IDX64(BOTH_AT, 1)}, {IDX64(BOTH_AT, 2)}, {IDX64(BOTH_AT, 3)}};
#undef IDX64
#undef IDX8
#undef LANE_AT
#undef BOTH_AT
#undef PAIR_AT
/* the bfloat16 bits of the E4M3 magnitudes 0..127: 2^(e - 7) (1 + m / 8), subnormal (e = 0) m 2^-9 (127, a NaN code,
 * never in words) */
#define E4M3_BF(em) ((em) >= 8 ? ((em) << 4) + 0x3C00 : (em) == 0 ? 0 : (em) == 1 ? 0x3B00                         \
                     : (em) < 4 ? 0x3B80 + ((em) - 2) * 0x40 : 0x3C00 + ((em) - 4) * 0x20)
#define E4M3_BF8(o) E4M3_BF(o), E4M3_BF(o + 1), E4M3_BF(o + 2), E4M3_BF(o + 3), E4M3_BF(o + 4), E4M3_BF(o + 5),       \
                    E4M3_BF(o + 6), E4M3_BF(o + 7)
#define E4M3_BF32(o) E4M3_BF8(o), E4M3_BF8(o + 8), E4M3_BF8(o + 16), E4M3_BF8(o + 24)
static const uint16_t E4M3_BF16[128] __attribute__((aligned(64))) = {E4M3_BF32(0), E4M3_BF32(32), E4M3_BF32(64),
                                                                      E4M3_BF32(96)};
#undef E4M3_BF32
#undef E4M3_BF8
#undef E4M3_BF
/* the bfloat16 bits of the 16 E2M1 codes (the sign bit 3; code 8 is -0), twice: an index's bit 4 is not the code's */
#define E2M1_BF 0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,                                        \
                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0
static const uint16_t E2M1_BF16[32] __attribute__((aligned(64))) = {E2M1_BF, E2M1_BF};
#undef E2M1_BF

/* s - 127 in a bfloat16's exponent field (bits 7..14) */
static inline uint16_t scale_add(unsigned s) { return (uint16_t)(((int)s - 127) * 128); }

/* FP8: the low and high bytes of the bfloat16 of each magnitude 0..127 times 2^(s - 127) (zero stays zero), for every
 * E8M0 scale s, made once (fp8_scaled_init): [s][lo of 0..63, lo of 64..127, hi of 0..63, hi of 64..127] (the scales
 * outside TILE_SCALES wrap: never admitted) */
static uint8_t FP8_SCALED[256][4][64] __attribute__((aligned(64)));

static void fp8_scaled_init(void) {
    for (unsigned s = 0; s < 256; s++)
        for (int em = 0; em < 128; em++) {
            const uint16_t v = E4M3_BF16[em] ? (uint16_t)(E4M3_BF16[em] + scale_add(s)) : 0;
            FP8_SCALED[s][em / 64][em % 64] = (uint8_t)v, FP8_SCALED[s][2 + em / 64][em % 64] = (uint8_t)(v >> 8);
        }
}

/* FP8: tile rows 2q and 2q + 1 (at dst) from their 64 codes x as LANE_AT lays them out, and their scale's tables
 * t = FP8_SCALED[s] (loaded by the caller): each bfloat16's low and high bytes looked up (the high with the code's
 * sign bit), the two rows unpacked from them */
typedef struct {
    __m512i lo0, lo1, hi0, hi1;
} fp8_tables;

__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) static inline fp8_tables fp8_tables_of(unsigned s) {
    const uint8_t(*t)[64] = FP8_SCALED[s];
    return (fp8_tables){_mm512_load_si512((const void *)t[0]), _mm512_load_si512((const void *)t[1]),
                        _mm512_load_si512((const void *)t[2]), _mm512_load_si512((const void *)t[3])};
}

__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) static inline void
fp8_two_rows(__m512i x, const fp8_tables *t, uint16_t *dst) {
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, x, t->lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, x, t->hi1), x,
                                                 _mm512_set1_epi8((char)0x80), 0xF8);
    _mm512_store_si512((void *)dst, _mm512_unpacklo_epi8(lo, hi));
    _mm512_store_si512((void *)(dst + 32), _mm512_unpackhi_epi8(lo, hi));
}

/* bf16_tile of FP8 words, a whole block [k0, k0 + 32) (k0 + 32 <= k) with one scale (else 0: nothing written): for
 * each two rows, one permutation picks their 64 codes (fp8_two_rows decodes them) */
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2"))) static int bf16_tile_fp8_words(panel_ref b, Py_ssize_t k0,
                                                                                         uint16_t *dst) {
    const uint8_t *sc = b.scale;
    const unsigned s = sc[k0 / b.group];
    if (s != sc[(k0 + 16) / b.group]) return 0;
    const fp8_tables t = fp8_tables_of(s);
    for (int i = 0; i < 4; i++) {
        const __m512i a = _mm512_loadu_si512((const void *)word_at(WF_FP8 | WF_WORDS, b, k0 + 4 * i));
        const __m512i c = _mm512_loadu_si512((const void *)word_at(WF_FP8 | WF_WORDS, b, k0 + 16 + 4 * i));
        for (int h = 0; h < 2; h++) /* rows 4i + 2h and 4i + 2h + 1 */
            fp8_two_rows(_mm512_permutex2var_epi8(a, _mm512_load_si512((const void *)LANE_INDEX[h]), c), &t,
                         dst + (4 * i + 2 * h) * 32);
    }
    return 1;
}

/* bf16_tile of FP8 tiled words (WF_TILED), the block [k0, k0 + 32): each 64-byte load holds two tile rows' codes
 * (no permutation picks them) */
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2"))) static inline void
fp8_tiled_block(panel_ref b, Py_ssize_t k0, uint16_t *dst) {
    const fp8_tables t = fp8_tables_of(((const uint8_t *)b.scale)[k0 / b.group]);
    const uint8_t *c = (const uint8_t *)b.data + k0 * NR;
    for (int q = 0; q < 8; q++) fp8_two_rows(_mm512_loadu_si512((const void *)(c + 64 * q)), &t, dst + 2 * q * 32);
}

/* MXFP4 tiled words: 64 bytes (loads 2 i + h and 2 i + h + 1, h = i % 2) = _mm512_permutex2var_epi8(the words of
 * pairs of inputs c, MX_PICK[h], those of c + 8), c = i / 2 * 4: byte p's element e = p % 32 is column e / 2's input
 * pair c % 4 + 2 h + p / 32 (+ 8 where e is odd) */
#define MX_AT(p, h) ((p) % 32 % 2 * 64 + (p) % 32 / 2 * 4 + 2 * (h) + (p) / 32)
#define IDX8(o, h) MX_AT(o, h), MX_AT(o + 1, h), MX_AT(o + 2, h), MX_AT(o + 3, h), MX_AT(o + 4, h), MX_AT(o + 5, h),  \
                   MX_AT(o + 6, h), MX_AT(o + 7, h)
#define IDX64(h) IDX8(0, h), IDX8(8, h), IDX8(16, h), IDX8(24, h), IDX8(32, h), IDX8(40, h), IDX8(48, h), IDX8(56, h)
static const uint8_t MX_PICK[2][64] __attribute__((aligned(64))) = {{IDX64(0)}, {IDX64(1)}};
#undef IDX64
#undef IDX8
#undef MX_AT

__attribute__((target("avx512f,avx2"))) static void bf16_tile_bf16_words(panel_ref b, Py_ssize_t k0, uint16_t *dst);

/* panel_words' tiled form: each block of 32 inputs of the words of np panels (k bytes a row) of format fmt put in
 * place in the tiles' order (WF_TILED). FP8: load q = 2 i + h is bf16_tile_fp8_words' pick of rows 4 i + 2 h, + 1;
 * MXFP4: the words of input pairs i and i + 8 of a column are already the bytes of tile rows 2 i and 2 i + 1
 * (MX_PICK); BF16: the block's tile (bf16_tile_bf16_words) */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void tile_order(uint8_t *words, Py_ssize_t np,
                                                                              Py_ssize_t k, int fmt) {
    if (fmt == WF_BF16) {
        uint16_t tile[AMX_TILE] __attribute__((aligned(64)));
        for (uint8_t *b = words, *end = words + np * k * NR; b < end; b += sizeof tile) {
            bf16_tile_bf16_words((panel_ref){.data = b}, 0, tile);
            memcpy(b, tile, sizeof tile);
        }
        return;
    }
    const int fp8 = fmt == WF_FP8;
    const uint8_t(*pick)[64] = fp8 ? LANE_INDEX : MX_PICK;
    const __m512i pick0 = _mm512_load_si512((const void *)pick[0]), pick1 = _mm512_load_si512((const void *)pick[1]);
    const Py_ssize_t block = fp8 ? AMX_K * NR : AMX_K * NR / 2;
    for (uint8_t *b = words, *end = words + np * k * NR; b < end; b += block) {
        __m512i q[8];
        for (int i = 0; i < 4; i++) {
            const Py_ssize_t w = fp8 ? i : i / 2; /* the first source word: the other block / 2 bytes on */
            const __m512i a = _mm512_loadu_si512((const void *)(b + 64 * w));
            const __m512i c = _mm512_loadu_si512((const void *)(b + block / 2 + 64 * w));
            if (fp8) {
                q[2 * i] = _mm512_permutex2var_epi8(a, pick0, c);
                q[2 * i + 1] = _mm512_permutex2var_epi8(a, pick1, c);
            } else {
                q[i] = _mm512_permutex2var_epi8(a, i % 2 ? pick1 : pick0, c);
            }
        }
        for (int i = 0; i < block / 64; i++) _mm512_storeu_si512((void *)(b + 64 * i), q[i]);
    }
}

/* MXFP4: the scales of a panel's 16 rows for 4 groups, read by one gather where the rows have them, kept from block
 * to block (base -8 at a panel's first) */
typedef struct {
    __m512i scales;  /* a 32-bit word a row: its scales of groups base .. base + 3 */
    Py_ssize_t base;
} mx_scales;

/* each row's E8M0 scale of the group at input k0 added to a bfloat16's exponent field, in both halves of the row's
 * 32-bit lane (a tile row's element pair) */
__attribute__((target("avx512f,avx2"), always_inline)) static inline __m512i mx_block_add(panel_ref b, Py_ssize_t k0,
                                                                                         mx_scales *st) {
    const Py_ssize_t g = k0 / MX_G;
    if ((g < st->base || g >= st->base + 4) && g + 4 <= b.sld) st->scales = mx_words16(b, k0), st->base = g;
    __m512i e; /* row r's E8M0 scale in 32-bit lane r */
    if (g >= st->base && g < st->base + 4) {
        e = _mm512_and_si512(_mm512_srl_epi32(st->scales, _mm_cvtsi32_si128(8 * (int)(g - st->base))),
                             _mm512_set1_epi32(255));
    } else {
        uint8_t rs[NR];
        row_scales(b, k0, rs);
        e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)rs));
    }
    const __m512i s = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(127)), 7);
    return _mm512_or_si512(_mm512_and_si512(s, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(s, 16));
}

/* bf16_tile of MXFP4 words for nb blocks from k0 (a block is one scale group; block i's tile at dst + i AMX_TILE):
 * the codes of inputs t and t + 16 put side by side in one byte a column, each row's codes picked as 16-bit lanes
 * by one permutation of those bytes (the second code shifted down), E2M1_BF16 looked up, each row's scale added to
 * the nonzero ones */
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx2"))) static void bf16_tile_mxfp4_words(panel_ref b,
                                                                                            Py_ssize_t k0, int nb,
                                                                                            uint16_t *dst) {
    const __m512i table = _mm512_load_si512((const void *)E2M1_BF16);
    const __m512i low = _mm512_set1_epi8(15), seven = _mm512_set1_epi16(7), down = _mm512_set1_epi32(4 << 16);
    const __mmask64 even = 0x5555555555555555ull;
    mx_scales st = {.base = -8};
    for (int i = 0; i < nb; i++, k0 += AMX_K, dst += AMX_TILE) {
        const __m512i add = mx_block_add(b, k0, &st);
        for (int q = 0; q < 2; q++) { /* rows 8q .. 8q + 7: inputs k0 + 8q + p and k0 + 16 + 8q + p */
            const __m512i a = _mm512_loadu_si512((const void *)word_at(WF_MXFP4 | WF_WORDS, b, k0 + 8 * q));
            const __m512i c = _mm512_loadu_si512((const void *)word_at(WF_MXFP4 | WF_WORDS, b, k0 + 16 + 8 * q));
            for (int odd = 0; odd < 2; odd++) { /* byte j's lower nibble is input 2j, its upper 2j + 1 */
                const __m512i both = odd ? _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(a, 4), c, 0xCA)
                                         : _mm512_ternarylogic_epi32(low, a, _mm512_slli_epi16(c, 4), 0xCA);
                for (int j = 0; j < 4; j++) { /* row 8q + 2j + odd */
                    const __m512i x = _mm512_srlv_epi16(
                        _mm512_maskz_permutexvar_epi8(even, _mm512_load_si512((const void *)BOTH_INDEX[j]), both), down);
                    const __m512i v = _mm512_permutexvar_epi16(x, table);
                    _mm512_store_si512((void *)(dst + (8 * q + 2 * j + odd) * 32),
                                       _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(x, seven), v, add));
                }
            }
        }
    }
}

/* bf16_tile of MXFP4 tiled words (WF_TILED), the block [k0, k0 + 32): each 32-byte load holds two tile rows' codes
 * (tiled_at), zero-extended to 16-bit lanes at once, the lower nibbles and the upper ones each looked up by one
 * permutation (E2M1_BF16 twice: an index's bit 4 is not the code's), the scale added to the nonzero ones */
__attribute__((target("avx512f,avx512bw,avx2"))) static inline void mxfp4_tiled_block(panel_ref b, Py_ssize_t k0,
                                                                                     uint16_t *dst, mx_scales *st) {
    const __m512i table = _mm512_load_si512((const void *)E2M1_BF16), add = mx_block_add(b, k0, st);
    const __m512i lower = _mm512_set1_epi16(7), upper = _mm512_set1_epi16(0x70);
    const uint8_t *c = (const uint8_t *)b.data + k0 * NR / 2;
    for (int q = 0; q < 8; q++) {
        const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(c + 32 * q)));
        const __m512i lo = _mm512_permutexvar_epi16(w, table), hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
        _mm512_store_si512((void *)(dst + 2 * q * 32), _mm512_mask_add_epi16(lo, _mm512_test_epi16_mask(w, lower), lo, add));
        _mm512_store_si512((void *)(dst + (2 * q + 1) * 32),
                           _mm512_mask_add_epi16(hi, _mm512_test_epi16_mask(w, upper), hi, add));
    }
}

/* bf16_tile of BF16 words, a whole block [k0, k0 + 32) (k0 + 32 <= k): a word holds a column's inputs 2g and 2g + 1,
 * so tile rows 2g and 2g + 1 are the lower and the upper halves of the words at inputs k0 + 2g and k0 + 16 + 2g
 * put side by side (no decode: the values are their bfloat16s) */
__attribute__((target("avx512f,avx2"))) static void bf16_tile_bf16_words(panel_ref b, Py_ssize_t k0, uint16_t *dst) {
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    for (int g = 0; g < 8; g++) {
        const __m512i a = _mm512_loadu_si512((const void *)word_at(WF_BF16 | WF_WORDS, b, k0 + 2 * g));
        const __m512i c = _mm512_loadu_si512((const void *)word_at(WF_BF16 | WF_WORDS, b, k0 + 16 + 2 * g));
        _mm512_store_si512((void *)(dst + 2 * g * 32), _mm512_ternarylogic_epi32(low, a, _mm512_slli_epi32(c, 16), 0xCA));
        _mm512_store_si512((void *)(dst + (2 * g + 1) * 32),
                           _mm512_ternarylogic_epi32(low, _mm512_srli_epi32(a, 16), c, 0xCA));
    }
}

typedef void (*tile_decode_fn)(panel_ref, Py_ssize_t, Py_ssize_t, uint16_t *);
#define TILE_DECODER(NAME, FMT)                                                                                    \
    __attribute__((target("avx512f,avx2"))) static void bf16_tile_##NAME(panel_ref b, Py_ssize_t k0, Py_ssize_t k,  \
                                                                         uint16_t *d) {                            \
        bf16_tile_avx512(FMT, b, k0, k, d);                                                                        \
    }
STORED_FORMATS(TILE_DECODER)
#undef TILE_DECODER

/* What the tile loops read of stored rows (WF_AMX): the weight, its format's float decode, and the two tiles of the
 * block being multiplied (one per call of linear_bf16_range, on its stack) */
typedef struct {
    const weight_ref *w;
    tile_decode_fn dec;
    uint16_t blk[2 * AMX_TILE] __attribute__((aligned(64)));
} tile_source;

static void tile_source_of(tile_source *ts, const weight_ref *w) {
    ts->w = w, ts->dec = NULL;
#define DECODER_CASE(NAME, FMT)                                                                                    \
    case FMT: ts->dec = bf16_tile_##NAME; break;
    switch (w->fmt & ~WF_AMX) { STORED_FORMATS(DECODER_CASE) }
#undef DECODER_CASE
}

/* the panels of the column pair from column n0 (pr[0], pr[1]; rows 0 past n) */
static inline void pair_panels(const weight_ref *w, Py_ssize_t n0, panel_ref *pr) {
    for (int h = 0; h < 2; h++) {
        if (n0 + h * NR < w->n) pr[h] = panel_at(w, n0 / NR + h);
        else pr[h].rows = 0;
    }
}

/* BF16 tiled words: the tile of the block [k0, k0 + 32) of a panel, as stored */
static inline const uint16_t *bf16_tiled_block(panel_ref b, Py_ssize_t k0) {
    return (const uint16_t *)(const void *)b.data + k0 * NR;
}
static const uint16_t ZERO_TILE[AMX_TILE] __attribute__((aligned(64))); /* a pair's second panel past n */
#define STORED_AHEAD 2 /* blocks of 32 inputs ahead that a one-row product prefetches of the weight it reads */

/* the two B tiles of the column pair of panels pr (pair_panels) for the nb blocks of 32 inputs from k0 into t6 and
 * t7 (block i's at + i AMX_TILE): one block for a call of few rows, right before its products (in L1), every block
 * for more */
static void stored_pair(tile_source *ts, const panel_ref *pr, Py_ssize_t k0, int nb, uint16_t *t6, uint16_t *t7) {
    const int fmt = ts->w->fmt & ~WF_AMX;
    const Py_ssize_t k = ts->w->k;
    for (int h = 0; h < 2; h++) {
        uint16_t *d = h ? t7 : t6;
        if (!pr[h].rows) {
            memset(d, 0, (size_t)nb * AMX_TILE * sizeof(uint16_t));
        } else if (fmt == (WF_BF16 | WF_WORDS | WF_TILED)) { /* the tiles themselves */
            memcpy(d, bf16_tiled_block(pr[h], k0), (size_t)nb * AMX_TILE * sizeof(uint16_t));
        } else if (fmt == (WF_MXFP4 | WF_WORDS)) {
            bf16_tile_mxfp4_words(pr[h], k0, nb, d);
        } else if (fmt & WF_TILED) {
            mx_scales st = {.base = -8};
            for (int i = 0; i < nb; i++) {
                if (BASE(fmt) == WF_MXFP4) mxfp4_tiled_block(pr[h], k0 + (Py_ssize_t)i * AMX_K, d + i * AMX_TILE, &st);
                else fp8_tiled_block(pr[h], k0 + (Py_ssize_t)i * AMX_K, d + i * AMX_TILE);
            }
        } else {
            for (int i = 0; i < nb; i++) {
                const Py_ssize_t t = k0 + (Py_ssize_t)i * AMX_K;
                uint16_t *o = d + i * AMX_TILE;
                if (fmt == (WF_BF16 | WF_WORDS) && t + AMX_K <= k)
                    bf16_tile_bf16_words(pr[h], t, o);
                else if (fmt != (WF_FP8 | WF_WORDS) || t + AMX_K > k || !bf16_tile_fp8_words(pr[h], t, o))
                    ts->dec(pr[h], t, k, o);
            }
        }
    }
}

/* A block of 32 inputs of one row tile times the B tiles 6 and 7: its three pieces (a, a + bk, a + 2 bk; rows lda
 * bytes apart) into tiles 4, 5 and 3 (free then, so no piece's load waits on a product), each piece times both
 * column tiles into accumulators 0 and 1, hi then mid then lo */
__attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline void one_tile_block(const uint16_t *a,
                                                                                             Py_ssize_t bk,
                                                                                             Py_ssize_t lda) {
    _tile_loadd(4, a, lda);
    _tile_loadd(5, a + bk, lda);
    _tile_loadd(3, a + 2 * bk, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_dpbf16ps(0, 3, 6);
    _tile_dpbf16ps(1, 3, 7);
}

/* One block of r <= 32 rows x (ldx apart) times the column pairs [c0, c1) (columns 32 c0 to min(n, 32 c1)) of the
 * packed tiles wp, or of the stored rows src decoded block by block (BF16 tiled words: read in place): y rows ldy
 * apart, n columns. two: whether r > 16 (a second row tile: constant tile numbers need two loops). The rows' three
 * pieces are in buf as split3 writes them (presplit), or are split into it here: all their inputs first where the
 * block has several column pairs (each pair reuses the split) or its pieces fit AMX_SPLIT_L1, or else, for one pair,
 * each block of 32 inputs into one half of buf while the products of the block before run on the other (buf stays in
 * L1). Every output gets the same tile operations in the same order. Tile config set by the caller. */
__attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline void
amx_block(const int two, int r, const float *x, Py_ssize_t ldx, Py_ssize_t k, Py_ssize_t kp, uint16_t *buf,
          int presplit, const uint16_t *wp, tile_source *src, float *y, Py_ssize_t ldy, Py_ssize_t n, Py_ssize_t c0,
          Py_ssize_t c1) {
    const int narrow = !presplit && c1 - c0 == 1 && (Py_ssize_t)r * 3 * kp * 2 > AMX_SPLIT_L1;
    const Py_ssize_t bk = narrow ? AMX_K : kp; /* inputs of a piece of a row in buf */
    const Py_ssize_t lda = 3 * bk * 2, second = (Py_ssize_t)AMX_ROWS * 3 * bk;
    const Py_ssize_t half = AMX_BLOCK * 3 * AMX_K; /* one block of inputs of the rows, split (one column pair) */
    const int in_place = src && (src->w->fmt & ~WF_AMX) == (WF_BF16 | WF_WORDS | WF_TILED);
    float part[AMX_BLOCK * 32];
    if (!narrow && !presplit) split3(x, ldx, r, k, kp, buf);
    for (Py_ssize_t n0 = c0 * 32; n0 < n && n0 < c1 * 32; n0 += 32) {
        const uint16_t *b0 = wp + (n0 / 16) * kp * 16, *b1 = b0 + kp * 16;
        panel_ref pr[2];
        if (src) pair_panels(src->w, n0, pr);
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        if (narrow) split3(x, ldx, r, k < AMX_K ? k : AMX_K, AMX_K, buf);
        for (Py_ssize_t k0 = 0; k0 < kp; k0 += AMX_K) {
            const uint16_t *a = narrow ? buf + k0 / AMX_K % 2 * half : buf + k0, *t6 = b0 + k0 * 16, *t7 = b1 + k0 * 16;
            if (in_place) { /* BF16 tiled words: this block's two tiles read where they are stored */
                t6 = bf16_tiled_block(pr[0], k0);
                t7 = pr[1].rows ? bf16_tiled_block(pr[1], k0) : ZERO_TILE;
            } else if (src) { /* stored rows: this block's two tiles, decoded into src->blk */
                t6 = src->blk, t7 = src->blk + AMX_TILE;
                stored_pair(src, pr, k0, 1, (uint16_t *)t6, (uint16_t *)t7);
            }
            /* tiles read where they lie: those of the block STORED_AHEAD on fetched meanwhile */
            if ((!src || in_place) && k0 + STORED_AHEAD * AMX_K < kp)
                for (int l = 0; l < AMX_TILE * 2; l += 64) {
                    _mm_prefetch((const char *)(t6 + STORED_AHEAD * AMX_TILE) + l, _MM_HINT_T0);
                    if (t7 != ZERO_TILE) _mm_prefetch((const char *)(t7 + STORED_AHEAD * AMX_TILE) + l, _MM_HINT_T0);
                }
            _tile_loadd(6, t6, 64);
            _tile_loadd(7, t7, 64);
            if (two) {
                for (int p = 0; p < 3; p++) {
                    _tile_loadd(4, a + p * bk, lda);
                    _tile_loadd(5, a + second + p * bk, lda);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            } else {
                one_tile_block(a, bk, lda);
            }
            if (narrow && k0 + AMX_K < kp) /* the next block of inputs into the other half, while these products run */
                split3(x + k0 + AMX_K, ldx, r, k - k0 - AMX_K < AMX_K ? k - k0 - AMX_K : AMX_K, AMX_K,
                       buf + (k0 / AMX_K + 1) % 2 * half);
        }
        const int full = n0 + 32 <= n;
        float *o = full ? y + n0 : part;
        const Py_ssize_t ldo = full ? ldy : 32;
        _tile_stored(0, o, ldo * 4);
        _tile_stored(1, o + 16, ldo * 4);
        if (two) {
            _tile_stored(2, o + AMX_ROWS * ldo, ldo * 4);
            _tile_stored(3, o + AMX_ROWS * ldo + 16, ldo * 4);
        }
        if (!full)
            for (int i = 0; i < r; i++) memcpy(y + i * ldy + n0, part + i * 32, (n - n0) * sizeof(float));
    }
}

/* amx_block's products for r <= 16 rows of tiled words (WF_TILED: FP8, or MXFP4 where mx), in a
 * loop of their own: all the rows' inputs split into buf first, then for each column pair and block of 32 inputs
 * the two panels' tiles decoded into src->blk (the words STORED_AHEAD blocks on fetched meanwhile) and the same six
 * products in the same order. A loop this small keeps the decode's stores, the tile loads and the products close
 * (amx_block's general one is ~1.3x slower at one row). */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vbmi,avx2"), always_inline)) static inline void
amx_stored_rows(const int mx, int r, const float *x, Py_ssize_t ldx, Py_ssize_t k, Py_ssize_t kp, uint16_t *buf,
                tile_source *src, float *y, Py_ssize_t ldy, Py_ssize_t n, Py_ssize_t c0, Py_ssize_t c1) {
    const Py_ssize_t lda = 3 * kp * 2;
    uint16_t *blk = src->blk;
    const Py_ssize_t ahead = STORED_AHEAD * AMX_K * NR / (mx ? 2 : 1), bytes = AMX_K * NR / (mx ? 2 : 1);
    float part[AMX_ROWS * 32];
    split3(x, ldx, r, k, kp, buf);
    for (Py_ssize_t n0 = c0 * 32; n0 < n && n0 < c1 * 32; n0 += 32) {
        panel_ref pr[2];
        pair_panels(src->w, n0, pr);
        if (!pr[1].rows) memset(blk + AMX_TILE, 0, AMX_TILE * sizeof(uint16_t));
        mx_scales st[2] = {{.base = -8}, {.base = -8}};
        _tile_zero(0);
        _tile_zero(1);
        for (Py_ssize_t k0 = 0; k0 < kp; k0 += AMX_K) {
            for (int h = 0; h < 2; h++) {
                if (!pr[h].rows) continue;
                const char *at = (const char *)word_at(src->w->fmt, pr[h], k0) + ahead;
                if (k0 + STORED_AHEAD * AMX_K < kp)
                    for (Py_ssize_t l = 0; l < bytes; l += 64) _mm_prefetch(at + l, _MM_HINT_T0);
                if (mx)
                    mxfp4_tiled_block(pr[h], k0, blk + h * AMX_TILE, &st[h]);
                else
                    fp8_tiled_block(pr[h], k0, blk + h * AMX_TILE);
            }
            _tile_loadd(6, blk, 64);
            _tile_loadd(7, blk + AMX_TILE, 64);
            one_tile_block(buf + k0, kp, lda);
        }
        const int full = n0 + 32 <= n;
        float *o = full ? y + n0 : part;
        const Py_ssize_t ldo = full ? ldy : 32;
        _tile_stored(0, o, ldo * 4);
        _tile_stored(1, o + 16, ldo * 4);
        if (!full)
            for (int i = 0; i < r; i++) memcpy(y + i * ldy + n0, part + i * 32, (n - n0) * sizeof(float));
    }
}

/* amx_stored_rows for each format, each its own loop (one loop for both is ~15% slower on FP8) */
#define STORED_ROWS(NAME, MX)                                                                                      \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vbmi,avx2"), noclone)) static void NAME(        \
        int r, const float *x, Py_ssize_t ldx, Py_ssize_t k, Py_ssize_t kp, uint16_t *buf, tile_source *src,        \
        float *y, Py_ssize_t ldy, Py_ssize_t n, Py_ssize_t c0, Py_ssize_t c1) {                                     \
        amx_stored_rows(MX, r, x, ldx, k, kp, buf, src, y, ldy, n, c0, c1);                                        \
    }
STORED_ROWS(amx_fp8_rows, 0)
STORED_ROWS(amx_mxfp4_rows, 1)
#undef STORED_ROWS

static __thread void *split_buf, *pair_buf; /* thread_buffer's: the split rows, a column pair's decoded tiles */
static __thread size_t split_cap, pair_cap;

/* the row blocks of x (ldx apart; presplit: split_buf holds their pieces already) times the column pairs [c0, c1) of
 * the packed tiles wp or of the stored rows src, y's rows ldy apart; the tile configuration of the block shape *shape
 * set here where it changes */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_rows(const float *xp, Py_ssize_t ldx, int presplit,
                                                                 const uint16_t *wp, tile_source *src, float *yp,
                                                                 Py_ssize_t ldy, Py_ssize_t m, Py_ssize_t k,
                                                                 Py_ssize_t kp, Py_ssize_t n, Py_ssize_t c0,
                                                                 Py_ssize_t c1, int *shape) {
    for (Py_ssize_t i = 0; i < m; i += AMX_BLOCK) {
        const int r = m - i < AMX_BLOCK ? (int)(m - i) : AMX_BLOCK;
        if (r != *shape) {
            tile_config c;
            memset(&c, 0, sizeof c);
            c.palette = 1;
            const int r0 = r < AMX_ROWS ? r : AMX_ROWS, r1 = r - r0;
            c.rows[0] = c.rows[1] = c.rows[4] = (uint8_t)r0; /* C of the first row tile, its A */
            c.rows[2] = c.rows[3] = c.rows[5] = (uint8_t)(r1 ? r1 : 1);
            if (!r1) c.rows[3] = c.rows[5] = (uint8_t)r0; /* one row tile: 3 and 5 hold its A's other pieces */
            c.rows[6] = c.rows[7] = AMX_K / 2; /* B: pairs of inputs */
            for (int t = 0; t < 8; t++) c.colsb[t] = 64;
            _tile_loadconfig(&c);
            *shape = r;
        }
        uint16_t *buf = (uint16_t *)split_buf + (presplit ? i * 3 * kp : 0);
        if (src && r <= AMX_ROWS && (src->w->fmt & WF_TILED) && BASE(src->w->fmt) == WF_FP8)
            amx_fp8_rows(r, xp + i * ldx, ldx, k, kp, buf, src, yp + i * ldy, ldy, n, c0, c1);
        else if (src && r <= AMX_ROWS && (src->w->fmt & WF_TILED) && BASE(src->w->fmt) == WF_MXFP4)
            amx_mxfp4_rows(r, xp + i * ldx, ldx, k, kp, buf, src, yp + i * ldy, ldy, n, c0, c1);
        else if (r > AMX_ROWS)
            amx_block(1, r, xp + i * ldx, ldx, k, kp, buf, presplit, wp, src, yp + i * ldy, ldy, n, c0, c1);
        else
            amx_block(0, r, xp + i * ldx, ldx, k, kp, buf, presplit, wp, src, yp + i * ldy, ldy, n, c0, c1);
    }
}

/* y = x @ w for the column pairs [c0, c1) (columns 32 c0 to min(n, 32 c1)), w the packed tiles wp or, where src is
 * not NULL, stored rows decoded into the same tiles (checked arguments, amx_supported()), y's rows ldy apart; runs
 * without the GIL, on the calling thread (its own tile configuration and buffers). Stored rows are decoded block by
 * block inside the products for one block of rows (a decode step's); for more, the rows are split once a group that
 * stays in L2 (AMX_SPLIT), and each column pair decoded once a group into pair_buf. Returns 1 if a buffer cannot be
 * had (nothing computed). */
__attribute__((target("amx-tile,amx-bf16"))) static int linear_bf16_range(const float *xp, Py_ssize_t ldx,
                                                                         const uint16_t *wp, const weight_ref *src,
                                                                         float *yp, Py_ssize_t ldy, Py_ssize_t m,
                                                                         Py_ssize_t k, Py_ssize_t n, Py_ssize_t c0,
                                                                         Py_ssize_t c1) {
    const Py_ssize_t kp = (k + AMX_K - 1) / AMX_K * AMX_K, piece_row = 3 * kp * (Py_ssize_t)sizeof(uint16_t);
    const int grouped = src && m > AMX_BLOCK;
    /* rows split a group at a time (grouped: a multiple of AMX_BLOCK), else a block's inputs (several column pairs)
     * or two blocks of 32 of them (one pair) */
    const Py_ssize_t group = AMX_SPLIT / piece_row / AMX_BLOCK * AMX_BLOCK > AMX_BLOCK
                                 ? AMX_SPLIT / piece_row / AMX_BLOCK * AMX_BLOCK : AMX_BLOCK;
    const Py_ssize_t split_rows = grouped ? (m < group ? m : group) : AMX_BLOCK;
    if (!thread_buffer(&split_buf, &split_cap,
                       (size_t)split_rows * 3 * (kp > 2 * AMX_K ? kp : 2 * AMX_K) * sizeof(uint16_t)))
        return 1;
    int shape = -1; /* the rows of the configured block */
    tile_source ts;
    if (src) tile_source_of(&ts, src);
    if (grouped) {
        uint16_t *pairs = thread_buffer(&pair_buf, &pair_cap, (size_t)kp * 32 * sizeof(uint16_t));
        if (!pairs) return 1;
        for (Py_ssize_t i = 0; i < m; i += group) {
            const Py_ssize_t mg = m - i < group ? m - i : group;
            split3(xp + i * ldx, ldx, (int)mg, k, kp, (uint16_t *)split_buf);
            for (Py_ssize_t c = c0; c < c1; c++) {
                panel_ref pr[2];
                pair_panels(src, 32 * c, pr);
                stored_pair(&ts, pr, 0, (int)(kp / AMX_K), pairs, pairs + kp * 16); /* pack_bf16's pair */
                amx_rows(xp + i * ldx, ldx, 1, pairs, NULL, yp + i * ldy + 32 * c, ldy, mg, k, kp,
                         n - 32 * c < 32 ? n - 32 * c : 32, 0, 1, &shape);
            }
        }
    } else {
        amx_rows(xp, ldx, 0, wp, src ? &ts : NULL, yp, ldy, m, k, kp, n, c0, c1, &shape);
    }
    _tile_release();
    return 0;
}

typedef struct {
    const float *x;
    Py_ssize_t ldx, ldy, m, k, n;
    const uint16_t *w;
    const weight_ref *src;
    float *y;
    grid g;
    int bad; /* a part could not have its buffers */
} bf16_job;

/* linear_bf16_range for the column pairs [u0, u1), a run a group of stored rows */
static int bf16_units(const float *xp, Py_ssize_t ldx, const uint16_t *wp, const weight_ref *src, float *yp,
                      Py_ssize_t ldy, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t u0, Py_ssize_t u1) {
    int bad = 0;
    for (Py_ssize_t e; u0 < u1; u0 = e) {
        e = src ? units_end(src, u0, u1, 32) : u1;
        bad |= linear_bf16_range(xp + (src ? group_x(src, u0 * 32) : 0), ldx, wp, src, yp, ldy, m, k, n, u0, e);
    }
    return bad;
}

static void bf16_part(void *c, int64_t b, int64_t e) {
    bf16_job *j = c;
    Py_ssize_t r0, mr, u0, u1;
    while (grid_next(&j->g, j->m, &b, e, &r0, &mr, &u0, &u1))
        if (bf16_units(j->x + r0 * j->ldx, j->ldx, j->w, j->src, j->y + r0 * j->ldy, j->ldy, mr, j->k, j->n, u0, u1))
            j->bad = 1;
}

/* y [m, n] = x @ w (the packed tiles wp, or the stored rows src): linear_bf16_range over every column pair (rows in
 * chunks of AMX_BLOCK where the pairs are few), on the kernels' pool where the product is big enough; y's rows ldy
 * apart; 1 if a buffer could not be had. */
static int linear_bf16(const float *xp, Py_ssize_t ldx, const uint16_t *wp, const weight_ref *src, float *yp,
                       Py_ssize_t ldy, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    const Py_ssize_t pairs = (n + 31) / 32;
    const grid g = grid_of(m, pairs, (double)m * (double)k * (double)n, AMX_BLOCK, TILE_UNITS_A_THREAD);
    if (g.parts <= 1) return bf16_units(xp, ldx, wp, src, yp, ldy, m, k, n, 0, pairs);
    bf16_job j = {xp, ldx, ldy, m, k, n, wp, src, yp, g, 0};
    parallel_run(g.items, g.parts, bf16_part, &j);
    return j.bad;
}
#endif

#define LINEAR_BF16_FIELDS(X)                                                                                  \
    X(ADDR, x, "[m, k] float32, rows ldx floats apart")                                                        \
    X(SIZE, ldx, "floats between two rows of x (>= k)")                                                        \
    X(ADDR, w, "the weight's bfloat16 tiles [ceil(n / 32) * 2, ceil(k / 32) * 16, 16, 2]")                     \
    X(ADDR, y, "[m, n] float32, contiguous, written")                                                          \
    X(SIZE, m, "rows")                                                                                         \
    X(SIZE, k, "inputs (>= 1)")                                                                                \
    X(SIZE, n, "outputs")
KERNEL_ARGS(linear_bf16, LINEAR_BF16_FIELDS,
            "y [m, n] = x @ w on AMX tiles, w every value a bfloat16, x split exactly in three bfloat16 pieces (AMX "
            "CPUs only).")
#if HAVE_X86_AVX2 && defined(__linux__)
static void run_linear_bf16(const struct linear_bf16_args *a) { /* no buffer (out of memory): y all NaN */
    if (linear_bf16(CF(a->x), a->ldx, (const uint16_t *)(uintptr_t)a->w, NULL, F(a->y), a->n, a->m, a->k, a->n))
        for (Py_ssize_t i = 0; i < a->m * a->n; i++) F(a->y)[i] = NAN;
}
RAW_ENTRY(linear_bf16)
#endif
KERNEL_PY(linear_bf16) {
    PARSE(linear_bf16);
    if (!amx_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "linear_bf16: this CPU or kernel gives no AMX-BF16 (amx_supported() is "
                        "False)");
        return NULL;
    }
    if (a.m < 0 || a.k < 1 || a.n < 0 || a.ldx < a.k || (a.m && a.n && (!a.x || !a.w || !a.y))) {
        PyErr_Format(PyExc_ValueError, "linear_bf16: m %zd, k %zd, n %zd, ldx %zd do not fit (k at least 1, ldx >= k, "
                     "non-null addresses)", (Py_ssize_t)a.m, (Py_ssize_t)a.k, (Py_ssize_t)a.n, (Py_ssize_t)a.ldx);
        return NULL;
    }
    int bad = 0;
#if HAVE_X86_AVX2 && defined(__linux__)
    Py_BEGIN_ALLOW_THREADS
    if (a.m && a.n)
        bad = linear_bf16(CF(a.x), a.ldx, (const uint16_t *)(uintptr_t)a.w, NULL, F(a.y), a.n, a.m, a.k, a.n);
    Py_END_ALLOW_THREADS
#endif
    if (bad) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_set_mx_proof(PyObject *Py_UNUSED(self), PyObject *on) {
    const int was = mx_proof, v = PyObject_IsTrue(on);
    if (v < 0) return NULL;
    mx_proof = v;
    return PyBool_FromLong(was);
}

static PyObject *py_amx_supported(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyBool_FromLong(amx_supported());
}

/* V4.1's routed experts over their grouped rows (see the header): per expert with rows, its w1/w3 product,
 * the clamped SwiGLU, its w2 product; returns 1 if the counts exceed the rows (nothing computed). */
CLONES static void swiglu_rows(const float *restrict h, Py_ssize_t rows, Py_ssize_t inter, float limit,
                               float *restrict g) {
    for (Py_ssize_t r = 0; r < rows; r++)
        for (Py_ssize_t j = 0; j < inter; j++)
            g[r * inter + j] = swiglu_value(h[r * 2 * inter + j], h[r * 2 * inter + inter + j], limit);
}

/* y = x [m, k] (contiguous) @ the weight at address w (scales s) in format fmt for the output units [u0, u1), y's
 * rows ldy apart: its bfloat16 tiles by linear_bf16_range (WF_TILES, units of 32 columns; 1 if it cannot have its
 * buffer), else its panels (WF_F32, WF_MXFP4 as stored, units of 16 columns) by linear_panels_range at block size kc */
static int product_range(const int fmt, const float *x, int64_t w, int64_t s, float *y, Py_ssize_t ldy, Py_ssize_t m,
                         Py_ssize_t k, Py_ssize_t n, Py_ssize_t kc, int simd, Py_ssize_t u0, Py_ssize_t u1) {
#if HAVE_X86_AVX2 && defined(__linux__)
    if (fmt == WF_TILES) return linear_bf16_range(x, k, (const uint16_t *)(uintptr_t)w, NULL, y, ldy, m, k, n, u0, u1);
#endif
    const weight_ref wr = {fmt, (const void *)(uintptr_t)w, (const void *)(uintptr_t)s, k, n, 0, 0};
#if HAVE_X86_AVX2 && defined(__linux__)
    if (fmt & WF_AMX) return linear_bf16_range(x, k, NULL, &wr, y, ldy, m, k, n, u0, u1);
#endif
    linear_panels_range(&wr, x, k, y, ldy, m, kc, simd, u0, u1);
    return 0;
}

#define EXPERT_WEIGHT_ROWS 2 /* an item's cost in rows for reading its weights (the partition's balance only) */

/* One product of every expert with rows (w1/w3, or w2), as items (expert a, output unit u), item a * units + u,
 * on the pool in contiguous ranges of about equal cost (an item's rows + EXPERT_WEIGHT_ROWS: balanced_bounds). With
 * MXFP4 as stored, w1 (w, s) and w3 (w3, s3) are two weights of n / 2 outputs each: units [0, half) are w1's, the
 * rest w3's, into the columns [n / 2, n) of y. */
typedef struct {
    int fmt, simd, bad;
    const float *x;                 /* the product's input rows, grouped by expert */
    Py_ssize_t k, n, kc, units;
    const int64_t *w, *s;           /* [e] each expert's weight (scales) address */
    float *y;
    const Py_ssize_t *ex, *start;   /* [na] the experts with rows and their first row; start[na] = all rows */
    const int64_t *w3, *s3;         /* [e] w3's, where w is w1 alone (else NULL) */
    Py_ssize_t half;                /* the units of w1 alone (0: one weight) */
} experts_job;

/* the items [b, e): one range call per expert they touch */
static void experts_part(void *c, int64_t b, int64_t e) {
    experts_job *j = c;
    for (int64_t it = b; it < e;) {
        const Py_ssize_t a = (Py_ssize_t)(it / j->units), u0 = (Py_ssize_t)(it % j->units);
        const Py_ssize_t u1 = u0 + (e - it) < j->units ? u0 + (Py_ssize_t)(e - it) : j->units;
        const Py_ssize_t x = j->ex[a], r0 = j->start[a], rows = j->start[a + 1] - r0;
        const float *xa = j->x + r0 * j->k;
        float *ya = j->y + r0 * j->n;
        if (!j->half) {
            if (product_range(j->fmt, xa, j->w[x], j->s ? j->s[x] : 0, ya, j->n, rows, j->k, j->n, j->kc, j->simd, u0,
                              u1))
                j->bad = 1;
        } else { /* w1's units, then w3's (into the second half of y's columns) */
            const Py_ssize_t h = j->half, n2 = j->n / 2;
            if (u0 < h && product_range(j->fmt, xa, j->w[x], j->s[x], ya, j->n, rows, j->k, n2, j->kc, j->simd, u0,
                                        u1 < h ? u1 : h))
                j->bad = 1;
            if (u1 > h && product_range(j->fmt, xa, j->w3[x], j->s3[x], ya + n2, j->n, rows, j->k, n2, j->kc, j->simd,
                                        (u0 > h ? u0 : h) - h, u1 - h))
                j->bad = 1;
        }
        it += u1 - u0;
    }
}

static double expert_item_cost(const void *c, int64_t it) {
    const experts_job *j = c;
    const Py_ssize_t a = (Py_ssize_t)(it / j->units);
    return (double)(j->start[a + 1] - j->start[a] + EXPERT_WEIGHT_ROWS);
}

/* Run job j over na experts; 1 if a product could not have its buffer. */
static int experts_product(experts_job *j, Py_ssize_t na) {
    const Py_ssize_t rows = j->start[na], items = na * j->units;
    j->bad = 0;
    parallel_balanced(items, pool_parts(items, (double)rows * (double)j->k * (double)j->n), expert_item_cost, j,
                      experts_part, j);
    return j->bad;
}

typedef struct {
    const float *h;
    Py_ssize_t inter;
    float limit, *g;
} swiglu_job;

static void swiglu_part(void *c, int64_t b, int64_t e) {
    const swiglu_job *j = c;
    swiglu_rows(j->h + b * 2 * j->inter, e - b, j->inter, j->limit, j->g + b * j->inter);
}

/* The pages of [address, address + bytes) read ahead (madvise MADV_WILLNEED, a hint whose failure changes nothing):
 * for a file's map the kernel queues the reads of them all at once, where the products' page faults would read them
 * one window at a time (measured 4.6x the rate from this VM's disk, docs/benchmarks.md). From the first page not
 * resident on (mincore: 2.5 us over 3.3 MB resident, where the advice walks them in 23 us) */
static void will_need(int64_t address, size_t bytes) {
#if defined(__unix__) && defined(MADV_WILLNEED)
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)address & ~(page - 1);
    const size_t len = (size_t)((uintptr_t)address + bytes - a);
    unsigned char in[256];
    for (size_t o = 0; o < len; o += sizeof in * page) {
        const size_t n = len - o < sizeof in * page ? len - o : sizeof in * page;
        int resident = mincore((void *)(a + o), n, in) == 0;
        for (size_t i = 0; resident && i < (n + page - 1) / page; i++) resident = in[i] & 1;
        if (!resident) {
            (void)madvise((void *)(a + o), len - o, MADV_WILLNEED);
            return;
        }
    }
#else
    (void)address, (void)bytes;
#endif
}

/* MXFP4 as stored: the codes and scales of the na experts ex with rows read ahead, w1's and w3's before w2's, in the
 * order the products take them */
static void prefetch_experts(const Py_ssize_t *ex, Py_ssize_t na, Py_ssize_t d, Py_ssize_t inter, const int64_t *p13,
                             const int64_t *s13, const int64_t *p3, const int64_t *s3, const int64_t *p2,
                             const int64_t *s2) {
    const size_t codes = (size_t)d * (size_t)inter / 2, scales = (size_t)d * (size_t)inter / MX_G; /* each matrix */
    for (Py_ssize_t i = 0; i < na; i++) {
        will_need(p13[ex[i]], codes), will_need(s13[ex[i]], scales);
        will_need(p3[ex[i]], codes), will_need(s3[ex[i]], scales);
    }
    for (Py_ssize_t i = 0; i < na; i++) will_need(p2[ex[i]], codes), will_need(s2[ex[i]], scales);
}

/* V4.1's routed experts (see the header): the w1/w3 products of every expert with rows, the clamped SwiGLU of every
 * row, the w2 products: three jobs on the kernels' pool, items (expert, output panel) and rows, never inside a sum.
 * prefetch: MXFP4 as stored, read ahead first (prefetch_experts). Returns 1 if the counts exceed the rows (nothing
 * computed), 2 if a buffer could not be had. */
static int moe_experts(const int fmt, const float *xs, Py_ssize_t rows, const int64_t *counts, Py_ssize_t e,
                       Py_ssize_t d, Py_ssize_t inter, const int64_t *p13, const int64_t *s13, const int64_t *p3,
                       const int64_t *s3, Py_ssize_t kc13, const int64_t *p2, const int64_t *s2, Py_ssize_t kc2,
                       float limit, float *h, float *g, float *ys, int simd, int prefetch) {
    int64_t total = 0;
    for (Py_ssize_t x = 0; x < e; x++) {
        if (counts[x] < 0) return 1;
        total += counts[x];
    }
    if (total > rows) return 1;
    Py_ssize_t *ex = malloc(sizeof(Py_ssize_t) * (size_t)(2 * e + 1));
    if (!ex) return 2;
    Py_ssize_t *start = ex + e, na = 0;
    start[0] = 0;
    for (Py_ssize_t x = 0; x < e; x++)
        if (counts[x]) ex[na] = x, start[na + 1] = start[na] + (Py_ssize_t)counts[x], na++;
    if (prefetch && BASE(fmt) == WF_MXFP4 && !(fmt & WF_WORDS))
        prefetch_experts(ex, na, d, inter, p13, s13, p3, s3, p2, s2);
    const Py_ssize_t unit = fmt == WF_TILES || (fmt & WF_AMX) ? 32 : NR; /* a pair of the tiles, a panel */
    const Py_ssize_t half = stored_rows(fmt) ? (inter + unit - 1) / unit : 0;
    experts_job j13 = {fmt, simd, 0, xs, d, 2 * inter, kc13, half ? 2 * half : (2 * inter + unit - 1) / unit, p13,
                       s13, h, ex, start, p3, s3, half};
    int bad = experts_product(&j13, na);
    if (!bad) {
        swiglu_job sj = {h, inter, limit, g};
        parallel_for_cost(total, (double)total * (double)inter * 16.0, swiglu_part, &sj);
        experts_job j2 = {fmt, simd, 0, g, inter, d, kc2, (d + unit - 1) / unit, p2, s2, ys, ex, start, NULL, NULL, 0};
        bad = experts_product(&j2, na);
    }
    free(ex);
    return bad ? 2 : 0;
}

#define MOE_EXPERTS_FIELDS(X)                                                                                  \
    X(ADDR, xs, "[rows, d] float32: the (token, expert) pairs grouped by expert")                              \
    X(SIZE, rows, "rows of xs")                                                                                \
    X(ADDR, counts, "[e] int64: the rows of each expert, in order")                                            \
    X(SIZE, e, "experts")                                                                                      \
    X(SIZE, d, "the model's width")                                                                            \
    X(SIZE, inter, "an expert's width")                                                                        \
    X(ADDR, panels13, "[e] int64: each expert's w1/w3 weight address ([2 inter] outputs)")                     \
    X(SIZE, kc13, "their block size (panels)")                                                                 \
    X(ADDR, panels2, "[e] int64: each expert's w2 weight address")                                             \
    X(SIZE, kc2, "its block size (panels)")                                                                    \
    X(REAL, limit, "the SwiGLU's clamp")                                                                       \
    X(ADDR, h, "[rows, 2 inter] float32 scratch")                                                              \
    X(ADDR, g, "[rows, inter] float32 scratch")                                                                \
    X(ADDR, ys, "[rows, d] float32, written")                                                                  \
    X(SIZE, simd, "linear_packed's simd: 0, 1 or 2 (unused with tiles)")                                       \
    X(OPTSIZE, format, "0 float32 panels, 1 bfloat16 tiles (as tiles=True), 2 MXFP4 as stored, 10 its codes "       \
                       "panel-major (panel_words); + 16 on the AMX tiles; 58 tiled words (panel_words tiled)")   \
    X(OPTADDR, scales13, "MXFP4: [e] int64, each expert's w1/w3 E8M0 scales' address (panels13: its codes)")       \
    X(OPTADDR, scales2, "MXFP4: [e] int64, each expert's w2 E8M0 scales' address")                             \
    X(OPTADDR, w3, "MXFP4 as stored: [e] int64, each expert's w3 codes' address (panels13: w1's, both [inter, d / 2])")\
    X(OPTADDR, scales3, "MXFP4 as stored: [e] int64, each expert's w3 E8M0 scales' address (scales13: w1's)")     \
    X(OPTFLAG, tiles, "the weight addresses are of bfloat16 tiles, multiplied by linear_bf16 (kc13, kc2 unused)")  \
    X(OPTFLAG, prefetch, "MXFP4 as stored (format 2 or 18): each expert with rows read ahead first (madvise "        \
                         "WILLNEED), for codes paged in from a file's map")
KERNEL_ARGS(moe_experts, MOE_EXPERTS_FIELDS,
            "V4.1's routed experts over rows grouped by expert: per expert its w1/w3 product, the clamped SwiGLU, its "
            "w2 product, into ys.")
KERNEL_PY(moe_experts) {
    PARSE(moe_experts);
    if (a.rows < 0 || a.e < 1 || a.d < 1 || a.inter < 1 || a.kc13 < 1 || a.kc2 < 1 || !a.counts || !a.panels13 ||
        !a.panels2 || (a.rows && (!a.xs || !a.h || !a.g || !a.ys))) {
        PyErr_Format(PyExc_ValueError, "moe_experts: rows %zd, %zd experts, d %zd, inter %zd, kc %zd / %zd do not fit",
                     (Py_ssize_t)a.rows, (Py_ssize_t)a.e, (Py_ssize_t)a.d, (Py_ssize_t)a.inter, (Py_ssize_t)a.kc13,
                     (Py_ssize_t)a.kc2);
        return NULL;
    }
    if (a.simd < 0 || a.simd > 2) {
        PyErr_Format(PyExc_ValueError, "moe_experts: simd is %zd, expected 0, 1 or 2", (Py_ssize_t)a.simd);
        return NULL;
    }
    const int fmt = a.tiles ? WF_TILES : (int)a.format;
    if (fmt != WF_F32 && fmt != WF_TILES && (BASE(fmt) != WF_MXFP4 || (fmt & ~(WF_WORDS | WF_AMX | WF_TILED)) != WF_MXFP4)) {
        PyErr_Format(PyExc_ValueError, "moe_experts: format %zd is not 0 (float panels), 1 (tiles), 2 (MXFP4 as "
                     "stored) or 10 (MXFP4 panel-major), the last two + 16 on the AMX tiles, 10 + 16 + 32 tiled words",
                     (Py_ssize_t)a.format);
        return NULL;
    }
    if (fmt == WF_TILES && !amx_supported()) {
        PyErr_SetString(PyExc_RuntimeError, "moe_experts: bfloat16 tiles (tiles=True or format 1) need "
                        "amx_supported()");
        return NULL;
    }
    if (BASE(fmt) == WF_MXFP4 && (!a.w3 || !a.scales3 || stored_misfit("moe_experts", fmt, a.d, a.kc13, 0) ||
                                 stored_misfit("moe_experts", fmt, a.inter, a.kc2, 0))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "moe_experts: MXFP4 as stored needs w3 and scales3");
        return NULL;
    }
    if (BASE(fmt) == WF_MXFP4 && (!a.scales13 || !a.scales2 || a.d % MX_G || a.inter % MX_G)) {
        PyErr_Format(PyExc_ValueError, "moe_experts: MXFP4 panels need scales13 and scales2, and d %zd and inter %zd "
                     "multiples of 32", (Py_ssize_t)a.d, (Py_ssize_t)a.inter);
        return NULL;
    }
    int bad;
    Py_BEGIN_ALLOW_THREADS
    bad = moe_experts(fmt, CF(a.xs), a.rows, CI64(a.counts), a.e, a.d, a.inter, CI64(a.panels13), CI64(a.scales13),
                      CI64(a.w3), CI64(a.scales3), a.kc13, CI64(a.panels2), CI64(a.scales2), a.kc2, (float)a.limit,
                      F(a.h), F(a.g), F(a.ys), (int)a.simd, (int)a.prefetch);
    Py_END_ALLOW_THREADS
    if (bad == 2) return PyErr_NoMemory();
    if (bad) {
        PyErr_Format(PyExc_ValueError, "moe_experts: the experts' row counts exceed the %zd rows (or one is negative)",
                     (Py_ssize_t)a.rows);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- raw entries (see _token_kernel.c `raw_kernels`): a replay's call from its argument struct ---- */

static const struct arg_spec *const SPECS[] = {&linear_packed_spec, &linear_stored_spec,
                                               &linear_fp8_spec,    &linear_bf16_spec,  &blas_mm_spec,
                                               &moe_experts_spec,   &decode_formats_spec, &panel_words_spec};

static PyObject *py_raw_kernels(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    PyObject *out = PyDict_New();
    if (out && add_raw(out, &linear_packed_spec, raw_linear_packed) < 0) Py_CLEAR(out);
    if (out && add_raw(out, &linear_stored_spec, raw_linear_stored) < 0) Py_CLEAR(out);
#if HAVE_X86_AVX2
    if (out && fp8_supported() && add_raw(out, &linear_fp8_spec, raw_linear_fp8) < 0) Py_CLEAR(out);
#endif
#if HAVE_X86_AVX2 && defined(__linux__)
    if (out && amx_supported() && add_raw(out, &linear_bf16_spec, raw_linear_bf16) < 0) Py_CLEAR(out);
#endif
    return out;
}

static PyObject *py_kernel_fields(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return kernel_fields_of(SPECS, sizeof SPECS / sizeof SPECS[0]);
}

static PyObject *py_spin_adds(PyObject *Py_UNUSED(self), PyObject *arg) {
    const long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    unsigned long long x = 0, one = 1; /* register adds: a core may fold adds of an immediate at rename */
    Py_BEGIN_ALLOW_THREADS
    for (long long i = 0; i < n; i++)
        __asm__ volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                         "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0" : "+r"(x) : "r"(one));
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(x);
#else
    Py_RETURN_NONE;
#endif
}

static PyObject *py_simd_level(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    int level = 0;
#if HAVE_X86_AVX2
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        level = __builtin_cpu_supports("avx512f") ? 2 : 1;
#endif
    return PyLong_FromLong(level);
}

static PyMethodDef methods[] = {
    {"spin_adds", py_spin_adds, METH_O, "spin_adds(n) -> 8 n, after 8 n dependent integer adds (None off x86-64)."},
    {"simd_level", py_simd_level, METH_NOARGS,
     "simd_level() -> the SIMD level of this CPU's tiles: 0 portable, 1 AVX2, 2 AVX-512 (what simd 2 runs at)."},
    KERNEL_METHOD(linear_packed),
    KERNEL_METHOD(linear_stored),
    KERNEL_METHOD(decode_formats),
    KERNEL_METHOD(panel_words),
    KERNEL_METHOD(linear_fp8),
    KERNEL_METHOD(linear_bf16),
    {"amx_supported", py_amx_supported, METH_NOARGS,
     "amx_supported() -> whether linear_bf16 runs here (AMX-BF16, AVX-512, the tile data granted by the kernel)."},
    {"set_mx_proof", py_set_mx_proof, METH_O,
     "set_mx_proof(on) -> the previous setting: whether MXFP4's scaled accumulators are taken only where proven "
     "exact (on, the default; off is a negative control for tests)."},
    {"fp8_supported", py_fp8_supported, METH_NOARGS, "fp8_supported() -> whether linear_fp8 runs on this CPU."},
    {"raw_kernels", py_raw_kernels, METH_NOARGS,
     "raw_kernels() -> {name: (((field, kind), ...), raw entry address)}: the kernels a CPU graph's replay runs from "
     "their argument structs (one 64-bit slot a field)."},
    {"kernel_fields", py_kernel_fields, METH_NOARGS,
     "kernel_fields() -> {name: ((field, kind), ...)}: every kernel's arguments in order; each takes them by "
     "position or by name."},
    KERNEL_METHOD(blas_mm),
    KERNEL_METHOD(moe_experts),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_linear_kernel",
    "CPU matmuls in a fixed accumulation order (float32 panels, FP8 panels, bfloat16 AMX tiles), the BLAS call "
    "torch makes, and the MoE's routed experts, for model/exactness.py.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__linear_kernel(void) {
    set_docs(methods, SPECS, sizeof SPECS / sizeof SPECS[0]);
#if HAVE_X86_AVX2 && defined(__linux__)
    fp8_scaled_init();
#endif
    pool_import();
    return PyModule_Create(&module);
}
