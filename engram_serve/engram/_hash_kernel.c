/* Engram n-gram hash (docs/contract.md §2) for CPU int64 arrays: a fused per-token loop.
 *
 * Plain CPython C API and the buffer protocol only (no torch or numpy headers), so the extension
 * builds with nothing but setuptools and a C compiler. Callers pass `tensor.numpy()` views (zero
 * copy); every array must be C-contiguous with the documented dtype and shape, else ValueError.
 *
 * Functions (all write into a caller-allocated `out`, release the GIL while looping, return None):
 *   hash_windows(window_c, multipliers, moduli, offsets, magic, pad_id, out)
 *       window_c [T, N] int64 compressed ids (negative = blocked) -> out [T, L, C] int64
 *   hash_step(input_ids, qsl, history, dead, token_map, multipliers, moduli, offsets, magic, pad_id, out)
 *       the windowing and compression of `hashing.step_windows` + `hashing.compress`, fused with the
 *       hash: input_ids [T], qsl [R+1], history [Rh, D], dead [T] bool or None, token_map [V]
 *   remainder(values, modulus, magic, out)
 *       out[k] = values[k] mod modulus (floor modulo, like Python `%` and torch.remainder); tests only
 * with multipliers [L, N] int64, moduli and offsets [L, C] int64 (C = (N-1)*H), magic [L, C] uint64.
 *
 * Division by a per-column modulus d >= 2 uses a precomputed reciprocal magic = floor(2^64 / d)
 * (computed exactly in Python by `layout.build_layout`): for any 64-bit unsigned n,
 *     q' = floor(n * magic / 2^64)  is  q or q - 1,  where q = floor(n / d),
 * because 2^64 = magic*d + e with 0 <= e < d gives n*magic/2^64 = n/d - n*e/(d*2^64) and
 * 0 <= n*e/(d*2^64) < 1. So r' = n - q'*d lies in [0, 2d) and one conditional subtraction makes
 * it exact. A wrong magic is not detected here (tests/kernels/test_hash_kernel.py shows it gives wrong ids).
 *
 * Arithmetic follows torch int64 semantics exactly: products and XOR wrap (done in uint64, so no
 * undefined behaviour), the remainder is a floor modulo (a negative rolling value, impossible for
 * valid inputs (docs/contract.md §2), still matches torch.remainder), and `+ offset` wraps.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__SIZEOF_INT128__)
#error "this kernel needs a compiler with unsigned __int128 (gcc or clang on a 64-bit target)"
#endif

__extension__ typedef unsigned __int128 u128;

#define OUT_OF_MAP INT64_MIN /* hash_step: a raw id >= the token map's size (confirmed against the id when read) */
#define MAX_N 64 /* longest n-gram the per-token scratch holds (published configs use N <= 5); a power of two */

/* n mod d for any 64-bit n, d >= 2, magic == floor(2^64 / d). */
static inline uint64_t umod_magic(uint64_t n, uint64_t d, uint64_t magic) {
    uint64_t q = (uint64_t)(((u128)n * magic) >> 64);
    uint64_t r = n - q * d; /* in [0, 2d) */
    return r >= d ? r - d : r;
}

/* Floor modulo of the int64 whose bits are x (torch.remainder / Python % for d > 0). */
static inline uint64_t floor_mod(uint64_t x, uint64_t d, uint64_t magic) {
    if ((int64_t)x >= 0) return umod_magic(x, d, magic);
    uint64_t r = umod_magic((uint64_t)0 - x, d, magic); /* -x as unsigned: at most 2^63 */
    return r ? d - r : 0;
}

#include "_kernel_buffers.h"

/* The per-layer constants shared by both hash entry points. */
typedef struct {
    Py_buffer mult, mod, off, magic, out;
    int held; /* the above are held (all or none) */
    Py_ssize_t tokens, layers, n, cols, heads;
    int64_t pad_id;
} HashArgs;

static void release_hash_args(HashArgs *a) {
    if (a->held) {
        Py_buffer *all[] = {&a->mult, &a->mod, &a->off, &a->magic, &a->out};
        for (int i = 0; i < 5; i++) PyBuffer_Release(all[i]);
    }
    a->held = 0;
}

