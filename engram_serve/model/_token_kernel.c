/* Token-wise fused steps of the serving forward (model/fused.py): each token computed alone, by the same
 * operations in the same order whatever the call's size, so a token's bits do not depend on its batch
 * mates, the cut or padding (docs/contract.md §9) with no padding rule; one call instead of the several torch
 * operators each step takes. model/fused.py keeps the torch form of each (CUDA, autograd, no compiler).
 *
 *   residual_norm(h, n, hc, hidden, delta, w, eps, h_out, x) -> None
 *     h [n, hc, hidden] float32 contiguous, the residual branches; delta [n, hidden] contiguous or 0:
 *     if given, h_out = h + delta on every branch, and h stands for h_out below (h_out unused
 *     otherwise). Then x [n, hidden] = rmsnorm(mean_i h_i) * w:
 *     mean = (h_0 + h_1 + ...) / hc, r = 1 / sqrt(sum(mean^2) / hidden + eps), x = mean * r * w.
 *   engram_gate(h, n, hc, hidden, kv, q_w, k_w, dead, eps, h_out) -> None
 *     The Engram gate of docs/contract.md §7, h_out = h with the gated value added: kv [n, (hc + 1) * hidden] (hc keys, then the value),
 *     q_w, k_w [hc, hidden], dead [n] bool or 0. Per branch i: dot = sum(rmsnorm(h_i) * q_w[i] *
 *     rmsnorm(key_i) * k_w[i]) / sqrt(hidden), gate = sigmoid(s * sqrt(max(|dot|, 1e-6))) with s = -1 if dot < 0 else +1 (the positive root at +-0),
 *     0 for a dead token; h_out_i = h_i + gate * value.
 *   silu_mul(gu, rows, inter, weights, out) -> None
 *     gu [rows, 2, inter] (gate, up), out [rows, inter] = silu(gate) * up [* weights[row]] (weights
 *     [rows] or 0); silu(x) = x / (1 + exp(-x)).
 *   gather_rows(src, rows, width, ids, n, copies, out) -> None
 *     out [n, copies, width] = src[ids[t]] on each copy, src [rows, width] float32 contiguous, ids [n]
 *     int64 (the embedding, the rotary tables); ValueError, and nothing written, if an id is outside
 *     [0, rows).
 *   add_branches(h, n, hc, hidden, delta, out) -> None
 *     out [n, hc, hidden] = h + delta on every branch (delta [n, hidden]).
 *   moe_route(logits, n, e, k, ids, w, dense) -> None
 *     The MoE router of model/layers.py for logits [n, e] (e <= 256, k <= e): probs = softmax (p_j =
 *     exp(l_j - max) / sum in index order), ids [n, k] int64 the k largest probs, best first (ties: lower
 *     index first), w [n, k] = those probs / their sum (in that order), dense [n, e] (or 0) = w at ids,
 *     0 elsewhere. A row with a non-finite logit gets ids 0..k-1 and NaN weights: its request errs.
 *   argmax_rows(x, rows, v, out) -> None
 *     x [rows, v] float32 contiguous (v >= 1), out [rows] int64: per row the first index of its maximum,
 *     a NaN above every number (torch.argmax's order: the first NaN if there is one).
 *   Sums run over 16 lanes (index mod 16, in order) added in a fixed tree. The GIL is released.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation is the IEEE one written, in
 * every clone; exp is `exp_fixed` (_kernel_math.h, the same operations for every element), sqrtf the IEEE one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_kernel_math.h"

/* 1 / sqrt(mean of x^2 + eps) over d values */
static inline float rms_scale(const float *restrict x, Py_ssize_t d, float eps) {
    return 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
}

CLONES static void residual_norm_rows(const float *restrict h, Py_ssize_t n, Py_ssize_t hc, Py_ssize_t dim,
                                      const float *restrict delta, const float *restrict w, float eps,
                                      float *restrict hout, float *restrict x) {
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *ht = h + t * hc * dim;
        float *xt = x + t * dim;
        if (delta) {
            float *ho = hout + t * hc * dim;
            for (Py_ssize_t i = 0; i < hc; i++)
                for (Py_ssize_t d = 0; d < dim; d++) ho[i * dim + d] = ht[i * dim + d] + delta[t * dim + d];
            ht = ho;
        }
        for (Py_ssize_t d = 0; d < dim; d++) xt[d] = ht[d];
        for (Py_ssize_t i = 1; i < hc; i++)
            for (Py_ssize_t d = 0; d < dim; d++) xt[d] = xt[d] + ht[i * dim + d];
        for (Py_ssize_t d = 0; d < dim; d++) xt[d] = xt[d] / (float)hc;
        const float r = rms_scale(xt, dim, eps);
        for (Py_ssize_t d = 0; d < dim; d++) xt[d] = xt[d] * r * w[d];
    }
}

