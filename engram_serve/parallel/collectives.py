"""The deterministic cross-rank sum, synchronous and asynchronous (docs/contract.md §5, §10).

Order rule: a sum over ranks is an all-gather of every rank's partial into a buffer [world, *shape],
then an elementwise sum in rank order, `((p0 + p1) + p2) + ...`. Each output element is the same
chain of float additions whatever the tensor's size, so a token's result does not depend on how
many tokens share the call (a ring all-reduce chunks by size and would). With 2 ranks a ring
all-reduce is also exact (one commutative addition); the rank-ordered sum costs one extra copy of
the partials (measured by `engram-serve bench step --tensor-parallel-size 2`).

Ownership of in-flight buffers: `launch_sum` writes the local partial into slice [rank] of the
microbatch's communication buffer (synchronously, at launch) and starts the all-gather on it.
Until `PendingSum.wait` returns, the buffer belongs to the launching microbatch: the debug
`OwnershipTracker` is told at launch and at the wait, and any other touch raises, naming the buffer
and both microbatches. A buffer shared by two microbatches is corrupted by the second launch (the
negative control in tests/test_parallel.py).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..model.context import ForwardContext
    from .group import ParallelGroup

COMM = "comm"  # the per-microbatch communication buffer (MicrobatchBuffers.scratch[COMM], 1-D)
COMM_ENGRAM = "comm_engram"  # a second one: every Engram layer's projection, summed once per forward


def rank_ordered_sum(gathered: torch.Tensor) -> torch.Tensor:
    """gathered [world, *shape] -> [*shape]: ((g0 + g1) + g2) + ... elementwise (the order rule)."""
    out = gathered[0].clone()
    for r in range(1, gathered.shape[0]):
        out += gathered[r]
    return out


class PendingSum:
    """An all-gather in flight for one microbatch; `wait` returns the rank-ordered sum."""

    def __init__(self, group: "ParallelGroup", gathered: torch.Tensor, work, ctx: "ForwardContext | None",
                 name: str, buffer: str = COMM):
        self.group, self.gathered, self.work, self.ctx, self.name = group, gathered, work, ctx, name
        self.buffer = buffer
        self.done = False
        st = group.stats
        st.launches += 1
        st.nbytes += gathered[0].numel() * gathered.element_size()

    def wait(self) -> torch.Tensor:
        if self.done:
            raise RuntimeError(f"collective {self.name!r} was already waited on")
        t_wait = time.perf_counter()
        self.group.wait(self.work, self.name)
        self.group.stats.add_wait(self.name, time.perf_counter() - t_wait)
        self.done = True
        if self.ctx is not None and self.ctx.tracker is not None:
            self.ctx.tracker.land(self.buffer, self.gathered, self.ctx.bufs.microbatch)
        out = rank_ordered_sum(self.gathered)
        if self.ctx is not None:
            self.ctx.touch(self.buffer, self.gathered)  # the read of the landed buffer
        return out


def comm_buffer(ctx: "ForwardContext | None", world: int, x: torch.Tensor, name: str = COMM) -> torch.Tensor:
    """[world, *x.shape] view of the microbatch's communication buffer `name` (a fresh one without a context)."""
    if ctx is None or name not in ctx.bufs.scratch:
        return torch.empty(world, *x.shape, dtype=x.dtype, device=x.device)
    flat = ctx.bufs.scratch_view(name, world * x.numel())  # raises if too small: never reallocates
    if flat.dtype != x.dtype:
        raise TypeError(f"communication buffer of microbatch {ctx.bufs.microbatch} is {flat.dtype}; the partial is "
                        f"{x.dtype}")
    return flat.view(world, *x.shape)


def launch_sum(group: "ParallelGroup", x: torch.Tensor, ctx: "ForwardContext | None", what: str,
               buffer: str = COMM) -> PendingSum:
    """Start the cross-rank sum of this rank's partial x in the microbatch's buffer `buffer`; the caller
    waits on it when it resumes."""
    g = comm_buffer(ctx, group.world, x, buffer)
    if ctx is not None and ctx.tracker is not None:
        ctx.tracker.launch(buffer, g, ctx.bufs.microbatch)
    g[group.rank].copy_(x)  # the local slice is written now, at launch
    work = group.all_gather(list(g.unbind(0)), g[group.rank])
    return PendingSum(group, g, work, ctx, what, buffer)


def sum_now(group: "ParallelGroup", x: torch.Tensor, what: str) -> torch.Tensor:
    """Synchronous cross-rank sum (same order rule) on a private buffer."""
    return PendingSum(group, *_gather(group, x), None, what).wait()


def _gather(group: "ParallelGroup", x: torch.Tensor):
    g = torch.empty(group.world, *x.shape, dtype=x.dtype, device=x.device)
    g[group.rank].copy_(x)
    return g, group.all_gather(list(g.unbind(0)), g[group.rank])
