/* Argument checking shared by the C kernels (_hash_kernel.c, _gather_kernel.c): buffers taken through
 * the buffer protocol (callers pass `tensor.numpy()` views, zero copy), checked for dtype, number of
 * dimensions and C-contiguity, with a ValueError naming the function, the argument and what it got.
 * Include after <Python.h>; everything here is static. */
#ifndef ENGRAM_KERNEL_BUFFERS_H
#define ENGRAM_KERNEL_BUFFERS_H

enum kind { K_I64, K_U64, K_BOOL, K_U8, K_F32, K_I16 };

static const char *kind_name(enum kind k) {
    switch (k) {
    case K_I64: return "int64";
    case K_U64: return "uint64";
    case K_BOOL: return "bool";
    case K_U8: return "uint8";
    case K_F32: return "float32";
    case K_I16: return "int16";
    }
    return "?";
}

/* Native-order format char of a buffer, or 0 for one we do not accept ('>' / '!' byte order,
 * multi-char formats). */
static char format_char(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (f[0] == 0 || f[1] != 0) return 0;
    return f[0];
}

static int kind_matches(const Py_buffer *v, enum kind k) {
    char c = format_char(v);
    switch (k) {
    case K_I64: return v->itemsize == 8 && (c == 'l' || c == 'q');
    case K_U64: return v->itemsize == 8 && (c == 'L' || c == 'Q');
    case K_BOOL: return v->itemsize == 1 && c == '?';
    case K_U8: return v->itemsize == 1 && c == 'B';
    case K_F32: return v->itemsize == 4 && c == 'f';
    case K_I16: return v->itemsize == 2 && (c == 'h' || c == 'H');
    }
    return 0;
}

/* Get a C-contiguous buffer of `kind` with `ndim` dimensions; on failure set ValueError naming the
 * argument and what it got. */
static int get_array(const char *fn, const char *name, PyObject *obj, enum kind k, int ndim, int writable,
                     Py_buffer *view) {
    int flags = (writable ? PyBUF_WRITABLE : 0) | PyBUF_FORMAT | PyBUF_STRIDES;
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %s must be a %s%s array supporting the buffer protocol "
                     "(e.g. tensor.numpy()), got %.200s", fn, name, writable ? "writable " : "",
                     kind_name(k), Py_TYPE(obj)->tp_name);
        return -1;
    }
    const char *why = NULL;
    if (!kind_matches(view, k)) why = "dtype";
    else if (view->ndim != ndim) why = "number of dimensions";
    else if (!PyBuffer_IsContiguous(view, 'C')) why = "layout (not C-contiguous)";
    if (why) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be a C-contiguous %s array with %d dimension(s); wrong %s "
                     "(got format '%s', itemsize %zd, ndim %d)", fn, name, kind_name(k), ndim, why,
                     view->format ? view->format : "B", view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One array of a group that get_arrays takes: get_array's arguments and where its view goes. */
typedef struct {
    const char *name;
    PyObject *obj;
    enum kind kind;
    int ndim, writable;
    Py_buffer *view;
} ArraySpec;

static void release_arrays(const ArraySpec *spec, int n) {
    while (n > 0) PyBuffer_Release(spec[--n].view);
}

/* get_array for each of spec[0..n): all held on success (0); on failure none is held (-1). */
static int get_arrays(const char *fn, const ArraySpec *spec, int n) {
    for (int i = 0; i < n; i++)
        if (get_array(fn, spec[i].name, spec[i].obj, spec[i].kind, spec[i].ndim, spec[i].writable, spec[i].view) < 0) {
            release_arrays(spec, i);
            return -1;
        }
    return 0;
}

#define SHAPE(v, i) ((v).shape[i])

static inline int shape_error(const char *fn, const char *what, Py_ssize_t got, Py_ssize_t want) {
    PyErr_Format(PyExc_ValueError, "%s: %s is %zd, expected %zd", fn, what, got, want);
    return -1;
}

#endif
