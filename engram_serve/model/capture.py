"""The forward's C kernel calls, recordable: every call into the linear, token and attention kernels
(engram_serve/kernels.py) goes through `call`, so that a CPU graph capture (runner/cpu_graphs.py) can
record it. The kernels take addresses, sizes and flags only, and return nothing the forward reads,
so a recorded call can be made again by itself. Code that reads data on the host to choose its next
calls says so (`refuse`): such a capture cannot be replayed."""
from __future__ import annotations

import threading
from contextlib import contextmanager

from .. import kernels

_local = threading.local()  # .tape: the capture in progress on this thread, if any (one at a time)


def call_python(fn, *args, **kwargs) -> None:
    """fn(*args, **kwargs), recorded as (fn, args) while `recording` on this thread: a call with keyword
    arguments is recorded as its positional form, every argument in the kernel's field order
    (`positional`), worked out only while recording. `call` where the token kernel is not loaded."""
    if fn(*args, **kwargs) is not None:
        raise RuntimeError(f"{fn.__name__} returned a value: a recorded kernel call must return nothing")
    tape = getattr(_local, "tape", None)
    if tape is not None:
        tape.append((fn, positional(fn, args, kwargs) if kwargs else args))


# `call(fn, *args, **kwargs)`: what `call_python` does, for every C kernel call of the forward. Where the token
# kernel is loaded it is that kernel's C `call`, which passes its own arguments on to fn (no tuple, no dict:
# about the cost of calling fn directly) and hands them to `_record` only while a capture is in progress on some
# thread. Rebound whenever the loaded kernels change (kernels.on_change, below): use it as `capture.call`.
call = call_python

_lock = threading.Lock()
_active = 0  # captures in progress, on all threads: while any is, the C `call`s record through `_record`
_hooked: list = []  # the token kernel modules whose `call` has been bound (one, in practice)


def _record(fn, values: tuple, kwnames: tuple | None) -> None:
    """The C `call`'s recorder: append fn's call (its arguments `values`, the last len(kwnames) of them by
    name) to this thread's tape in positional form, if a capture is in progress on this thread."""
    tape = getattr(_local, "tape", None)
    if tape is not None:
        if kwnames:
            n = len(values) - len(kwnames)
            values = positional(fn, values[:n], dict(zip(kwnames, values[n:])))
        tape.append((fn, values))


def _bind() -> None:
    """Point `call` at the loaded token kernel's C `call`, else at `call_python` (kernels.on_change)."""
    global call
    tok = kernels.get("token")
    fast = getattr(tok, "call", None)
    with _lock:
        if fast is not None and tok not in _hooked:
            _hooked.append(tok)
            if _active:
                tok.set_recorder(_record)
        call = fast if fast is not None else call_python


kernels.on_change(_bind)


_fields: dict = {}  # kernel function -> its argument names in order (its module's `kernel_fields()`)


def fields(fn) -> tuple[str, ...]:
    """The names of a C kernel's arguments, in positional order (its module's `kernel_fields()`); TypeError for
    a function that has none."""
    names = _fields.get(fn)
    if names is None:
        table = getattr(getattr(fn, "__self__", None), "kernel_fields", None)
        spec = table().get(getattr(fn, "__name__", None)) if table is not None else None
        if spec is None:
            raise TypeError(f"{getattr(fn, '__name__', fn)!r} has no named arguments (kernel_fields): call it by "
                            f"position")
        names = _fields[fn] = tuple(name for name, _ in spec)
    return names


def positional(fn, args: tuple, kwargs: dict) -> tuple:
    """A call's arguments `args`, `kwargs` (a call fn accepted) as one positional tuple in field order; an
    argument left out (an optional address) is 0."""
    return args + tuple(kwargs.get(name, 0) for name in fields(fn)[len(args):])


def refuse(reason: str) -> None:
    """Say that the forward does something a recorded call list cannot make again (e.g. reads data on the host
    to choose its next calls): a capture in progress on this thread gets `(None, reason)` on its tape, and
    whoever replays it must not keep it."""
    tape = getattr(_local, "tape", None)
    if tape is not None:
        tape.append((None, reason))


@contextmanager
def recording(tape: list):
    """Append every kernel call this thread makes inside the block to `tape`, in call order."""
    global _active
    if getattr(_local, "tape", None) is not None:
        raise RuntimeError("a kernel capture is already in progress on this thread")
    with _lock:
        _active += 1
        if _active == 1:
            for mod in _hooked:
                mod.set_recorder(_record)
    _local.tape = tape
    try:
        yield tape
    finally:
        _local.tape = None
        with _lock:
            _active -= 1
            if _active == 0:
                for mod in _hooked:
                    mod.set_recorder(None)
