/* A decode step's inputs (inputs/decode.py `DecodeInputs.fill`) in one call: the numpy form's values, without
 * its ~40 array operations a step.
 *
 * Plain CPython C API (no torch or numpy headers). Arguments are addresses of C-contiguous arrays the caller
 * keeps alive and sizes; the caller checks the shapes (a `DecodeInputs` owns every output buffer).
 *
 *   decode_inputs(ids, dead, num_slots, max_len, tables, max_blocks, slots, positions, r, n, block_size, width,
 *                 wide_width, history_len, neutral, input_ids, out_positions, out_dead, slot_mapping, seq_lens,
 *                 history, block_tables, wide)
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

#define BEFORE_START (-1) /* engram/hashing.py */
#define DEAD (-2)

static PyObject *py_decode_inputs(PyObject *Py_UNUSED(self), PyObject *args) {
    unsigned long long ia, da, ta, sa, pa, oia, opa, oda, sma, sla, ha, bta, wa;
    Py_ssize_t num_slots, max_len, max_blocks, r, n, bs, width, wide_width, hl;
    int neutral;
    if (!PyArg_ParseTuple(args, "KKnnKnKKnnnnnnpKKKKKKKK", &ia, &da, &num_slots, &max_len, &ta, &max_blocks, &sa,
                          &pa, &r, &n, &bs, &width, &wide_width, &hl, &neutral, &oia, &opa, &oda, &sma, &sla, &ha, &bta,
                          &wa))
        return NULL;
    if (r < 0 || n < r || bs < 1 || width < 1 || width > max_blocks || (wide_width && wide_width < width)
            || wide_width > max_blocks || hl < 0) {
        PyErr_Format(PyExc_ValueError, "decode_inputs: r %zd, n %zd, block_size %zd, width %zd, wide_width %zd, "
                     "history_len %zd do not fit max_blocks %zd", r, n, bs, width, wide_width, hl, max_blocks);
        return NULL;
    }
    const int32_t *ids = (const int32_t *)(uintptr_t)ia;
    const bool *dead = (const bool *)(uintptr_t)da;
    const int64_t *tables = (const int64_t *)(uintptr_t)ta, *slots = (const int64_t *)(uintptr_t)sa,
                  *pos = (const int64_t *)(uintptr_t)pa;
    int64_t *input_ids = (int64_t *)(uintptr_t)oia, *positions = (int64_t *)(uintptr_t)opa,
            *slot_mapping = (int64_t *)(uintptr_t)sma, *seq_lens = (int64_t *)(uintptr_t)sla,
            *history = (int64_t *)(uintptr_t)ha, *block_tables = (int64_t *)(uintptr_t)bta,
            *wide = (int64_t *)(uintptr_t)wa;
    bool *out_dead = (bool *)(uintptr_t)oda;
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

static PyMethodDef methods[] = {
    {"decode_inputs", py_decode_inputs, METH_VARARGS,
     "decode_inputs(ids, dead, num_slots, max_len, tables, max_blocks, slots, positions, r, n, block_size, width, "
     "wide_width, history_len, neutral, input_ids, positions, dead, slot_mapping, seq_lens, history, block_tables, "
     "wide): a decode step's inputs (see the file's header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_decode_kernel", "A decode step's inputs in one call; see engram_serve/inputs/decode.py.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__decode_kernel(void) { return PyModule_Create(&module); }
