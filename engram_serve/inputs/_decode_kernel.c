/* A decode step's inputs (inputs/decode.py `DecodeInputs.fill`) in one call: the numpy form's values, without
 * its ~40 array operations a step.
 *
 * Plain CPython C API (no torch or numpy headers), with the kernels' conventions (_kernel_buffers.h). Arguments are addresses of C-contiguous arrays the caller
 * keeps alive and sizes; the caller checks the shapes (a `DecodeInputs` owns every output buffer).
 *
 *   decode_inputs(ids, dead, num_slots, max_len, tables, max_blocks, slots, positions, r, n, block_size, width,
 *                 wide_width, history_len, neutral, input_ids, out_positions, out_dead, slot_mapping, seq_lens,
 *                 history, block_tables, wide), by position or by name (DECODE_INPUTS_FIELDS)
 *     ids [S, max_len] int32 and dead [S, max_len] bool: the token store (S = num_slots); tables [S, max_blocks]
 *     int64: the block tables (-1 null); slots, positions [r] int64: row i computes the token at positions[i] of slot
 *     slots[i]. Writes, for i < r: input_ids, out_positions, out_dead, slot_mapping [n] (block * block_size +
 *     offset, -1 where the block is null), seq_lens [r] (position + 1), history [r, history_len] (column j: the
 *     token at position - 1 - j; -1 before position 0, -2 for a dead token), block_tables [r, width] (the
 *     table's first width entries) and wide [r + 1, wide_width] (block_tables, then -1; wide_width 0: none).
 *     With neutral, the padding tokens i in [r, n): id 0, position 0, dead, slot -1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdbool.h>
#include <stdint.h>

#include "_kernel_buffers.h"

#define BEFORE_START (-1) /* engram/hashing.py */
#define DEAD (-2)

/* The arguments, one X-macro list (../_kernel_buffers.h): the struct, the parser (positional and keyword
 * arguments) and the docstring come from it. */
#define DECODE_INPUTS_FIELDS(X)                                                                                \
    X(ADDR, ids, "[num_slots, max_len] int32: the token store")                                                \
    X(ADDR, dead, "[num_slots, max_len] bool")                                                                 \
    X(SIZE, num_slots, "slots of the store")                                                                   \
    X(SIZE, max_len, "positions of a slot")                                                                    \
    X(ADDR, tables, "[num_slots, max_blocks] int64 block tables (-1 null)")                                    \
    X(SIZE, max_blocks, "blocks of a table")                                                                   \
    X(ADDR, slots, "[r] int64: each row's slot")                                                               \
    X(ADDR, positions, "[r] int64: each row's position")                                                       \
    X(SIZE, r, "rows")                                                                                         \
    X(SIZE, n, "tokens (>= r; [r, n) padding)")                                                                \
    X(SIZE, block_size, "tokens of a block")                                                                   \
    X(SIZE, width, "block_tables' width")                                                                      \
    X(SIZE, wide_width, "wide's width (0: none)")                                                              \
    X(SIZE, history_len, "history's width")                                                                    \
    X(FLAG, neutral, "write the padding tokens [r, n)")                                                        \
    X(ADDR, input_ids, "[n] int64, written")                                                                   \
    X(ADDR, out_positions, "[n] int64, written")                                                               \
    X(ADDR, out_dead, "[n] bool, written")                                                                     \
    X(ADDR, slot_mapping, "[n] int64, written")                                                                \
    X(ADDR, seq_lens, "[r] int64, written")                                                                    \
    X(ADDR, history, "[r, history_len] int64, written")                                                        \
    X(ADDR, block_tables, "[r, width] int64, written")                                                         \
    X(ADDR, wide, "[r + 1, wide_width] int64, written")
KERNEL_ARGS(decode_inputs, DECODE_INPUTS_FIELDS, "a decode step's inputs (see the file's header).")

