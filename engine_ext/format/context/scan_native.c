/* The context pass over a part's base (decode side), compiled: engine_ext.format.context._scan_native.

Math. Element i of a part has class c(i) = #{edges <= exponent(base[i])} (K <= 16 classes).
Within block b, class c lists ascending ranks r_0 < r_1 < ...; the pass finds, for each,
the part-flat position of the (r_j + 1)-th element of class c in the block's element order
(its rows' runs, in order). It writes those positions (pos) and the index of each rank
(src), block by block in element order, and returns how many it found: fewer than listed
means a rank beyond its class (a wrong base, or corrupt input).

Why compiled: the numba reference (scan_kernels._scan_blocks) counts down per class, one
load and one store per element; consecutive elements of one class chain through a
store-to-load forward, about 4 cycles an element (1.3 ns on one core). Here 64 elements at
a time: their exponents as bytes, then one bit mask per class edge (e >= edge: one SIMD
compare per 16-64 bytes), then per class the population count of (mask_c & ~mask_c+1),
subtracted from the class's countdown. Only where a countdown reaches zero in the chunk are
the chunk's bits of that class walked (at most one per change).

The same source builds a scalar variant everywhere and AVX2 / AVX-512BW variants on x86-64,
chosen at import by what the CPU reports. Bounds: every array length is checked against the
indices read from it before the pass (scan_blocks raises ValueError on a mismatch), and corrupt
ranks make a short count, never a read out of bounds or a signed overflow.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

#define CHUNK 64
#define MAX_K 16

typedef struct {
    const void *u;
    int itemsize, shift;
    unsigned mask;
    int K;
    uint8_t edges[MAX_K];
    const int64_t *rows, *row_ptr, *run, *ranks, *starts;
    int64_t n_rows, n_blocks, n_ranks;
    int64_t *pos, *src;
} Scan;

static const int64_t FAR = (int64_t)1 << 62; /* a countdown that never ends: no rank left in the class */

/* The pass, once per instruction set: the same source with SCAN_ISA 0 (scalar), 1 (AVX2) and 2 (AVX-512BW). */
#define SCAN_ISA 0
#define SCAN_TARGET
#define SCAN_SUFFIX _scalar
#include "scan_native_pass.h"
#if HAVE_X86
#define SCAN_ISA 1
#define SCAN_TARGET __attribute__((target("avx2,bmi,popcnt")))
#define SCAN_SUFFIX _avx2
#include "scan_native_pass.h"
#define SCAN_ISA 2
#define SCAN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx2,bmi,bmi2,popcnt")))
#define SCAN_SUFFIX _avx512
#include "scan_native_pass.h"
#endif

/* ---------------------------------------------------------------- Python face */

typedef int64_t (*ScanFn)(Scan *s);

typedef struct {
    const char *name;
    ScanFn fn;
    int runs; /* whether this CPU runs it: set at import */
} Variant;

/* Widest first: the order ISAS lists them in, so that its first is the one to take. */
static Variant VARIANTS[] = {
#if HAVE_X86
    {"avx512bw", run_scan_avx512, 0},
    {"avx2", run_scan_avx2, 0},
#endif
    {"scalar", run_scan_scalar, 1},
};
#define N_VARIANTS ((int)(sizeof(VARIANTS) / sizeof(VARIANTS[0])))

static void probe(void) {
#if HAVE_X86
    __builtin_cpu_init();
    VARIANTS[0].runs = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
                       __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    VARIANTS[1].runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("popcnt");
#endif
}

static int check(int ok, const char *what) {
    if (!ok) PyErr_Format(PyExc_ValueError, "scan_blocks: %s", what);
    return ok;
}

/* Every index the pass reads, checked against its array's length, so that no input reads out of bounds. */
static int validate(const Scan *s, int64_t numel, int64_t n_pos, int64_t starts_len) {
    if (!check(s->K >= 1 && s->K <= MAX_K, "1..16 classes") || !check(starts_len == s->n_blocks * (s->K + 1), "starts is [blocks, K + 1]") ||
        !check(s->shift >= 0 && s->shift < 8 * s->itemsize && s->mask <= 0xFF, "shift and mask within an element"))
        return 0;
    if (!check(s->row_ptr[0] >= 0, "row_ptr starts at 0 or later")) return 0;
    int64_t listed = 0;
    for (int64_t b = 0; b < s->n_blocks; b++) {
        if (!check(s->row_ptr[b] <= s->row_ptr[b + 1] && s->row_ptr[b + 1] <= s->n_rows, "row_ptr ascending within rows") ||
            !check(s->run[b] >= 0 && s->run[b] <= numel, "runs within the part"))
            return 0;
        for (int64_t ri = s->row_ptr[b]; ri < s->row_ptr[b + 1]; ri++)
            if (!check(s->rows[ri] >= 0 && s->rows[ri] <= numel - s->run[b], "rows within the part")) return 0;
        const int64_t *st = s->starts + b * (s->K + 1);
        for (int c = 0; c < s->K; c++)
            if (!check(0 <= st[c] && st[c] <= st[c + 1] && st[c + 1] <= s->n_ranks, "starts ascending within ranks")) return 0;
        listed += st[s->K] - st[0];
    }
    return check(listed <= n_pos, "pos and src hold every listed rank");
}