CLONES static void engram_gate_rows(const float *restrict h, Py_ssize_t n, Py_ssize_t hc, Py_ssize_t dim,
                                    const float *restrict kv, const float *restrict qw, const float *restrict kw,
                                    const uint8_t *restrict dead, float eps, float *restrict hout) {
    const float root = sqrtf((float)dim);
    float qn[1024], kn[1024];
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

CLONES static void silu_mul_rows(const float *restrict gu, Py_ssize_t rows, Py_ssize_t inter,
                                 const float *restrict wt, float *restrict out) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (Py_ssize_t d = 0; d < inter; d++) o[d] = g[d] / (1.0f + exp_fixed(-g[d])) * u[d];
        if (wt)
            for (Py_ssize_t d = 0; d < inter; d++) o[d] = o[d] * wt[r];
    }
}

/* The row's maximum over its numbers (a NaN compares false: skipped), and whether it holds a NaN. */
static float row_max_plain(const float *restrict xr, Py_ssize_t v, Py_ssize_t j, float mx, int *restrict has_nan) {
    for (; j < v; j++) {
        mx = xr[j] > mx ? xr[j] : mx;
        *has_nan |= xr[j] != xr[j];
    }
    return mx;
}

#if HAVE_X86_AVX2
/* The same in AVX2 where the CPU has it (GCC does not vectorise the select): vmaxps(x, m) is x > m ? x : m. */
__attribute__((target("avx2"))) static float row_max_avx2(const float *restrict xr, Py_ssize_t v, int *restrict has_nan) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, n0 = _mm256_setzero_ps(), n1 = n0;
    Py_ssize_t j = 0;
    for (; j + 16 <= v; j += 16) {
        const __m256 a = _mm256_loadu_ps(xr + j), b = _mm256_loadu_ps(xr + j + 8);
        m0 = _mm256_max_ps(a, m0), m1 = _mm256_max_ps(b, m1);
        n0 = _mm256_or_ps(n0, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)), n1 = _mm256_or_ps(n1, _mm256_cmp_ps(b, b, _CMP_UNORD_Q));
    }
    float lanes[16];
    _mm256_storeu_ps(lanes, m0), _mm256_storeu_ps(lanes + 8, m1);
    *has_nan = _mm256_movemask_ps(_mm256_or_ps(n0, n1)) != 0;
    return row_max_plain(lanes, 16, 0, row_max_plain(xr, v, j, -INFINITY, has_nan), has_nan);
}
#endif

static float row_max(const float *restrict xr, Py_ssize_t v, int *restrict has_nan) {
#if HAVE_X86_AVX2
    if (__builtin_cpu_supports("avx2")) return row_max_avx2(xr, v, has_nan);
#endif
    *has_nan = 0;
    return row_max_plain(xr, v, 0, -INFINITY, has_nan);
}

static void argmax_rows(const float *restrict x, Py_ssize_t rows, Py_ssize_t v, int64_t *restrict out) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *xr = x + r * v;
        int has_nan;
        const float mx = row_max(xr, v, &has_nan);
        Py_ssize_t at = 0;
        if (has_nan)
            while (xr[at] == xr[at]) at++;
        else
            while (xr[at] != mx) at++;
        out[r] = at;
    }
}

static Py_ssize_t gather_rows(const float *restrict src, Py_ssize_t rows, Py_ssize_t width, const int64_t *restrict ids,
                              Py_ssize_t n, Py_ssize_t copies, float *restrict out) {
    for (Py_ssize_t t = 0; t < n; t++)
        if (ids[t] < 0 || ids[t] >= rows) return t;
    for (Py_ssize_t t = 0; t < n; t++)
        for (Py_ssize_t c = 0; c < copies; c++)
            memcpy(out + (t * copies + c) * width, src + ids[t] * width, (size_t)width * sizeof(float));
    return -1;
}

