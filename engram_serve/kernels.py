"""The optional C kernels, loaded in one place, and the one switch that chooses them.

setup.py builds five C extensions where a C compiler exists (docs/kernels.md says what each does):

    hash       engram/_hash_kernel       the Engram n-gram hash (engram/hashing.py)
    gather     engram/_gather_kernel     the staging gather of table rows (engram/staging.py)
    linear     model/_linear_kernel      the float32 matmul in a fixed order (model/exactness.py, layers.py)
    token      model/_token_kernel       the token-wise steps of the forward (model/ops_c.py)
    decode     inputs/_decode_kernel     a decode step's inputs in place (inputs/decode.py)

Every other module asks this one (`get`, `loaded`) and never imports a kernel itself; where a kernel is
not loaded, its torch path runs. Which kernels load is the environment variable ENGRAM_SERVE_KERNELS,
read once, at the first question:

    all (or unset, or empty)   every kernel that was built
    none                       no kernel: the torch paths everywhere, as a build without a C compiler
    hash,gather                only these
    -linear,-token             every kernel but these

Names are those above; an unknown name, or names with and without `-` mixed, raise ConfigError naming
the variable and its value. `override(spec)` (same syntax) changes the choice inside a block, for tests
and benchmarks that run a kernel against its torch path in one process. Which path a call takes
depends on this choice, the build, dtypes, devices and autograd, never on a shape. A kernel that
reproduces another library's bits (the linear kernel, MKL's) is further checked by a numerical probe
(`exactness.small_call_kc`); that is an exactness rule, not a switch.

The engine logs `summary()` once at start-up; `engram-serve env` prints `environment()`.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

from .errors import ConfigError

ENV = "ENGRAM_SERVE_KERNELS"
MODULES = {
    "hash": "engram_serve.engram._hash_kernel",
    "gather": "engram_serve.engram._gather_kernel",
    "linear": "engram_serve.model._linear_kernel",
    "token": "engram_serve.model._token_kernel",
    "decode": "engram_serve.inputs._decode_kernel",
}
SIMD_LEVELS = {0: "portable", 1: "AVX2", 2: "AVX-512"}
CPU_GRAPHS_NEED = ("linear", "token")  # runner/cpu_graphs.py replays only C kernel calls


@dataclass(frozen=True)
class KernelStatus:
    """One kernel: loaded, or why not ("not built", with the import error's text if it was not a missing
    file; "switched off by ENGRAM_SERVE_KERNELS=...")."""

    name: str
    loaded: bool
    reason: str = ""


def parse(spec: str | None, source: str = ENV) -> frozenset[str]:
    """The kernel names a spec switches on (syntax in the module docstring); `source` names it in errors."""
    text = (spec or "").strip()
    if text in ("", "all"):
        return frozenset(MODULES)
    if text == "none":
        return frozenset()
    items = [s.strip() for s in text.split(",")]
    names = [s.removeprefix("-") for s in items]
    unknown = [n for n in names if n not in MODULES]
    if unknown or "" in items:
        raise ConfigError(f"{source}={spec!r}: unknown kernel name(s) {unknown or ['']}; expected all, none, or a "
                          f"comma list of {', '.join(MODULES)} (each may start with '-': all but it)")
    negated = {s.startswith("-") for s in items}
    if len(negated) > 1:
        raise ConfigError(f"{source}={spec!r}: names with and without '-' mixed; give the kernels to load "
                          f"(hash,gather) or those to leave out (-linear,-token)")
    return frozenset(MODULES) - set(names) if negated == {True} else frozenset(names)


class _Registry:
    """The loaded modules (a kernel switched off or not built: None) and the spec they came from."""

    def __init__(self, spec: str | None, source: str):
        self.spec, self.source = spec, source
        wanted = parse(spec, source)
        self.modules: dict[str, ModuleType | None] = {}
        self.status: dict[str, KernelStatus] = {}
        for name, path in MODULES.items():
            self.modules[name], self.status[name] = _load(name, path, name in wanted, f"{source}={spec!r}")


def _load(name: str, path: str, wanted: bool, switch: str) -> tuple[ModuleType | None, KernelStatus]:
    if importlib.util.find_spec(path) is None:
        return None, KernelStatus(name, False, "not built")
    if not wanted:
        return None, KernelStatus(name, False, f"switched off by {switch}")
    try:
        return importlib.import_module(path), KernelStatus(name, True)
    except ImportError as e:  # built, but it does not load here (another Python, a missing symbol)
        return None, KernelStatus(name, False, f"not built for this interpreter ({e})")


_registry: _Registry | None = None
_watchers: list[Callable[[], None]] = []


def _set(registry: _Registry) -> None:
    global _registry
    _registry = registry
    for fn in _watchers:
        fn()


def _current() -> _Registry:
    if _registry is None:
        _set(_Registry(os.environ.get(ENV), ENV))
    return _registry


def on_change(fn: Callable[[], None]) -> None:
    """Call fn() now if the kernels are chosen already, and after every later change of the choice (the first
    question, an override and its end): for a user that resolves something from the loaded kernels once
    (model/capture.py `call`) instead of at each use. Never loads the kernels itself."""
    _watchers.append(fn)
    if _registry is not None:
        fn()


def get(name: str) -> ModuleType | None:
    """The kernel module `name` if it is loaded, else None (its torch path runs)."""
    reg = _registry if _registry is not None else _current()
    return reg.modules[name]


class RawKernel(NamedTuple):
    """One of a kernel module's raw entries (its `raw_kernels()` item, by name): the fields ((name, kind), ...)
    in slot order and the address of the C function that runs the kernel on those 64-bit slots."""

    fields: tuple[tuple[str, str], ...]
    entry: int


def raw_kernels(name: str) -> dict[str, RawKernel]:
    """{function name: RawKernel} of the loaded kernel `name`'s raw entries (runner/cpu_graphs.py, hc_next's
    matmul); {} where it is not loaded."""
    mod = get(name)
    return {} if mod is None else {fn: RawKernel(*raw) for fn, raw in mod.raw_kernels().items()}


def loaded(*names: str) -> bool:
    """Whether every kernel named is loaded."""
    return all(get(n) is not None for n in names)


def status() -> list[KernelStatus]:
    """Every kernel, in the order of MODULES: loaded, or why not."""
    return list(_current().status.values())


@contextmanager
def override(spec: str) -> Iterator[None]:
    """Inside the block, the kernels `spec` names (ENGRAM_SERVE_KERNELS syntax) are the loaded ones; the
    previous choice comes back after it. For tests and benchmarks: not thread-safe against a forward that
    runs meanwhile, and results memoised inside the block (plans, captures) belong to the block."""
    before = _current()
    _set(_Registry(spec, "override"))
    try:
        yield
    finally:
        _set(before)


def simd_level() -> int | None:
    """The linear kernel's SIMD level on this CPU (0 portable, 1 AVX2, 2 AVX-512), None if it is not loaded."""
    lin = get("linear")
    return None if lin is None else int(lin.simd_level())


