/* The argument conventions every C kernel shares (engram/_hash_kernel.c, engram/_gather_kernel.c,
 * model/_linear_kernel.c, model/_token_kernel.c, inputs/_decode_kernel.c); include after <Python.h>,
 * everything here is static.
 *
 * 1. Named arguments (the address kernels: linear, token, decode). A kernel's arguments are one list, an
 *    X-macro of (kind, name, doc) entries in the order of its positional form:
 *
 *        #define SWIGLU_FIELDS(X) X(ADDR, gu, "[n, 2 inter] float32: g then u") X(SIZE, n, "rows") ...
 *        KERNEL_ARGS(swiglu, SWIGLU_FIELDS, "silu(min(g, L)) * clamp(u, -L, L)")
 *
 *    KERNEL_ARGS makes from it `struct swiglu_args` (one 8-byte member per entry, in order: ADDR a uint64_t
 *    address, SIZE an int64_t, REAL a double, FLAG an int64_t 0 or 1; OPTADDR, OPTFLAG and OPTSIZE may be left out:
 *    0; they come last), so that the struct's memory is the array of 64-bit slots a CPU graph's replay packs
 *    (runner/cpu_graphs.py); `swiglu_spec`, the names, kinds and docs the parser (`parse_args`: positional
 *    and keyword arguments, METH_FASTCALL), the docstring with its text signature (`kernel_doc`) and
 *    `kernel_fields()` / `raw_kernels()` read. A kernel's compute reads `a->n`, `a->limit` by name; its raw
 *    entry (`RAW_ENTRY`) casts the slots to the struct.
 * 2. Buffers (the hash and gather kernels): taken through the buffer protocol (callers pass `tensor.numpy()`
 *    views, zero copy), checked for dtype, number of dimensions and C-contiguity, with a ValueError naming the
 *    function, the argument and what it got.
 * 3. Errors: `misfit` (a ValueError "fn: what"), `shape_error`. */
#ifndef ENGRAM_KERNEL_BUFFERS_H
#define ENGRAM_KERNEL_BUFFERS_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- 1. named arguments ------------------------------------------------------------------------------- */

enum arg_kind { ARG_ADDR, ARG_SIZE, ARG_REAL, ARG_FLAG, ARG_OPTADDR, ARG_OPTFLAG, ARG_OPTSIZE };
static const char *const ARG_KIND_NAMES[] __attribute__((unused)) = {"addr", "size", "real", "flag", "addr", "flag",
                                                                        "size"};

#define ARG_TYPE_ADDR uint64_t
#define ARG_TYPE_OPTADDR uint64_t
#define ARG_TYPE_SIZE int64_t
#define ARG_TYPE_FLAG int64_t
#define ARG_TYPE_OPTFLAG int64_t
#define ARG_TYPE_OPTSIZE int64_t
#define ARG_TYPE_REAL double

struct arg_field {
    const char *name;
    enum arg_kind kind;
    const char *doc;
};

struct arg_spec {
    const char *name, *summary;
    const struct arg_field *fields;
    Py_ssize_t count;
    PyObject **keys; /* [count]: the field names as interned str, made at the first keyword call (`match_key`) */
};

#define ARG_MEMBER_(kind, name, doc) ARG_TYPE_##kind name;
#define ARG_FIELD_(kind, name, doc) {#name, ARG_##kind, doc},

/* struct NAME_args, NAME_spec (and its fields NAME_fields) from the list FIELDS */
/* struct NAME_args alone (a kernel that fills another's slots: hc_next's matmul) */
#define ARGS_STRUCT(NAME, FIELDS) struct __attribute__((may_alias)) NAME##_args { FIELDS(ARG_MEMBER_) };