static PyObject *scan_blocks(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *isa;
    Py_buffer u, edges, rows, row_ptr, run, ranks, starts, pos, src;
    int itemsize, shift;
    unsigned mask;
    if (!PyArg_ParseTuple(args, "sy*iiIy*y*y*y*y*y*w*w*", &isa, &u, &itemsize, &shift, &mask, &edges, &rows, &row_ptr, &run,
                          &ranks, &starts, &pos, &src))
        return NULL;
    Py_buffer *all[] = {&u, &edges, &rows, &row_ptr, &run, &ranks, &starts, &pos, &src};
    PyObject *result = NULL;
    ScanFn fn = NULL;
    for (int v = 0; v < N_VARIANTS; v++)
        if (!strcmp(isa, VARIANTS[v].name) && VARIANTS[v].runs) fn = VARIANTS[v].fn;
    Scan s = {0};
    s.u = u.buf;
    s.itemsize = itemsize;
    s.shift = shift;
    s.mask = mask;
    s.K = (int)edges.len + 1;
    int64_t n_blocks = run.len / 8;
    if (!check(fn != NULL, "a variant in ISAS (this CPU runs it)") || !check(itemsize == 1 || itemsize == 2 || itemsize == 4, "elements of 1, 2 or 4 bytes") ||
        !check(u.len % itemsize == 0, "whole elements") || !check(edges.len < MAX_K, "at most 15 edges") ||
        !check(rows.len % 8 == 0 && row_ptr.len == 8 * (n_blocks + 1) && run.len % 8 == 0 && ranks.len % 8 == 0 &&
                   starts.len % 8 == 0 && pos.len % 8 == 0 && pos.len == src.len,
               "int64 arrays, row_ptr one longer than run, pos as long as src"))
        goto done;
    memcpy(s.edges, edges.buf, (size_t)edges.len);
    s.rows = rows.buf;
    s.row_ptr = row_ptr.buf;
    s.run = run.buf;
    s.ranks = ranks.buf;
    s.starts = starts.buf;
    s.pos = pos.buf;
    s.src = src.buf;
    s.n_rows = rows.len / 8;
    s.n_blocks = n_blocks;
    s.n_ranks = ranks.len / 8;
    if (!validate(&s, u.len / itemsize, pos.len / 8, starts.len / 8)) goto done;
    int64_t found;
    Py_BEGIN_ALLOW_THREADS found = fn(&s);
    Py_END_ALLOW_THREADS result = PyLong_FromLongLong(found);
done:
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) PyBuffer_Release(all[i]);
    return result;
}

static PyMethodDef METHODS[] = {
    {"scan_blocks", scan_blocks, METH_VARARGS,
     "scan_blocks(isa, u, itemsize, shift, mask, edges, rows, row_ptr, run, ranks, starts, pos, src) -> found: "
     "scan_kernels._scan_blocks with class edges (bytes) for its lookup table; every array int64 and C-contiguous"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_scan_native", NULL, -1, METHODS, NULL, NULL, NULL, NULL};

/* ISAS: the variants this CPU runs, widest first. */
PyMODINIT_FUNC PyInit__scan_native(void) {
    probe();
    PyObject *m = PyModule_Create(&MODULE), *names = PyList_New(0), *isas = NULL;
    int ok = m && names;
    for (int v = 0; ok && v < N_VARIANTS; v++) {
        if (!VARIANTS[v].runs) continue;
        PyObject *name = PyUnicode_FromString(VARIANTS[v].name);
        ok = name && PyList_Append(names, name) == 0;
        Py_XDECREF(name);
    }
    ok = ok && (isas = PyList_AsTuple(names)) && PyModule_AddObject(m, "ISAS", isas) == 0;
    Py_XDECREF(names);
    if (!ok) {
        Py_XDECREF(isas);
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
