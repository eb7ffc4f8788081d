"""The forward's C kernel calls, recordable: every call into the linear, token and attention kernels
(engram_serve/kernels.py) goes through `call`, so that a CPU graph capture (runner/cpu_graphs.py) can
record it. The kernels take addresses, sizes and flags only, and return nothing the forward reads,
so a recorded call can be made again by itself. Code that reads data on the host to choose its next
calls says so (`refuse`): such a capture cannot be replayed."""
from __future__ import annotations

import threading
from contextlib import contextmanager

_local = threading.local()  # .tape: the capture in progress on this thread, if any (one at a time)


def call(fn, *args, **kwargs) -> None:
    """fn(*args, **kwargs), recorded as (fn, args) while `recording` on this thread: a call with keyword
    arguments is recorded as its positional form, every argument in the kernel's field order
    (`positional`), worked out only while recording."""
    if fn(*args, **kwargs) is not None:
        raise RuntimeError(f"{fn.__name__} returned a value: a recorded kernel call must return nothing")
    tape = getattr(_local, "tape", None)
    if tape is not None:
        tape.append((fn, positional(fn, args, kwargs) if kwargs else args))


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
    if getattr(_local, "tape", None) is not None:
        raise RuntimeError("a kernel capture is already in progress on this thread")
    _local.tape = tape
    try:
        yield tape
    finally:
        _local.tape = None
