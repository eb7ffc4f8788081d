/* Token-wise fused steps of DeepSeek-V4.1's serving forward (model/ops_c.py): each token computed alone,
 * by the same operations in the same order whatever the call's size, so a token's bits do not depend on
 * its batch mates, the cut or padding (docs/contract.md §9) with no padding rule; one call instead of the
 * several torch operators each step takes. The torch form of each lives beside its caller
 * (model/deepseek_v41.py, model/layers.py, model/ops_c.py) and runs where this kernel does not (CUDA,
 * autograd, no compiler, ENGRAM_SERVE_KERNELS). The two forms compute the same formula, not the same bits.
 *
 * Arrays come as addresses (torch's `data_ptr()`): float32 C-contiguous unless said otherwise, int64
 * ids, bool masks as one byte. model/ops_c.py checks dtypes, devices and shapes; the kernel checks sizes.
 * Every kernel but concat_cols (a variable number of parts) takes its arguments by position, in the order below,
 * or by name: one X-macro list each (X_FIELDS, ../_kernel_buffers.h) makes its struct, parser, raw entry and
 * docstring (`help(kernel.hc_next)` lists the fields), and `kernel_fields()` lists them.
 *
 * mHC (docs/deepseek_v41.md, "mHC"), hc <= 16 streams:
 *   hc_mix(x, mm, n, hc, dim, scale, base, eps, hc_eps, iters, pre, post, comb)
 *     x [n, hc * dim] the streams, mm [n, (2 + hc) * hc] = fn . x (the matmul, done before). Per token:
 *     r = 1 / sqrt(dot(x, x) / (hc * dim) + eps); m_j = mm_j * r * scale[seg j] + base_j;
 *     pre [n, hc] = sigmoid(m_i) + hc_eps; post [n, hc] = 2 * sigmoid(m_{hc + i});
 *     comb [n, hc, hc]: per row a softmax over b of m_{2hc + a hc + b} (max first, sums in b order),
 *     + hc_eps, then columns c * (1 / (sum_a c + hc_eps)); iters - 1 times rows c * (1 / (sum_b c + hc_eps)) then
 *     columns (one division per row or column).
 *   collapse(x, mix, n, hc, dim, out): out [n, dim] = mix_0 x_0 + mix_1 x_1 + ... (streams in order).
 *   stream_mean(x, n, hc, dim, out, ldo): out [n, dim] (rows ldo floats apart) = (x_0 + x_1 + ...) / hc, added in
 *     stream order, then divided (the bits of those torch operators): the DSpark drafter's features.
 *   expand(o, x, post, comb, n, hc, dim, out): out [n, hc, dim], stream b = post_b o + comb[0][b] x_0
 *     + comb[1][b] x_1 + ... (added left to right). out may be x (every stream's values at a dim are read before
 *     any is written), as in hc_next.
 *   hc_next(o, x, post, comb, mix, n, hc, dim, matmul, panels, kc, scale, base, eps, hc_eps, iters, norm_w, norm_eps,
 *           out, pre, post2, comb2, h, mm, y): between two sublayers, out = expand(o, x, post, comb); the next
 *     sublayer's mix (pre, post2, comb2) = hc_mix(out, mm, ...) with mm = out . fn, the product of the linear
 *     kernel's raw entry `matmul` (its `raw_kernels()["linear_packed"]`) over fn's packed panels at block size
 *     kc, or `linear_bf16`'s over fn's bfloat16 tiles (its slots are the first seven); its input h [n, dim] = rms_norm(collapse(out, mix), norm_w, norm_eps). The same calls as those five,
 *     made on HC_TILE tokens at a time, whose streams are read back from L2: the same bits. mm
 *     [min(n, HC_TILE), (2 + hc) hc] and y [min(n, HC_TILE), dim] are scratch.
 * Norm and rotary:
 *   rms_norm(x, rows, dim, w, eps, out): out = x * (1 / sqrt(dot(x, x) / dim + eps)) [* w] (w [dim] or 0).
 *   rope(x, n, m, width, cos, sin, half, inverse, out): x [n, m, width], cos, sin [n, half]; out = x with
 *     the last 2 * half dims rotated in interleaved pairs (j: dims d0 + 2j, d0 + 2j + 1):
 *     (x0 c - x1 s, x0 s + x1 c), inverse (x0 c + x1 s, x1 c - x0 s).
 * Paged state (model/paged_state.py):
 *   plan_window(positions, rows, tables, n, tr, tb, bs, zero, window, win, win_ok, prev): the SlotPlan's window
 *     and partner slots of tokens at positions [n] in rows [n] of tables [tr, tb] (-1 a null block): slot_of(q)
 *     = tables[row][q / bs] * bs + q % bs where q >= 0, q / bs < tb and that block is not null, else `zero`;
 *     win [n, window] = slot_of(p - window + 1 + j), win_ok [n, window] = (p - window + 1 + j >= 0), prev [n] =
 *     slot_of(p - 1). ValueError, and nothing written, if a row is outside [0, tr).
 *   plan_entries(positions, rows, tables, n, tr, tb, bs, zero, ratio, width, count, eslots): count [n] =
 *     (p + 1) / ratio (the entries complete at p), eslots [n, width] = slot_of(g * ratio + ratio - 1) for
 *     g < count, else `zero`.
 *   store_rows(pool, rows, width, slots, n, values, trash, positions, ratio): pool [rows, width] row slots[t] =
 *     values[t] for each token t, in token order; the trash row where slots[t] < 0 or, with positions [n]
 *     (else 0), where positions[t] % ratio != ratio - 1 (the token completes no entry). ValueError, and
 *     nothing written, if a slot is outside [0, rows) (PagedState.write; a compressor's entries).
 * Attention:
 *   attend_paged(q, window, wslots, wok, n, w, entries, eslots, es, topk, k, rows, hd, sink, h, scale, out):
 *     q [n, h, hd], sink [h] -> out [n, h, hd]. Token t reads the keys (key = value) of its window,
 *     window[wslots[t][j]] with ok wok[t][j], then with topk [n, k] (else k = 0) the entries it picked,
 *     entries[eslots[t][topk[t][i]]], ok where the pick is >= 0 (below es), all in place in their pools
 *     [rows, hd]. Per token and head: z_j = dot(q, key_j) * scale over the keys with ok (the others are never
 *     read), m = the max of sink and the z_j, e_j = exp(z_j - m),
 *     out = (sum_j e_j key_j) / (sum_j e_j + exp(sink - m)), sums over j in key order (window, then picks).
 *     On AVX-512, for h a multiple of 4 and hd of 16, four heads' scores against four keys run at once and
 *     their 16 lane sums reduce together through the same tree, and the weighted sums of four heads share each
 *     key's load: the same bits.
 *     ValueError, and nothing written, if a slot is outside [0, rows).
 *   pool_pair(first, second, n, hd, out): first, second [n, 2 hd] ([kv, gate] rows) -> out [n, hd]: per
 *     channel e0 = exp(g0 - m), e1 = exp(g1 - m), m = max(g0, g1); out = (e0 kv0 + e1 kv1) / (e0 + e1).
 * Indexer (docs/deepseek_v41.md, "Indexer"):
 *   index_scores(q, w, wscale, pool, slots, count, n, es, e, nh, ihd, cands, nc, block, out): q [n, nh, ihd],
 *     w [n, nh], pool [slots, ihd] the index keys, slots [n, es] each entry's slot, count [n] the visible
 *     entries, cands [n, nc] block ids (-1 none) or 0 -> out [n, e]: entry g scores
 *     sum_h (w_h * wscale) * relu(dot(q_h, key_g)) (heads in order) if g < min(count, es) and, with cands,
 *     its block g / block is a candidate; -inf otherwise (no key read). relu keeps a NaN. On AVX-512, for nh a
 *     multiple of 4 and ihd of 16, four heads' dots against four entries run at once (attend_paged's way): the
 *     same bits.
 *   candidate_blocks(s, count, n, e, block, k, out): s [n, e] (e a multiple of block) -> out [n, k]: block
 *     scores are the max of their entries (a NaN wins), the newest visible block (count - 1) / block is
 *     +inf, then topk_rows.
 *   topk_rows(x, rows, v, k, out): out [rows, k] int64, the k best of each row x [rows, v]: higher first, a
 *     NaN above every number, ties to the lower index; -1 for a pick that is -inf or beyond v
 *     (model/ops_torch.py `topk`).
 * MoE (docs/deepseek_v41.md, "MoE"):
 *   moe_route(z, bias, n, e, k, norm, scale, ids, w): z [n, e] the router's logits -> ids [n, k] best first
 *     by score + bias (topk_rows' order, always k experts), w [n, k]: score = sqrt(softplus(z)) (softplus =
 *     z above 20, else log1p(exp(z))), w_i = score[ids_i] [/ (w_0 + w_1 + ...) if norm] * scale.
 *   moe_group(ids, pairs, e, k, order, counts, tok): ids [pairs] expert of each (token, pick) pair (pair p is
 *     token p / k's pick p % k) -> counts [e], order [pairs] the pairs sorted by expert, ascending pair index
 *     inside an expert (a stable counting sort), tok [pairs] = order / k; ValueError if an id is outside [0, e).
 *   moe_combine(ys, order, w, pairs, n, k, dim, shared, out): ys [pairs, dim] the expert outputs in `order`,
 *     w [n * k] -> out [n, dim] = (0 + w y of the token's pairs, in order: ascending expert) + shared [n, dim];
 *     ValueError if `order` lists a pair twice.
 *   swiglu(gu, n, inter, limit, out): gu [n, 2 inter] (g, u) -> out [n, inter] = silu(min(g, L)) *
 *     clamp(u, -L, L), L = limit (no clamp when L <= 0); silu(x) = x / (1 + exp(-x)).
 * Copies:
 *   concat_cols(out, n, width, a_0, w_0, a_1, w_1, ...): out [n, width] = the parts a_i [n, w_i] side by side
 *     (row strides w_i; the w_i add up to width): torch.cat(dim=1) of a microbatch's few column blocks.
 * Engram, embedding, sampling:
 *   engram_gate(h, n, hc, hidden, kv, q_w, k_w, dead, eps, h_out) -> None
 *     The Engram gate of docs/contract.md §7, h_out = h with the gated value added: kv [n, (hc + 1) * hidden]
 *     (hc keys, then the value), q_w, k_w [hc, hidden], dead [n] bool or 0. Per branch i: dot =
 *     sum(rmsnorm(h_i) * q_w[i] * rmsnorm(key_i) * k_w[i]) / sqrt(hidden), gate = sigmoid(s * sqrt(max(|dot|,
 *     1e-6))) with s = -1 if dot < 0 else +1 (the positive root at +-0), 0 for a dead token; h_out_i = h_i +
 *     gate * value.
 *   gather_rows(src, rows, width, ids, n, copies, out): out [n, copies, width] = src[ids[t]] on each copy
 *     (the embedding into every stream, the rotary tables); ValueError, and nothing written, if an id is
 *     outside [0, rows).
 *   argmax_rows(x, rows, v, out[, finite]): out [rows] int64, per row the first index of its maximum, a NaN
 *     above every number (torch.argmax's order: the first NaN if there is one); finite [rows] bool (an address,
 *     0 for none): whether every value of the row is finite.
 *
 * Sums of products run over 16 lanes (index mod 16, in order) added in a fixed tree (`dot`); exp is
 * `exp_fixed` (_kernel_math.h, the same operations for every element), sqrtf the IEEE one, log1pf libm's
 * (one scalar function). Built without -ffast-math and with -ffp-contract=off: every operation is the
 * IEEE one written, in every clone. Scratch memory is allocated per call (per part of a call on the pool), sized
 * by the call's shape parameters that do not depend on the token count. The GIL is released during the
 * arithmetic, which runs on the kernels' pool (_thread_pool.h): the tokens (rows) of a call in contiguous ranges,
 * attention's (token, group of 4 heads) items, the indexer's (token, 256 entries) items; each token (entry)
 * computed whole on one thread, so its bits do not depend on the thread count (the section "threads" below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_kernel_buffers.h"
#include "_kernel_math.h"
#include "_thread_pool.h"

#define MAX_HC 16

/* 1 / sqrt(mean of x^2 + eps) over d values */
static inline float rms_scale(const float *restrict x, Py_ssize_t d, float eps) {
    return 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
}

static inline float sigmoid_fixed(float x) { return 1.0f / (1.0f + exp_fixed(-x)); }

/* ---- mHC ------------------------------------------------------------------------------------------ */

static inline __attribute__((always_inline)) void sinkhorn_columns(float *restrict c, const Py_ssize_t hc, float eps) {
    for (Py_ssize_t b = 0; b < hc; b++) {
        float s = 0.0f;
        for (Py_ssize_t a = 0; a < hc; a++) s = s + c[a * hc + b];
        const float inv = 1.0f / (s + eps);
        for (Py_ssize_t a = 0; a < hc; a++) c[a * hc + b] = c[a * hc + b] * inv;
    }
}

static inline __attribute__((always_inline)) void sinkhorn_rows(float *restrict c, const Py_ssize_t hc, float eps) {
    for (Py_ssize_t a = 0; a < hc; a++) {
        float s = 0.0f;
        for (Py_ssize_t b = 0; b < hc; b++) s = s + c[a * hc + b];
        const float inv = 1.0f / (s + eps);
        for (Py_ssize_t b = 0; b < hc; b++) c[a * hc + b] = c[a * hc + b] * inv;
    }
}

/* One token's mix (the header's formula); inlined with hc a constant where the call site knows it (V4.1's 4),
 * so that its small loops unroll: the same operations in the same order either way. */
static inline __attribute__((always_inline)) void
hc_mix_rows_of(const float *restrict x, const float *restrict mm, Py_ssize_t n, const Py_ssize_t hc, Py_ssize_t dim,
               const float *restrict scale, const float *restrict base, float eps, float hc_eps, Py_ssize_t iters,
               float *restrict pre, float *restrict post, float *restrict comb) {
    const Py_ssize_t mix = (2 + hc) * hc;
    float m[(2 + MAX_HC) * MAX_HC];
    for (Py_ssize_t t = 0; t < n; t++) {
        const float r = rms_scale(x + t * hc * dim, hc * dim, eps);
        const float *mt = mm + t * mix;
        for (Py_ssize_t j = 0; j < mix; j++) m[j] = mt[j] * r * scale[j < hc ? 0 : (j < 2 * hc ? 1 : 2)] + base[j];
        for (Py_ssize_t i = 0; i < hc; i++) {
            pre[t * hc + i] = sigmoid_fixed(m[i]) + hc_eps;
            post[t * hc + i] = 2.0f * sigmoid_fixed(m[hc + i]);
        }
        float *c = comb + t * hc * hc;
        for (Py_ssize_t a = 0; a < hc; a++) {
            const float *row = m + 2 * hc + a * hc;
            float mx = row[0], s = 0.0f;
            for (Py_ssize_t b = 1; b < hc; b++) mx = row[b] > mx ? row[b] : mx;
            for (Py_ssize_t b = 0; b < hc; b++) {
                c[a * hc + b] = exp_fixed(row[b] - mx);
                s = s + c[a * hc + b];
            }
            for (Py_ssize_t b = 0; b < hc; b++) c[a * hc + b] = c[a * hc + b] / s + hc_eps;
        }
        sinkhorn_columns(c, hc, hc_eps);
        for (Py_ssize_t it = 1; it < iters; it++) {
            sinkhorn_rows(c, hc, hc_eps);
            sinkhorn_columns(c, hc, hc_eps);
        }
    }
}

#define HC_LANES 16 /* tokens mixed at once at most: lane l of every array below is token l */