KERNEL_PY(decode_inputs) {
    PARSE(decode_inputs);
    const Py_ssize_t num_slots = a.num_slots, max_len = a.max_len, max_blocks = a.max_blocks, r = a.r, n = a.n,
                     bs = a.block_size, width = a.width, wide_width = a.wide_width, hl = a.history_len;
    const int neutral = (int)a.neutral;
    if (r < 0 || n < r || bs < 1 || width < 1 || width > max_blocks || (wide_width && wide_width < width)
            || wide_width > max_blocks || hl < 0) {
        PyErr_Format(PyExc_ValueError, "decode_inputs: r %zd, n %zd, block_size %zd, width %zd, wide_width %zd, "
                     "history_len %zd do not fit max_blocks %zd", r, n, bs, width, wide_width, hl, max_blocks);
        return NULL;
    }
    const int32_t *ids = (const int32_t *)(uintptr_t)a.ids;
    const bool *dead = (const bool *)(uintptr_t)a.dead;
    const int64_t *tables = CI64(a.tables), *slots = CI64(a.slots), *pos = CI64(a.positions);
    int64_t *input_ids = I64(a.input_ids), *positions = I64(a.out_positions), *slot_mapping = I64(a.slot_mapping),
            *seq_lens = I64(a.seq_lens), *history = I64(a.history), *block_tables = I64(a.block_tables),
            *wide = I64(a.wide);
    bool *out_dead = (bool *)(uintptr_t)a.out_dead;
    for (Py_ssize_t i = 0; i < r; i++) {
        const Py_ssize_t s = slots[i], p = pos[i];
        if (s < 0 || s >= num_slots || p < 0 || p >= max_len || p / bs >= width) {
            PyErr_Format(PyExc_ValueError, "decode_inputs: row %zd's slot %zd or position %zd is outside [0, %zd), "
                         "[0, %zd) or past the table width %zd", i, s, p, num_slots, max_len, width);
            return NULL;
        }
        const int32_t *row_ids = ids + s * max_len;
        const bool *row_dead = dead + s * max_len;
        const int64_t *table = tables + s * max_blocks;
        input_ids[i] = row_ids[p];
        positions[i] = p;
        out_dead[i] = row_dead[p];
        const int64_t block = table[p / bs];
        slot_mapping[i] = block >= 0 ? block * bs + p % bs : -1;
        seq_lens[i] = p + 1;
        for (Py_ssize_t j = 0; j < hl; j++) {
            const Py_ssize_t q = p - 1 - j;
            history[i * hl + j] = q < 0 ? BEFORE_START : row_dead[q] ? DEAD : row_ids[q];
        }
        for (Py_ssize_t b = 0; b < width; b++) block_tables[i * width + b] = table[b];
        if (wide_width)
            for (Py_ssize_t b = 0; b < wide_width; b++) wide[i * wide_width + b] = b < width ? table[b] : -1;
    }
    if (wide_width)
        for (Py_ssize_t b = 0; b < wide_width; b++) wide[r * wide_width + b] = -1;
    if (neutral)
        for (Py_ssize_t i = r; i < n; i++) {
            input_ids[i] = 0;
            positions[i] = 0;
            out_dead[i] = true;
            slot_mapping[i] = -1;
        }
    Py_RETURN_NONE;
}

static const struct arg_spec *const SPECS[] = {&decode_inputs_spec};

static PyObject *py_kernel_fields(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return kernel_fields_of(SPECS, 1);
}

static PyMethodDef methods[] = {
    KERNEL_METHOD(decode_inputs),
    {"kernel_fields", py_kernel_fields, METH_NOARGS,
     "kernel_fields() -> {name: ((field, kind), ...)}: the kernel's arguments in order (by position or by name)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_decode_kernel", "A decode step's inputs in one call; see engram_serve/inputs/decode.py.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__decode_kernel(void) {
    set_docs(methods, SPECS, 1);
    return PyModule_Create(&module);
}
