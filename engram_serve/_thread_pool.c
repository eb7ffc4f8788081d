/* The one thread pool of the C kernels (_thread_pool.h: the rule a job follows and the table every kernel module
 * imports from this extension's PyCapsule, so the linear, token and other kernels share one pool and one
 * thread-local "inside a job" flag: a job started inside another runs whole on its thread).
 *
 *   set_threads(n) -> the previous size: the pool's threads, the calling thread included (n - 1 workers; 1: none).
 *                     Waits for a job in progress; engine/threads.py sets it (the engine's thread count).
 *   threads() -> the size.
 *
 * A job: the caller writes each participating worker's slot (function, context, range) and bumps the slot's
 * generation; the worker claims its part, runs it and counts down `pending`; the caller runs part 0, then runs
 * every part no worker has claimed yet (a worker descheduled by another process: the part, its range fixed, runs
 * on the caller instead of waiting), then waits for pending to reach 0. Waiting, on either side, spins for up to
 * SPIN_NS (a pause per look at the word, a sched_yield now and then, so that a core shared with a runnable thread
 * gives way), then sleeps in futex_wait on the word, so an idle pool costs nothing; a caller that bumps a
 * sleeper's word wakes it. (A sched_yield costs microseconds on a VM: it runs every ~0.1 ms of spinning, every
 * YIELD_CROWDED looks where the pool has more threads than the process has cores, where a spinning thread may
 * hold the core of one with work.) One job at a time: a second thread that finds the pool busy runs its job
 * whole itself (the bits do not depend on the parts). Linux only (futex); elsewhere the pool has one thread and
 * set_threads(n > 1) raises.
 *
 * After fork() the child has no workers: a handler sets the pool's size to 1 there.
 *
 * Test hooks, not part of the module: the same shared object holds a second module, `_thread_pool_hooks`, which
 * only tests load (tests/support/kernel_hooks.py): set_always(flag), every job of at least 2 items split whatever
 * its cost (so that the tests' small models run every partition), set_k_halves(flag), the negative control
 * of the threading rule (model/_linear_kernel.c sums a dot product's two halves computed on two threads), and
 * shared_jobs(), the jobs run on two threads or more (that a test's jobs really were shared). */
#define _GNU_SOURCE /* CPU_COUNT */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_thread_pool.h"

#if defined(__linux__)
#define POOL_THREADS 1
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#else
#define POOL_THREADS 0
#endif

#define MAX_THREADS 512
#define SPIN_NS 300000L  /* 0.3 ms: longer than the host work between two kernel calls of a step */
#define YIELD_EVERY 4096 /* looks at the word between two sched_yield calls (~0.1 ms): a yield costs microseconds */
#define YIELD_CROWDED 64 /* the same where the pool has more threads than the process has cores */

static volatile int k_halves = 0;
static int always = 0;
#if defined(__linux__)
static _Atomic long long shared_jobs = 0; /* jobs run on two threads or more (a test's count) */
#else
static long long shared_jobs = 0;
#endif

#if POOL_THREADS

typedef struct __attribute__((aligned(64))) { /* one cache line each: a worker's word is its own */
    _Atomic uint32_t gen;   /* bumped by the caller for each job of this worker (and to stop it); its futex word */
    _Atomic int sleeping;   /* the worker sleeps on gen (futex_wait) */
    _Atomic uint32_t todo;  /* the generation of a posted part nobody has claimed yet, else 0 */
    pool_fn fn;
    void *ctx;
    int64_t begin, end;
    int stop;
    pthread_t tid;
} slot;

static struct {
    int size;                    /* threads of the pool, the caller's included */
    slot *slots;                 /* [size]: slot w for worker w >= 1 */
    _Atomic uint32_t pending;    /* parts of the current job not yet done by workers; the caller's futex word */
    _Atomic int caller_sleeping;
    _Atomic int busy;            /* a thread runs a job (or set_threads changes the pool) */
} P = {1, NULL, 0, 0, 0};

static _Thread_local int inside; /* this thread runs a part of a job: a job it starts runs whole on it */
static unsigned yield_every = YIELD_EVERY;