/* Check multipliers [L, N], moduli/offsets/magic [L, C] with C = (N-1)*H, out [T, L, C]. */
static int get_hash_args(const char *fn, HashArgs *a, Py_ssize_t tokens, Py_ssize_t n_expected,
                         PyObject *mult, PyObject *mod, PyObject *off, PyObject *magic, PyObject *out) {
    const ArraySpec spec[] = {{"multipliers", mult, K_I64, 2, 0, &a->mult}, {"moduli", mod, K_I64, 2, 0, &a->mod},
                              {"offsets", off, K_I64, 2, 0, &a->off}, {"magic", magic, K_U64, 2, 0, &a->magic},
                              {"out", out, K_I64, 3, 1, &a->out}};
    a->held = 0;
    if (get_arrays(fn, spec, 5) < 0) return -1;
    a->held = 1;
    a->tokens = tokens;
    a->layers = SHAPE(a->mult, 0);
    a->n = SHAPE(a->mult, 1);
    a->cols = SHAPE(a->mod, 1);
    if (n_expected >= 0 && a->n != n_expected) { shape_error(fn, "multipliers.shape[1] (N)", a->n, n_expected); goto fail; }
    if (a->n < 2 || a->n > MAX_N) {
        PyErr_Format(PyExc_ValueError, "%s: n-gram size N = multipliers.shape[1] = %zd must be in 2..%d",
                     fn, a->n, MAX_N);
        goto fail;
    }
    if (a->cols % (a->n - 1) != 0) {
        PyErr_Format(PyExc_ValueError, "%s: moduli.shape[1] = %zd is not a multiple of N-1 = %zd", fn, a->cols,
                     a->n - 1);
        goto fail;
    }
    a->heads = a->cols / (a->n - 1);
    Py_buffer *lc[] = {&a->mod, &a->off, &a->magic};
    const char *lc_name[] = {"moduli", "offsets", "magic"};
    for (int i = 0; i < 3; i++) {
        if (SHAPE(*lc[i], 0) != a->layers || SHAPE(*lc[i], 1) != a->cols) {
            PyErr_Format(PyExc_ValueError, "%s: %s has shape [%zd, %zd], expected [L, C] = [%zd, %zd]", fn,
                         lc_name[i], SHAPE(*lc[i], 0), SHAPE(*lc[i], 1), a->layers, a->cols);
            goto fail;
        }
    }
    if (SHAPE(a->out, 0) != tokens || SHAPE(a->out, 1) != a->layers || SHAPE(a->out, 2) != a->cols) {
        PyErr_Format(PyExc_ValueError, "%s: out has shape [%zd, %zd, %zd], expected [T, L, C] = [%zd, %zd, %zd]", fn,
                     SHAPE(a->out, 0), SHAPE(a->out, 1), SHAPE(a->out, 2), tokens, a->layers, a->cols);
        goto fail;
    }
    const int64_t *m = (const int64_t *)a->mod.buf;
    for (Py_ssize_t i = 0; i < a->layers * a->cols; i++) {
        if (m[i] < 2) {
            PyErr_Format(PyExc_ValueError, "%s: moduli[%zd, %zd] = %lld; every modulus must be >= 2", fn,
                         i / a->cols, i % a->cols, (long long)m[i]);
            goto fail;
        }
    }
    return 0;
fail:
    release_hash_args(a);
    return -1;
}

/* Hash one token from its compressed window v[0..N-1] (negative = blocked) into out[L*C]. */
static inline void hash_token(const HashArgs *a, const int64_t *win, int64_t *out) {
    const Py_ssize_t L = a->layers, N = a->n, C = a->cols, H = a->heads;
    const uint64_t *mult = (const uint64_t *)a->mult.buf;
    const uint64_t *mod = (const uint64_t *)a->mod.buf;
    const uint64_t *off = (const uint64_t *)a->off.buf;
    const uint64_t *magic = (const uint64_t *)a->magic.buf;
    uint64_t v[MAX_N];
    int blocked = 0;
    for (Py_ssize_t s = 0; s < N; s++) {
        blocked |= win[s] < 0; /* once blocked, stays blocked */
        v[s] = (uint64_t)(blocked ? a->pad_id : win[s]);
    }
    for (Py_ssize_t l = 0; l < L; l++) {
        const uint64_t *ml = mult + l * N;
        const uint64_t *dl = mod + l * C, *gl = magic + l * C, *ol = off + l * C;
        uint64_t *o = (uint64_t *)out + l * C;
        uint64_t rolling = v[0] * ml[0];
        for (Py_ssize_t s = 1; s < N; s++) {
            rolling ^= v[s] * ml[s];
            Py_ssize_t c0 = (s - 1) * H;
            for (Py_ssize_t h = 0; h < H; h++) {
                Py_ssize_t c = c0 + h;
                o[c] = floor_mod(rolling, dl[c], gl[c]) + ol[c];
            }
        }
    }
}

