/* A matmul for the calls of few rows that batch invariance would otherwise pad (model/layers.py,
 * `linear`): each row computed alone, with the accumulation order of the BLAS's blocked kernel, so
 * that the row gets the bits it gets in a batch without the padded rows and the blocked kernel's cost
 * on a call of one row. layers.py uses it for a weight only where a probe on this CPU shows it gives
 * those bits (`small_call_kc`); elsewhere the call is padded as before.
 *
 * Plain CPython C API. The arrays come as addresses (torch's `data_ptr()`), not through the buffer
 * protocol: numpy conversions around each call cost more than the arithmetic of a one-row call
 * (~5 us against ~1 us at [128, 128]). The one caller, layers.py `_rows_kernel`, checks dtype, device,
 * shapes and strides and keeps the tensors alive; the kernel checks sizes only.
 *
 *   linear_rows(x, ldx, w, ldw, y, m, k, n, kc) -> None
 *       x  [m, k] float32, rows ldx floats apart;
 *       w  [k, n] float32, rows ldw floats apart: an input-major weight's transpose;
 *       y  [m, n] float32, contiguous, written: for every (i, j), the k products summed as blocks of
 *          kc inputs: within a block one fused multiply-add chain over the inputs in order, from 0
 *          (one rounding per step); the blocks' sums then added in order, the first one taken as is.
 *          The same operations whatever m, so the row's bits do not depend on the call's row count.
 *   The GIL is released during the arithmetic.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation is the IEEE one written
 * (fmaf rounds once), in every clone below.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

/* The column loops are compiled for AVX-512, FMA (with AVX) and baseline x86-64 (where fmaf is the libm
 * call), picked at load time by the CPU (gcc/clang function multiversioning, Linux ifunc); one plain
 * build elsewhere. The same correctly rounded fmaf everywhere, so the same bits. */
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || defined(__GNUC__))
#define CLONES __attribute__((target_clones("avx512f", "fma", "default"), noinline))
#else
#define CLONES
#endif

#define JB 4096 /* columns per block: its accumulators stay in L1 while the rows of w stream past */

/* a[j] = 0, then fma(x[k], w[k][j], a[j]) for the nk inputs in order, j < nb (w rows ldw floats apart). */
CLONES static void chain(float *restrict a, const float *restrict x, const float *restrict w, Py_ssize_t ldw,
                         Py_ssize_t nk, Py_ssize_t nb) {
    for (Py_ssize_t j = 0; j < nb; j++) a[j] = 0.0f;
    Py_ssize_t k = 0;
    for (; k + 16 <= nk; k += 16) { /* 16 inputs a pass: the same chain, 16 streams of w, 1/16 of a's traffic */
        const float *restrict w0 = w + k * ldw;
        for (Py_ssize_t j = 0; j < nb; j++) {
            float t = a[j];
            for (int u = 0; u < 16; u++) t = fmaf(x[k + u], w0[u * ldw + j], t);
            a[j] = t;
        }
    }
    for (; k < nk; k++) {
        const float xv = x[k];
        const float *restrict wk = w + k * ldw;
        for (Py_ssize_t j = 0; j < nb; j++) a[j] = fmaf(xv, wk[j], a[j]);
    }
}

CLONES static void add_to(float *restrict y, const float *restrict a, Py_ssize_t nb) {
    for (Py_ssize_t j = 0; j < nb; j++) y[j] = y[j] + a[j];
}

static PyObject *py_linear_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long xa, wa, ya;
    Py_ssize_t ldx, ldw, m, k, n, kc;
    if (!PyArg_ParseTuple(args, "KnKnKnnnn", &xa, &ldx, &wa, &ldw, &ya, &m, &k, &n, &kc)) return NULL;
    if (m < 0 || k < 1 || n < 0 || kc < 1 || ldx < k || ldw < n || (m && n && (!xa || !wa || !ya))) {
        PyErr_Format(PyExc_ValueError, "linear_rows: m %zd, k %zd, n %zd, kc %zd, ldx %zd, ldw %zd do not fit (k and kc "
                     "at least 1, ldx >= k, ldw >= n, non-null addresses)", m, k, n, kc, ldx, ldw);
        return NULL;
    }
    const float *xp = (const float *)(uintptr_t)xa, *wp = (const float *)(uintptr_t)wa;
    float *yp = (float *)(uintptr_t)ya;
    Py_BEGIN_ALLOW_THREADS
    float acc[JB];
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t j0 = 0; j0 < n; j0 += JB) {
            const Py_ssize_t nb = n - j0 < JB ? n - j0 : JB;
            float *out = yp + i * n + j0;
            for (Py_ssize_t k0 = 0; k0 < k; k0 += kc) {
                const Py_ssize_t nk = k - k0 < kc ? k - k0 : kc;
                chain(k0 ? acc : out, xp + i * ldx + k0, wp + k0 * ldw + j0, ldw, nk, nb);
                if (k0) add_to(out, acc, nb);
            }
        }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"linear_rows", py_linear_rows, METH_VARARGS,
     "linear_rows(x, ldx, w, ldw, y, m, k, n, kc) -> None: y = x @ w row by row (addresses of float32 data: x [m, k] "
     "rows ldx apart, w [k, n] rows ldw apart, y [m, n] contiguous), the products summed in fma chains of kc inputs, "
     "the chains then added in order."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_linear_kernel",
    "Row-by-row float32 matmul in a fixed accumulation order, for the small calls of model/layers.py `linear`.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__linear_kernel(void) { return PyModule_Create(&module); }