CLONES static void add_branches_rows(const float *restrict h, Py_ssize_t n, Py_ssize_t hc, Py_ssize_t dim,
                                     const float *restrict delta, float *restrict out) {
    for (Py_ssize_t t = 0; t < n; t++)
        for (Py_ssize_t i = 0; i < hc; i++)
            for (Py_ssize_t d = 0; d < dim; d++)
                out[(t * hc + i) * dim + d] = h[(t * hc + i) * dim + d] + delta[t * dim + d];
}

#define MAX_EXPERTS 256
static void moe_route_rows(const float *restrict logits, Py_ssize_t n, Py_ssize_t e, Py_ssize_t k,
                           int64_t *restrict ids, float *restrict w, float *restrict dense) {
    float p[MAX_EXPERTS];
    unsigned char taken[MAX_EXPERTS];
    for (Py_ssize_t t = 0; t < n; t++) {
        const float *l = logits + t * e;
        int64_t *it = ids + t * k;
        float *wt = w + t * k, *dt = dense ? dense + t * e : NULL;
        int finite = 1;
        float m = -INFINITY;
        for (Py_ssize_t j = 0; j < e; j++) {
            finite &= isfinite(l[j]) != 0;
            m = l[j] > m ? l[j] : m;
        }
        if (dt)
            for (Py_ssize_t j = 0; j < e; j++) dt[j] = 0.0f;
        if (!finite) {
            for (Py_ssize_t i = 0; i < k; i++) {
                it[i] = i, wt[i] = NAN;
                if (dt) dt[i] = NAN;
            }
            continue;
        }
        float sum = 0.0f;
        for (Py_ssize_t j = 0; j < e; j++) {
            p[j] = exp_fixed(l[j] - m);
            sum = sum + p[j];
            taken[j] = 0;
        }
        for (Py_ssize_t j = 0; j < e; j++) p[j] = p[j] / sum;
        float wsum = 0.0f;
        for (Py_ssize_t i = 0; i < k; i++) {
            Py_ssize_t best = -1;
            for (Py_ssize_t j = 0; j < e; j++)
                if (!taken[j] && (best < 0 || p[j] > p[best])) best = j;
            taken[best] = 1, it[i] = best, wt[i] = p[best];
            wsum = wsum + p[best];
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            wt[i] = wt[i] / wsum;
            if (dt) dt[it[i]] = wt[i];
        }
    }
}