/* sinkhorn_rows (group stride hc, element stride 1) or sinkhorn_columns (1, hc) on the first `lanes` lanes of c */
static inline __attribute__((always_inline)) void sinkhorn_lanes(float (*c)[HC_LANES], const int lanes,
                                                                 const Py_ssize_t hc, Py_ssize_t gs, Py_ssize_t es,
                                                                 float eps) {
    float s[HC_LANES];
    for (Py_ssize_t g = 0; g < hc; g++) {
        for (int l = 0; l < lanes; l++) s[l] = 0.0f;
        for (Py_ssize_t e = 0; e < hc; e++)
            for (int l = 0; l < lanes; l++) s[l] = s[l] + c[g * gs + e * es][l];
        for (int l = 0; l < lanes; l++) s[l] = 1.0f / (s[l] + eps);
        for (Py_ssize_t e = 0; e < hc; e++)
            for (int l = 0; l < lanes; l++) c[g * gs + e * es][l] = c[g * gs + e * es][l] * s[l];
    }
}

/* hc_mix_rows_of on `lanes` tokens at once (16, or 8 for a shorter rest), each operation a loop over the lanes
 * (which the compiler turns into vector instructions): on each lane the same operations in the same order as
 * on one token, so the same bits. */
static inline __attribute__((always_inline)) void
hc_mix_lanes(const int lanes, const float *restrict x, const float *restrict mm, const Py_ssize_t hc, Py_ssize_t dim,
             const float *restrict scale, const float *restrict base, float eps, float hc_eps, Py_ssize_t iters,
             float *restrict pre, float *restrict post, float *restrict comb) {
    const Py_ssize_t mix = (2 + hc) * hc;
    float r[HC_LANES], s[HC_LANES], mx[HC_LANES];
    float m[(2 + MAX_HC) * MAX_HC][HC_LANES], c[MAX_HC * MAX_HC][HC_LANES];
    for (int l = 0; l < lanes; l++) r[l] = rms_scale(x + l * hc * dim, hc * dim, eps);
    for (Py_ssize_t j = 0; j < mix; j++) {
        const float sc = scale[j < hc ? 0 : (j < 2 * hc ? 1 : 2)], bj = base[j];
        for (int l = 0; l < lanes; l++) m[j][l] = mm[l * mix + j] * r[l] * sc + bj;
    }
    for (Py_ssize_t i = 0; i < hc; i++)
        for (int l = 0; l < lanes; l++) {
            pre[l * hc + i] = sigmoid_fixed(m[i][l]) + hc_eps;
            post[l * hc + i] = 2.0f * sigmoid_fixed(m[hc + i][l]);
        }
    for (Py_ssize_t a = 0; a < hc; a++) {
        float (*row)[HC_LANES] = m + 2 * hc + a * hc;
        for (int l = 0; l < lanes; l++) mx[l] = row[0][l], s[l] = 0.0f;
        for (Py_ssize_t b = 1; b < hc; b++)
            for (int l = 0; l < lanes; l++) mx[l] = row[b][l] > mx[l] ? row[b][l] : mx[l];
        for (Py_ssize_t b = 0; b < hc; b++)
            for (int l = 0; l < lanes; l++) {
                c[a * hc + b][l] = exp_fixed(row[b][l] - mx[l]);
                s[l] = s[l] + c[a * hc + b][l];
            }
        for (Py_ssize_t b = 0; b < hc; b++)
            for (int l = 0; l < lanes; l++) c[a * hc + b][l] = c[a * hc + b][l] / s[l] + hc_eps;
    }
    for (Py_ssize_t it = 0; it < (iters > 1 ? iters : 1); it++) { /* columns, then (rows, columns) iters - 1 times */
        if (it)
            sinkhorn_lanes(c, lanes, hc, hc, 1, hc_eps); /* rows */
        sinkhorn_lanes(c, lanes, hc, 1, hc, hc_eps);     /* columns */
    }
    for (Py_ssize_t e = 0; e < hc * hc; e++)
        for (int l = 0; l < lanes; l++) comb[l * hc * hc + e] = c[e][l];
}

/* HC_LANES tokens at a time, then 8, the rest one by one */
CLONES static void hc_mix_rows(const float *restrict x, const float *restrict mm, Py_ssize_t n, Py_ssize_t hc,
                               Py_ssize_t dim, const float *restrict scale, const float *restrict base, float eps,
                               float hc_eps, Py_ssize_t iters, float *restrict pre, float *restrict post,
                               float *restrict comb) {
    const Py_ssize_t mix = (2 + hc) * hc;
    Py_ssize_t t = 0;
#define HC_MIX_LANES(lanes)                                                                                        \
    for (; n - t >= lanes; t += lanes) {                                                                           \
        if (hc == 4)                                                                                               \
            hc_mix_lanes(lanes, x + t * hc * dim, mm + t * mix, 4, dim, scale, base, eps, hc_eps, iters,           \
                         pre + t * hc, post + t * hc, comb + t * hc * hc);                                         \
        else                                                                                                       \
            hc_mix_lanes(lanes, x + t * hc * dim, mm + t * mix, hc, dim, scale, base, eps, hc_eps, iters,          \
                         pre + t * hc, post + t * hc, comb + t * hc * hc);                                         \
    }
    HC_MIX_LANES(HC_LANES)
    HC_MIX_LANES(8)
#undef HC_MIX_LANES
    x += t * hc * dim, mm += t * mix, pre += t * hc, post += t * hc, comb += t * hc * hc;
    if (hc == 4)
        hc_mix_rows_of(x, mm, n - t, 4, dim, scale, base, eps, hc_eps, iters, pre, post, comb);
    else
        hc_mix_rows_of(x, mm, n - t, hc, dim, scale, base, eps, hc_eps, iters, pre, post, comb);
}

#define HC_D 16 /* dims of a stream computed at once (one v16): the outputs stay in registers, each read once */

/* 16 floats at any float's address, as one v16 value (a plain load where the CPU has 16-lane vectors) */
typedef float v16_unaligned __attribute__((vector_size(64), aligned(4), may_alias));
#define V16_AT(p) (*(const v16_unaligned *)(p))

/* one token's collapse and expand (the header's formulas), HC_D dims at a time, then the rest one by one: each
 * output gets the same operations in the same order either way; inlined with hc a constant where it is 4 */
static inline __attribute__((always_inline)) void collapse_token(const float *restrict xt, const float *restrict mt,
                                                                 const Py_ssize_t hc, Py_ssize_t dim,
                                                                 float *restrict ot) {
    Py_ssize_t d = 0;
    for (; d + HC_D <= dim; d += HC_D) {
        v16 acc = mt[0] * V16_AT(xt + d);
        for (Py_ssize_t i = 1; i < hc; i++) acc = acc + mt[i] * V16_AT(xt + i * dim + d);
        memcpy(ot + d, &acc, sizeof acc);
    }
    for (; d < dim; d++) {
        float acc = mt[0] * xt[d];
        for (Py_ssize_t i = 1; i < hc; i++) acc = acc + mt[i] * xt[i * dim + d];
        ot[d] = acc;
    }
}

static inline __attribute__((always_inline)) void expand_token(const float *ot, const float *xt, const float *pt,
                                                               const float *ct, const Py_ssize_t hc, Py_ssize_t dim,
                                                               float *out) {
    Py_ssize_t d = 0;
    for (; d + HC_D <= dim; d += HC_D) { /* every stream's values read before any is written: out may be xt */
        v16 xs[MAX_HC];
        for (Py_ssize_t a = 0; a < hc; a++) xs[a] = V16_AT(xt + a * dim + d);
        const v16 o = V16_AT(ot + d);
        for (Py_ssize_t b = 0; b < hc; b++) {
            v16 acc = pt[b] * o;
            for (Py_ssize_t a = 0; a < hc; a++) acc = acc + ct[a * hc + b] * xs[a];
            memcpy(out + b * dim + d, &acc, sizeof acc);
        }
    }
    for (; d < dim; d++) {
        float xs[MAX_HC];
        for (Py_ssize_t a = 0; a < hc; a++) xs[a] = xt[a * dim + d];
        for (Py_ssize_t b = 0; b < hc; b++) {
            float acc = pt[b] * ot[d];
            for (Py_ssize_t a = 0; a < hc; a++) acc = acc + ct[a * hc + b] * xs[a];
            out[b * dim + d] = acc;
        }
    }
}

CLONES static void collapse_rows(const float *restrict x, const float *restrict mix, Py_ssize_t n, Py_ssize_t hc,
                                 Py_ssize_t dim, float *restrict out) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (hc == 4)
            collapse_token(x + t * 4 * dim, mix + t * 4, 4, dim, out + t * dim);
        else
            collapse_token(x + t * hc * dim, mix + t * hc, hc, dim, out + t * dim);
}

CLONES static void expand_rows(const float *o, const float *x, const float *restrict post, const float *restrict comb,
                               Py_ssize_t n, Py_ssize_t hc, Py_ssize_t dim, float *out) { /* out may be x */
    for (Py_ssize_t t = 0; t < n; t++)
        if (hc == 4)
            expand_token(o + t * dim, x + t * 4 * dim, post + t * 4, comb + t * 16, 4, dim, out + t * 4 * dim);
        else
            expand_token(o + t * dim, x + t * hc * dim, post + t * hc, comb + t * hc * hc, hc, dim,
                         out + t * hc * dim);
}

/* ---- norm and rotary ------------------------------------------------------------------------------- */

CLONES static void rms_norm_rows(const float *restrict x, Py_ssize_t rows, Py_ssize_t dim, const float *restrict w,
                                 float eps, float *restrict out) {
    for (Py_ssize_t t = 0; t < rows; t++) {
        const float *xt = x + t * dim;
        float *ot = out + t * dim;
        const float r = rms_scale(xt, dim, eps);
        if (w)
            for (Py_ssize_t d = 0; d < dim; d++) ot[d] = xt[d] * r * w[d];
        else
            for (Py_ssize_t d = 0; d < dim; d++) ot[d] = xt[d] * r;
    }
}

/* out may be x itself (each pair is read before it is written) */
CLONES static void rope_rows(const float *x, Py_ssize_t n, Py_ssize_t m, Py_ssize_t width, const float *restrict cs,
                             const float *restrict sn, Py_ssize_t half, int inverse, float *out) {
    const Py_ssize_t d0 = width - 2 * half;
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *c = cs + t * half, *s = sn + t * half;
        for (Py_ssize_t v = 0; v < m; v++) {
            const float *xv = x + (t * m + v) * width;
            float *ov = out + (t * m + v) * width;
            if (ov != xv)
                memcpy(ov, xv, (size_t)d0 * sizeof(float));
            const float *xr = xv + d0;
            float *orr = ov + d0;
            if (inverse)
                for (Py_ssize_t j = 0; j < half; j++) {
                    const float x0 = xr[2 * j], x1 = xr[2 * j + 1];
                    orr[2 * j] = x0 * c[j] + x1 * s[j];
                    orr[2 * j + 1] = x1 * c[j] - x0 * s[j];
                }
            else
                for (Py_ssize_t j = 0; j < half; j++) {
                    const float x0 = xr[2 * j], x1 = xr[2 * j + 1];
                    orr[2 * j] = x0 * c[j] - x1 * s[j];
                    orr[2 * j + 1] = x0 * s[j] + x1 * c[j];
                }
        }
    }
}

/* ---- mHC between two sublayers ------------------------------------------------------------------------------ */

#define HC_TILE 128 /* tokens of hc_next a tile: its streams (hc x dim floats a token) are read again from L2 */

/* ---- paged state ---------------------------------------------------------------------------------------- */

static inline int64_t slot_of(int64_t q, const int64_t *restrict table, Py_ssize_t tb, int64_t bs, int64_t zero) {
    if (q < 0 || q / bs >= tb) return zero;
    const int64_t block = table[q / bs];
    return block < 0 ? zero : block * bs + q % bs;
}

/* returns the first token whose row is outside [0, tr), or -1 */
static Py_ssize_t plan_window(const int64_t *restrict positions, const int64_t *restrict rows,
                              const int64_t *restrict tables, Py_ssize_t n, Py_ssize_t tr, Py_ssize_t tb, int64_t bs,
                              int64_t zero, Py_ssize_t window, int64_t *restrict win, uint8_t *restrict win_ok,
                              int64_t *restrict prev) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (rows[t] < 0 || rows[t] >= tr) return t;
    for (Py_ssize_t t = 0; t < n; t++) {
        const int64_t *table = tables + rows[t] * tb, p = positions[t];
        for (Py_ssize_t j = 0; j < window; j++) {
            const int64_t q = p - window + 1 + j;
            win[t * window + j] = slot_of(q, table, tb, bs, zero);
            win_ok[t * window + j] = q >= 0;
        }
        prev[t] = slot_of(p - 1, table, tb, bs, zero);
    }
    return -1;
}

static Py_ssize_t plan_entries(const int64_t *restrict positions, const int64_t *restrict rows,
                               const int64_t *restrict tables, Py_ssize_t n, Py_ssize_t tr, Py_ssize_t tb, int64_t bs,
                               int64_t zero, int64_t ratio, Py_ssize_t width, int64_t *restrict count,
                               int64_t *restrict eslots) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (rows[t] < 0 || rows[t] >= tr) return t;
    for (Py_ssize_t t = 0; t < n; t++) {
        const int64_t *table = tables + rows[t] * tb, p = positions[t];
        const int64_t c = p + 1 >= 0 ? (p + 1) / ratio : -((-(p + 1) + ratio - 1) / ratio); /* floor */
        count[t] = c;
        for (Py_ssize_t g = 0; g < width; g++)
            eslots[t * width + g] = g < c ? slot_of(g * ratio + ratio - 1, table, tb, bs, zero) : zero;
    }
    return -1;
}

/* returns the first token whose slot is outside [0, rows), or -1 */
static Py_ssize_t store_rows(float *restrict pool, Py_ssize_t rows, Py_ssize_t width, const int64_t *restrict slots,
                             Py_ssize_t n, const float *restrict values, int64_t trash,
                             const int64_t *restrict positions, int64_t ratio) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (slots[t] >= rows) return t;
    if (trash < 0 || trash >= rows) return n;
    for (Py_ssize_t t = 0; t < n; t++) {
        const int complete = !positions || positions[t] % ratio == ratio - 1;
        const int64_t s = slots[t] < 0 || !complete ? trash : slots[t];
        memcpy(pool + s * width, values + t * width, (size_t)width * sizeof(float));
    }
    return -1;
}

/* ---- attention --------------------------------------------------------------------------------------- */

/* z[i * k] = dot(q_i, key) * scale for the h heads of q [h, hd]: four heads' dot chains interleaved where hd is a
 * multiple of 16 (each head's lanes and tree exactly dot's, two 8-lane vectors), else dot itself */
static inline __attribute__((always_inline)) void dot_heads(const float *restrict q, const float *restrict key,
                                                             Py_ssize_t h, Py_ssize_t hd, float scale,
                                                             float *restrict z, Py_ssize_t k) {
    Py_ssize_t i = 0;
    if (hd % LANES == 0)
        for (; i + 4 <= h; i += 4) {
            v8 lo[4] = {{0}}, hi[4] = {{0}}, ka, kb, x;
            for (Py_ssize_t d = 0; d < hd; d += LANES) {
                memcpy(&ka, key + d, sizeof ka);
                memcpy(&kb, key + d + 8, sizeof kb);
                for (int u = 0; u < 4; u++) {
                    memcpy(&x, q + (i + u) * hd + d, sizeof x);
                    lo[u] = lo[u] + x * ka;
                    memcpy(&x, q + (i + u) * hd + d + 8, sizeof x);
                    hi[u] = hi[u] + x * kb;
                }
            }
            for (int u = 0; u < 4; u++) z[(i + u) * k] = dot_tree8(lo[u] + hi[u]) * scale;
        }
    for (; i < h; i++) z[i * k] = dot(q + i * hd, key, hd) * scale;
}

/* o [8 nv] = columns c .. c + 8 nv of the sum over the keys j, in key order, of e[j] * kp[j]: nv (<= 8)
 * independent addition chains in registers */
static inline __attribute__((always_inline)) void weigh_columns(const float *const *kp, const float *restrict e,
                                                                 Py_ssize_t k, Py_ssize_t c, const int nv,
                                                                 float *restrict o) {
    v8 acc[8] = {{0}}, x;
    for (Py_ssize_t j = 0; j < k; j++) {
        const v8 ej = {e[j], e[j], e[j], e[j], e[j], e[j], e[j], e[j]};
        for (int u = 0; u < nv; u++) {
            memcpy(&x, kp[j] + c + 8 * u, sizeof x);
            acc[u] = acc[u] + ej * x;
        }
    }
    memcpy(o, acc, (size_t)nv * sizeof(v8));
}

