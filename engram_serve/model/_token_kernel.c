/* Token-wise fused steps of the serving forward (model/fused.py): each token computed alone, by the same
 * operations in the same order whatever the call's size, so a token's bits do not depend on its batch
 * mates, the cut or padding (spec §9) with no padding rule; one call instead of the several torch
 * operators each step takes. model/fused.py keeps the torch form of each (CUDA, autograd, no compiler).
 *
 *   residual_norm(h, n, hc, hidden, delta, w, eps, h_out, x) -> None
 *     h [n, hc, hidden] float32 contiguous, the residual branches; delta [n, hidden] contiguous or 0:
 *     if given, h_out = h + delta on every branch, and h stands for h_out below (h_out unused
 *     otherwise). Then x [n, hidden] = rmsnorm(mean_i h_i) * w:
 *     mean = (h_0 + h_1 + ...) / hc, r = 1 / sqrt(sum(mean^2) / hidden + eps), x = mean * r * w.
 *   engram_gate(h, n, hc, hidden, kv, q_w, k_w, dead, eps, h_out) -> None
 *     The Engram gate of spec §7, h_out = h with the gated value added: kv [n, (hc + 1) * hidden] (hc keys, then the value),
 *     q_w, k_w [hc, hidden], dead [n] bool or 0. Per branch i: dot = sum(rmsnorm(h_i) * q_w[i] *
 *     rmsnorm(key_i) * k_w[i]) / sqrt(hidden), gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))),
 *     0 for a dead token; h_out_i = h_i + gate * value.
 *   silu_mul(gu, rows, inter, weights, out) -> None
 *     gu [rows, 2, inter] (gate, up), out [rows, inter] = silu(gate) * up [* weights[row]] (weights
 *     [rows] or 0); silu(x) = x / (1 + exp(-x)).
 *   Sums run over 16 lanes (index mod 16, in order) added in a fixed tree. The GIL is released.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation is the IEEE one written, in
 * every clone; exp is `exp_fixed` (_kernel_math.h, the same operations for every element), sqrtf the IEEE one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

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
            const float z = qk > 0.0f ? mag : (qk < 0.0f ? -mag : (qk == qk ? 0.0f * mag : qk));  /* sign(qk) * mag */
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_token_kernel",
    "Token-wise fused steps of the serving forward, one token at a time in a fixed order (model/fused.py).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__token_kernel(void) { return PyModule_Create(&module); }
