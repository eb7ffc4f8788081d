"""The torch thread count of the process, set once by the engine.

Torch's default is one intra-op thread per physical core of the machine, whatever else runs on
it and whatever the process may use. The engine sets it once, when the first engine is built:
to `threads` if given (the `--threads` flag), else `ENGRAM_SERVE_THREADS` if set, else the number
of cores in the process's affinity mask (`os.sched_getaffinity`: the cores this process may run
on, e.g. under `taskset` or a container's cpuset). Later engines keep it unless they are given an
explicit count.
"""
from __future__ import annotations

import os

from ..errors import ConfigError

ENV = "ENGRAM_SERVE_THREADS"
_chosen: int | None = None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def parse_threads(value, source: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}={value!r}: must be a positive integer (torch threads)") from None
    if isinstance(value, bool) or n < 1 or str(n) != str(value).strip():
        raise ConfigError(f"{source}={value!r}: must be a positive integer (torch threads)")
    return n


def set_torch_threads(threads: int | None = None) -> int:
    """Apply the thread count (see the module docstring); returns the count in effect."""
    global _chosen
    import torch
    if threads is not None:
        n = parse_threads(threads, "threads")
    elif _chosen is not None:
        return _chosen
    elif os.environ.get(ENV):
        n = parse_threads(os.environ[ENV], ENV)
    else:
        n = available_cores()
    if n != torch.get_num_threads():
        torch.set_num_threads(n)
    _chosen = n
    return n