/* o [hd] = sum over the keys j, in key order, of e[j] * kp[j]; 64 or 32 columns at a time in registers where hd
 * is a multiple of 64 or 32 (each column's additions in the same order) */
static inline __attribute__((always_inline)) void weigh_keys(const float *const *kp, const float *restrict e,
                                                              Py_ssize_t k, Py_ssize_t hd, float *restrict o) {
    if (hd % 64 == 0) {
        for (Py_ssize_t c = 0; c < hd; c += 64) weigh_columns(kp, e, k, c, 8, o + c);
        return;
    }
    if (hd % 32 == 0) {
        for (Py_ssize_t c = 0; c < hd; c += 32) weigh_columns(kp, e, k, c, 4, o + c);
        return;
    }
    for (Py_ssize_t x = 0; x < hd; x++) o[x] = 0.0f;
    for (Py_ssize_t j = 0; j < k; j++) {
        for (Py_ssize_t d = 0; d < hd; d++) o[d] = o[d] + e[j] * kp[j][d];
    }
}

/* For each of the u heads (u <= 4) of z [u, k]: mx = the max of sink and its scores (taken in key order),
 * its scores replaced by exp(z - mx), den = their sum in key order + exp(sink - mx) */
static inline __attribute__((always_inline)) void softmax_heads(float *restrict z, const float *restrict sink,
                                                                Py_ssize_t u, Py_ssize_t k, float *restrict den) {
    float mx[4], s[4];
    for (Py_ssize_t i = 0; i < u; i++) mx[i] = sink[i], s[i] = 0.0f;
    for (Py_ssize_t j = 0; j < k; j++)
        for (Py_ssize_t i = 0; i < u; i++) mx[i] = z[i * k + j] > mx[i] ? z[i * k + j] : mx[i];
    for (Py_ssize_t i = 0; i < u; i++)
        for (Py_ssize_t j = 0; j < k; j++) z[i * k + j] = exp_fixed(z[i * k + j] - mx[i]); /* (vectorised) */
    for (Py_ssize_t j = 0; j < k; j++)
        for (Py_ssize_t i = 0; i < u; i++) s[i] = s[i] + z[i * k + j];
    for (Py_ssize_t i = 0; i < u; i++) den[i] = s[i] + exp_fixed(sink[i] - mx[i]);
}

/* One token's attention over its k keys kp[j] (read in place); z [h, k] scores, then weights; den [h]: scratch
 * of the call */
static inline __attribute__((always_inline)) void
attend_token(const float *restrict qt, const float *const *kp, const float *restrict sink, Py_ssize_t h, Py_ssize_t k,
             Py_ssize_t hd, float scale, float *restrict ot, float *restrict z, float *restrict den) {
    for (Py_ssize_t j = 0; j < k; j++) dot_heads(qt, kp[j], h, hd, scale, z + j, k);
    Py_ssize_t i = 0;
    for (; i + 4 <= h; i += 4) /* four heads' max and sum chains interleaved, each in key order */
        softmax_heads(z + i * k, sink + i, 4, k, den + i);
    softmax_heads(z + i * k, sink + i, h - i, k, den + i);
    for (i = 0; i < h; i++) {
        float *oi = ot + i * hd;
        weigh_keys(kp, z + i * k, k, hd, oi);
        for (Py_ssize_t d = 0; d < hd; d++) oi[d] = oi[d] / den[i];
    }
}

#if HAVE_X86_AVX2
/* r[m] = the scores of 16 lane vectors a[m] reduced by dot's tree (lane l + 8 onto lane l, then l + 4 onto l,
 * then (0 + 2) + (1 + 3)), all 16 at once: each add of the network adds two lanes of the same a[m], so r[m] has
 * exactly dot's bits for a[m] */
__attribute__((target("avx512f"), always_inline)) static inline v16 tree16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int p = 0; p < 8; p++)
        b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int p = 0; p < 4; p++)
        c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(b[2 * p], b[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int p = 0; p < 2; p++)
        d[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(c[2 * p], c[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* r[e * 4 + u] = dot(q_e, key_u) for four heads q_e = q + e * d and four keys kp[0..3] of d floats (a multiple
 * of 16), each dot's lanes and tree (tree16): attention's scores and the indexer's dots */
__attribute__((target("avx512f"), always_inline)) static inline v16 dots4x4(const float *restrict q,
                                                                            const float *const *kp, Py_ssize_t d) {
    v16 acc[16] = {{0}}, x, y; /* acc[head * 4 + key] */
    for (Py_ssize_t c = 0; c < d; c += LANES)
        for (int u = 0; u < 4; u++) {
            memcpy(&y, kp[u] + c, sizeof y);
            for (int e = 0; e < 4; e++) {
                memcpy(&x, q + e * d + c, sizeof x);
                acc[e * 4 + u] = acc[e * 4 + u] + x * y;
            }
        }
    return tree16(acc);
}

/* columns c .. c + 16 nv of o [4 heads, hd] = the sums over the keys j, in key order, of e[head * k + j] * kp[j],
 * then / den[head]: 4 nv addition chains in registers. With sum, first den[head] = (the sum of its weights, in key
 * order: softmax_heads' chain) + esink[head] (its exp(sink - max)) */
__attribute__((target("avx512f"), always_inline)) static inline void
weigh_heads16(const float *const *kp, const float *restrict e, Py_ssize_t k, Py_ssize_t c,
              const int nv, const float *restrict esink, float *restrict den, const int sum, float *restrict o,
              Py_ssize_t hd) {
    v16 acc[4][4] = {{{0}}}, x[4];
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (Py_ssize_t j = 0; j < k; j++) {
        for (int v = 0; v < nv; v++) memcpy(&x[v], kp[j] + c + v * LANES, sizeof x[v]);
        for (int h = 0; h < 4; h++) {
            const float w = e[h * k + j];
            const v16 wv = {w, w, w, w, w, w, w, w, w, w, w, w, w, w, w, w};
            for (int v = 0; v < nv; v++) acc[h][v] = acc[h][v] + wv * x[v];
            if (sum) s[h] = s[h] + w;
        }
    }
    for (int h = 0; h < 4; h++) {
        if (sum) den[h] = s[h] + esink[h];
        const v16 dv = {den[h], den[h], den[h], den[h], den[h], den[h], den[h], den[h],
                        den[h], den[h], den[h], den[h], den[h], den[h], den[h], den[h]};
        for (int v = 0; v < nv; v++) {
            const v16 r = acc[h][v] / dv;
            memcpy(o + h * hd + c + v * LANES, &r, sizeof r);
        }
    }
}

/* softmax_heads' max and exp for four heads of z [4, k] (the max over 16 lanes then across them: a max is exact
 * and an equal +0 / -0 gives the same exps), without the sum: esink [4] = exp(sink - max) */
__attribute__((target("avx512f"), always_inline)) static inline void exp_heads16(float *restrict z,
                                                                                const float *restrict sink,
                                                                                Py_ssize_t k, float *restrict esink) {
    for (int h = 0; h < 4; h++) {
        float *zh = z + h * k;
        float mx = sink[h];
        Py_ssize_t j = 0;
        if (k >= LANES) {
            v16 m, x;
            memcpy(&m, zh, sizeof m);
            for (j = LANES; j + LANES <= k; j += LANES) {
                memcpy(&x, zh + j, sizeof x);
                m = (v16)_mm512_max_ps((__m512)x, (__m512)m); /* x > m ? x : m */
            }
            for (int l = 0; l < LANES; l++) mx = m[l] > mx ? m[l] : mx;
        }
        for (; j < k; j++) mx = zh[j] > mx ? zh[j] : mx;
        for (j = 0; j < k; j++) zh[j] = exp_fixed(zh[j] - mx);
        esink[h] = exp_fixed(sink[h] - mx);
    }
}

/* attend_token for h a multiple of 4 and hd of 16 in 16-lane vectors, the same bits: the scores of four heads
 * against four keys at a time, each score dot's lanes and tree; the weighted sums of four heads at once, each
 * column added in key order */
__attribute__((target("avx512f"))) static void attend_token16(const float *restrict qt, const float *const *kp,
                                                              const float *restrict sink, Py_ssize_t h, Py_ssize_t k,
                                                              Py_ssize_t hd, float scale, float *restrict ot,
                                                              float *restrict z, float *restrict den) {
    const v16 sc = {scale, scale, scale, scale, scale, scale, scale, scale,
                    scale, scale, scale, scale, scale, scale, scale, scale};
    for (Py_ssize_t i = 0; i < h; i += 4) {
        const float *q = qt + i * hd;
        Py_ssize_t j = 0;
        for (; j + 4 <= k; j += 4) {
            const v16 r = dots4x4(q, kp + j, hd) * sc;
            for (int e = 0; e < 4; e++) memcpy(z + (i + e) * k + j, (const float *)&r + e * 4, 4 * sizeof(float));
        }
        for (; j < k; j++) dot_heads(q, kp[j], 4, hd, scale, z + i * k + j, k);
        float esink[4];
        exp_heads16(z + i * k, sink + i, k, esink);
        Py_ssize_t c = 0;
        for (; c + 4 * LANES <= hd; c += 4 * LANES)
            weigh_heads16(kp, z + i * k, k, c, 4, esink, den + i, c == 0, ot + i * hd, hd);
        for (; c < hd; c += LANES) weigh_heads16(kp, z + i * k, k, c, 1, esink, den + i, c == 0, ot + i * hd, hd);
    }
}
#endif

/* returns 1 if a slot token t of [0, n) would read is outside [0, rows), else 0 */
static int attend_check(const int64_t *restrict wslots, Py_ssize_t n, Py_ssize_t w, const int64_t *restrict eslots,
                        Py_ssize_t es, const int64_t *restrict topk, Py_ssize_t k, Py_ssize_t rows) {
    for (Py_ssize_t t = 0; t < n; t++) {
        for (Py_ssize_t j = 0; j < w; j++)
            if (wslots[t * w + j] < 0 || wslots[t * w + j] >= rows) return 1;
        for (Py_ssize_t i = 0; i < k; i++) {
            const int64_t g = topk[t * k + i];
            if (g >= 0 && g < es && (eslots[t * es + g] < 0 || eslots[t * es + g] >= rows)) return 1;
        }
    }
    return 0;
}

#define HEAD_GROUP 4 /* heads of an attention item (the wide tile's four) */

/* The attention of the items [b, e) (checked slots): item it is token it / groups, heads [HEAD_GROUP g, HEAD_GROUP g
 * + HEAD_GROUP) of it (g = it % groups, the last group the rest). Each head's scores, softmax and weighted sums are
 * its own (attend_token, attend_token16: per head the same operations whatever heads come with it). kp [w + k],
 * z [HEAD_GROUP (w + k)], den [HEAD_GROUP]: scratch; wide: attend_token16 where h and hd allow it */
CLONES static void attend_items(const float *restrict q, const float *restrict window, const int64_t *restrict wslots,
                                const uint8_t *restrict wok, Py_ssize_t n, Py_ssize_t w, const float *restrict entries,
                                const int64_t *restrict eslots, Py_ssize_t es, const int64_t *restrict topk,
                                Py_ssize_t k, Py_ssize_t hd, const float *restrict sink, Py_ssize_t h, float scale,
                                float *restrict out, int64_t b, int64_t e, const float **kp, float *restrict z,
                                float *restrict den, int wide) {
    wide = wide && h % 4 == 0 && hd % LANES == 0;
    const Py_ssize_t groups = (h + HEAD_GROUP - 1) / HEAD_GROUP;
    Py_ssize_t have = -1, m = 0; /* the token whose keys kp holds, and their count */
    for (int64_t it = b; it < e; it++) {
        const Py_ssize_t t = (Py_ssize_t)(it / groups), i0 = (Py_ssize_t)(it % groups) * HEAD_GROUP;
        const Py_ssize_t hg = h - i0 < HEAD_GROUP ? h - i0 : HEAD_GROUP;
        if (t != have) {
            if (t + 1 < n) { /* the next token's keys on their way to the cache while this token computes; a window
                              * that slides by one from this token's (a prompt's next token) brings only its newest key */
                const Py_ssize_t j0 = w > 1 && wslots[(t + 1) * w] == wslots[t * w + 1] ? w - 1 : 0;
                for (Py_ssize_t j = j0; j < w; j++)
                    for (Py_ssize_t d = 0; d < hd; d += 16) __builtin_prefetch(window + wslots[(t + 1) * w + j] * hd + d);
                for (Py_ssize_t i = 0; i < k; i++) {
                    const int64_t g = topk[(t + 1) * k + i];
                    if (g >= 0 && g < es)
                        for (Py_ssize_t d = 0; d < hd; d += 16)
                            __builtin_prefetch(entries + eslots[(t + 1) * es + g] * hd + d);
                }
            }
            m = 0; /* the keys with ok, in key order: a masked key only adds exp(-inf) = +0 to the sums */
            for (Py_ssize_t j = 0; j < w; j++)
                if (wok[t * w + j]) kp[m++] = window + wslots[t * w + j] * hd;
            for (Py_ssize_t i = 0; i < k; i++) {
                const int64_t g = topk[t * k + i];
                if (g >= 0 && g < es) kp[m++] = entries + eslots[t * es + g] * hd;
            }
            have = t;
        }
        const float *qt = q + (t * h + i0) * hd;
        float *ot = out + (t * h + i0) * hd;
#if HAVE_X86_AVX2
        if (wide)
            attend_token16(qt, kp, sink + i0, hg, m, hd, scale, ot, z, den);
        else
#endif
            attend_token(qt, kp, sink + i0, hg, m, hd, scale, ot, z, den);
    }
}

CLONES static void pool_pair_rows(const float *restrict first, const float *restrict second, Py_ssize_t n,
                                  Py_ssize_t hd, float *restrict out) {
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *f = first + t * 2 * hd, *s = second + t * 2 * hd;
        float *o = out + t * hd;
        for (Py_ssize_t d = 0; d < hd; d++) {
            const float g0 = f[hd + d], g1 = s[hd + d];
            const float m = g0 > g1 ? g0 : g1;
            const float e0 = exp_fixed(g0 - m), e1 = exp_fixed(g1 - m);
            o[d] = (e0 * f[d] + e1 * s[d]) / (e0 + e1);
        }
    }
}

/* ---- top-k with the written tie rule -------------------------------------------------------------- */

/* whether value a (index ia) comes before b (index ib): higher first, a NaN above every number, ties to the
 * lower index */
static inline int ranks_before(float a, Py_ssize_t ia, float b, Py_ssize_t ib) {
    if (a != a) return b == b || ia < ib;
    if (b != b) return 0;
    return a > b || (a == b && ia < ib);
}

/* out [k]: the k best of x [v] in order (an insertion into the sorted picks so far; the indices come in
 * ascending order, so an equal value goes after the earlier ones); -1 for -inf picks and beyond v.
 * vals [k] scratch. Returns the picks made (min(k, v)). */
static Py_ssize_t topk_row(const float *restrict x, Py_ssize_t v, Py_ssize_t k, int64_t *restrict out,
                           float *restrict vals) {
    Py_ssize_t cnt = 0;
    for (Py_ssize_t j = 0; j < v; j++) {
        const float xj = x[j];
        if (cnt == k && !ranks_before(xj, j, vals[k - 1], out[k - 1])) continue;
        Py_ssize_t p = cnt < k ? cnt++ : k - 1;
        while (p > 0 && ranks_before(xj, j, vals[p - 1], out[p - 1])) {
            vals[p] = vals[p - 1], out[p] = out[p - 1];
            p--;
        }
        vals[p] = xj, out[p] = j;
    }
    return cnt;
}

#define TOPK_RANK_SMALL 96  /* a row of at most this many values is ranked whole (topk_rank16) whatever k */
#define TOPK_RANK_MAX 2048 /* a row of at most this many values may be ranked whole */

/* whether topk_rank16 takes a row of v values (every value ranked against every other, ~v^2 / 16 vector steps), not
 * topk_row (an insertion into the picks, ~v min(k, v) scalar steps): measured faster up to 96 values whatever k,
 * and up to 4 k values (one thread, Xeon: v 128, k 64 1.6 us a row against 3.5; v 512, k 512 17 against 71) */
static int topk_ranks(Py_ssize_t v, Py_ssize_t k) {
    return v <= TOPK_RANK_MAX && (v <= TOPK_RANK_SMALL || v <= 4 * k);
}

#if HAVE_X86_AVX2
/* topk_row for v <= TOPK_RANK_MAX with AVX-512, the same picks: a value's place is the number of values that rank
 * before it, counted 16 at a time on keys that order as ranks_before does (an int32 a value: -0 as +0, every NaN
 * above +inf; an equal key ranks before when its index is lower). key [v], kv and valid [v / 16 rounded up]: the
 * caller's scratch (on its stack: a frame sized for 2,048 values made rows of 64 values 1.25x slower) */
__attribute__((target("avx512f,popcnt"), always_inline)) static inline Py_ssize_t
topk_rank16(const float *restrict x, Py_ssize_t v, Py_ssize_t k, int64_t *restrict out, float *restrict vals,
            int32_t *restrict key, __m512i *restrict kv, __mmask16 *restrict valid) {
    for (Py_ssize_t j = 0; j < v; j++) {
        const float y = x[j] + 0.0f; /* -0 -> +0 */
        int32_t b;
        memcpy(&b, &y, sizeof b);
        key[j] = y != y ? INT32_MAX : (b < 0 ? b ^ INT32_MAX : b); /* a negative value: its magnitude bits flipped */
    }
    const Py_ssize_t chunks = (v + 15) / 16;
    for (Py_ssize_t c = 0; c < chunks; c++) {
        valid[c] = v - c * 16 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (v - c * 16)) - 1);
        kv[c] = _mm512_maskz_loadu_epi32(valid[c], key + c * 16);
    }
    for (Py_ssize_t j = 0; j < v; j++) {
        const __m512i kj = _mm512_set1_epi32(key[j]);
        unsigned before = 0;
        for (Py_ssize_t c = 0; c < chunks; c++) {
            const Py_ssize_t lower = j - c * 16; /* the lanes of lower index than j */
            const __mmask16 low = lower >= 16 ? (__mmask16)0xffff : lower <= 0 ? 0 : (__mmask16)((1u << lower) - 1);
            before += (unsigned)__builtin_popcount((unsigned)(_mm512_mask_cmpgt_epi32_mask(valid[c], kv[c], kj) |
                                                              _mm512_mask_cmpeq_epi32_mask(low, kv[c], kj)));
        }
        if (before < (unsigned)k) out[before] = j, vals[before] = x[j];
    }
    return v < k ? v : k;
}

/* topk_rank16 with scratch for up to N values */
#define TOPK_RANK_UPTO(NAME, N)                                                                                    \
    __attribute__((target("avx512f,popcnt"))) static Py_ssize_t NAME(                                              \
        const float *restrict x, Py_ssize_t v, Py_ssize_t k, int64_t *restrict out, float *restrict vals) {        \
        int32_t key[N];                                                                                            \
        __m512i kv[N / 16];                                                                                        \
        __mmask16 valid[N / 16];                                                                                   \
        return topk_rank16(x, v, k, out, vals, key, kv, valid);                                                    \
    }
TOPK_RANK_UPTO(topk_rank_small, TOPK_RANK_SMALL)
TOPK_RANK_UPTO(topk_rank_large, TOPK_RANK_MAX)
#undef TOPK_RANK_UPTO
#endif

static void topk_rows(const float *restrict x, Py_ssize_t rows, Py_ssize_t v, Py_ssize_t k, int64_t *restrict out,
                      float *restrict vals) {
#if HAVE_X86_AVX2
    const int rank = topk_ranks(v, k) && __builtin_cpu_supports("avx512f");
#endif
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t *o = out + r * k;
        Py_ssize_t cnt;
#if HAVE_X86_AVX2
        if (rank)
            cnt = v <= TOPK_RANK_SMALL ? topk_rank_small(x + r * v, v, k, o, vals)
                                       : topk_rank_large(x + r * v, v, k, o, vals);
        else
#endif
            cnt = topk_row(x + r * v, v, k, o, vals);
        for (Py_ssize_t i = 0; i < k; i++)
            if (i >= cnt || vals[i] == -INFINITY) o[i] = -1;
    }
}