#define KERNEL_ARGS(NAME, FIELDS, SUMMARY)                                                                     \
    ARGS_STRUCT(NAME, FIELDS)                                                                                  \
    static const struct arg_field NAME##_fields[] = {FIELDS(ARG_FIELD_)};                                      \
    static PyObject *NAME##_keys[sizeof NAME##_fields / sizeof NAME##_fields[0]];                              \
    static const struct arg_spec NAME##_spec = {#NAME, SUMMARY, NAME##_fields,                                  \
                                                (Py_ssize_t)(sizeof NAME##_fields / sizeof NAME##_fields[0]),  \
                                                NAME##_keys};                                                  \
    _Static_assert(sizeof(struct NAME##_args) == sizeof NAME##_fields / sizeof NAME##_fields[0] * 8,           \
                   #NAME ": every argument is one 8-byte slot");

/* raw_NAME(slots): run_NAME on the slots as the struct (a replay's call, without the parser's checks) */
#define RAW_ENTRY(NAME) \
    static void raw_##NAME(const uint64_t *slots) { run_##NAME((const struct NAME##_args *)(const void *)slots); }

/* the method table's entry of a kernel with a spec: its docstring comes from `kernel_doc` at module init */
#define KERNEL_METHOD(NAME) {#NAME, (PyCFunction)(void (*)(void))py_##NAME, METH_FASTCALL | METH_KEYWORDS, NULL}

typedef void (*raw_fn)(const uint64_t *slots);

/* an ADDR field as the pointer it is */
#define F(a) ((float *)(uintptr_t)(a))
#define CF(a) ((const float *)(uintptr_t)(a))
#define I64(a) ((int64_t *)(uintptr_t)(a))
#define CI64(a) ((const int64_t *)(uintptr_t)(a))
#define U8(a) ((const uint8_t *)(uintptr_t)(a))

/* py_NAME's head, and its arguments parsed into `struct NAME_args a` (returns NULL on a TypeError) */
#define KERNEL_PY(NAME) \
    static PyObject *py_##NAME(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
#define PARSE(NAME)            \
    struct NAME##_args a;      \
    if (parse_args(&NAME##_spec, args, nargs, kwnames, &a) < 0) return NULL

/* one argument into its 8-byte slot: ADDR / OPTADDR as 'K' took it (an int, the two's complement bits), SIZE as
 * 'n' (an index), REAL as 'd', FLAG as 'p' (truth) */
static inline int arg_convert(const struct arg_spec *s, Py_ssize_t i, PyObject *o, void *slot) {
    const enum arg_kind k = s->fields[i].kind;
    if (k == ARG_REAL) {
        const double d = PyFloat_AsDouble(o);
        if (d == -1.0 && PyErr_Occurred()) goto bad;
        memcpy(slot, &d, 8);
        return 0;
    }
    int64_t v;
    if (k == ARG_FLAG || k == ARG_OPTFLAG) {
        const int t = PyObject_IsTrue(o);
        if (t < 0) goto bad;
        v = t;
    } else if (k == ARG_SIZE || k == ARG_OPTSIZE) {
        const Py_ssize_t n = PyLong_Check(o) ? PyLong_AsSsize_t(o) : PyNumber_AsSsize_t(o, PyExc_OverflowError);
        if (n == -1 && PyErr_Occurred()) goto bad;
        v = (int64_t)n;
    } else {
        if (!PyLong_Check(o)) {
            PyErr_Format(PyExc_TypeError, "%s: %s must be an int (an address), not %.200s", s->name, s->fields[i].name,
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        const unsigned long long u = PyLong_AsUnsignedLongLongMask(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) goto bad;
        v = (int64_t)u;
    }
    memcpy(slot, &v, 8);
    return 0;
bad:
    if (PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: %s must be %s, not %.200s", s->name, s->fields[i].name,
                     k == ARG_REAL ? "a float" : k == ARG_FLAG || k == ARG_OPTFLAG ? "a truth value" : "an int", Py_TYPE(o)->tp_name);
    }
    return -1;
}

/* The index of the field named `key` (a str) among fields [from, s->count), -1 if none (-2 with an error set).
 * A keyword in Python source, or a **dict's key written in source, is an interned str: the field's interned name
 * is the same object, found by pointer first, from `hint` on (keywords mostly come in field order: one look);
 * any other str falls back to comparing the text. */
static inline Py_ssize_t match_key(const struct arg_spec *s, PyObject *key, Py_ssize_t from, Py_ssize_t hint) {
    if (!s->keys[0])
        for (Py_ssize_t i = 0; i < s->count; i++)
            if (!(s->keys[i] = PyUnicode_InternFromString(s->fields[i].name))) {
                while (i > 0) Py_CLEAR(s->keys[--i]);
                return -2;
            }
    if (hint < from || hint >= s->count) hint = from;
    for (Py_ssize_t i = hint; i < s->count; i++)
        if (s->keys[i] == key) return i;
    for (Py_ssize_t i = from; i < hint; i++)
        if (s->keys[i] == key) return i;
    if (!PyUnicode_Check(key)) return -1;
    for (Py_ssize_t i = from; i < s->count; i++)
        if (PyUnicode_CompareWithASCIIString(key, s->fields[i].name) == 0) return i;
    return -1;
}

/* A METH_FASTCALL | METH_KEYWORDS call's arguments into the struct at `out` (s->count slots): positional ones
 * first, in the list's order, then keywords by name; TypeError naming a missing, unknown or repeated argument.
 * An OPTADDR, OPTFLAG or OPTSIZE left out is 0. */
static inline int parse_args(const struct arg_spec *s, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                      void *out) {
    char *slots = out;
    const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > s->count) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd arguments (%zd given)", s->name, s->count, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        if (arg_convert(s, i, args[i], slots + 8 * i) < 0) return -1;
    if (!nkw && nargs == s->count) return 0; /* the positional call: every argument given */
    uint64_t seen[4] = {0, 0, 0, 0};                 /* fields given by keyword (at most 256) */
    Py_ssize_t hint = nargs;                         /* where the next keyword is looked for first */
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, j);
        const Py_ssize_t i = match_key(s, key, nargs, hint);
        if (i == -2) return -1;
        if (i < 0 || seen[i / 64] >> (i % 64) & 1) {
            if (i >= 0 || (nargs && match_key(s, key, 0, 0) >= 0))
                PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%U'", s->name, key);
            else
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", s->name, key);
            return -1;
        }
        hint = i + 1;
        seen[i / 64] |= (uint64_t)1 << (i % 64);
        if (arg_convert(s, i, args[nargs + j], slots + 8 * i) < 0) return -1;
    }
    for (Py_ssize_t i = nargs; i < s->count; i++)
        if (!(seen[i / 64] >> (i % 64) & 1)) {
            if (s->fields[i].kind < ARG_OPTADDR) {
                PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s' (pos %zd)", s->name,
                             s->fields[i].name, i + 1);
                return -1;
            }
            memset(slots + 8 * i, 0, 8);
        }
    return 0;
}

/* "name($module, f1, f2, f3=0)\n--\n\nsummary\n\n  f1 (kind): doc\n..." (a text signature: inspect.signature
 * reads the names); allocated once, for the module's life */
static inline const char *kernel_doc(const struct arg_spec *s) {
    size_t len = strlen(s->name) + strlen(s->summary) + 64;
    for (Py_ssize_t i = 0; i < s->count; i++) len += 2 * strlen(s->fields[i].name) + strlen(s->fields[i].doc) + 24;
    char *d = malloc(len), *p = d;
    if (!d) return s->summary;
    p += sprintf(p, "%s($module", s->name);
    for (Py_ssize_t i = 0; i < s->count; i++)
        p += sprintf(p, ", %s%s", s->fields[i].name, s->fields[i].kind >= ARG_OPTADDR ? "=0" : "");
    p += sprintf(p, ")\n--\n\n%s\n", s->summary);
    for (Py_ssize_t i = 0; i < s->count; i++)
        p += sprintf(p, "\n  %s (%s): %s", s->fields[i].name, ARG_KIND_NAMES[s->fields[i].kind], s->fields[i].doc);
    return d;
}

/* the methods' docstrings from their specs (before PyModule_Create) */
static inline void set_docs(PyMethodDef *methods, const struct arg_spec *const *specs, size_t n) {
    for (size_t i = 0; i < n; i++)
        for (PyMethodDef *m = methods; m->ml_name; m++)
            if (!strcmp(m->ml_name, specs[i]->name)) m->ml_doc = kernel_doc(specs[i]);
}

/* ((name, kind), ...) of a spec's fields, in order */
static inline PyObject *spec_fields(const struct arg_spec *s) {
    PyObject *t = PyTuple_New(s->count);
    for (Py_ssize_t i = 0; t && i < s->count; i++) {
        PyObject *f = Py_BuildValue("(ss)", s->fields[i].name, ARG_KIND_NAMES[s->fields[i].kind]);
        if (!f) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, f);
    }
    return t;
}

/* {name: ((field, kind), ...)} of every kernel with a spec: the order a keyword call's arguments take
 * (model/capture.py records them so) */
static inline PyObject *kernel_fields_of(const struct arg_spec *const *specs, size_t n) {
    PyObject *out = PyDict_New();
    for (size_t i = 0; out && i < n; i++) {
        PyObject *v = spec_fields(specs[i]);
        if (!v || PyDict_SetItemString(out, specs[i]->name, v) < 0) Py_CLEAR(out);
        Py_XDECREF(v);
    }
    return out;
}

/* one raw_kernels() item: name -> (((field, kind), ...), raw entry address) */
static inline int add_raw(PyObject *out, const struct arg_spec *s, raw_fn fn) {
    PyObject *v = Py_BuildValue("(NN)", spec_fields(s), PyLong_FromVoidPtr((void *)(uintptr_t)fn));
    const int r = v ? PyDict_SetItemString(out, s->name, v) : -1;
    Py_XDECREF(v);
    return r;
}

/* ---- 3. errors ------------------------------------------------------------------------------------------ */

static inline PyObject *misfit(const char *fn, const char *what) {
    PyErr_Format(PyExc_ValueError, "%s: %s", fn, what);
    return NULL;
}

/* ---- 2. buffers ----------------------------------------------------------------------------------------- */

enum kind { K_I64, K_U64, K_BOOL, K_U8, K_F32, K_I16 };

static inline const char *kind_name(enum kind k) {
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
static inline char format_char(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') f++;
    if (f[0] == 0 || f[1] != 0) return 0;
    return f[0];
}

static inline int kind_matches(const Py_buffer *v, enum kind k) {
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
static inline int get_array(const char *fn, const char *name, PyObject *obj, enum kind k, int ndim, int writable,
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

static inline void release_arrays(const ArraySpec *spec, int n) {
    while (n > 0) PyBuffer_Release(spec[--n].view);
}

/* get_array for each of spec[0..n): all held on success (0); on failure none is held (-1). */
static inline int get_arrays(const char *fn, const ArraySpec *spec, int n) {
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