def summary() -> str:
    """One line: the loaded kernels, the others with why, the SIMD level in use, and whether CPU graphs run."""
    st = status()
    on = [s.name for s in st if s.loaded]
    off = [f"{s.name} ({s.reason})" for s in st if not s.loaded]
    level = simd_level()
    parts = [f"C kernels loaded: {', '.join(on) or 'none'}"]
    if off:
        parts.append(f"not loaded: {', '.join(off)}")
    parts.append(f"SIMD: {'-' if level is None else f'{level} ({SIMD_LEVELS[level]})'}")
    if not loaded(*CPU_GRAPHS_NEED):
        parts.append(f"CPU graphs off (they need {', '.join(CPU_GRAPHS_NEED)})")
    return "; ".join(parts)


def environment() -> dict:
    """What `engram-serve env` prints: the kernels, the SIMD level, whether CPU graphs can run, torch's version,
    the thread count the engine would set (engine/threads.py, without setting it) and whether the kernels' thread
    pool was built."""
    import torch

    from . import thread_pool
    from .engine.threads import ENV as THREADS_ENV, available_cores, parse_threads
    threads = os.environ.get(THREADS_ENV)
    return {
        "kernels": {s.name: "loaded" if s.loaded else s.reason for s in status()},
        "kernels_env": os.environ.get(ENV),
        "simd_level": simd_level(),
        "simd": None if simd_level() is None else SIMD_LEVELS[simd_level()],
        "cpu_graphs_possible": loaded(*CPU_GRAPHS_NEED),
        "torch": torch.__version__,
        "threads": parse_threads(threads, THREADS_ENV) if threads else available_cores(),
        "threads_source": THREADS_ENV if threads else "cores of the affinity mask",
        "thread_pool": "built" if thread_pool.built() else "not built (the kernels run on one thread)",
    }