/* ---- indexer --------------------------------------------------------------------------------------------- */

#if HAVE_X86_AVX2
/* index_scores_rows' scores of one token's live entries (keys kp[j], written to ot[gi[j]]) four at a time, for nh a
 * multiple of 4 and ihd of 16, the same bits: four heads' dots against four entries at once, their 16 lane sums
 * reduced together by dot's tree (tree16), then each entry's sum over the heads in order. Returns the entries
 * scored: m rounded down to a multiple of 4 */
__attribute__((target("avx512f"))) static Py_ssize_t index_token16(const float *restrict qt, const float *restrict wt,
                                                                   const float *const *kp,
                                                                   const Py_ssize_t *restrict gi, Py_ssize_t m,
                                                                   Py_ssize_t nh, Py_ssize_t ihd, float *restrict ot) {
    Py_ssize_t j = 0;
    for (; j + 4 <= m; j += 4) {
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (Py_ssize_t i = 0; i < nh; i += 4) {
            const v16 r = dots4x4(qt + i * ihd, kp + j, ihd);
            for (int u = 0; u < 4; u++)
                for (int e = 0; e < 4; e++) {
                    const float dd = r[e * 4 + u];
                    acc[u] = acc[u] + wt[i + e] * (dd < 0.0f ? 0.0f : dd);
                }
        }
        for (int u = 0; u < 4; u++) ot[gi[j + u]] = acc[u];
    }
    return j;
}
#endif

/* The scores of entries [g0, g1) of each token (each entry's score its own: the same bits in any range). keep
 * [e / block], wt [nh], kp [g1 - g0], gi [g1 - g0]: scratch of the call; wide: index_token16 where nh and ihd allow
 * it */
CLONES static void index_scores_rows(const float *restrict q, const float *restrict w, float wscale,
                                     const float *restrict pool, const int64_t *restrict slots,
                                     const int64_t *restrict count, Py_ssize_t n, Py_ssize_t es, Py_ssize_t e,
                                     Py_ssize_t nh, Py_ssize_t ihd, const int64_t *restrict cands, Py_ssize_t nc,
                                     Py_ssize_t block, float *restrict out, uint8_t *restrict keep, float *restrict wt,
                                     const float **kp, Py_ssize_t *restrict gi, int wide, Py_ssize_t g0,
                                     Py_ssize_t g1) {
    const Py_ssize_t nb = e / block;
    wide = wide && nh % 4 == 0 && ihd % LANES == 0;
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *qt = q + t * nh * ihd;
        const int64_t *st = slots + t * es;
        float *ot = out + t * e;
        const Py_ssize_t lim = count[t] < es ? (count[t] < 0 ? 0 : count[t]) : es;
        for (Py_ssize_t i = 0; i < nh; i++) wt[i] = w[t * nh + i] * wscale;
        if (cands) {
            memset(keep, 0, (size_t)nb);
            for (Py_ssize_t c = 0; c < nc; c++) {
                const int64_t b = cands[t * nc + c];
                if (b >= 0 && b < nb) keep[b] = 1;
            }
        }
        Py_ssize_t m = 0; /* the live entries: below the count and, with candidates, in a kept block */
        for (Py_ssize_t g = g0; g < g1; g++) {
            if (g >= lim || (cands && !keep[g / block])) {
                ot[g] = -INFINITY;
                continue;
            }
            kp[m] = pool + st[g] * ihd, gi[m++] = g;
        }
        Py_ssize_t j = 0;
#if HAVE_X86_AVX2
        if (wide) j = index_token16(qt, wt, kp, gi, m, nh, ihd, ot);
#endif
        for (; j < m; j++) {
            float acc = 0.0f;
            for (Py_ssize_t i = 0; i < nh; i++) {
                const float d = dot(qt + i * ihd, kp[j], ihd);
                acc = acc + wt[i] * (d < 0.0f ? 0.0f : d);
            }
            ot[gi[j]] = acc;
        }
    }
}

static void candidate_blocks_rows(const float *restrict s, const int64_t *restrict count, Py_ssize_t n, Py_ssize_t e,
                                  Py_ssize_t block, Py_ssize_t k, int64_t *restrict out, float *restrict bs,
                                  float *restrict vals) {
    const Py_ssize_t nb = e / block;
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *st = s + t * e;
        for (Py_ssize_t b = 0; b < nb; b++) {
            float m = -INFINITY;
            for (Py_ssize_t i = 0; i < block; i++) {
                const float v = st[b * block + i];
                m = (v > m || v != v) && m == m ? v : m; /* a NaN, once seen, stays */
            }
            bs[b] = m;
        }
        const int64_t newest = count[t] > 0 ? (count[t] - 1) / block : -1;
        if (newest >= 0 && newest < nb) bs[newest] = INFINITY;
        topk_rows(bs, 1, nb, k, out + t * k, vals);
    }
}

/* ---- MoE ------------------------------------------------------------------------------------------------ */

static void moe_route_rows(const float *restrict z, const float *restrict bias, Py_ssize_t n, Py_ssize_t e,
                           Py_ssize_t k, int norm, float scale, int64_t *restrict ids, float *restrict w,
                           float *restrict score, float *restrict choose, float *restrict vals) {
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *zt = z + t * e;
        for (Py_ssize_t j = 0; j < e; j++) {
            const float x = zt[j];
            score[j] = sqrtf(x > 20.0f ? x : log1pf(exp_fixed(x)));
            choose[j] = score[j] + bias[j];
        }
        int64_t *it = ids + t * k;
        float *wt = w + t * k;
        topk_row(choose, e, k, it, vals);
        float sum = 0.0f;
        for (Py_ssize_t i = 0; i < k; i++) {
            wt[i] = score[it[i]];
            sum = sum + wt[i];
        }
        for (Py_ssize_t i = 0; i < k; i++) wt[i] = ((norm && k > 1) ? wt[i] / sum : wt[i]) * scale;
    }
}

/* returns the first pair whose id is outside [0, e), or -1 */
static Py_ssize_t moe_group(const int64_t *restrict ids, Py_ssize_t pairs, Py_ssize_t e, Py_ssize_t k,
                            int64_t *restrict order, int64_t *restrict counts, int64_t *restrict tok,
                            int64_t *restrict start) {
    for (Py_ssize_t p = 0; p < pairs; p++)
        if (ids[p] < 0 || ids[p] >= e) return p;
    for (Py_ssize_t j = 0; j < e; j++) counts[j] = 0;
    for (Py_ssize_t p = 0; p < pairs; p++) counts[ids[p]]++;
    int64_t at = 0;
    for (Py_ssize_t j = 0; j < e; j++) start[j] = at, at += counts[j];
    for (Py_ssize_t p = 0; p < pairs; p++) order[start[ids[p]]++] = p;
    for (Py_ssize_t p = 0; p < pairs; p++) tok[p] = order[p] / k;
    return -1;
}

#define COMBINE_CHUNK 64 /* outputs of a token summed in registers at a time */

/* the tokens [t0, t1) of moe_combine (the header), at [n * k] the row of ys of each (token, pick), -1 for none: a
 * token's pairs in ascending row (the pairs' order), each output summed in a register from 0 and written once */
CLONES static void moe_combine_rows(const float *restrict ys, const int64_t *restrict at, const float *restrict w,
                                    Py_ssize_t t0, Py_ssize_t t1, Py_ssize_t k, Py_ssize_t dim,
                                    const float *restrict shared, float *restrict out) {
    int64_t rows[k];
    float wr[k];
    for (Py_ssize_t t = t0; t < t1; t++) {
        Py_ssize_t np = 0;
        for (Py_ssize_t j = 0; j < k; j++) { /* insertion: ascending row */
            const int64_t r = at[t * k + j];
            if (r < 0) continue;
            Py_ssize_t i = np++;
            for (; i > 0 && rows[i - 1] > r; i--) rows[i] = rows[i - 1], wr[i] = wr[i - 1];
            rows[i] = r, wr[i] = w[t * k + j];
        }
        for (Py_ssize_t d0 = 0; d0 < dim; d0 += COMBINE_CHUNK) {
            const Py_ssize_t m = dim - d0 < COMBINE_CHUNK ? dim - d0 : COMBINE_CHUNK;
            float acc[COMBINE_CHUNK] = {0.0f};
            for (Py_ssize_t i = 0; i < np; i++) {
                const float *y = ys + rows[i] * dim + d0, wi = wr[i];
                for (Py_ssize_t d = 0; d < m; d++) acc[d] = acc[d] + y[d] * wi;
            }
            if (shared)
                for (Py_ssize_t d = 0; d < m; d++) acc[d] = acc[d] + shared[t * dim + d0 + d];
            memcpy(out + t * dim + d0, acc, (size_t)m * sizeof(float));
        }
    }
}

CLONES static void swiglu_rows(const float *restrict gu, Py_ssize_t n, Py_ssize_t inter, float limit,
                               float *restrict out) {
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
        for (Py_ssize_t d = 0; d < inter; d++) o[d] = swiglu_value(g[d], u[d], limit);
    }
}

/* ---- Engram, embedding, sampling ------------------------------------------------------------------------ */

#define MAX_GATE_DIM 65536 /* the widest branch engram_gate takes (its normed rows on the stack) */

CLONES static void engram_gate_rows(const float *restrict h, Py_ssize_t n, Py_ssize_t hc, Py_ssize_t dim,
                                    const float *restrict kv, const float *restrict qw, const float *restrict kw,
                                    const uint8_t *restrict dead, float eps, float *restrict hout) {
    const float root = sqrtf((float)dim);
    float qn[dim], kn[dim]; /* (dim <= MAX_GATE_DIM: 512 KiB of stack at most) */
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *ht = h + t * hc * dim;
        float *hot = hout + t * hc * dim;
        const float *kvt = kv + t * (hc + 1) * dim, *value = kvt + hc * dim;
        for (Py_ssize_t i = 0; i < hc; i++) {
            const float *hi = ht + i * dim;
            const float *key = kvt + i * dim;
            const float rq = rms_scale(hi, dim, eps), rk = rms_scale(key, dim, eps);
            for (Py_ssize_t d = 0; d < dim; d++) {
                qn[d] = hi[d] * rq * qw[i * dim + d];
                kn[d] = key[d] * rk * kw[i * dim + d];
            }
            const float qk = dot(qn, kn, dim) / root;
            const float mag = sqrtf(fmaxf(fabsf(qk), 1e-6f));
            const float z = qk < 0.0f ? -mag : (qk == qk ? mag : qk);  /* the positive root at qk = +-0; NaN stays */
            const float gate = (dead && dead[t]) ? 0.0f : 1.0f / (1.0f + exp_fixed(-z));
            for (Py_ssize_t d = 0; d < dim; d++) hot[i * dim + d] = hi[d] + gate * value[d];
        }
    }
}

/* The row's maximum over its numbers (a NaN compares false: skipped), whether it holds a NaN, and whether it
 * holds a value that is not finite (x - x is 0 for a finite x, NaN for +-inf and NaN). */
static float row_max_plain(const float *restrict xr, Py_ssize_t v, Py_ssize_t j, float mx, int *restrict has_nan,
                           int *restrict bad) {
    for (; j < v; j++) {
        mx = xr[j] > mx ? xr[j] : mx;
        *has_nan |= xr[j] != xr[j];
        *bad |= !(xr[j] - xr[j] == 0.0f);
    }
    return mx;
}