static PyObject *py_hash_windows(PyObject *self, PyObject *args) {
    static const char *fn = "hash_windows";
    PyObject *win_o, *mult_o, *mod_o, *off_o, *magic_o, *out_o;
    long long pad_id;
    if (!PyArg_ParseTuple(args, "OOOOOLO:hash_windows", &win_o, &mult_o, &mod_o, &off_o, &magic_o, &pad_id, &out_o))
        return NULL;
    Py_buffer win;
    if (get_array(fn, "window_c", win_o, K_I64, 2, 0, &win) < 0) return NULL;
    HashArgs a;
    if (get_hash_args(fn, &a, SHAPE(win, 0), SHAPE(win, 1), mult_o, mod_o, off_o, magic_o, out_o) < 0) {
        PyBuffer_Release(&win);
        return NULL;
    }
    a.pad_id = pad_id;
    const int64_t *w = (const int64_t *)win.buf;
    int64_t *out = (int64_t *)a.out.buf;
    const Py_ssize_t T = a.tokens, N = a.n, LC = a.layers * a.cols;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 0; t < T; t++) hash_token(&a, w + t * N, out + t * LC);
    Py_END_ALLOW_THREADS
    release_hash_args(&a);
    PyBuffer_Release(&win);
    Py_RETURN_NONE;
}

/* Fused step_windows + compress + hash_windows; mirrors hashing.step_windows line for line. */
static PyObject *py_hash_step(PyObject *self, PyObject *args) {
    static const char *fn = "hash_step";
    PyObject *ids_o, *qsl_o, *hist_o, *dead_o, *map_o, *mult_o, *mod_o, *off_o, *magic_o, *out_o;
    long long pad_id;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOLO:hash_step", &ids_o, &qsl_o, &hist_o, &dead_o, &map_o, &mult_o, &mod_o,
                          &off_o, &magic_o, &pad_id, &out_o))
        return NULL;
    Py_buffer ids, qsl, hist, dead, map;
    int have_dead = dead_o != Py_None, held = 0;
    HashArgs a;
    a.held = 0;
    PyObject *result = NULL;
    if (get_array(fn, "input_ids", ids_o, K_I64, 1, 0, &ids) < 0) goto done;
    held = 1;
    if (get_array(fn, "qsl", qsl_o, K_I64, 1, 0, &qsl) < 0) goto done;
    held = 2;
    if (get_array(fn, "history", hist_o, K_I64, 2, 0, &hist) < 0) goto done;
    held = 3;
    if (get_array(fn, "token_map", map_o, K_I64, 1, 0, &map) < 0) goto done;
    held = 4;
    if (have_dead) {
        if (get_array(fn, "dead", dead_o, K_BOOL, 1, 0, &dead) < 0) goto done;
        held = 5;
    }
    const Py_ssize_t T = SHAPE(ids, 0), nq = SHAPE(qsl, 0), rows_h = SHAPE(hist, 0), depth = SHAPE(hist, 1);
    const Py_ssize_t vocab = SHAPE(map, 0);
    if (have_dead && SHAPE(dead, 0) != T) { shape_error(fn, "dead.shape[0]", SHAPE(dead, 0), T); goto done; }
    if (nq < 1) { shape_error(fn, "qsl.shape[0] (R+1)", nq, 1); goto done; }
    const int64_t *q = (const int64_t *)qsl.buf;
    for (Py_ssize_t i = 1; i < nq; i++) {
        if (q[i] < q[i - 1]) {
            PyErr_Format(PyExc_ValueError, "%s: qsl must be non-decreasing, but qsl[%zd] = %lld < qsl[%zd] = %lld",
                         fn, i, (long long)q[i], i - 1, (long long)q[i - 1]);
            goto done;
        }
    }
    if (get_hash_args(fn, &a, T, -1, mult_o, mod_o, off_o, magic_o, out_o) < 0) goto done;
    a.pad_id = pad_id;
    const Py_ssize_t N = a.n, LC = a.layers * a.cols;
    const int64_t *id = (const int64_t *)ids.buf, *hp = (const int64_t *)hist.buf, *tm = (const int64_t *)map.buf;
    const char *dd = have_dead ? (const char *)dead.buf : NULL;
    int64_t *out = (int64_t *)a.out.buf;
    const int have_hist = rows_h * depth > 0;
    const Py_ssize_t max_row = rows_h > 0 ? rows_h - 1 : 0, max_j = depth > 0 ? depth - 1 : 0;
    /* recent[k % MAX_N]: token k's compressed id (DEAD if dead; negative ids pass through), computed
     * once per token, not once per window that reads it; windows read at most N-1 <= MAX_N-1 back */
    int64_t recent[MAX_N];
    Py_ssize_t bad_t = -1;
    int64_t bad_id = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t row = 0; /* searchsorted(qsl[1:], t, right=True): how many qsl[1:] are <= t */
    int64_t win[MAX_N];
    for (Py_ssize_t t = 0; t < T && bad_t < 0; t++) {
        const int64_t raw_t = dd && dd[t] ? -2 : id[t]; /* DEAD */
        recent[t % MAX_N] = raw_t < 0 ? raw_t : raw_t < vocab ? tm[raw_t] : OUT_OF_MAP; /* raised only if read */
        while (row < nq - 1 && q[row + 1] <= t) row++;
        const int valid = row < rows_h;
        const Py_ssize_t r = row < max_row ? row : max_row;
        const int64_t offset = (int64_t)t - q[r]; /* position of t inside its row */
        for (Py_ssize_t s = 0; s < N; s++) {
            int64_t c;
            if (!valid) {
                c = -1; /* BEFORE_START: padding past the last row */
            } else if (offset >= s) {
                Py_ssize_t k = t - s > 0 ? t - s : 0; /* (k = 0 only while t < N: recent[0] still holds token 0) */
                c = recent[k % MAX_N];
                if (c == OUT_OF_MAP && id[k] >= vocab && !(dd && dd[k])) { bad_t = t; bad_id = id[k]; break; }
            } else {
                int64_t j = s - offset - 1;
                j = j < 0 ? 0 : (j > max_j ? max_j : j);
                c = have_hist ? hp[r * depth + j] : -1;
                if (c >= 0) {
                    if (c >= vocab) { bad_t = t; bad_id = c; break; }
                    c = tm[c];
                }
            }
            win[s] = c;
        }
        if (bad_t < 0) hash_token(&a, win, out + t * LC);
    }
    Py_END_ALLOW_THREADS
    if (bad_t >= 0) {
        PyErr_Format(PyExc_IndexError, "%s: raw token id %lld in the window of token %zd is outside the token map "
                     "(size %zd)", fn, (long long)bad_id, bad_t, vocab);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_hash_args(&a);
    Py_buffer *all[] = {&ids, &qsl, &hist, &map, &dead};
    for (int i = 0; i < held; i++) PyBuffer_Release(all[i]);
    return result;
}

