"""Test-only hooks of the C kernels (negative controls and tuning knobs), loaded here and nowhere else.

`_gather_kernel.c` holds a second module in the same shared object, `_gather_hooks` (see its header), and so does
the kernels' thread pool, `_thread_pool.c` (`_thread_pool_hooks`).
Loaded from the kernel's own file, it shares the kernel's state, so a hook set here changes what the
real kernel does, through the real staging gather.
Production code never loads them: the kernels' modules have no test entry points.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from engram_serve import kernels, thread_pool

_loaded: dict[str, ModuleType] = {}


def hooks(name: str) -> ModuleType:
    """The hooks module of kernel `name` ("gather"), or of the kernels' thread pool ("pool"); skips the test if it
    was not built."""
    import pytest
    if name not in _loaded:
        path = thread_pool.MODULE if name == "pool" else kernels.MODULES[name]
        spec = importlib.util.find_spec(path)
        if spec is None:
            pytest.skip(f"the {name} kernel was not built (no C compiler at install time)")
        hook_name = path.replace("_kernel", "_hooks") if name != "pool" else path + "_hooks"
        hook_spec = importlib.util.spec_from_file_location(hook_name, spec.origin)
        module = importlib.util.module_from_spec(hook_spec)
        hook_spec.loader.exec_module(module)
        _loaded[name] = module
    return _loaded[name]


@contextmanager
def gather_trust(slots: bool = False, keys: bool = False) -> Iterator[None]:
    """Inside the block the C gather takes a filled dedup slot (`slots`) or a filled way 0 of the hot-row
    cache (`keys`) for the id without comparing keys (a negative control of the key checks)."""
    before = hooks("gather").set_trust(slots, keys)
    try:
        yield
    finally:
        hooks("gather").set_trust(*before)


@contextmanager
def pool_always() -> Iterator[None]:
    """Inside the block every kernel job of at least 2 items is split across the kernels' pool, whatever its cost:
    a small model runs the partitions of a big one."""
    before = hooks("pool").set_always(True)
    try:
        yield
    finally:
        hooks("pool").set_always(before)


@contextmanager
def k_halves() -> Iterator[None]:
    """Inside the block the linear kernel sums each output's two halves of inputs computed on two threads (with a
    pool of at least 2 threads): the negative control of the threading rule."""
    before = hooks("pool").set_k_halves(True)
    try:
        yield
    finally:
        hooks("pool").set_k_halves(before)


def shared_jobs() -> int:
    """The kernel jobs run on two threads or more in this process so far."""
    return int(hooks("pool").shared_jobs())