#if HAVE_X86_AVX2
/* The same in AVX2 where the CPU has it (GCC does not vectorise the select): vmaxps(x, m) is x > m ? x : m. */
__attribute__((target("avx2"))) static float row_max_avx2(const float *restrict xr, Py_ssize_t v, int *restrict has_nan,
                                                           int *restrict bad) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, n0 = _mm256_setzero_ps(), n1 = n0, f0 = n0, f1 = n0;
    const __m256 zero = _mm256_setzero_ps();
    Py_ssize_t j = 0;
    for (; j + 16 <= v; j += 16) {
        const __m256 a = _mm256_loadu_ps(xr + j), b = _mm256_loadu_ps(xr + j + 8);
        m0 = _mm256_max_ps(a, m0), m1 = _mm256_max_ps(b, m1);
        n0 = _mm256_or_ps(n0, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)), n1 = _mm256_or_ps(n1, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
        f0 = _mm256_or_ps(f0, _mm256_cmp_ps(_mm256_sub_ps(a, a), zero, _CMP_NEQ_UQ));
        f1 = _mm256_or_ps(f1, _mm256_cmp_ps(_mm256_sub_ps(b, b), zero, _CMP_NEQ_UQ));
    }
    float lanes[16];
    _mm256_storeu_ps(lanes, m0), _mm256_storeu_ps(lanes + 8, m1);
    *has_nan = _mm256_movemask_ps(_mm256_or_ps(n0, n1)) != 0;
    *bad = _mm256_movemask_ps(_mm256_or_ps(f0, f1)) != 0;
    int lanes_bad = 0; /* (the lanes start at -inf) */
    return row_max_plain(lanes, 16, 0, row_max_plain(xr, v, j, -INFINITY, has_nan, bad), has_nan, &lanes_bad);
}
#endif

static float row_max(const float *restrict xr, Py_ssize_t v, int *restrict has_nan, int *restrict bad) {
#if HAVE_X86_AVX2
    if (__builtin_cpu_supports("avx2")) return row_max_avx2(xr, v, has_nan, bad);
#endif
    *has_nan = *bad = 0;
    return row_max_plain(xr, v, 0, -INFINITY, has_nan, bad);
}

static void argmax_rows(const float *restrict x, Py_ssize_t rows, Py_ssize_t v, int64_t *restrict out,
                        uint8_t *restrict finite) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *xr = x + r * v;
        int has_nan, bad;
        const float mx = row_max(xr, v, &has_nan, &bad);
        if (finite) finite[r] = !bad;
        Py_ssize_t at = 0;
        if (has_nan)
            while (xr[at] == xr[at]) at++;
        else
            while (xr[at] != mx) at++;
        out[r] = at;
    }
}

/* the first of the n ids outside [0, rows), or -1 */
static Py_ssize_t id_outside(const int64_t *restrict ids, Py_ssize_t n, Py_ssize_t rows) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= rows) return t;
    return -1;
}


/* ---- the kernels' arguments and their Python functions ----------------------------------------------------
 * Each kernel's arguments are one X-macro list (_kernel_buffers.h): its struct, parser (positional and keyword
 * arguments), raw entry and docstring all come from it. The order is the positional one. */

/* whether the 16-lane tiles (attend_token16, index_token16) run on this CPU */
static int has_avx512(void) {
#if HAVE_X86_AVX2
    return __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

/* whole cache lines (aligned_alloc takes a multiple of its alignment) */
static void *scratch(size_t bytes) { return aligned_alloc(64, bytes ? (bytes + 63) / 64 * 64 : 64); }

/* ---- threads ---------------------------------------------------------------------------------------------------
 * A kernel's tokens (or rows; the (token, head group) items of attend_paged) run in contiguous ranges across the
 * kernels' pool (_thread_pool.h): each token is computed whole by one thread, by the same operations as alone
 * (every kernel here computes a token alone already), so its bits do not depend on the thread count. A call whose
 * work (COST, about one unit an element's operation) is small stays on the calling thread. Scratch is a part's own
 * (allocated per part). */

/* run_NAME: NAME_range(a, begin, end) over the items [0, a->N) on the pool */
#define TOKEN_JOB(NAME, N, COST)                                                                                   \
    static void NAME##_part(void *c, int64_t b, int64_t e) { NAME##_range((const struct NAME##_args *)c, b, e); }  \
    static void run_##NAME(const struct NAME##_args *a) {                                                          \
        parallel_for_cost(a->N, (double)(COST), NAME##_part, (void *)(uintptr_t)a);                                \
    }

#define HC_MIX_FIELDS(X)                                                                                       \
    X(ADDR, x, "[n, hc * dim] float32: the streams")                                                           \
    X(ADDR, mm, "[n, (2 + hc) * hc] float32: fn . x")                                                          \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, hc, "streams (1 to 16)")                                                                           \
    X(SIZE, dim, "values of a stream")                                                                         \
    X(ADDR, scale, "[3] float32: the pre, post and comb segments' scales")                                     \
    X(ADDR, base, "[(2 + hc) * hc] float32")                                                                   \
    X(REAL, eps, "the RMS epsilon")                                                                            \
    X(REAL, hc_eps, "added to pre and in the Sinkhorn sums")                                                   \
    X(SIZE, iters, "Sinkhorn iterations")                                                                      \
    X(ADDR, pre, "[n, hc] float32, written")                                                                   \
    X(ADDR, post, "[n, hc] float32, written")                                                                  \
    X(ADDR, comb, "[n, hc, hc] float32, written")
KERNEL_ARGS(hc_mix, HC_MIX_FIELDS, "mHC mixes: pre, post and the Sinkhorn-normalised comb of each token.")
static void hc_mix_range(const struct hc_mix_args *a, int64_t b, int64_t e) {
    const Py_ssize_t hc = a->hc, mix = (2 + hc) * hc;
    hc_mix_rows(CF(a->x) + b * hc * a->dim, CF(a->mm) + b * mix, e - b, hc, a->dim, CF(a->scale), CF(a->base),
                (float)a->eps, (float)a->hc_eps, a->iters, F(a->pre) + b * hc, F(a->post) + b * hc,
                F(a->comb) + b * hc * hc);
}
TOKEN_JOB(hc_mix, n, a->n * (a->hc * a->dim + 8 * a->iters * a->hc * a->hc + 40 * (2 + a->hc) * a->hc))
RAW_ENTRY(hc_mix)
KERNEL_PY(hc_mix) {
    PARSE(hc_mix);
    if (a.n < 0 || a.hc < 1 || a.hc > MAX_HC || a.dim < 1 ||
        (a.n && (!a.x || !a.mm || !a.scale || !a.base || !a.pre || !a.post || !a.comb)))
        return misfit("hc_mix", "n >= 0, 1 <= hc <= 16, dim >= 1 and every array");
    Py_BEGIN_ALLOW_THREADS
    run_hc_mix(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define COLLAPSE_FIELDS(X)                                                                                     \
    X(ADDR, x, "[n, hc * dim] float32: the streams")                                                           \
    X(ADDR, mix, "[n, hc] float32")                                                                            \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, hc, "streams")                                                                                     \
    X(SIZE, dim, "values of a stream")                                                                         \
    X(ADDR, out, "[n, dim] float32, written")
KERNEL_ARGS(collapse, COLLAPSE_FIELDS, "out = sum_i mix_i x_i (streams in order).")
static void collapse_range(const struct collapse_args *a, int64_t b, int64_t e) {
    collapse_rows(CF(a->x) + b * a->hc * a->dim, CF(a->mix) + b * a->hc, e - b, a->hc, a->dim, F(a->out) + b * a->dim);
}
TOKEN_JOB(collapse, n, a->n * a->hc * a->dim)
RAW_ENTRY(collapse)
KERNEL_PY(collapse) {
    PARSE(collapse);
    if (a.n < 0 || a.hc < 1 || a.dim < 1 || (a.n && (!a.x || !a.mix || !a.out)))
        return misfit("collapse", "n >= 0, hc, dim >= 1");
    Py_BEGIN_ALLOW_THREADS
    run_collapse(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define STREAM_MEAN_FIELDS(X)                                                                                  \
    X(ADDR, x, "[n, hc * dim] float32: the streams")                                                           \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, hc, "streams")                                                                                     \
    X(SIZE, dim, "values of a stream")                                                                         \
    X(ADDR, out, "[n, dim] float32, rows ldo floats apart, written")                                           \
    X(SIZE, ldo, "floats between two rows of out (>= dim)")
KERNEL_ARGS(stream_mean, STREAM_MEAN_FIELDS, "out = (x_0 + x_1 + ...) / hc (streams in order).")
static void stream_mean_range(const struct stream_mean_args *a, int64_t b, int64_t e) {
    const Py_ssize_t hc = a->hc, dim = a->dim;
    const float div = (float)hc;
    for (int64_t t = b; t < e; t++) {
        const float *xt = CF(a->x) + t * hc * dim;
        float *ot = F(a->out) + t * a->ldo;
        Py_ssize_t d = 0;
        for (; d + HC_D <= dim; d += HC_D) {
            v16 acc = V16_AT(xt + d);
            for (Py_ssize_t i = 1; i < hc; i++) acc = acc + V16_AT(xt + i * dim + d);
            acc = acc / div;
            memcpy(ot + d, &acc, sizeof acc);
        }
        for (; d < dim; d++) {
            float acc = xt[d];
            for (Py_ssize_t i = 1; i < hc; i++) acc = acc + xt[i * dim + d];
            ot[d] = acc / div;
        }
    }
}
TOKEN_JOB(stream_mean, n, a->n * a->hc * a->dim)
RAW_ENTRY(stream_mean)
KERNEL_PY(stream_mean) {
    PARSE(stream_mean);
    if (a.n < 0 || a.hc < 1 || a.dim < 1 || a.ldo < a.dim || (a.n && (!a.x || !a.out)))
        return misfit("stream_mean", "n >= 0, hc, dim >= 1, ldo >= dim");
    Py_BEGIN_ALLOW_THREADS
    run_stream_mean(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define EXPAND_FIELDS(X)                                                                                       \
    X(ADDR, o, "[n, dim] float32: the sublayer's output")                                                      \
    X(ADDR, x, "[n, hc * dim] float32: the streams")                                                           \
    X(ADDR, post, "[n, hc] float32")                                                                           \
    X(ADDR, comb, "[n, hc, hc] float32")                                                                       \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, hc, "streams")                                                                                     \
    X(SIZE, dim, "values of a stream")                                                                         \
    X(ADDR, out, "[n, hc * dim] float32, written (may be x)")
KERNEL_ARGS(expand, EXPAND_FIELDS, "stream b = post_b o + sum_a comb[a][b] x_a.")
static void expand_range(const struct expand_args *a, int64_t b, int64_t e) {
    const Py_ssize_t hc = a->hc, dim = a->dim;
    expand_rows(CF(a->o) + b * dim, CF(a->x) + b * hc * dim, CF(a->post) + b * hc, CF(a->comb) + b * hc * hc, e - b, hc,
                dim, F(a->out) + b * hc * dim);
}
TOKEN_JOB(expand, n, a->n * a->hc * (a->hc + 1) * a->dim)
RAW_ENTRY(expand)
KERNEL_PY(expand) {
    PARSE(expand);
    if (a.n < 0 || a.hc < 1 || a.dim < 1 || (a.n && (!a.o || !a.x || !a.post || !a.comb || !a.out)))
        return misfit("expand", "n >= 0, hc, dim >= 1");
    Py_BEGIN_ALLOW_THREADS
    run_expand(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

ARGS_STRUCT(linear_packed, LINEAR_PACKED_FIELDS) /* the slots of hc_next's matmul */

#define HC_NEXT_FIELDS(X)                                                                                      \
    X(ADDR, o, "[n, dim] float32: the sublayer's output")                                                      \
    X(ADDR, x, "[n, hc * dim] float32: the streams before it")                                                 \
    X(ADDR, post, "[n, hc] float32: this sublayer's post")                                                     \
    X(ADDR, comb, "[n, hc, hc] float32: this sublayer's comb")                                                 \
    X(ADDR, mix, "[n, hc] float32: the next sublayer's pre (its collapse)")                                    \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, hc, "streams (1 to 16)")                                                                           \
    X(SIZE, dim, "values of a stream")                                                                         \
    X(ADDR, matmul, "the linear kernel's raw entry: linear_packed's, or linear_bf16's over bfloat16 tiles")    \
    X(ADDR, panels, "fn's packed panels (or tiles) for matmul")                                                \
    X(SIZE, kc, "matmul's block size (>= 1)")                                                                  \
    X(ADDR, scale, "[3] float32: the next mix's segment scales")                                               \
    X(ADDR, base, "[(2 + hc) * hc] float32")                                                                   \
    X(REAL, eps, "the mix's RMS epsilon")                                                                      \
    X(REAL, hc_eps, "the mix's hc epsilon")                                                                    \
    X(SIZE, iters, "Sinkhorn iterations")                                                                      \
    X(ADDR, norm_w, "[dim] float32: the next sublayer's norm weight")                                          \
    X(REAL, norm_eps, "its epsilon")                                                                           \
    X(ADDR, out, "[n, hc * dim] float32, written: the expanded streams (may be x)")                            \
    X(ADDR, pre, "[n, hc] float32, written: the next pre")                                                     \
    X(ADDR, post2, "[n, hc] float32, written: the next post")                                                  \
    X(ADDR, comb2, "[n, hc, hc] float32, written: the next comb")                                              \
    X(ADDR, h, "[n, dim] float32, written: the next sublayer's normed input")                                  \
    X(ADDR, mm, "[min(n, HC_TILE), (2 + hc) * hc] float32 scratch")                                            \
    X(ADDR, y, "[min(n, HC_TILE), dim] float32 scratch")
KERNEL_ARGS(hc_next, HC_NEXT_FIELDS,
            "expand, then the next sublayer's mix and normed input, HC_TILE tokens at a time (the header).")

/* hc_next (the header) for the tokens [b, e): expand, the product mm = fn . x' through the linear kernel's raw entry
 * `matmul` over fn's packed panels, hc_mix, collapse (into y) and rms_norm, HC_TILE tokens at a time; mm and y:
 * scratch of min(e - b, HC_TILE) tokens */
static void hc_next_tiles(const struct hc_next_args *a, int64_t b, int64_t e, float *mm, float *y) {
    const Py_ssize_t hc = a->hc, dim = a->dim, width = hc * dim, nm = (2 + hc) * hc;
    for (Py_ssize_t t = b; t < e; t += HC_TILE) {
        const Py_ssize_t m = e - t < HC_TILE ? e - t : HC_TILE;
        float *xt = F(a->out) + t * width;
        expand_rows(CF(a->o) + t * dim, CF(a->x) + t * width, CF(a->post) + t * hc, CF(a->comb) + t * hc * hc, m, hc,
                    dim, xt);
        const struct linear_packed_args mat = {.x = (uintptr_t)xt, .ldx = width, .panels = a->panels,
                                               .y = (uintptr_t)mm, .m = m, .k = width, .n = nm, .kc = a->kc, .simd = 2};
        ((raw_fn)(uintptr_t)a->matmul)((const uint64_t *)(const void *)&mat);
        hc_mix_rows(xt, mm, m, hc, dim, CF(a->scale), CF(a->base), (float)a->eps, (float)a->hc_eps, a->iters,
                    F(a->pre) + t * hc, F(a->post2) + t * hc, F(a->comb2) + t * hc * hc);
        collapse_rows(xt, CF(a->mix) + t * hc, m, hc, dim, y);
        rms_norm_rows(y, m, dim, CF(a->norm_w), (float)a->norm_eps, F(a->h) + t * dim);
    }
}

static void hc_next_part(void *c, int64_t b, int64_t e) { /* a part of several: its own scratch */
    const struct hc_next_args *a = c;
    const Py_ssize_t tile = e - b < HC_TILE ? e - b : HC_TILE;
    float *mm = scratch(sizeof(float) * (size_t)(tile * ((2 + a->hc) * a->hc + a->dim)));
    if (!mm) { /* out of memory: this part's outputs NaN */
        for (Py_ssize_t t = b; t < e; t++)
            for (Py_ssize_t d = 0; d < a->dim; d++) F(a->h)[t * a->dim + d] = NAN;
        return;
    }
    hc_next_tiles(a, b, e, mm, mm + tile * (2 + a->hc) * a->hc);
    free(mm);
}

/* the tokens in contiguous ranges across the pool (each part's matmul then runs on its thread alone); one part: the
 * caller's scratch, and the matmul may run on the pool */
static void run_hc_next(const struct hc_next_args *a) {
    const Py_ssize_t hc = a->hc, nm = (2 + hc) * hc;
    const int parts = pool_parts(a->n, (double)a->n * (double)(hc * a->dim) * (double)(nm + 2 * hc + 4));
    if (parts <= 1)
        hc_next_tiles(a, 0, a->n, F(a->mm), F(a->y));
    else
        parallel_run(a->n, parts, hc_next_part, (void *)(uintptr_t)a);
}
RAW_ENTRY(hc_next)
KERNEL_PY(hc_next) {
    PARSE(hc_next);
    if (a.n < 0 || a.hc < 1 || a.hc > MAX_HC || a.dim < 1 || a.kc < 1 ||
        (a.n && (!a.o || !a.x || !a.post || !a.comb || !a.mix || !a.matmul || !a.panels || !a.scale || !a.base ||
                 !a.norm_w || !a.out || !a.pre || !a.post2 || !a.comb2 || !a.h || !a.mm || !a.y)))
        return misfit("hc_next", "n >= 0, 1 <= hc <= 16, dim, kc >= 1 and every array");
    Py_BEGIN_ALLOW_THREADS
    run_hc_next(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define RMS_NORM_FIELDS(X)                                                                                     \
    X(ADDR, x, "[rows, dim] float32")                                                                          \
    X(SIZE, rows, "rows")                                                                                      \
    X(SIZE, dim, "values of a row")                                                                            \
    X(ADDR, w, "[dim] float32 weight, or 0 for none")                                                          \
    X(REAL, eps, "epsilon")                                                                                    \
    X(ADDR, out, "[rows, dim] float32, written")
KERNEL_ARGS(rms_norm, RMS_NORM_FIELDS, "out = x * rsqrt(mean(x^2) + eps) [* w].")
static void rms_norm_range(const struct rms_norm_args *a, int64_t b, int64_t e) {
    rms_norm_rows(CF(a->x) + b * a->dim, e - b, a->dim, CF(a->w), (float)a->eps, F(a->out) + b * a->dim);
}
TOKEN_JOB(rms_norm, rows, a->rows * a->dim * 3)
RAW_ENTRY(rms_norm)
KERNEL_PY(rms_norm) {
    PARSE(rms_norm);
    if (a.rows < 0 || a.dim < 1 || (a.rows && (!a.x || !a.out))) return misfit("rms_norm", "rows >= 0, dim >= 1");
    Py_BEGIN_ALLOW_THREADS
    run_rms_norm(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define ROPE_FIELDS(X)                                                                                         \
    X(ADDR, x, "[n, m, width] float32")                                                                        \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, m, "vectors of a token (heads)")                                                                   \
    X(SIZE, width, "values of a vector")                                                                       \
    X(ADDR, cos, "[n, half] float32")                                                                          \
    X(ADDR, sin, "[n, half] float32")                                                                          \
    X(SIZE, half, "pairs rotated: the last 2 half dims")                                                       \
    X(FLAG, inverse, "rotate back")                                                                            \
    X(ADDR, out, "[n, m, width] float32, written (may be x)")
KERNEL_ARGS(rope, ROPE_FIELDS, "interleaved RoPE of the last 2 half dims (out may be x).")
static void rope_range(const struct rope_args *a, int64_t b, int64_t e) {
    const Py_ssize_t row = a->m * a->width;
    rope_rows(CF(a->x) + b * row, e - b, a->m, a->width, CF(a->cos) + b * a->half, CF(a->sin) + b * a->half, a->half,
              (int)a->inverse, F(a->out) + b * row);
}
TOKEN_JOB(rope, n, a->n * a->m * a->width * 2)
RAW_ENTRY(rope)
KERNEL_PY(rope) {
    PARSE(rope);
    if (a.n < 0 || a.m < 0 || a.half < 0 || 2 * a.half > a.width || (a.n && a.m && (!a.x || !a.cos || !a.sin || !a.out)))
        return misfit("rope", "n, m >= 0, 0 <= 2 half <= width");
    Py_BEGIN_ALLOW_THREADS
    run_rope(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define MAX_PARTS 16

typedef struct {
    unsigned long long out, pa[MAX_PARTS];
    Py_ssize_t width, parts, pw[MAX_PARTS];
} concat_job;

static void concat_part(void *c, int64_t b, int64_t e) {
    const concat_job *j = c;
    for (Py_ssize_t t = b; t < e; t++) {
        float *o = F(j->out) + t * j->width;
        for (Py_ssize_t i = 0; i < j->parts; i++) {
            memcpy(o, CF(j->pa[i]) + t * j->pw[i], (size_t)j->pw[i] * sizeof(float));
            o += j->pw[i];
        }
    }
}

/* concat_cols takes a variable number of parts: positional only (no struct, no raw entry) */
static PyObject *py_concat_cols(PyObject *Py_UNUSED(self), PyObject *args) {
    const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs < 3 || (nargs - 3) % 2 || (nargs - 3) / 2 > MAX_PARTS)
        return misfit("concat_cols", "out, n, width, then 1 to 16 (address, width) pairs");
    concat_job j = {.out = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, 0)),
                    .width = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 2)), .parts = (nargs - 3) / 2};
    const Py_ssize_t n = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 1));
    Py_ssize_t sum = 0;
    for (Py_ssize_t i = 0; i < j.parts; i++) {
        j.pa[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, 3 + 2 * i));
        j.pw[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, 4 + 2 * i));
        sum += j.pw[i];
        if (j.pw[i] < 0 || (n && j.pw[i] && !j.pa[i]))
            return misfit("concat_cols", "a part of negative width or a null address");
    }
    if (PyErr_Occurred()) return NULL;
    if (n < 0 || sum != j.width || (n && j.width && !j.out))
        return misfit("concat_cols", "n >= 0, the parts' widths adding up to width");
    Py_BEGIN_ALLOW_THREADS
    parallel_for_cost(n, (double)n * (double)j.width, concat_part, &j);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* the fields plan_window and plan_entries share: tokens at positions [n] in rows [n] of block tables */
#define SLOT_PLAN_FIELDS(X)                                                                                    \
    X(ADDR, positions, "[n] int64")                                                                            \
    X(ADDR, rows, "[n] int64: each token's block-table row")                                                   \
    X(ADDR, tables, "[tr, tb] int64 block tables (-1 a null block)")                                           \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, tr, "block-table rows")                                                                            \
    X(SIZE, tb, "blocks of a table")                                                                           \
    X(SIZE, bs, "block size")                                                                                  \
    X(SIZE, zero, "the slot of a position with no block")