static PyObject *py_remainder(PyObject *self, PyObject *args) {
    static const char *fn = "remainder";
    PyObject *vals_o, *out_o;
    unsigned long long d, magic;
    if (!PyArg_ParseTuple(args, "OKKO:remainder", &vals_o, &d, &magic, &out_o)) return NULL;
    if (d < 2) {
        PyErr_Format(PyExc_ValueError, "%s: modulus %llu must be >= 2", fn, d);
        return NULL;
    }
    Py_buffer vals, out;
    if (get_array(fn, "values", vals_o, K_I64, 1, 0, &vals) < 0) return NULL;
    if (get_array(fn, "out", out_o, K_I64, 1, 1, &out) < 0) {
        PyBuffer_Release(&vals);
        return NULL;
    }
    if (SHAPE(out, 0) != SHAPE(vals, 0)) {
        shape_error(fn, "out.shape[0]", SHAPE(out, 0), SHAPE(vals, 0));
        PyBuffer_Release(&vals);
        PyBuffer_Release(&out);
        return NULL;
    }
    const uint64_t *v = (const uint64_t *)vals.buf;
    uint64_t *o = (uint64_t *)out.buf;
    for (Py_ssize_t i = 0; i < SHAPE(vals, 0); i++) o[i] = floor_mod(v[i], d, magic);
    PyBuffer_Release(&vals);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"hash_windows", py_hash_windows, METH_VARARGS,
     "hash_windows(window_c, multipliers, moduli, offsets, magic, pad_id, out): out[T, L, C] = docs/contract.md §2 hash of "
     "the compressed windows [T, N] (negative = blocked)."},
    {"hash_step", py_hash_step, METH_VARARGS,
     "hash_step(input_ids, qsl, history, dead, token_map, multipliers, moduli, offsets, magic, pad_id, out): "
     "windowing, compression and hash of one step, fused (see hashing.step_windows)."},
    {"remainder", py_remainder, METH_VARARGS,
     "remainder(values, modulus, magic, out): out = values mod modulus (floor modulo) via the reciprocal "
     "magic = floor(2**64 / modulus). For tests."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hash_kernel",
    "Engram n-gram hash kernel for CPU int64 arrays (docs/contract.md §2); see engram_serve/engram/hashing.py.", -1, methods,
};

PyMODINIT_FUNC PyInit__hash_kernel(void) { return PyModule_Create(&module); }
