/* Paged attention over the KV pool, one query at a time (model/attention_kernels.py, `attend_native`).
 *
 * Every query is computed alone, by the same operations in the same order whatever else is in the
 * call: its scores over its own keys in position order, their max, exp of each minus the max, the sum
 * and the value accumulation in position order, one division. So a query's bits depend only on its
 * own q, its own keys and values, and its position: not on the batch, the cut, the chunk or padding
 * (docs/contract.md §9), with no padding rule to keep. The same holds for index selection and for attention over
 * a selection.
 *
 * Isolation (docs/contract.md §9) is structural: a query at absolute position p of row r reads key positions
 * 0..p only (p < seq_len[r]), each through row r's block table; a position whose block is null reads
 * the pool's zero slot. No key it may not read is ever loaded, so nothing needs masking, and a
 * non-finite value reaches exactly the queries that read it.
 *
 * Plain CPython C API; the arrays come as addresses (torch's `data_ptr()`), checked by the one caller
 * (`attend_native` in attention_kernels.py: dtypes, device, strides, shapes); the kernel checks sizes.
 *
 *   attend(mode, q, ldq, k, v, ld_head, tables, ld_table, width, block_size, zero_slot, num_slots,
 *          qsl, computed, rows, num_tokens, heads, kv_heads, head_dim, scale, out, sel, topk) -> None
 *     mode 0 (full): every visible key; 1 (select): choose each query's `topk` keys into sel, then
 *     attend to them; 2 (reuse): attend to the keys already in sel.
 *     q [T, heads, head_dim] float32, head rows contiguous, tokens ldq floats apart;
 *     k, v: one layer's pools [kv_heads, slots, head_dim] float32, heads ld_head floats apart;
 *     tables [rows, width] int64 (ld_table apart), -1 = null block, every other block within the pool's
 *     num_slots slots (else ValueError, nothing read); qsl [rows + 1], computed [rows] int64;
 *     out [T, heads * head_dim] float32 contiguous: written for every token, 0 for padding tokens
 *     (t >= qsl[rows]); sel [T, topk] int64 contiguous (modes 1, 2): absolute key positions best first,
 *     -1 = none (written by mode 1 for every token).
 *     Selection: score = (sum over heads in head order of q_h . k) / heads; the `topk` highest, ties to
 *     the lower position, a NaN score above every number.
 *
 *   rotate_store(qkv, num_tokens, heads, kv_heads, head_dim, cos, sin, slot_mapping, k, v, ld_head, num_slots)
 *     qkv [T, heads + 2 kv_heads, head_dim] float32 contiguous (q heads, k heads, v heads): the q and k
 *     heads rotated in place, x * cos + swap_halves(x) * sin with cos, sin [T, head_dim] (rotary_cos_sin's
 *     tables: the same two products and one sum per value as model/layers.py apply_rotary, so the same
 *     bits); then every token's rotated k and its v stored at slot_mapping[t] of the pools (slot < 0:
 *     nowhere; a slot >= num_slots is an error).
 *   The GIL is released during the arithmetic.
 *
 * Test hooks, not part of the module: the same shared object holds a second module,
 * `_attention_hooks` (PyInit__attention_hooks), which only tests load (tests/kernel_hooks.py, from this
 * file's path, so it shares this file's statics). Its `set_leaks(read_past, later_keys)` switches the
 * isolation off for the negative controls of the isolation tests: read_past reads that many positions
 * past the query; later_keys reads the row's later keys of this step too, each weighted 0 (a product,
 * as a masked dense kernel would). Both are 0 unless a test sets them.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation is the IEEE one written, in
 * every clone below; exp is `exp_fixed` (_kernel_math.h), the same operations for every element.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernel_math.h"

/* Keys and values are read from the pool in DRAM-sized hops (a row's blocks lie anywhere): the key of
 * PREFETCH positions ahead and the value of this position are requested early. No effect on results. */
#define PREFETCH 8
static inline __attribute__((always_inline)) void prefetch_row(const float *p, Py_ssize_t hd) {
    for (Py_ssize_t i = 0; i < hd; i += 16) __builtin_prefetch(p + i);
}

