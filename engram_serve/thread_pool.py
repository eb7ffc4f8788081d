"""The C kernels' one thread pool (engram_serve/_thread_pool.c), from Python: its size. Not a kernel (no torch path,
never switched off by ENGRAM_SERVE_KERNELS): every kernel module imports its table at init, and where it was not
built every kernel runs on its caller. engine/threads.py sets the size to the engine's thread count; a kernel's
results do not depend on it (docs/exactness.md, "Threads")."""
from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

MODULE = "engram_serve._thread_pool"


def _pool() -> ModuleType | None:
    if importlib.util.find_spec(MODULE) is None:
        return None
    try:
        return importlib.import_module(MODULE)
    except ImportError:
        return None


def built() -> bool:
    """Whether the pool was built (and loads)."""
    return _pool() is not None


def set_threads(n: int) -> int:
    """The C kernels run their jobs on n threads, the calling thread included. Returns the size now in effect: 1
    where the pool was not built."""
    pool = _pool()
    if pool is None:
        return 1
    pool.set_threads(int(n))
    return int(pool.threads())


def threads() -> int:
    """The pool's size (1 where it was not built)."""
    pool = _pool()
    return 1 if pool is None else int(pool.threads())


@contextmanager
def threads_set(n: int) -> Iterator[None]:
    """Inside the block the pool has n threads; the previous size comes back after it (verify's one-thread
    baseline, tests, benchmarks)."""
    before = threads()
    set_threads(n)
    try:
        yield
    finally:
        set_threads(before)