static PyObject *py_gather_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long sa, ia, oa;
    Py_ssize_t rows, width, n, copies;
    if (!PyArg_ParseTuple(args, "KnnKnnK", &sa, &rows, &width, &ia, &n, &copies, &oa)) return NULL;
    if (rows < 0 || width < 1 || n < 0 || copies < 1 || (n && (!sa || !ia || !oa))) {
        PyErr_Format(PyExc_ValueError, "gather_rows: rows %zd, width %zd, n %zd, copies %zd do not fit", rows, width, n,
                     copies);
        return NULL;
    }
    Py_ssize_t bad;
    Py_BEGIN_ALLOW_THREADS
    bad = gather_rows((const float *)(uintptr_t)sa, rows, width, (const int64_t *)(uintptr_t)ia, n, copies,
                      (float *)(uintptr_t)oa);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "gather_rows: index %lld at entry %zd is outside the %zd rows",
                     (long long)((const int64_t *)(uintptr_t)ia)[bad], bad, rows);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_add_branches(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long ha, da, oa;
    Py_ssize_t n, hc, dim;
    if (!PyArg_ParseTuple(args, "KnnnKK", &ha, &n, &hc, &dim, &da, &oa)) return NULL;
    if (n < 0 || hc < 1 || dim < 1 || (n && (!ha || !da || !oa))) {
        PyErr_Format(PyExc_ValueError, "add_branches: n %zd, hc %zd, hidden %zd do not fit", n, hc, dim);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    add_branches_rows((const float *)(uintptr_t)ha, n, hc, dim, (const float *)(uintptr_t)da, (float *)(uintptr_t)oa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_moe_route(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long la, ia, wa, da;
    Py_ssize_t n, e, k;
    if (!PyArg_ParseTuple(args, "KnnnKKK", &la, &n, &e, &k, &ia, &wa, &da)) return NULL;
    if (n < 0 || e < 1 || e > MAX_EXPERTS || k < 1 || k > e || (n && (!la || !ia || !wa))) {
        PyErr_Format(PyExc_ValueError, "moe_route: n %zd, %zd experts (<= %d), top %zd do not fit", n, e, MAX_EXPERTS, k);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    moe_route_rows((const float *)(uintptr_t)la, n, e, k, (int64_t *)(uintptr_t)ia, (float *)(uintptr_t)wa,
                   (float *)(uintptr_t)da);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_argmax_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long xa, oa;
    Py_ssize_t rows, v;
    if (!PyArg_ParseTuple(args, "KnnK", &xa, &rows, &v, &oa)) return NULL;
    if (rows < 0 || v < 1 || (rows && (!xa || !oa))) {
        PyErr_Format(PyExc_ValueError, "argmax_rows: rows %zd, v %zd do not fit (v at least 1)", rows, v);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    argmax_rows((const float *)(uintptr_t)xa, rows, v, (int64_t *)(uintptr_t)oa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_residual_norm(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long ha, da, wa, oa, xa;
    Py_ssize_t n, hc, dim;
    double eps;
    if (!PyArg_ParseTuple(args, "KnnnKKdKK", &ha, &n, &hc, &dim, &da, &wa, &eps, &oa, &xa)) return NULL;
    if (n < 0 || hc < 1 || dim < 1 || (n && (!ha || !wa || !xa || (da && !oa)))) {
        PyErr_Format(PyExc_ValueError, "residual_norm: n %zd, hc %zd, hidden %zd do not fit", n, hc, dim);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    residual_norm_rows((float *)(uintptr_t)ha, n, hc, dim, (const float *)(uintptr_t)da, (const float *)(uintptr_t)wa,
                       (float)eps, (float *)(uintptr_t)oa, (float *)(uintptr_t)xa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_engram_gate(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long ha, kva, qa, ka, da, oa;
    Py_ssize_t n, hc, dim;
    double eps;
    if (!PyArg_ParseTuple(args, "KnnnKKKKdK", &ha, &n, &hc, &dim, &kva, &qa, &ka, &da, &eps, &oa)) return NULL;
    if (n < 0 || hc < 1 || dim < 1 || dim > 1024 || (n && (!ha || !kva || !qa || !ka || !oa))) {
        PyErr_Format(PyExc_ValueError, "engram_gate: n %zd, hc %zd, hidden %zd (<= 1024) do not fit", n, hc, dim);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    engram_gate_rows((float *)(uintptr_t)ha, n, hc, dim, (const float *)(uintptr_t)kva, (const float *)(uintptr_t)qa,
                     (const float *)(uintptr_t)ka, (const uint8_t *)(uintptr_t)da, (float)eps, (float *)(uintptr_t)oa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long ga, wa, oa;
    Py_ssize_t rows, inter;
    if (!PyArg_ParseTuple(args, "KnnKK", &ga, &rows, &inter, &wa, &oa)) return NULL;
    if (rows < 0 || inter < 1 || (rows && (!ga || !oa))) {
        PyErr_Format(PyExc_ValueError, "silu_mul: rows %zd, inter %zd do not fit", rows, inter);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_rows((const float *)(uintptr_t)ga, rows, inter, (const float *)(uintptr_t)wa, (float *)(uintptr_t)oa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"residual_norm", py_residual_norm, METH_VARARGS,
     "residual_norm(h, n, hc, hidden, delta, w, eps, h_out, x) -> None: h_out = h + delta per branch, x = rmsnorm(mean) * w."},
    {"engram_gate", py_engram_gate, METH_VARARGS,
     "engram_gate(h, n, hc, hidden, kv, q_w, k_w, dead, eps, h_out) -> None: the Engram gate into h_out."},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(gu, rows, inter, weights, out) -> None: out = silu(gate) * up [* weight of the row]."},
    {"gather_rows", py_gather_rows, METH_VARARGS,
     "gather_rows(src, rows, width, ids, n, copies, out) -> None: out[t, c] = src[ids[t]] (ValueError: id out of range)."},
    {"add_branches", py_add_branches, METH_VARARGS,
     "add_branches(h, n, hc, hidden, delta, out) -> None: out = h + delta on every branch."},
    {"moe_route", py_moe_route, METH_VARARGS,
     "moe_route(logits, n, e, k, ids, w, dense) -> None: softmax, top-k (ties: lower index), renormalised weights."},
    {"argmax_rows", py_argmax_rows, METH_VARARGS,
     "argmax_rows(x, rows, v, out) -> None: out[r] = the first index of row r's maximum, NaN first (torch.argmax)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_token_kernel",
    "Token-wise fused steps of the serving forward, one token at a time in a fixed order (model/fused.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__token_kernel(void) { return PyModule_Create(&module); }
