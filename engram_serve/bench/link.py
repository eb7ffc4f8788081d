"""SIMULATED links for the tensor-parallel benchmark (`bench step --tensor-parallel-size N`), benchmark-side.

`configure_link` puts a process group's c10d backend behind a `SimulatedLink`: every all-gather (the
cross-rank sums of parallel/collectives.py) completes `latency_s + bytes / bytes_per_s` after its
launch, or when the real (loopback) transfer completes if that is later; with `overlap=False` each is
awaited at its launch (the same collectives, nothing hidden). The serving code knows nothing of it:
it calls the backend as usual.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..parallel.group import ParallelGroup


@dataclass(frozen=True)
class LinkDelay:
    """A SIMULATED link: every cross-rank sum completes `latency_s + bytes / bytes_per_s` after its
    launch, or when the real (loopback) transfer completes if that is later. Stands in for an
    inter-node network in the benchmark. Nothing blocks at the launch: the wait sleeps only for what
    is left of that time since the launch, so compute between launch and wait hides it, as it would
    hide a transfer on a real link (two sums in flight at once each take their own time: the link is
    not modelled as shared)."""

    latency_s: float = 0.0
    bytes_per_s: float = float("inf")

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


class _DelayedWork:
    """A c10d Work that completes no earlier than `due` (a time.perf_counter() value)."""

    def __init__(self, work, due: float):
        self.work, self.due = work, due

    def wait(self, timeout=None):
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        left = self.due - time.perf_counter()  # sleep only for what is left of the link's time
        if left > 0:
            time.sleep(left)
        return done


class SimulatedLink:
    """A group's real c10d backend (`inner`) seen through a SIMULATED link (module docstring): all-gathers
    are delayed by `delay` (None: the real link), and with `overlap=False` awaited at their launch, the
    time blocked there counted in the group's `stats` as a wait. Every other call goes to `inner`."""

    def __init__(self, inner, group: ParallelGroup, delay: LinkDelay | None, overlap: bool):
        self.inner, self.group, self.delay, self.overlap = inner, group, delay, overlap

    def allgather(self, outs, inputs):
        work = self.inner.allgather(outs, inputs)
        if self.delay is not None:
            nbytes = inputs[0].numel() * inputs[0].element_size()  # this rank's partial
            work = _DelayedWork(work, time.perf_counter() + self.delay.seconds(nbytes))
        if not self.overlap:  # awaited at once: nothing hidden
            t0 = time.perf_counter()
            self.group.wait(work, "all-gather awaited at its launch")
            self.group.stats.add_wait("at launch", time.perf_counter() - t0)
        return work

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def configure_link(group: ParallelGroup, delay: LinkDelay | None = None, overlap: bool = True) -> None:
    """Bench only (via TPCluster.call_all, so every rank agrees): a simulated link delay and overlap on/off
    for `group`'s all-gathers; `configure_link(group)` restores the real backend."""
    real = group.pg.inner if isinstance(group.pg, SimulatedLink) else group.pg
    group.pg = real if delay is None and overlap else SimulatedLink(real, group, delay, overlap)