typedef struct {
    const float *q, *k, *v;
    Py_ssize_t ldq, ld_head, heads, kvh, hd;
    float scale;
} Attn;

/* The largest non-NaN x[j], j < n (-inf if none), through 8 running maxima (x > m ? x : m, lane j % 8)
 * then the 8 in order: the same value as one running maximum in j order, up to the sign of a zero
 * maximum, which changes no exp(x - max) (x - (+0) and x - (-0) are equal but for x = -0, where both
 * exps are 1). */
static inline __attribute__((always_inline)) float max_of(const float *restrict x, Py_ssize_t n) {
    float m[8];
    for (int l = 0; l < 8; l++) m[l] = -INFINITY;
    Py_ssize_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) m[l] = x[j + l] > m[l] ? x[j + l] : m[l];
    for (int l = 0; j + l < n; l++) m[l] = x[j + l] > m[l] ? x[j + l] : m[l];
    float r = m[0];
    for (int l = 1; l < 8; l++) r = m[l] > r ? m[l] : r;
    return r;
}

/* o[d] = sum over j in order of e[j] * v_j[d] (from 0: 0 + e0 v0 + e1 v1 + ...), v_j at vbase + slots[j] * hd;
 * returns the sum of e[j] in order. The accumulators stay in registers for a constant hd. */
static inline __attribute__((always_inline)) float sum_weighted(const float *restrict e, const float *restrict vbase,
                                                                const int64_t *restrict slots, Py_ssize_t n,
                                                                float *restrict o, const Py_ssize_t hd) {
    float l = 0.0f;
    if (hd % 8 == 0 && hd <= 128) {
        v8 acc[16];
        for (Py_ssize_t c = 0; c < hd / 8; c++) acc[c] = (v8){0};
        for (Py_ssize_t j = 0; j < n; j++) {
            const float *vj = vbase + slots[j] * hd;
            const float ej = e[j];
            l = l + ej;
            for (Py_ssize_t c = 0; c < hd / 8; c++) {
                v8 x;
                memcpy(&x, vj + 8 * c, sizeof x);
                acc[c] = acc[c] + ej * x;
            }
        }
        memcpy(o, acc, sizeof(float) * (size_t)hd);
        return l;
    }
    for (Py_ssize_t d = 0; d < hd; d++) o[d] = 0.0f;
    for (Py_ssize_t j = 0; j < n; j++) {
        const float *vj = vbase + slots[j] * hd;
        l = l + e[j];
        for (Py_ssize_t d = 0; d < hd; d++) o[d] = o[d] + e[j] * vj[d];
    }
    return l;
}

/* dot(q, k_j, hd) for 8 keys k_j (rows at kbase + slots[j] * hd) as lanes j, hd a multiple of 16: each
 * key's 16 lanes summed as `dot` sums them (lane l over indices l, l + 16, ... from 0, then l + 8, l + 4 and
 * the last two pairs), the 8 keys side by side: after the lanes l + 8 are added (one vector a key), the
 * 8 x 8 block is transposed so that lane j of vector l holds key j's lane l, and the remaining tree runs
 * on whole vectors, without a horizontal step per key. The same operations on the same values as
 * dot(), so the same bits. */
