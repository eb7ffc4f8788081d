"""The thread count of the process, set once by the engine: the C kernels' pool and torch's intra-op threads.

Torch's default is one intra-op thread per physical core of the machine, whatever else runs on
it and whatever the process may use. The engine sets the count once, when the first engine is built:
to `threads` if given (the `--threads` flag), else `ENGRAM_SERVE_THREADS` if set, else the number
of cores in the process's affinity mask (`os.sched_getaffinity`: the cores this process may run
on, e.g. under `taskset` or a container's cpuset). Later engines keep it unless they are given an
explicit count.

Two things take it. The C kernels' thread pool (`thread_pool.set_threads`, engram_serve/_thread_pool.c): each
kernel call partitions its independent outputs (output panels, (expert, panel) pairs, tokens, heads, rows) in
contiguous ranges across the threads, never a sum, so a result's bits do not depend on the count
(docs/exactness.md, "Threads"). And torch's intra-op threads, which a runner in exact mode (the default) on CPU
sets back to one (`ModelRunner`): torch splits its matmuls and elementwise loops at size-dependent places, so the
torch forms (a kernel not built, a weight no kernel takes) stay exact on one thread.

Tensor-parallel ranks on one machine share its cores: `share_cores(ranks)` (parallel/launch.py `TPCluster`)
gives each rank max(1, count // ranks) threads, e.g. one each at TP=2 on 2 cores.
"""
from __future__ import annotations

import os

from ..errors import ConfigError

ENV = "ENGRAM_SERVE_THREADS"
_chosen: int | None = None  # the engine's count (the flag, the variable or the cores)
_ranks = 1  # tensor-parallel ranks sharing this machine's cores (share_cores)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """The count an engine takes when given none: `ENGRAM_SERVE_THREADS` if set, else the affinity mask's cores."""
    return parse_threads(os.environ[ENV], ENV) if os.environ.get(ENV) else available_cores()


def parse_threads(value, source: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}={value!r}: must be a positive integer (threads)") from None
    if isinstance(value, bool) or n < 1 or str(n) != str(value).strip():
        raise ConfigError(f"{source}={value!r}: must be a positive integer (threads)")
    return n


def rank_threads(n: int, ranks: int) -> int:
    """The threads of one of `ranks` tensor-parallel ranks that share n."""
    return max(1, n // ranks)


def _apply(n: int, raise_torch: bool = True) -> None:
    """n threads for the kernels' pool and torch; raise_torch=False never raises torch's count (an exact runner may
    have set it to one)."""
    import torch

    from .. import thread_pool
    if n != torch.get_num_threads() and (raise_torch or n < torch.get_num_threads()):
        torch.set_num_threads(n)
    thread_pool.set_threads(n)


def set_torch_threads(threads: int | None = None) -> int:
    """Apply the thread count (see the module docstring) to torch and to the C kernels' pool; returns the count in
    effect in this process (the engine's count, or this rank's share of it)."""
    global _chosen
    if threads is not None:
        n = parse_threads(threads, "threads")
    elif _chosen is not None:
        return rank_threads(_chosen, _ranks)
    else:
        n = default_threads()
    _chosen = n
    _apply(rank_threads(n, _ranks))
    return rank_threads(n, _ranks)


def share_cores(ranks: int) -> int:
    """This process is one of `ranks` tensor-parallel ranks on this machine (1: alone again): it keeps its share of
    the engine's count (set now where the count is chosen already). Returns its threads."""
    global _ranks
    _ranks = max(1, int(ranks))
    if _chosen is None:
        return set_torch_threads()
    n = rank_threads(_chosen, _ranks)
    _apply(n, raise_torch=False)
    return n