#define PLAN_WINDOW_FIELDS(X)                                                                                  \
    SLOT_PLAN_FIELDS(X)                                                                                        \
    X(SIZE, window, "window length")                                                                           \
    X(ADDR, win, "[n, window] int64, written")                                                                 \
    X(ADDR, win_ok, "[n, window] bool, written")                                                               \
    X(ADDR, prev, "[n] int64, written: the partner slots")
KERNEL_ARGS(plan_window, PLAN_WINDOW_FIELDS, "window and partner slots (ValueError: a row outside the tables).")
KERNEL_PY(plan_window) {
    PARSE(plan_window);
    if (a.n < 0 || a.tr < 1 || a.tb < 1 || a.bs < 1 || a.window < 0 ||
        (a.n && (!a.positions || !a.rows || !a.tables || !a.prev || (a.window && (!a.win || !a.win_ok)))))
        return misfit("plan_window", "n, window >= 0, tr, tb, block size >= 1");
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = plan_window(CI64(a.positions), CI64(a.rows), CI64(a.tables), a.n, a.tr, a.tb, a.bs, a.zero, a.window,
                      I64(a.win), (uint8_t *)(uintptr_t)a.win_ok, I64(a.prev));
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "plan_window: row %lld of token %zd is outside the %zd block-table rows",
                     (long long)CI64(a.rows)[bad], bad, (Py_ssize_t)a.tr);
        return NULL;
    }
    Py_RETURN_NONE;
}

#define PLAN_ENTRIES_FIELDS(X)                                                                                 \
    SLOT_PLAN_FIELDS(X)                                                                                        \
    X(SIZE, ratio, "tokens of an entry")                                                                       \
    X(SIZE, width, "entry slots of a token")                                                                   \
    X(ADDR, count, "[n] int64, written")                                                                       \
    X(ADDR, eslots, "[n, width] int64, written")
KERNEL_ARGS(plan_entries, PLAN_ENTRIES_FIELDS, "entry counts and slots (ValueError: a row outside the tables).")
KERNEL_PY(plan_entries) {
    PARSE(plan_entries);
    if (a.n < 0 || a.tr < 1 || a.tb < 1 || a.bs < 1 || a.ratio < 1 || a.width < 1 ||
        (a.n && (!a.positions || !a.rows || !a.tables || !a.count || !a.eslots)))
        return misfit("plan_entries", "n >= 0, tr, tb, block size, ratio, width >= 1");
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = plan_entries(CI64(a.positions), CI64(a.rows), CI64(a.tables), a.n, a.tr, a.tb, a.bs, a.zero, a.ratio,
                       a.width, I64(a.count), I64(a.eslots));
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "plan_entries: row %lld of token %zd is outside the %zd block-table rows",
                     (long long)CI64(a.rows)[bad], bad, (Py_ssize_t)a.tr);
        return NULL;
    }
    Py_RETURN_NONE;
}

#define STORE_ROWS_FIELDS(X)                                                                                   \
    X(ADDR, pool, "[rows, width] float32, written")                                                            \
    X(SIZE, rows, "rows of the pool")                                                                          \
    X(SIZE, width, "values of a row")                                                                          \
    X(ADDR, slots, "[n] int64: each token's row (< 0: the trash row)")                                         \
    X(SIZE, n, "tokens")                                                                                       \
    X(ADDR, values, "[n, width] float32")                                                                      \
    X(SIZE, trash, "the trash row")                                                                            \
    X(ADDR, positions, "[n] int64, or 0: with it, only tokens completing an entry are stored")                 \
    X(SIZE, ratio, "tokens of an entry (with positions)")
KERNEL_ARGS(store_rows, STORE_ROWS_FIELDS, "pool[slots[t]] = values[t], else the trash row.")
KERNEL_PY(store_rows) {
    PARSE(store_rows);
    if (a.rows < 1 || a.width < 1 || a.n < 0 || (a.positions && a.ratio < 1) || !a.pool || (a.n && (!a.slots || !a.values)))
        return misfit("store_rows", "rows, width >= 1, n >= 0, ratio >= 1 with positions");
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = store_rows(F(a.pool), a.rows, a.width, CI64(a.slots), a.n, CF(a.values), a.trash, CI64(a.positions), a.ratio);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "store_rows: slot %lld (token %zd) is outside the pool's %zd rows",
                     bad < a.n ? (long long)CI64(a.slots)[bad] : (long long)a.trash, bad, (Py_ssize_t)a.rows);
        return NULL;
    }
    Py_RETURN_NONE;
}

#define ATTEND_PAGED_FIELDS(X)                                                                                 \
    X(ADDR, q, "[n, h, hd] float32")                                                                           \
    X(ADDR, window, "[rows, hd] float32: the window pool")                                                     \
    X(ADDR, wslots, "[n, w] int64: each token's window slots")                                                 \
    X(ADDR, wok, "[n, w] bool: which of them it reads")                                                        \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, w, "window keys of a token")                                                                       \
    X(ADDR, entries, "[rows, hd] float32: the entry pool")                                                     \
    X(ADDR, eslots, "[n, es] int64: each token's entry slots")                                                 \
    X(SIZE, es, "entry slots of a token")                                                                      \
    X(ADDR, topk, "[n, k] int64: the entries picked (-1 none)")                                                \
    X(SIZE, k, "picks of a token (0: none)")                                                                   \
    X(SIZE, rows, "rows of the pools")                                                                         \
    X(SIZE, hd, "head dim")                                                                                    \
    X(ADDR, sink, "[h] float32")                                                                               \
    X(SIZE, h, "heads")                                                                                        \
    X(REAL, scale, "score scale")                                                                              \
    X(ADDR, out, "[n, h, hd] float32, written")
KERNEL_ARGS(attend_paged, ATTEND_PAGED_FIELDS, "attention over the keys a token reads, in place.")

/* attend_items over items [b, e) with this part's scratch (out of memory: its outputs NaN) */
static void attend_part(void *c, int64_t b, int64_t e) {
    const struct attend_paged_args *a = c;
    if (b >= e) return;
    const size_t keys = (size_t)(a->w + a->k), ptrs = (keys * sizeof(float *) + 63) & ~(size_t)63;
    char *buf = scratch(ptrs + sizeof(float) * (HEAD_GROUP * keys + HEAD_GROUP));
    if (!buf) {
        const Py_ssize_t groups = (a->h + HEAD_GROUP - 1) / HEAD_GROUP;
        for (int64_t it = b; it < e; it++) {
            const Py_ssize_t t = (Py_ssize_t)(it / groups), i0 = (Py_ssize_t)(it % groups) * HEAD_GROUP;
            const Py_ssize_t hg = a->h - i0 < HEAD_GROUP ? a->h - i0 : HEAD_GROUP;
            for (Py_ssize_t x = 0; x < hg * a->hd; x++) F(a->out)[(t * a->h + i0) * a->hd + x] = NAN;
        }
        return;
    }
    float *z = (float *)(void *)(buf + ptrs);
    attend_items(CF(a->q), CF(a->window), CI64(a->wslots), U8(a->wok), a->n, a->w, CF(a->entries), CI64(a->eslots),
                 a->es, CI64(a->topk), a->k, a->hd, CF(a->sink), a->h, (float)a->scale, F(a->out), b, e,
                 (const float **)(void *)buf, z, z + HEAD_GROUP * keys, has_avx512());
    free(buf);
}
/* keys [n]: the keys each token reads (and a few for its items themselves) */
static void attend_token_keys(const struct attend_paged_args *a, double *keys) {
    for (Py_ssize_t t = 0; t < a->n; t++) {
        const uint8_t *ok = U8(a->wok) + t * a->w;
        Py_ssize_t m = 4;
        for (Py_ssize_t j = 0; j < a->w; j++) m += ok[j] != 0;
        for (Py_ssize_t i = 0; i < a->k; i++) {
            const int64_t g = CI64(a->topk)[t * a->k + i];
            m += g >= 0 && g < a->es;
        }
        keys[t] = (double)m;
    }
}

typedef struct {
    const struct attend_paged_args *a;
    const double *keys;
} attend_cost;

static double attend_item_cost(const void *c, int64_t it) {
    const attend_cost *x = c;
    return x->keys[it / ((x->a->h + HEAD_GROUP - 1) / HEAD_GROUP)];
}

KERNEL_PY(attend_paged) {
    PARSE(attend_paged);
    if (a.n < 0 || a.w < 0 || a.es < 0 || a.k < 0 || a.rows < 1 || a.hd < 1 || a.h < 1 || (a.k && !a.topk) ||
        (a.n && (!a.q || !a.window || !a.sink || !a.out || (a.w && (!a.wslots || !a.wok)) ||
                 (a.k && a.es && (!a.entries || !a.eslots)))))
        return misfit("attend_paged", "n, w, es, k >= 0, rows, hd, h >= 1");
    if (attend_check(CI64(a.wslots), a.n, a.w, CI64(a.eslots), a.es, CI64(a.topk), a.k, a.rows))
        return misfit("attend_paged", "a slot is outside the pool");
    const Py_ssize_t items = a.n * ((a.h + HEAD_GROUP - 1) / HEAD_GROUP);
    const int parts = pool_parts(items, 2.0 * (double)(a.n * a.h) * (double)(a.w + a.k) * (double)a.hd);
    double *keys = parts > 1 ? malloc(sizeof(double) * (size_t)a.n) : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (keys) { /* a prompt's tokens read more keys as they go: ranges of about equal keys, not items */
        const attend_cost cost = {&a, keys};
        attend_token_keys(&a, keys);
        parallel_balanced(items, parts, attend_item_cost, &cost, attend_part, &a);
    } else {
        attend_part(&a, 0, items);
    }
    Py_END_ALLOW_THREADS
    free(keys);
    Py_RETURN_NONE;
}