static long futex(_Atomic uint32_t *word, int op, uint32_t val) {
    return syscall(SYS_futex, (uint32_t *)word, op | FUTEX_PRIVATE_FLAG, val, NULL, NULL, 0);
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Wait until *word differs from `seen` (returns the new value): spin, then sleep with *sleeping set. */
static uint32_t wait_change(_Atomic uint32_t *word, uint32_t seen, _Atomic int *sleeping) {
    int64_t start = 0;
    for (unsigned i = 1;; i++) {
        const uint32_t g = atomic_load_explicit(word, memory_order_acquire);
        if (g != seen) return g;
        if (i % 32 == 0) {
            const int64_t t = now_ns();
            if (!start) start = t;
            else if (t - start > SPIN_NS) break;
            if (i % yield_every == 0) sched_yield();
        }
        relax();
    }
    for (;;) {
        atomic_store(sleeping, 1); /* seq_cst: a caller that changes the word after this sees it and wakes us */
        uint32_t g = atomic_load(word);
        if (g == seen) futex(word, FUTEX_WAIT, seen);
        atomic_store(sleeping, 0);
        g = atomic_load_explicit(word, memory_order_acquire);
        if (g != seen) return g;
    }
}

/* Run slot s's posted part of generation g if nobody has claimed it yet (its worker, or the caller stealing it),
 * then count it done */
static void claim_and_run(slot *s, uint32_t g) {
    uint32_t want = g;
    if (!atomic_compare_exchange_strong(&s->todo, &want, 0)) return;
    s->fn(s->ctx, s->begin, s->end);
    if (atomic_fetch_sub(&P.pending, 1) == 1 && atomic_load(&P.caller_sleeping)) futex(&P.pending, FUTEX_WAKE, 1);
}

static void *worker(void *arg) {
    slot *s = arg;
    inside = 1;
    uint32_t seen = 0; /* the slot's generation at its creation (a job may be posted before this thread runs) */
    for (;;) {
        seen = wait_change(&s->gen, seen, &s->sleeping);
        if (s->stop) return NULL;
        claim_and_run(s, seen);
    }
}

/* a new generation of slot s (its part posted in todo first, or its stop set), waking its worker if it sleeps */
static uint32_t bump(slot *s, int post) {
    const uint32_t g = atomic_load_explicit(&s->gen, memory_order_relaxed) + 1; /* (only the caller writes gen) */
    if (post) atomic_store_explicit(&s->todo, g, memory_order_release);
    atomic_store(&s->gen, g); /* seq_cst, then the sleeping flag: see wait_change */
    if (atomic_load(&s->sleeping)) futex(&s->gen, FUTEX_WAKE, 1);
    return g;
}

static int try_acquire(void) {
    int free_ = 0;
    return atomic_compare_exchange_strong(&P.busy, &free_, 1);
}

static void release(void) { atomic_store_explicit(&P.busy, 0, memory_order_release); }

static int pool_parts_impl(int64_t n, double cost) {
    if (P.size <= 1 || inside || n < 2) return 1;
    int64_t parts = n < P.size ? n : P.size;
    if (!always && cost / POOL_MIN_COST < (double)parts) /* each part at least POOL_MIN_COST */
        parts = cost >= POOL_MIN_COST ? (int64_t)(cost / POOL_MIN_COST) : 1;
    return (int)parts;
}

static void pool_run_impl(int64_t n, int parts, pool_fn fn, void *ctx) {
    if (parts > P.size) parts = P.size;
    if (parts > n) parts = (int)n;
    if (parts <= 1 || inside || !try_acquire()) {
        fn(ctx, 0, n);
        return;
    }
    if (parts > P.size) parts = P.size; /* (set_threads waits for busy: the size is stable from here) */
    atomic_fetch_add_explicit(&shared_jobs, 1, memory_order_relaxed);
    atomic_store(&P.pending, (uint32_t)(parts - 1));
    uint32_t posted[MAX_THREADS];
    for (int w = 1; w < parts; w++) {
        slot *s = &P.slots[w];
        s->fn = fn, s->ctx = ctx;
        range_of(n, parts, w, &s->begin, &s->end);
        posted[w] = bump(s, 1);
    }
    int64_t b, e;
    range_of(n, parts, 0, &b, &e);
    inside = 1;
    fn(ctx, b, e);
    /* parts no worker has claimed yet (its thread descheduled, on a loaded machine) run here: each part's range is
     * the same whichever thread runs it */
    for (int w = parts - 1; w >= 1; w--) claim_and_run(&P.slots[w], posted[w]);
    inside = 0;
    int64_t start = 0;
    for (unsigned i = 1;; i++) {
        const uint32_t left = atomic_load_explicit(&P.pending, memory_order_acquire);
        if (!left) break;
        if (i % 32 == 0) {
            const int64_t t = now_ns();
            if (!start) start = t;
            if (i % yield_every == 0) sched_yield();
            if (t - start > SPIN_NS) {
                atomic_store(&P.caller_sleeping, 1);
                const uint32_t v = atomic_load(&P.pending);
                if (v) futex(&P.pending, FUTEX_WAIT, v);
                atomic_store(&P.caller_sleeping, 0);
                continue;
            }
        }
        relax();
    }
    atomic_thread_fence(memory_order_acquire);
    release();
}

static void stop_workers(void) {
    for (int w = 1; w < P.size; w++) {
        P.slots[w].stop = 1;
        bump(&P.slots[w], 0);
    }
    for (int w = 1; w < P.size; w++) pthread_join(P.slots[w].tid, NULL);
    free(P.slots);
    P.slots = NULL;
    P.size = 1;
}

/* n threads (n - 1 workers); 0, or -1 with errno's text in *why */
static int resize(int n, const char **why) {
    stop_workers();
    cpu_set_t cores;
    yield_every = sched_getaffinity(0, sizeof cores, &cores) == 0 && n > CPU_COUNT(&cores) ? YIELD_CROWDED : YIELD_EVERY;
    if (n <= 1) return 0;
    slot *slots = aligned_alloc(64, (size_t)n * sizeof(slot));
    if (!slots) {
        *why = "out of memory";
        return -1;
    }
    memset(slots, 0, (size_t)n * sizeof(slot));
    P.slots = slots;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the workers take no signals: the interpreter's thread does */
    int started = 1, err = 0;
    for (; started < n; started++)
        if ((err = pthread_create(&slots[started].tid, NULL, worker, &slots[started])) != 0) break;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    P.size = started;
    if (started < n) {
        stop_workers();
        *why = strerror(err);
        return -1;
    }
    return 0;
}

static void after_fork_child(void) { /* the workers did not come along */
    P.slots = NULL;
    P.size = 1;
    atomic_store(&P.busy, 0);
    atomic_store(&P.pending, 0);
    atomic_store(&P.caller_sleeping, 0);
    inside = 0;
}

static int pool_threads_impl(void) { return P.size; }

#else /* no threads: every job runs whole on its caller */

static int pool_parts_impl(int64_t n, double cost) {
    (void)n, (void)cost;
    return 1;
}

static void pool_run_impl(int64_t n, int parts, pool_fn fn, void *ctx) {
    (void)parts;
    fn(ctx, 0, n);
}

static int pool_threads_impl(void) { return 1; }

#endif

static const struct pool_api API = {POOL_ABI, pool_parts_impl, pool_run_impl, pool_threads_impl, &k_halves};

static PyObject *py_set_threads(PyObject *Py_UNUSED(self), PyObject *arg) {
    const long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "set_threads: n is %ld, expected 1 to %d", n, MAX_THREADS);
        return NULL;
    }
    const int before = pool_threads_impl();