static inline __attribute__((always_inline)) void dots8(const float *restrict q, const float *restrict kbase,
                                                        const int64_t *restrict slots, v8 *restrict d, const Py_ssize_t hd) {
    v8 r[8];
    for (int j = 0; j < 8; j++) dot_lanes8(q, kbase + slots[j] * hd, hd, &r[j]); /* lane l: lanes l and l + 8 */
    v8 t[8], u[8];
    for (int j = 0; j < 8; j += 2) {
        t[j] = __builtin_shufflevector(r[j], r[j + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[j + 1] = __builtin_shufflevector(r[j], r[j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int j = 0; j < 8; j += 4) {
        u[j] = __builtin_shufflevector(t[j], t[j + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[j + 1] = __builtin_shufflevector(t[j], t[j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[j + 2] = __builtin_shufflevector(t[j + 1], t[j + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[j + 3] = __builtin_shufflevector(t[j + 1], t[j + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    v8 lane[8]; /* lane[l][j] = r[j][l] */
    for (int l = 0; l < 4; l++) {
        lane[l] = __builtin_shufflevector(u[l], u[l + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        lane[l + 4] = __builtin_shufflevector(u[l], u[l + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
    const v8 s0 = lane[0] + lane[4], s1 = lane[1] + lane[5], s2 = lane[2] + lane[6], s3 = lane[3] + lane[7];
    *d = (s0 + s2) + (s1 + s3);
}

/* sum_weighted for two heads' weights e0, e1 over the same values in one pass: each head's operations
 * and order are sum_weighted's (so the same bits); the two heads' chains interleave, each value row is
 * loaded once. l[0], l[1] get the two sums. */
static inline __attribute__((always_inline)) void sum_weighted2(const float *restrict e0, const float *restrict e1,
                                                                const float *restrict vbase,
                                                                const int64_t *restrict slots, Py_ssize_t n,
                                                                float *restrict o0, float *restrict o1,
                                                                float *restrict l, const Py_ssize_t hd) {
    if (!(hd % 8 == 0 && hd <= 64)) {
        l[0] = sum_weighted(e0, vbase, slots, n, o0, hd);
        l[1] = sum_weighted(e1, vbase, slots, n, o1, hd);
        return;
    }
    v8 a0[8], a1[8];
    float l0 = 0.0f, l1 = 0.0f;
    for (Py_ssize_t c = 0; c < hd / 8; c++) a0[c] = a1[c] = (v8){0};
    for (Py_ssize_t j = 0; j < n; j++) {
        const float *vj = vbase + slots[j] * hd;
        const float x0 = e0[j], x1 = e1[j];
        l0 = l0 + x0;
        l1 = l1 + x1;
        for (Py_ssize_t c = 0; c < hd / 8; c++) {
            v8 x;
            memcpy(&x, vj + 8 * c, sizeof x);
            a0[c] = a0[c] + x0 * x;
            a1[c] = a1[c] + x1 * x;
        }
    }
    memcpy(o0, a0, sizeof(float) * (size_t)hd);
    memcpy(o1, a1, sizeof(float) * (size_t)hd);
    l[0] = l0, l[1] = l1;
}

/* out[h] for one query over n keys at `slots`: softmax of scale * q_h . k_j in key order, every head;
 * keys from `zero_from` on get weight exactly 0 (negative control only; else zero_from == n). The g query
 * heads of a KV head share each key's loads; every head's operations are its own, in key order.
 * s holds g * n scores. */
static inline __attribute__((always_inline)) void softmax_attend_hd(
        const Attn *a, const float *restrict qt, const int64_t *restrict slots, Py_ssize_t n, Py_ssize_t zero_from,
        float *restrict s, float *restrict out, const Py_ssize_t hd) {
    const Py_ssize_t g = a->heads / a->kvh;
    float l[64];
    for (Py_ssize_t kh = 0; kh < a->kvh; kh++) {
        const float *kbase = a->k + kh * a->ld_head, *vbase = a->v + kh * a->ld_head;
        const float *q0 = qt + kh * g * hd;
        float *o0 = out + kh * g * hd;
        Py_ssize_t j = 0;
        if (hd % LANES == 0)
            for (; j + 8 <= n; j += 8) { /* 8 keys at a time, the same bits (dots8) */
                for (Py_ssize_t p = j; p < j + 8; p++) {
                    if (p + PREFETCH < n) prefetch_row(kbase + slots[p + PREFETCH] * hd, hd);
                    prefetch_row(vbase + slots[p] * hd, hd);
                }
                for (Py_ssize_t i = 0; i < g; i++) {
                    v8 sc;
                    dots8(q0 + i * hd, kbase, slots + j, &sc, hd);
                    sc = sc * a->scale;
                    memcpy(s + i * n + j, &sc, sizeof sc);
                }
            }
        for (; j < n; j++) {
            const float *kj = kbase + slots[j] * hd;
            if (j + PREFETCH < n) prefetch_row(kbase + slots[j + PREFETCH] * hd, hd);
            prefetch_row(vbase + slots[j] * hd, hd);  /* read in the value pass below */
            for (Py_ssize_t i = 0; i < g; i++) s[i * n + j] = dot(q0 + i * hd, kj, hd) * a->scale;
        }
        for (Py_ssize_t i = 0; i < g; i++) {
            float *si = s + i * n;
            const float mi = max_of(si, zero_from);
            for (Py_ssize_t j = 0; j < zero_from; j++) si[j] = exp_fixed(si[j] - mi);
            for (Py_ssize_t j = zero_from; j < n; j++) si[j] = 0.0f;
        }
        Py_ssize_t i = 0;
        for (; i + 2 <= g; i += 2) /* two heads a pass: their sums are independent chains */
            sum_weighted2(s + i * n, s + (i + 1) * n, vbase, slots, n, o0 + i * hd, o0 + (i + 1) * hd, l + i, hd);
        for (; i < g; i++) l[i] = sum_weighted(s + i * n, vbase, slots, n, o0 + i * hd, hd);
        /* l == 0 only when nothing is visible: 0, as a dense kernel's guard; a NaN stays NaN */
        for (Py_ssize_t i = 0; i < g; i++) {
            const float li = l[i];
            if (li == 0.0f)
                for (Py_ssize_t d = 0; d < hd; d++) o0[i * hd + d] = 0.0f;
            else
                for (Py_ssize_t d = 0; d < hd; d++) o0[i * hd + d] = o0[i * hd + d] / li;
        }
    }
}

/* softmax_attend_hd with the common head sizes as constants (the compiler keeps a dot's lanes in
 * registers); the same operations as the general case. */
CLONES static void softmax_attend(const Attn *a, const float *restrict qt, const int64_t *restrict slots,
                                  Py_ssize_t n, Py_ssize_t zero_from, float *restrict s, float *restrict out) {
    switch (a->hd) {
    case 32: softmax_attend_hd(a, qt, slots, n, zero_from, s, out, 32); break;
    case 64: softmax_attend_hd(a, qt, slots, n, zero_from, s, out, 64); break;
    case 128: softmax_attend_hd(a, qt, slots, n, zero_from, s, out, 128); break;
    default: softmax_attend_hd(a, qt, slots, n, zero_from, s, out, a->hd);
    }
}

/* Orderable key of a selection score: larger score -> larger key, -0.0 == +0.0, NaN above everything. */
static inline uint32_t score_key(float s) {
    if (s != s) return UINT32_MAX;
    s = s + 0.0f;
    uint32_t b;
    memcpy(&b, &s, 4);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* The topk best of n candidates (positions 0..n-1 at `slots`), best first, into sel (-1 padded). */
static inline __attribute__((always_inline)) void select_top_hd(
        const Attn *a, const float *restrict qt, const int64_t *restrict slots, Py_ssize_t n, Py_ssize_t topk,
        uint64_t *restrict best, int64_t *restrict sel, const Py_ssize_t hd) {
    const Py_ssize_t g = a->heads / a->kvh;
    Py_ssize_t cnt = 0;
    float sc8[8];
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + PREFETCH < n)
            for (Py_ssize_t kh = 0; kh < a->kvh; kh++) prefetch_row(a->k + kh * a->ld_head + slots[j + PREFETCH] * hd, hd);
        float sc = 0.0f;
        if (hd % LANES == 0 && j % 8 == 0 && j + 8 <= n) { /* this key and the next 7 scored at once (dots8) */
            v8 acc = {0}, d;
            for (Py_ssize_t kh = 0; kh < a->kvh; kh++)
                for (Py_ssize_t i = 0; i < g; i++) {
                    dots8(qt + (kh * g + i) * hd, a->k + kh * a->ld_head, slots + j, &d, hd);
                    acc = acc + d; /* head order, from 0, as the per-key sum below */
                }
            acc = acc / (float)a->heads;
            memcpy(sc8, &acc, sizeof acc);
        }
        if (hd % LANES == 0 && j < n / 8 * 8) {
            sc = sc8[j % 8];
        } else {
            for (Py_ssize_t kh = 0; kh < a->kvh; kh++) {  /* heads kh * g .. kh * g + g - 1: head order */
                const float *kj = a->k + kh * a->ld_head + slots[j] * hd;
                for (Py_ssize_t i = 0; i < g; i++) sc = sc + dot(qt + (kh * g + i) * hd, kj, hd);
            }
            sc = sc / (float)a->heads;
        }
        const uint64_t key = ((uint64_t)score_key(sc) << 32) | (uint64_t)(UINT32_MAX - (uint32_t)j);
        if (cnt == topk && key <= best[cnt - 1]) continue;
        Py_ssize_t i = cnt < topk ? cnt++ : topk - 1;
        while (i > 0 && best[i - 1] < key) {
            best[i] = best[i - 1];
            i--;
        }
        best[i] = key;
    }
    for (Py_ssize_t i = 0; i < topk; i++) sel[i] = i < cnt ? (int64_t)(UINT32_MAX - (uint32_t)best[i]) : -1;
}

CLONES static void select_top(const Attn *a, const float *restrict qt, const int64_t *restrict slots,
                              Py_ssize_t n, Py_ssize_t topk, uint64_t *restrict best, int64_t *restrict sel) {
    switch (a->hd) { /* as softmax_attend */
    case 32: select_top_hd(a, qt, slots, n, topk, best, sel, 32); break;
    case 64: select_top_hd(a, qt, slots, n, topk, best, sel, 64); break;
    case 128: select_top_hd(a, qt, slots, n, topk, best, sel, 128); break;
    default: select_top_hd(a, qt, slots, n, topk, best, sel, a->hd);
    }
}

/* The isolation switched off, for negative controls only (set by `_attention_hooks.set_leaks`). */
static Py_ssize_t leak_read_past = 0;
static int leak_later_keys = 0;

static PyObject *py_attend(PyObject *Py_UNUSED(self), PyObject *args) {
    int mode;
    unsigned long long qa, ka, va, ta, qsla, ca, oa, sa;
    Py_ssize_t ldq, ld_head, ld_table, width, bs, zero, nslots, rows, ntok, heads, kvh, hd, topk;
    double scale;
    if (!PyArg_ParseTuple(args, "iKnKKnKnnnnnKKnnnnndKKn", &mode, &qa, &ldq, &ka, &va, &ld_head, &ta, &ld_table,
                          &width, &bs, &zero, &nslots, &qsla, &ca, &rows, &ntok, &heads, &kvh, &hd, &scale, &oa, &sa,
                          &topk))
        return NULL;
    const Py_ssize_t read_past = leak_read_past; /* 0 but in a negative control */
    const int later_keys = leak_later_keys;
    if (mode < 0 || mode > 2 || heads < 1 || kvh < 1 || heads % kvh || hd < 1 || bs < 1 || rows < 0 || ntok < 0 ||
        ldq < heads * hd || ld_head < 1 || width < 0 || (mode && topk < 1) ||
        (ntok && (!qa || !oa || (mode && !sa))) || (rows && (!qsla || !ca || !ka || !va || (width && !ta)))) {
        PyErr_Format(PyExc_ValueError, "attend: mode %d, heads %zd, kv_heads %zd, head_dim %zd, block_size %zd, rows %zd, "
                     "tokens %zd, ldq %zd, topk %zd do not fit", mode, heads, kvh, hd, bs, rows, ntok, ldq, topk);
        return NULL;
    }
    const int64_t *qsl = (const int64_t *)(uintptr_t)qsla, *computed = (const int64_t *)(uintptr_t)ca;
    const int64_t *tables = (const int64_t *)(uintptr_t)ta;
    float *out = (float *)(uintptr_t)oa;
    int64_t *sel = (int64_t *)(uintptr_t)sa;
    Py_ssize_t maxn = 1, end = rows ? (Py_ssize_t)qsl[rows] : 0;
    if (end > ntok || (rows && qsl[0] != 0)) {
        PyErr_Format(PyExc_ValueError, "attend: qsl spans %zd tokens of %zd", end, ntok);
        return NULL;
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        const Py_ssize_t n = (Py_ssize_t)(computed[r] + qsl[r + 1] - qsl[r]) + read_past;
        if (qsl[r + 1] < qsl[r] || computed[r] < 0) {
            PyErr_Format(PyExc_ValueError, "attend: row %zd has qsl %lld..%lld and %lld computed", r,
                         (long long)qsl[r], (long long)qsl[r + 1], (long long)computed[r]);
            return NULL;
        }
        if (n > maxn) maxn = n;
    }
    const Py_ssize_t nsel = mode ? topk : 1, g = heads / kvh;
    if (g > 64) {
        PyErr_Format(PyExc_ValueError, "attend: %zd query heads per KV head (at most 64)", g);
        return NULL;
    }
    float *s = malloc(sizeof(float) * (size_t)(g * (maxn > nsel ? maxn : nsel)));
    int64_t *slots = malloc(sizeof(int64_t) * (size_t)maxn), *chosen = malloc(sizeof(int64_t) * (size_t)nsel);
    uint64_t *best = malloc(sizeof(uint64_t) * (size_t)nsel);
    if (!s || !slots || !chosen || !best) {
        free(s), free(slots), free(chosen), free(best);
        return PyErr_NoMemory();
    }
    Py_ssize_t bad_row = -1;
    int64_t bad_block = 0;
    const Attn a = {(const float *)(uintptr_t)qa, (const float *)(uintptr_t)ka, (const float *)(uintptr_t)va,
                    ldq, ld_head, heads, kvh, hd, (float)scale};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows; r++) {
        const int64_t *table = tables + r * ld_table;
        const Py_ssize_t first = (Py_ssize_t)computed[r], seq = first + (Py_ssize_t)(qsl[r + 1] - qsl[r]);
        if (qsl[r + 1] == qsl[r]) continue;
        const Py_ssize_t nrow = seq + read_past; /* the row's readable positions: slots once per row */
        for (Py_ssize_t b = 0, j = 0; j < nrow; b++) {
            const int64_t blk = b < width ? table[b] : -1;
            if (blk >= 0 && (blk + 1) * bs > nslots) { /* a block outside the pool: refuse, never read it */
                bad_row = r, bad_block = blk;
                break;
            }
            for (Py_ssize_t o = 0; o < bs && j < nrow; o++, j++) slots[j] = blk >= 0 ? blk * bs + o : zero;
        }
        if (bad_row >= 0) break;
        for (Py_ssize_t t = (Py_ssize_t)qsl[r]; t < (Py_ssize_t)qsl[r + 1]; t++) {
            const Py_ssize_t p = first + (t - (Py_ssize_t)qsl[r]);  /* the query's absolute position */
            const float *qt = a.q + t * ldq;
            float *ot = out + t * heads * hd;
            if (mode == 0) {
                const Py_ssize_t n = (later_keys ? seq : p + 1) + read_past;
                softmax_attend(&a, qt, slots, n, later_keys ? p + 1 + read_past : n, s, ot);
                continue;
            }
            int64_t *st = sel + t * topk;
            if (mode == 1) select_top(&a, qt, slots, p + 1 + read_past, topk, best, st);
            Py_ssize_t n = 0;
            for (; n < topk && st[n] >= 0; n++) chosen[n] = st[n] < nrow ? slots[st[n]] : zero;
            softmax_attend(&a, qt, chosen, n, n, s, ot);
        }
    }
    if (end < ntok) memset(out + end * heads * hd, 0, sizeof(float) * (size_t)((ntok - end) * heads * hd));
    if (mode == 1)
        for (Py_ssize_t i = end * topk; i < ntok * topk; i++) sel[i] = -1;
    Py_END_ALLOW_THREADS
    free(s), free(slots), free(chosen), free(best);
    if (bad_row >= 0) {
        PyErr_Format(PyExc_ValueError, "attend: row %zd's block table holds block %lld, outside the pool's %zd slots",
                     bad_row, (long long)bad_block, nslots);
        return NULL;
    }
    Py_RETURN_NONE;
}

CLONES static void rotate(float *restrict x, const float *restrict c, const float *restrict sn, Py_ssize_t hd) {
    const Py_ssize_t half = hd / 2;
    float tmp[512];
    for (Py_ssize_t d = 0; d < hd; d++) tmp[d] = x[d];
    for (Py_ssize_t d = 0; d < hd; d++) x[d] = tmp[d] * c[d] + tmp[d < half ? d + half : d - half] * sn[d];
}

static PyObject *py_rotate_store(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long xa, ca, sa, ma, ka, va;
    Py_ssize_t ntok, heads, kvh, hd, ld_head, nslots;
    if (!PyArg_ParseTuple(args, "KnnnnKKKKKnn", &xa, &ntok, &heads, &kvh, &hd, &ca, &sa, &ma, &ka, &va, &ld_head,
                          &nslots))
        return NULL;
    if (ntok < 0 || heads < 1 || kvh < 1 || hd < 2 || hd % 2 || hd > 512 || ld_head < 1 ||
        (ntok && (!xa || !ca || !sa || !ma || !ka || !va))) {
        PyErr_Format(PyExc_ValueError, "rotate_store: tokens %zd, heads %zd, kv_heads %zd, head_dim %zd (even, <= 512) "
                     "do not fit", ntok, heads, kvh, hd);
        return NULL;
    }
    float *x = (float *)(uintptr_t)xa, *kp = (float *)(uintptr_t)ka, *vp = (float *)(uintptr_t)va;
    const float *cs = (const float *)(uintptr_t)ca, *sn = (const float *)(uintptr_t)sa;
    const int64_t *slots = (const int64_t *)(uintptr_t)ma;
    const Py_ssize_t width = (heads + 2 * kvh) * hd;
    for (Py_ssize_t t = 0; t < ntok; t++)
        if (slots[t] >= nslots) {
            PyErr_Format(PyExc_ValueError, "rotate_store: slot_mapping[%zd] = %lld is outside the pool's %zd slots", t,
                         (long long)slots[t], nslots);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < ntok; t++) {
        float *xt = x + t * width;
        for (Py_ssize_t h = 0; h < heads + kvh; h++) rotate(xt + h * hd, cs + t * hd, sn + t * hd, hd);
        if (slots[t] < 0) continue;
        for (Py_ssize_t h = 0; h < kvh; h++) {
            memcpy(kp + h * ld_head + slots[t] * hd, xt + (heads + h) * hd, sizeof(float) * (size_t)hd);
            memcpy(vp + h * ld_head + slots[t] * hd, xt + (heads + kvh + h) * hd, sizeof(float) * (size_t)hd);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rotate_store", py_rotate_store, METH_VARARGS,
     "rotate_store(qkv, num_tokens, heads, kv_heads, head_dim, cos, sin, slot_mapping, k, v, ld_head, num_slots) -> None: rotary on "
     "the q and k heads of qkv in place, then k and v stored at their slots (see the module source)."},
    {"attend", py_attend, METH_VARARGS,
     "attend(mode, q, ldq, k, v, ld_head, tables, ld_table, width, block_size, zero_slot, num_slots, qsl, computed, rows, "
     "num_tokens, heads, kv_heads, head_dim, scale, out, sel, topk) -> None: paged attention "
     "one query at a time (addresses of float32 / int64 data; see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_attention_kernel",
    "Paged attention one query at a time, in a fixed order per query, for model/attention_kernels.py.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__attention_kernel(void) { return PyModule_Create(&module); }

/* ---- the test hooks: a second module in this shared object (see the header) ---------------------- */

static PyObject *py_set_leaks(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_ssize_t read_past;
    int later_keys;
    if (!PyArg_ParseTuple(args, "np", &read_past, &later_keys)) return NULL;
    if (read_past < 0) {
        PyErr_Format(PyExc_ValueError, "set_leaks: read_past %zd is negative", read_past);
        return NULL;
    }
    PyObject *old = Py_BuildValue("nO", leak_read_past, leak_later_keys ? Py_True : Py_False);
    leak_read_past = read_past;
    leak_later_keys = later_keys;
    return old;
}

static PyMethodDef hook_methods[] = {
    {"set_leaks", py_set_leaks, METH_VARARGS,
     "set_leaks(read_past, later_keys) -> the previous (read_past, later_keys). Negative controls only: `attend` "
     "reads read_past positions past each query, and with later_keys the row's later keys of the step, weighted 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hook_module = {
    PyModuleDef_HEAD_INIT, "_attention_hooks",
    "Test hooks of _attention_kernel (the isolation switched off); loaded from the kernel's file by tests only.",
    -1, hook_methods,
};

PyMODINIT_FUNC PyInit__attention_hooks(void) { return PyModule_Create(&hook_module); }