#define POOL_PAIR_FIELDS(X)                                                                                    \
    X(ADDR, first, "[n, 2 hd] float32: [kv, gate] rows")                                                       \
    X(ADDR, second, "[n, 2 hd] float32: [kv, gate] rows")                                                      \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, hd, "head dim")                                                                                    \
    X(ADDR, out, "[n, hd] float32, written")
KERNEL_ARGS(pool_pair, POOL_PAIR_FIELDS, "a ratio-2 entry from two [kv, gate] rows.")
static void pool_pair_range(const struct pool_pair_args *a, int64_t b, int64_t e) {
    pool_pair_rows(CF(a->first) + b * 2 * a->hd, CF(a->second) + b * 2 * a->hd, e - b, a->hd, F(a->out) + b * a->hd);
}
TOKEN_JOB(pool_pair, n, a->n * a->hd * 40)
RAW_ENTRY(pool_pair)
KERNEL_PY(pool_pair) {
    PARSE(pool_pair);
    if (a.n < 0 || a.hd < 1 || (a.n && (!a.first || !a.second || !a.out))) return misfit("pool_pair", "n >= 0, hd >= 1");
    Py_BEGIN_ALLOW_THREADS
    run_pool_pair(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define TOPK_ROWS_FIELDS(X)                                                                                    \
    X(ADDR, x, "[rows, v] float32")                                                                            \
    X(SIZE, rows, "rows")                                                                                      \
    X(SIZE, v, "values of a row")                                                                              \
    X(SIZE, k, "picks of a row (>= 1)")                                                                        \
    X(ADDR, out, "[rows, k] int64, written")
KERNEL_ARGS(topk_rows, TOPK_ROWS_FIELDS, "the k best per row, ties to the lower index, -1 for -inf.")

/* topk_rows over the rows [b, e) with this part's scratch (out of memory: their picks -1) */
static void topk_rows_part(void *c, int64_t b, int64_t e) {
    const struct topk_rows_args *a = c;
    float *vals = scratch(sizeof(float) * (size_t)a->k);
    if (!vals) {
        for (Py_ssize_t x = b * a->k; x < e * a->k; x++) I64(a->out)[x] = -1;
        return;
    }
    topk_rows(a->v ? CF(a->x) + b * a->v : CF(a->x), e - b, a->v, a->k, I64(a->out) + b * a->k, vals);
    free(vals);
}
KERNEL_PY(topk_rows) {
    PARSE(topk_rows);
    if (a.rows < 0 || a.v < 0 || a.k < 1 || (a.rows && (!a.out || (a.v && !a.x))))
        return misfit("topk_rows", "rows, v >= 0, k >= 1");
    Py_BEGIN_ALLOW_THREADS
    const double v = (double)a.v, row = topk_ranks(a.v, a.k) ? v * v / 2.0 : 3.0 * v * (double)(a.k < a.v ? a.k : a.v);
    parallel_for_cost(a.rows, (double)a.rows * (row + 4.0 * (v + (double)a.k)), topk_rows_part, &a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define INDEX_SCORES_FIELDS(X)                                                                                 \
    X(ADDR, q, "[n, nh, ihd] float32")                                                                         \
    X(ADDR, w, "[n, nh] float32: head weights")                                                                \
    X(REAL, wscale, "their scale")                                                                             \
    X(ADDR, pool, "[slots, ihd] float32: the index keys")                                                      \
    X(ADDR, slots, "[n, es] int64: each entry's slot")                                                         \
    X(ADDR, count, "[n] int64: the visible entries")                                                           \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, es, "entry slots of a token")                                                                      \
    X(SIZE, e, "scores of a token")                                                                            \
    X(SIZE, nh, "heads")                                                                                       \
    X(SIZE, ihd, "head dim")                                                                                   \
    X(ADDR, cands, "[n, nc] int64 candidate blocks (-1 none), or 0")                                           \
    X(SIZE, nc, "candidates of a token")                                                                       \
    X(SIZE, block, "entries of a block")                                                                       \
    X(ADDR, out, "[n, e] float32, written")
KERNEL_ARGS(index_scores, INDEX_SCORES_FIELDS, "the indexer's entry scores.")

#define INDEX_ENTRIES 256 /* entries of an index_scores item: a decode token's entries split across the pool */

/* index_scores_rows over the items [b, e), item it the entries [INDEX_ENTRIES u, INDEX_ENTRIES (u + 1)) of token
 * it / units (u = it % units), with this part's scratch (out of memory: their scores NaN) */
static void index_scores_part(void *c, int64_t b, int64_t e) {
    const struct index_scores_args *a = c;
    const Py_ssize_t ne = a->e, nh = a->nh, units = (ne + INDEX_ENTRIES - 1) / INDEX_ENTRIES;
    const size_t keep_bytes = (size_t)((ne / a->block + 16) / 16) * 16; /* whole 16-byte units: what follows aligns */
    const size_t wt_bytes = (sizeof(float) * (size_t)nh + 15) / 16 * 16;
    uint8_t *keep = scratch(keep_bytes + wt_bytes + (sizeof(float *) + sizeof(Py_ssize_t)) * (size_t)ne);
    for (int64_t it = b; it < e; it++) {
        const Py_ssize_t t = (Py_ssize_t)(it / units), g0 = (Py_ssize_t)(it % units) * INDEX_ENTRIES;
        const Py_ssize_t g1 = ne - g0 < INDEX_ENTRIES ? ne : g0 + INDEX_ENTRIES;
        if (!keep) {
            for (Py_ssize_t g = g0; g < g1; g++) F(a->out)[t * ne + g] = NAN;
            continue;
        }
        float *wt = (float *)(void *)(keep + keep_bytes);
        const float **kp = (const float **)(void *)(keep + keep_bytes + wt_bytes);
        Py_ssize_t *gi = (Py_ssize_t *)(void *)(kp + ne);
        index_scores_rows(CF(a->q) + t * nh * a->ihd, CF(a->w) + t * nh, (float)a->wscale, CF(a->pool),
                          a->slots ? CI64(a->slots) + t * a->es : NULL, CI64(a->count) + t, 1, a->es, ne, nh, a->ihd,
                          a->cands ? CI64(a->cands) + t * a->nc : NULL, a->nc, a->block, F(a->out) + t * ne, keep, wt,
                          kp, gi, has_avx512(), g0, g1);
    }
    free(keep);
}
/* an item's cost: the entries it scores (below its token's count), and a few for the item itself */
static double index_item_cost(const void *c, int64_t it) {
    const struct index_scores_args *a = c;
    const Py_ssize_t units = (a->e + INDEX_ENTRIES - 1) / INDEX_ENTRIES, t = (Py_ssize_t)(it / units);
    const Py_ssize_t g0 = (Py_ssize_t)(it % units) * INDEX_ENTRIES, g1 = a->e - g0 < INDEX_ENTRIES ? a->e : g0 + INDEX_ENTRIES;
    const int64_t lim = CI64(a->count)[t] < a->es ? CI64(a->count)[t] : a->es;
    return (double)(8 + (lim < g0 ? 0 : (lim < g1 ? lim : g1) - g0));
}

KERNEL_PY(index_scores) {
    PARSE(index_scores);
    const Py_ssize_t e = a.e, nh = a.nh, block = a.block;
    if (a.n < 0 || a.es < 0 || e < 0 || nh < 1 || a.ihd < 1 || block < 1 || (a.cands && (a.nc < 1 || e % block)) ||
        (a.n && (!a.q || !a.w || !a.pool || !a.count || !a.out || (a.es && !a.slots))))
        return misfit("index_scores", "n, es, e >= 0, nh, ihd, block >= 1; with candidates nc >= 1 and e a multiple of block");
    const Py_ssize_t items = a.n * ((e + INDEX_ENTRIES - 1) / INDEX_ENTRIES);
    Py_BEGIN_ALLOW_THREADS /* a prompt's tokens see more entries as they go: ranges of about equal entries */
    parallel_balanced(items, pool_parts(items, 2.0 * (double)a.n * (double)e * (double)(nh * a.ihd)),
                      index_item_cost, &a, index_scores_part, &a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define CANDIDATE_BLOCKS_FIELDS(X)                                                                             \
    X(ADDR, s, "[n, e] float32 entry scores")                                                                  \
    X(ADDR, count, "[n] int64: the visible entries")                                                           \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, e, "scores of a token (a multiple of block)")                                                      \
    X(SIZE, block, "entries of a block")                                                                       \
    X(SIZE, k, "blocks picked")                                                                                \
    X(ADDR, out, "[n, k] int64, written")
KERNEL_ARGS(candidate_blocks, CANDIDATE_BLOCKS_FIELDS, "the candidate source's top blocks.")

/* candidate_blocks_rows over the tokens [b, e) with this part's scratch (out of memory: their picks -1) */
static void candidate_blocks_part(void *c, int64_t b, int64_t e) {
    const struct candidate_blocks_args *a = c;
    float *bs = scratch(sizeof(float) * (size_t)(a->e / a->block + a->k));
    if (!bs) {
        for (Py_ssize_t x = b * a->k; x < e * a->k; x++) I64(a->out)[x] = -1;
        return;
    }
    candidate_blocks_rows(a->e ? CF(a->s) + b * a->e : CF(a->s), CI64(a->count) + b, e - b, a->e, a->block, a->k,
                          I64(a->out) + b * a->k, bs, bs + a->e / a->block);
    free(bs);
}
KERNEL_PY(candidate_blocks) {
    PARSE(candidate_blocks);
    const Py_ssize_t e = a.e, block = a.block, k = a.k;
    if (a.n < 0 || e < 0 || block < 1 || e % block || k < 1 || (a.n && (!a.count || !a.out || (e && !a.s))))
        return misfit("candidate_blocks", "n, e >= 0, e a multiple of block >= 1, k >= 1");
    Py_BEGIN_ALLOW_THREADS
    parallel_for_cost(a.n, (double)a.n * (double)(e + e / block * 4), candidate_blocks_part, &a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define MOE_ROUTE_FIELDS(X)                                                                                    \
    X(ADDR, z, "[n, e] float32: the router's logits")                                                          \
    X(ADDR, bias, "[e] float32: the choice bias")                                                              \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, e, "experts")                                                                                      \
    X(SIZE, k, "experts of a token")                                                                           \
    X(FLAG, norm, "normalise the weights")                                                                     \
    X(REAL, scale, "weight scale")                                                                             \
    X(ADDR, ids, "[n, k] int64, written")                                                                      \
    X(ADDR, w, "[n, k] float32, written")
KERNEL_ARGS(moe_route, MOE_ROUTE_FIELDS, "sqrt-softplus router.")
typedef struct {
    const struct moe_route_args *a;
    int bad; /* a part could not have its scratch */
} moe_route_job;

static void moe_route_part(void *c, int64_t b, int64_t e) {
    moe_route_job *j = c;
    const struct moe_route_args *a = j->a;
    float *buf = scratch(sizeof(float) * (size_t)(2 * a->e + a->k));
    if (!buf) {
        j->bad = 1;
        return;
    }
    moe_route_rows(CF(a->z) + b * a->e, CF(a->bias), e - b, a->e, a->k, (int)a->norm, (float)a->scale,
                   I64(a->ids) + b * a->k, F(a->w) + b * a->k, buf, buf + a->e, buf + 2 * a->e);
    free(buf);
}

KERNEL_PY(moe_route) {
    PARSE(moe_route);
    if (a.n < 0 || a.e < 1 || a.k < 1 || a.k > a.e || (a.n && (!a.z || !a.bias || !a.ids || !a.w)))
        return misfit("moe_route", "n >= 0, 1 <= k <= e");
    moe_route_job j = {&a, 0};
    Py_BEGIN_ALLOW_THREADS
    /* ~36 ns an expert of a token (libm's log1pf, exp_fixed, the square root; measured on the Xeon) */
    parallel_for_cost(a.n, (double)a.n * (double)a.e * 300.0, moe_route_part, &j);
    Py_END_ALLOW_THREADS
    if (j.bad) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

#define MOE_GROUP_FIELDS(X)                                                                                    \
    X(ADDR, ids, "[pairs] int64: the expert of each (token, pick) pair")                                       \
    X(SIZE, pairs, "pairs")                                                                                    \
    X(SIZE, e, "experts")                                                                                      \
    X(SIZE, k, "picks of a token")                                                                             \
    X(ADDR, order, "[pairs] int64, written: the pairs sorted by expert")                                       \
    X(ADDR, counts, "[e] int64, written")                                                                      \
    X(ADDR, tok, "[pairs] int64, written: order / k")
KERNEL_ARGS(moe_group, MOE_GROUP_FIELDS, "pairs sorted by expert (stable), their tokens.")
KERNEL_PY(moe_group) {
    PARSE(moe_group);
    if (a.pairs < 0 || a.e < 1 || a.k < 1 || !a.counts || (a.pairs && (!a.ids || !a.order || !a.tok)))
        return misfit("moe_group", "pairs >= 0, e, k >= 1");
    int64_t *start = scratch(sizeof(int64_t) * (size_t)a.e);
    if (!start) return PyErr_NoMemory();
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = moe_group(CI64(a.ids), a.pairs, a.e, a.k, I64(a.order), I64(a.counts), I64(a.tok), start);
    Py_END_ALLOW_THREADS
    free(start);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "moe_group: expert id %lld of pair %zd is outside [0, %zd)",
                     (long long)CI64(a.ids)[bad], bad, (Py_ssize_t)a.e);
        return NULL;
    }
    Py_RETURN_NONE;
}

#define MOE_COMBINE_FIELDS(X)                                                                                  \
    X(ADDR, ys, "[pairs, dim] float32: the expert outputs in order")                                           \
    X(ADDR, order, "[pairs] int64")                                                                            \
    X(ADDR, w, "[n * k] float32: the pairs' weights")                                                          \
    X(SIZE, pairs, "pairs")                                                                                    \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, k, "picks of a token")                                                                             \
    X(SIZE, dim, "values of a row")                                                                            \
    X(ADDR, shared, "[n, dim] float32 the shared expert's output, or 0")                                       \
    X(ADDR, out, "[n, dim] float32, written")
KERNEL_ARGS(moe_combine, MOE_COMBINE_FIELDS, "weighted expert outputs per token, then the shared one.")

typedef struct {
    const struct moe_combine_args *a;
    const int64_t *at;
} combine_job;

static void moe_combine_part(void *c, int64_t b, int64_t e) { /* tokens [b, e): each token's sum is its own */
    const combine_job *j = c;
    const struct moe_combine_args *a = j->a;
    moe_combine_rows(CF(a->ys), j->at, CF(a->w), b, e, a->k, a->dim, CF(a->shared), F(a->out));
}
KERNEL_PY(moe_combine) {
    PARSE(moe_combine);
    const Py_ssize_t pairs = a.pairs, n = a.n, k = a.k;
    if (pairs < 0 || n < 0 || k < 1 || k > 4096 || a.dim < 1 || pairs > n * k || (n && !a.out) ||
        (pairs && (!a.ys || !a.order || !a.w)))
        return misfit("moe_combine", "0 <= pairs <= n k, 1 <= k <= 4096, dim >= 1");
    int64_t *at = malloc(sizeof(int64_t) * (size_t)(n * k > 0 ? n * k : 1));
    if (!at) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n * k; i++) at[i] = -1;
    for (Py_ssize_t p = 0; p < pairs; p++) {
        const int64_t q = CI64(a.order)[p];
        if (q < 0 || q >= n * k || at[q] >= 0) {
            free(at);
            PyErr_Format(PyExc_ValueError, "moe_combine: pair %lld at %zd is outside [0, %zd) or listed twice",
                         (long long)q, p, n * k);
            return NULL;
        }
        at[q] = p;
    }
    combine_job j = {&a, at};
    Py_BEGIN_ALLOW_THREADS
    parallel_for_cost(n, (double)(pairs + 2 * n) * (double)a.dim * 2.0, moe_combine_part, &j);
    Py_END_ALLOW_THREADS
    free(at);
    Py_RETURN_NONE;
}

#define SWIGLU_FIELDS(X)                                                                                       \
    X(ADDR, gu, "[n, 2 inter] float32: g, then u")                                                             \
    X(SIZE, n, "rows")                                                                                         \
    X(SIZE, inter, "values of g (and of u)")                                                                   \
    X(REAL, limit, "L (no clamp when L <= 0)")                                                                 \
    X(ADDR, out, "[n, inter] float32, written")
KERNEL_ARGS(swiglu, SWIGLU_FIELDS, "out = silu(min(g, L)) * clamp(u, -L, L).")
static void swiglu_range(const struct swiglu_args *a, int64_t b, int64_t e) {
    swiglu_rows(CF(a->gu) + b * 2 * a->inter, e - b, a->inter, (float)a->limit, F(a->out) + b * a->inter);
}
TOKEN_JOB(swiglu, n, a->n * a->inter * 20)
RAW_ENTRY(swiglu)
KERNEL_PY(swiglu) {
    PARSE(swiglu);
    if (a.n < 0 || a.inter < 1 || (a.n && (!a.gu || !a.out))) return misfit("swiglu", "n >= 0, inter >= 1");
    Py_BEGIN_ALLOW_THREADS
    run_swiglu(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define ENGRAM_GATE_FIELDS(X)                                                                                  \
    X(ADDR, h, "[n, hc * hidden] float32: the streams")                                                        \
    X(SIZE, n, "tokens")                                                                                       \
    X(SIZE, hc, "branches")                                                                                    \
    X(SIZE, hidden, "values of a branch (<= 65536)")                                                            \
    X(ADDR, kv, "[n, (hc + 1) * hidden] float32: hc keys, then the value")                                     \
    X(ADDR, q_w, "[hc, hidden] float32")                                                                       \
    X(ADDR, k_w, "[hc, hidden] float32")                                                                       \
    X(ADDR, dead, "[n] bool, or 0")                                                                            \
    X(REAL, eps, "the RMS epsilon")                                                                            \
    X(ADDR, h_out, "[n, hc * hidden] float32, written")
KERNEL_ARGS(engram_gate, ENGRAM_GATE_FIELDS, "the Engram gate into h_out.")
static void engram_gate_range(const struct engram_gate_args *a, int64_t b, int64_t e) {
    const Py_ssize_t hc = a->hc, d = a->hidden;
    engram_gate_rows(CF(a->h) + b * hc * d, e - b, hc, d, CF(a->kv) + b * (hc + 1) * d, CF(a->q_w), CF(a->k_w),
                     a->dead ? U8(a->dead) + b : NULL, (float)a->eps, F(a->h_out) + b * hc * d);
}
TOKEN_JOB(engram_gate, n, a->n * a->hc * a->hidden * 8)
RAW_ENTRY(engram_gate)
KERNEL_PY(engram_gate) {
    PARSE(engram_gate);
    if (a.n < 0 || a.hc < 1 || a.hidden < 1 || a.hidden > MAX_GATE_DIM ||
        (a.n && (!a.h || !a.kv || !a.q_w || !a.k_w || !a.h_out))) {
        PyErr_Format(PyExc_ValueError, "engram_gate: n %zd, hc %zd, hidden %zd (<= 65536) do not fit", (Py_ssize_t)a.n,
                     (Py_ssize_t)a.hc, (Py_ssize_t)a.hidden);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    run_engram_gate(&a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

#define GATHER_ROWS_FIELDS(X)                                                                                  \
    X(ADDR, src, "[rows, width] float32")                                                                      \
    X(SIZE, rows, "rows of src")                                                                               \
    X(SIZE, width, "values of a row")                                                                          \
    X(ADDR, ids, "[n] int64")                                                                                  \
    X(SIZE, n, "ids")                                                                                          \
    X(SIZE, copies, "copies of each row")                                                                      \
    X(ADDR, out, "[n, copies, width] float32, written")
KERNEL_ARGS(gather_rows, GATHER_ROWS_FIELDS, "out[t, c] = src[ids[t]] (ValueError: an id out of range).")
static void gather_rows_range(const struct gather_rows_args *a, int64_t b, int64_t e) {
    const size_t bytes = (size_t)a->width * sizeof(float);
    for (Py_ssize_t t = b; t < e; t++)
        for (Py_ssize_t c = 0; c < a->copies; c++)
            memcpy(F(a->out) + (t * a->copies + c) * a->width, CF(a->src) + CI64(a->ids)[t] * a->width, bytes);
}
TOKEN_JOB(gather_rows, n, a->n * a->copies * a->width)
KERNEL_PY(gather_rows) {
    PARSE(gather_rows);
    if (a.rows < 0 || a.width < 1 || a.n < 0 || a.copies < 1 || (a.n && (!a.src || !a.ids || !a.out))) {
        PyErr_Format(PyExc_ValueError, "gather_rows: rows %zd, width %zd, n %zd, copies %zd do not fit",
                     (Py_ssize_t)a.rows, (Py_ssize_t)a.width, (Py_ssize_t)a.n, (Py_ssize_t)a.copies);
        return NULL;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = id_outside(CI64(a.ids), a.n, a.rows);
    if (bad < 0) run_gather_rows(&a);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "gather_rows: index %lld at entry %zd is outside the %zd rows",
                     (long long)CI64(a.ids)[bad], bad, (Py_ssize_t)a.rows);
        return NULL;
    }
    Py_RETURN_NONE;
}

#define ARGMAX_ROWS_FIELDS(X)                                                                                  \
    X(ADDR, x, "[rows, v] float32")                                                                            \
    X(SIZE, rows, "rows")                                                                                      \
    X(SIZE, v, "values of a row (>= 1)")                                                                       \
    X(ADDR, out, "[rows] int64, written")                                                                      \
    X(OPTADDR, finite, "[rows] bool, written: every value of the row finite (0 or left out: none)")
KERNEL_ARGS(argmax_rows, ARGMAX_ROWS_FIELDS,
            "out[r] = the first index of row r's maximum, NaN first (torch.argmax); finite[r] = every value of row r "
            "finite.")

static void argmax_rows_part(void *c, int64_t b, int64_t e) {
    const struct argmax_rows_args *a = c;
    argmax_rows(CF(a->x) + b * a->v, e - b, a->v, I64(a->out) + b, a->finite ? (uint8_t *)(uintptr_t)a->finite + b : NULL);
}

KERNEL_PY(argmax_rows) {
    PARSE(argmax_rows);
    if (a.rows < 0 || a.v < 1 || (a.rows && (!a.x || !a.out))) {
        PyErr_Format(PyExc_ValueError, "argmax_rows: rows %zd, v %zd do not fit (v at least 1)", (Py_ssize_t)a.rows,
                     (Py_ssize_t)a.v);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    parallel_for_cost(a.rows, (double)a.rows * (double)a.v * 2.0, argmax_rows_part, &a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ---- raw entries: a CPU graph's replay of a kernel without its Python call ---------------------------------
 * raw_X(slots) runs kernel X on its argument struct (the slots, in field order), without the checks: a replay
 * makes a call whose sizes its capture already made through the Python form, at addresses of tensors of the same
 * shapes. Only kernels without data-dependent checks (an index outside a table or pool) have one. */
static const struct {
    const struct arg_spec *spec;
    raw_fn fn;
} RAW[] = {
    {&hc_mix_spec, raw_hc_mix}, {&collapse_spec, raw_collapse}, {&stream_mean_spec, raw_stream_mean},
    {&expand_spec, raw_expand}, {&hc_next_spec, raw_hc_next}, {&rms_norm_spec, raw_rms_norm},
    {&rope_spec, raw_rope}, {&pool_pair_spec, raw_pool_pair}, {&swiglu_spec, raw_swiglu},
    {&engram_gate_spec, raw_engram_gate},
};

/* every kernel with an argument list (concat_cols, variadic, has none) */
static const struct arg_spec *const SPECS[] = {
    &hc_mix_spec, &collapse_spec, &stream_mean_spec, &expand_spec, &hc_next_spec, &rms_norm_spec, &rope_spec,
    &plan_window_spec, &plan_entries_spec, &store_rows_spec, &attend_paged_spec, &pool_pair_spec, &topk_rows_spec,
    &index_scores_spec, &candidate_blocks_spec, &moe_route_spec, &moe_group_spec, &moe_combine_spec, &swiglu_spec,
    &engram_gate_spec, &gather_rows_spec, &argmax_rows_spec,
};

static PyObject *py_raw_kernels(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    PyObject *out = PyDict_New();
    for (size_t i = 0; out && i < sizeof RAW / sizeof RAW[0]; i++)
        if (add_raw(out, RAW[i].spec, RAW[i].fn) < 0) Py_CLEAR(out);
    return out;
}

static PyObject *py_kernel_fields(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return kernel_fields_of(SPECS, sizeof SPECS / sizeof SPECS[0]);
}

#define RAW_RUN 64 /* raw calls run in one release of the GIL, at most */

/* A CPU graph's replay (runner/cpu_graphs.py): for each item of the list, in order, fn(*args) for an (fn, args)
 * pair, or raw(slots) for an (fn, raw entry address, slots address) triple (consecutive ones in one release of
 * the GIL); the first error stops it. One C loop instead of the interpreter's. */
static PyObject *py_call_all(PyObject *Py_UNUSED(self), PyObject *calls) {
    if (!PyList_Check(calls)) {
        PyErr_SetString(PyExc_TypeError, "call_all: expected a list of (callable, args tuple) or (callable, raw, slots)");
        return NULL;
    }
    const Py_ssize_t len = PyList_GET_SIZE(calls);
    raw_fn fns[RAW_RUN];
    const uint64_t *slots[RAW_RUN];
    for (Py_ssize_t i = 0; i < len;) {
        int run = 0;
        for (; i < len && run < RAW_RUN; i++, run++) {
            PyObject *call = PyList_GET_ITEM(calls, i);
            if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 3) break;
            fns[run] = (raw_fn)(uintptr_t)PyLong_AsVoidPtr(PyTuple_GET_ITEM(call, 1));
            slots[run] = (const uint64_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(call, 2));
            if (PyErr_Occurred()) return NULL;
            if (!fns[run] || !slots[run]) {
                PyErr_Format(PyExc_ValueError, "call_all: item %zd has a null raw entry or slots", i);
                return NULL;
            }
        }
        if (run) {
            Py_BEGIN_ALLOW_THREADS
            for (int r = 0; r < run; r++) fns[r](slots[r]);
            Py_END_ALLOW_THREADS
            continue;
        }
        PyObject *call = PyList_GET_ITEM(calls, i++);
        if (!PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(call, 1))) {
            PyErr_Format(PyExc_TypeError, "call_all: item %zd is not a (callable, args tuple) pair", i - 1);
            return NULL;
        }
        PyObject *out = PyObject_Call(PyTuple_GET_ITEM(call, 0), PyTuple_GET_ITEM(call, 1), NULL);
        if (out == NULL) return NULL;
        Py_DECREF(out);
    }
    Py_RETURN_NONE;
}

/* model/capture.py's hook while a capture is in progress on some thread (set_recorder), else NULL. */
static PyObject *recorder = NULL;

/* capture.call(fn, *args, **kwargs) in C: fn called with this call's own vectorcall arguments and keyword names
 * (no tuple, no dict), RuntimeError naming fn if it returns anything but None; then, only while a recorder is set,
 * recorder(fn, (args..., keyword values...), kwnames or None), which appends to the calling thread's tape, if any. */
static PyObject *py_call(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "call(fn, *args, **kwargs): missing fn");
        return NULL;
    }
    PyObject *fn = args[0];
    PyObject *out = PyObject_Vectorcall(fn, args + 1, (size_t)(nargs - 1), kwnames);
    if (out == NULL) return NULL;
    if (out != Py_None) {
        Py_DECREF(out);
        PyObject *name = PyObject_GetAttrString(fn, "__name__");
        if (name == NULL) {
            PyErr_Clear();
            if ((name = PyObject_Repr(fn)) == NULL) return NULL;
        }
        PyErr_Format(PyExc_RuntimeError, "%S returned a value: a recorded kernel call must return nothing", name);
        Py_DECREF(name);
        return NULL;
    }
    Py_DECREF(out);
    if (recorder != NULL) {
        const Py_ssize_t total = nargs - 1 + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
        PyObject *values = PyTuple_New(total);
        if (values == NULL) return NULL;
        for (Py_ssize_t i = 0; i < total; i++) {
            Py_INCREF(args[1 + i]);
            PyTuple_SET_ITEM(values, i, args[1 + i]);
        }
        PyObject *hook = recorder; /* held: the hook may uninstall itself */
        Py_INCREF(hook);
        PyObject *r = PyObject_CallFunctionObjArgs(hook, fn, values, kwnames ? kwnames : Py_None, NULL);
        Py_DECREF(hook);
        Py_DECREF(values);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyObject *py_set_recorder(PyObject *Py_UNUSED(self), PyObject *hook) {
    if (hook != Py_None && !PyCallable_Check(hook)) {
        PyErr_SetString(PyExc_TypeError, "set_recorder: expected a callable or None");
        return NULL;
    }
    PyObject *old = recorder;
    recorder = hook == Py_None ? NULL : (Py_INCREF(hook), hook);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"call_all", py_call_all, METH_O,
     "call_all(calls) -> None: fn(*args) for each (fn, args) of the list calls, raw(slots) for each (fn, raw, slots), "
     "in order (a CPU graph's replay)."},
    {"call", (PyCFunction)(void (*)(void))py_call, METH_FASTCALL | METH_KEYWORDS,
     "call(fn, *args, **kwargs) -> None: fn(*args, **kwargs), which must return None (RuntimeError otherwise), "
     "then recorder(fn, values, kwnames) while one is set (model/capture.py `call`)."},
    {"set_recorder", py_set_recorder, METH_O,
     "set_recorder(hook or None): the hook `call` calls after each call while set (model/capture.py `recording`)."},
    {"raw_kernels", py_raw_kernels, METH_NOARGS,
     "raw_kernels() -> {name: (((field, kind), ...), raw entry address)}: the kernels a replay can run from their "
     "argument structs (one 64-bit slot a field, in order: an address or size as an integer, a real as a double's "
     "bits)."},
    {"kernel_fields", py_kernel_fields, METH_NOARGS,
     "kernel_fields() -> {name: ((field, kind), ...)}: every kernel's arguments in order (kinds addr, size, real, "
     "flag); each takes them by position or by name."},
    KERNEL_METHOD(hc_mix),
    KERNEL_METHOD(collapse),
    KERNEL_METHOD(stream_mean),
    KERNEL_METHOD(hc_next),
    KERNEL_METHOD(expand),
    KERNEL_METHOD(rms_norm),
    KERNEL_METHOD(rope),
    {"concat_cols", py_concat_cols, METH_VARARGS,
     "concat_cols(out, n, width, a_0, w_0, ...): column blocks side by side (positional only: a variable number of "
     "parts)."},
    KERNEL_METHOD(plan_window),
    KERNEL_METHOD(plan_entries),
    KERNEL_METHOD(store_rows),
    KERNEL_METHOD(attend_paged),
    KERNEL_METHOD(pool_pair),
    KERNEL_METHOD(topk_rows),
    KERNEL_METHOD(index_scores),
    KERNEL_METHOD(candidate_blocks),
    KERNEL_METHOD(moe_route),
    KERNEL_METHOD(moe_group),
    KERNEL_METHOD(moe_combine),
    KERNEL_METHOD(swiglu),
    KERNEL_METHOD(engram_gate),
    KERNEL_METHOD(gather_rows),
    KERNEL_METHOD(argmax_rows),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_token_kernel",
    "Token-wise fused steps of DeepSeek-V4.1's serving forward, one token at a time in a fixed order (model/ops_c.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__token_kernel(void) {
    set_docs(methods, SPECS, sizeof SPECS / sizeof SPECS[0]);
    pool_import();
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "HC_TILE", HC_TILE) < 0) Py_CLEAR(m);
    return m;
}
