/* The C kernels' one thread pool, as every kernel module sees it (the pool itself: _thread_pool.c, the extension
 * `engram_serve._thread_pool`, which exports this table of functions in a PyCapsule; each kernel module imports
 * it once at its init with `pool_import`). Include after <Python.h>; everything here is static.
 *
 * The rule (docs/exactness.md, "Threads"): a job is a range of work items whose results are computed
 * independently (output panels, (expert, panel) pairs, tokens, heads, rows), never the terms of one sum. Each
 * part is a contiguous range of items, a fixed function of the item count and the part count, and every output
 * element is computed whole by the one thread that owns its item, by the same operations in the same order as on
 * one thread: so a result's bits do not depend on the thread count or on the partition.
 *
 *   pool_parts(n, cost)         the parts a job of n items and `cost` (about one unit a multiply-add or an
 *                               element's operation) runs in: min(threads, n, cost / POOL_MIN_COST), at least 1; 1
 *                               where the pool has one thread or the calling thread already runs a part of a job (a
 *                               nested job runs whole on it). A small call stays on the calling thread, and every
 *                               part costs at least POOL_MIN_COST: a fork and join costs more on more threads.
 *   parallel_run(n, parts, fn, ctx)   fn(ctx, begin, end) over [0, n) in `parts` ranges, part i being
 *                               [n i / parts, n (i + 1) / parts); the calling thread runs part 0 and returns when
 *                               every part is done. parts <= 1, a pool busy with another thread's job, or no pool
 *                               (not built, not imported): fn(ctx, 0, n) on the calling thread.
 *   parallel_for(n, fn, ctx)    parallel_run over min(threads, n) parts (the caller judged the job big enough).
 *   parallel_for_cost(n, cost, fn, ctx)   parallel_run over pool_parts(n, cost) parts.
 *   range_of(n, parts, i, &b, &e)   part i's range (the same function the pool uses).
 *   balanced_bounds(n, cost, ctx, parts, bounds)   contiguous ranges of about equal cost, for items of unequal cost
 *                               (a causal prompt's attention and indexer, experts of unequal rows);
 *                               parallel_balanced(n, parts, cost, cost_ctx, fn, ctx) runs fn over them.
 *   pool_k_halves()             the negative control's switch (set only by tests, _thread_pool_hooks): a kernel that
 *                               reads it sums one dot product's two halves on two threads (model/_linear_kernel.c).
 *
 * A job's function must not raise, allocate Python objects or take the GIL: the workers are plain threads. */
#ifndef ENGRAM_THREAD_POOL_H
#define ENGRAM_THREAD_POOL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define POOL_ABI 1
#define POOL_CAPSULE "engram_serve._thread_pool._C_API"
#define POOL_MIN_COST 16384.0 /* the least cost of a part (~1-3 us of one core's work): a job runs on
                                * cost / POOL_MIN_COST threads at most */

typedef void (*pool_fn)(void *ctx, int64_t begin, int64_t end);

struct pool_api {
    int abi;                                                    /* POOL_ABI */
    int (*parts)(int64_t n, double cost);                       /* pool_parts */
    void (*run)(int64_t n, int parts, pool_fn fn, void *ctx);   /* parallel_run */
    int (*threads)(void);                                       /* the pool's size (the calling thread included) */
    const volatile int *k_halves;                               /* the negative control's switch */
};

static const struct pool_api *pool_api_ = NULL;

/* Import the pool's table (module init; once). Without it (the pool not built) every job runs whole on the
 * calling thread: no error. */
static inline void pool_import(void) {
    if (pool_api_) return;
    PyObject *m = PyImport_ImportModule("engram_serve._thread_pool"); /* (PyCapsule_Import only reads attributes) */
    Py_XDECREF(m);
    const struct pool_api *api = (const struct pool_api *)PyCapsule_Import(POOL_CAPSULE, 0);
    if (!api || api->abi != POOL_ABI) {
        PyErr_Clear();
        return;
    }
    pool_api_ = api;
}

static inline void range_of(int64_t n, int parts, int i, int64_t *b, int64_t *e) {
    *b = n * i / parts;
    *e = n * (i + 1) / parts;
}

static inline int pool_parts(int64_t n, double cost) { return pool_api_ ? pool_api_->parts(n, cost) : 1; }

static inline void parallel_run(int64_t n, int parts, pool_fn fn, void *ctx) {
    if (n <= 0) return;
    if (parts <= 1 || !pool_api_)
        fn(ctx, 0, n);
    else
        pool_api_->run(n, parts, fn, ctx);
}

/* Contiguous ranges of items [0, n) of unequal costs (cost(ctx, i) >= 0), about equal in cost: bounds [parts + 1],
 * part i being [bounds[i], bounds[i + 1]), ending at the first item whose running cost reaches i / parts of the
 * total (a fixed function of the items' costs and the part count; for parallel_run over `parts` items, each part
 * reading its bounds). */
static inline void balanced_bounds(int64_t n, double (*cost)(const void *ctx, int64_t i), const void *ctx, int parts,
                                   int64_t *bounds) {
    double total = 0.0, sum = 0.0;
    for (int64_t i = 0; i < n; i++) total += cost(ctx, i);
    int part = 1;
    bounds[0] = 0;
    for (int64_t i = 0; i < n && part < parts; i++) {
        sum += cost(ctx, i);
        while (part < parts && sum >= total * part / parts) bounds[part++] = i + 1;
    }
    while (part <= parts) bounds[part++] = n;
}

typedef struct {
    pool_fn fn;
    void *ctx;
    const int64_t *bounds;
} bounded_job;

static inline void bounded_part(void *c, int64_t b, int64_t e) {
    const bounded_job *j = (const bounded_job *)c;
    for (int64_t part = b; part < e; part++) j->fn(j->ctx, j->bounds[part], j->bounds[part + 1]);
}

/* fn(ctx, begin, end) over [0, n) in `parts` contiguous ranges of about equal cost (balanced_bounds) */
static inline void parallel_balanced(int64_t n, int parts, double (*cost)(const void *ctx, int64_t i),
                                     const void *cost_ctx, pool_fn fn, void *ctx) {
    int64_t *bounds = parts > 1 ? (int64_t *)malloc(sizeof(int64_t) * (size_t)(parts + 1)) : NULL;
    if (!bounds) {
        parallel_run(n, 1, fn, ctx);
        return;
    }
    balanced_bounds(n, cost, cost_ctx, parts, bounds);
    bounded_job j = {fn, ctx, bounds};
    parallel_run(parts, parts, bounded_part, &j);
    free(bounds);
}

static inline void parallel_for(int64_t n, pool_fn fn, void *ctx) { parallel_run(n, pool_parts(n, INFINITY), fn, ctx); }

static inline void parallel_for_cost(int64_t n, double cost, pool_fn fn, void *ctx) {
    parallel_run(n, pool_parts(n, cost), fn, ctx);
}

static inline int pool_k_halves(void) { return pool_api_ && *pool_api_->k_halves; }

#endif