#if POOL_THREADS
    if (n != P.size) {
        const char *why = NULL;
        int r;
        Py_BEGIN_ALLOW_THREADS
        while (!try_acquire()) sched_yield(); /* a job in progress on another thread ends first */
        r = resize((int)n, &why);
        release();
        Py_END_ALLOW_THREADS
        if (r < 0) {
            PyErr_Format(PyExc_RuntimeError, "set_threads(%ld): starting the workers failed (%s); the pool has one "
                         "thread", n, why);
            return NULL;
        }
    }
#else
    if (n > 1) {
        PyErr_SetString(PyExc_RuntimeError, "set_threads: this build's pool has one thread (no futex)");
        return NULL;
    }
#endif
    return PyLong_FromLong(before);
}

static PyObject *py_threads(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLong(pool_threads_impl());
}

static PyMethodDef methods[] = {
    {"set_threads", py_set_threads, METH_O,
     "set_threads(n) -> the previous size: the kernels' pool runs jobs on n threads, the calling thread included "
     "(waits for a job in progress)."},
    {"threads", py_threads, METH_NOARGS, "threads() -> the pool's size (threads a job may run on)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_thread_pool",
    "The C kernels' one thread pool (_thread_pool.h): its size, and its table of functions for the kernels "
    "(the capsule _C_API).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__thread_pool(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *cap = PyCapsule_New((void *)&API, POOL_CAPSULE, NULL);
    if (!cap || PyModule_AddObject(m, "_C_API", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
#if POOL_THREADS
    static int registered = 0;
    if (!registered && pthread_atfork(NULL, NULL, after_fork_child) == 0) registered = 1;
#endif
    return m;
}

/* ---- test hooks (see the header): a second module of this shared object, loaded only by tests ---------- */

static PyObject *py_set_always(PyObject *Py_UNUSED(self), PyObject *arg) {
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    const int before = always;
    always = on;
    return PyBool_FromLong(before);
}

static PyObject *py_set_k_halves(PyObject *Py_UNUSED(self), PyObject *arg) {
    const int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    const int before = k_halves;
    k_halves = on;
    return PyBool_FromLong(before);
}

static PyObject *py_shared_jobs(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLongLong((long long)shared_jobs);
}

static PyMethodDef hook_methods[] = {
    {"shared_jobs", py_shared_jobs, METH_NOARGS,
     "shared_jobs() -> the jobs run on two threads or more since the process started."},
    {"set_always", py_set_always, METH_O,
     "set_always(flag) -> the previous flag: every job of at least 2 items is split across the pool, whatever its "
     "cost."},
    {"set_k_halves", py_set_k_halves, METH_O,
     "set_k_halves(flag) -> the previous flag: the negative control, one dot product's two halves summed on two "
     "threads (the linear kernel)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hook_module = {
    PyModuleDef_HEAD_INIT, "_thread_pool_hooks", "Test hooks of the kernels' thread pool (tests only).", -1,
    hook_methods,
};

PyMODINIT_FUNC PyInit__thread_pool_hooks(void) { return PyModule_Create(&hook_module); }
