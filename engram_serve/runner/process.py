"""Process-wide settings for serving, applied once per process by the first ModelRunner.

`keep_freed_memory`: freed host memory kept for the next step (glibc). glibc's malloc gives large
freed blocks back to the kernel: a block above the mmap threshold is unmapped when freed, and free
memory at the top of the heap beyond the trim threshold is trimmed. A
CPU step allocates the same large activations as the step before, so each step then faults in and
zeroes them again: about 25,000 minor faults (100 MiB) per 8,192-token prefill step of the built-in
model, 8% of its time (measured). `keep_freed_memory` raises both thresholds once per process, so
freed blocks stay in the heap and are reused; the resident set stays at its peak instead of shrinking
between steps. A no-op where the C library is not glibc, or with ENGRAM_SERVE_KEEP_FREED_MEMORY=0.

`freeze_startup_objects`: the objects alive once the first runner is built (imported modules, the
model, the tokenizer: ~290,000 for the built-in model) are moved out of the cyclic garbage
collector's reach (`gc.freeze`). Serving allocates Python objects with every request, so the collector
runs full collections now and then, and each walked every one of them: ~70 ms, on the step that
triggered it (measured: 10% of the samples of a loop of 8,192-token prefill steps). Objects made
afterwards are collected as before; a frozen object is still freed when its last reference goes
(reference counting), only a cycle among frozen objects would outlive its last outside reference.
ENGRAM_SERVE_GC_FREEZE=0 turns it off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os

ENV = "ENGRAM_SERVE_KEEP_FREED_MEMORY"
GC_ENV = "ENGRAM_SERVE_GC_FREEZE"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap
log = logging.getLogger(__name__)
_state: list[bool] = []  # keep_freed_memory's outcome, once per process
_frozen: list[int] = []  # the objects freeze_startup_objects froze, once per process


def keep_freed_memory() -> bool:
    """Keep freed blocks in the heap for reuse (see the module docstring); whether it is in effect."""
    if not _state:
        _state.append(_apply())
    return _state[0]


def _apply() -> bool:
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to set
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD - 1) == 1
    log.debug("glibc mallopt: mmap threshold %d, trim threshold %d: %s", MMAP_THRESHOLD, 2 * MMAP_THRESHOLD - 1,
              "set" if ok else "refused")
    return ok


def freeze_startup_objects() -> int:
    """Freeze the objects alive now, once per process (see the module docstring); how many were frozen."""
    if not _frozen:
        if os.environ.get(GC_ENV, "1") == "0":
            _frozen.append(0)
        else:
            gc.collect()  # garbage first: only live objects are frozen
            gc.freeze()
            _frozen.append(gc.get_freeze_count())
            log.debug("gc.freeze: %d startup objects frozen", _frozen[0])
    return _frozen[0]
