/* A matmul for the calls of few rows that batch invariance would otherwise pad (model/layers.py,
 * `linear`): each row computed alone, with the accumulation order of the BLAS's blocked kernel, so
 * that the row gets the bits it gets in a batch without the padded rows and the blocked kernel's cost
 * on a call of one row. layers.py uses it for a weight only where a probe on this CPU shows it gives
 * those bits (`small_call_kc`); elsewhere the call is padded as before.
 *
 * Plain CPython C API and the buffer protocol only (see engram/_kernel_buffers.h), like the other kernels.
 *
 *   linear_rows(x, w, y, kc) -> None
 *       x  [m, k] float32, each row contiguous (any row stride);
 *       w  [k, n] float32, each row contiguous (any row stride): an input-major weight's transpose;
 *       y  [m, n] float32, C-contiguous, written: for every (i, j), the k products summed as blocks of
 *          kc inputs: within a block one fused multiply-add chain over the inputs in order, from 0
 *          (one rounding per step); the blocks' sums then added in order, the first one taken as is. The same operations whatever m, so the row's bits do
 *          not depend on the call's row count.
 *   The GIL is released during the arithmetic.
 *
 * Built without -ffast-math and with -ffp-contract=off: every operation is the IEEE one written
 * (fmaf rounds once), in every clone below.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#include "../engram/_kernel_buffers.h"

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

/* A 2-D float32 buffer whose rows are contiguous, rows any whole number of floats apart. */
static int get_rows(const char *name, PyObject *obj, int writable, Py_buffer *v) {
    if (PyObject_GetBuffer(obj, v, (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "linear_rows: %s must be a %sfloat32 array supporting the buffer protocol, "
                     "got %.200s", name, writable ? "writable " : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (!kind_matches(v, K_F32) || v->ndim != 2 || (SHAPE(*v, 1) > 1 && v->strides[1] != 4) ||
        (SHAPE(*v, 0) > 1 && (v->strides[0] % 4 || v->strides[0] < 4 * SHAPE(*v, 1)))) {
        PyErr_Format(PyExc_ValueError, "linear_rows: %s must be a 2-D float32 array with contiguous, "
                     "non-overlapping rows (got format '%s', ndim %d)", name, v->format ? v->format : "B", v->ndim);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *py_linear_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *x_o, *w_o, *y_o;
    Py_ssize_t kc;
    if (!PyArg_ParseTuple(args, "OOOn", &x_o, &w_o, &y_o, &kc)) return NULL;
    Py_buffer x, w, y;
    if (get_rows("x", x_o, 0, &x) < 0) return NULL;
    if (get_rows("w", w_o, 0, &w) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (get_array("linear_rows", "y", y_o, K_F32, 2, 1, &y) < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&x);
        return NULL;
    }
    const Py_ssize_t m = SHAPE(x, 0), k = SHAPE(x, 1), n = SHAPE(w, 1);
    PyObject *result = NULL;
    if (SHAPE(w, 0) != k || SHAPE(y, 0) != m || SHAPE(y, 1) != n || k < 1 || kc < 1) {
        PyErr_Format(PyExc_ValueError, "linear_rows: x [%zd, %zd], w [%zd, %zd], y [%zd, %zd], kc %zd do not fit "
                     "(w [k, n], y [m, n], k and kc at least 1)", m, k, SHAPE(w, 0), n, SHAPE(y, 0), SHAPE(y, 1), kc);
        goto done;
    }
    const Py_ssize_t ldx = m > 1 ? x.strides[0] / 4 : k, ldw = k > 1 ? w.strides[0] / 4 : n;
    const float *xp = x.buf, *wp = w.buf;
    float *yp = y.buf;
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
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&y);
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    return result;
}

static PyMethodDef methods[] = {
    {"linear_rows", py_linear_rows, METH_VARARGS,
     "linear_rows(x, w, y, kc) -> None: y = x @ w row by row, the products summed in fma chains of kc inputs, "
     "the chains then added in order (x [m, k], w [k, n], y [m, n] float32)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_linear_kernel",
    "Row-by-row float32 matmul in a fixed accumulation order, for the small calls of model/layers.py `linear`.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__linear_kernel(void) { return PyModule_Create(&module); }
