"""Sharded layers in the Megatron style. Each rank holds 1/world of a layer's weights; the model code
calls them exactly as it calls the unsharded layers. Every matmul goes through the batch-invariant
`engram_serve.model.layers.linear` (the row rule of model/exactness.py).

A module whose output is a per-rank partial sum exposes `launch_reduce(x, ctx)`: the model launches
the cross-rank sum at its next stage boundary and waits on it when the microbatch resumes
(`model._collective_point`), so the other microbatch computes while the sum is in flight.
"""
from __future__ import annotations

from collections.abc import Generator

import torch
from torch import nn

from ..model.context import MOE_COMBINE, MOE_DISPATCH, ForwardContext
from ..model.layers import Linear, MoE
from .collectives import COMM, COMM_ENGRAM, PendingSum, launch_sum, sum_now
from .group import ParallelGroup


def _split(n: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if n % world:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {world}")
    part = n // world
    return rank * part, (rank + 1) * part


def column_parallel_qkv(attn, rank: int, world: int) -> None:
    """Split an attention's fused q/k/v projection by heads in place: rank r keeps its slice of the q
    heads, of the kv heads and of the v heads (each GQA group stays on one rank), fused again."""
    parts = []
    for w, what in zip(attn.split_qkv(attn.qkv_proj.weight.detach()), ("q heads", "kv heads", "kv heads")):
        lo, hi = _split(w.shape[0], world, rank, what)
        parts.append(w[lo:hi])
    attn.qkv_proj = Linear(attn.qkv_proj.in_features, sum(p.shape[0] for p in parts))
    attn.qkv_proj.weight = nn.Parameter(torch.cat(parts), requires_grad=False)
    attn.heads, attn.kv_heads = attn.heads // world, attn.kv_heads // world


def column_parallel_mlp(mlp, rank: int, world: int) -> None:
    """Split a dense MLP's fused gate/up projection `gate_up` [2, I, H] by its OUTPUT dimension I in place:
    rank r keeps rows [lo, hi) of both the gate and the up projection (no collective follows: its slice
    of the activations feeds the RowParallelLinear down projection)."""
    lo, hi = _split(mlp.intermediate, world, rank, "intermediate_size")
    mlp.gate_up = nn.Parameter(mlp.gate_up.detach()[:, lo:hi].clone(), requires_grad=False)
    mlp.intermediate = hi - lo


class _SumsAcrossRanks:
    """Output is this rank's partial sum; `launch_reduce` starts the deterministic cross-rank sum."""

    group: ParallelGroup

    def launch_reduce(self, x: torch.Tensor, ctx: ForwardContext | None, buffer: str = COMM) -> PendingSum:
        return launch_sum(self.group, x, ctx, self.reduce_name, buffer)


class RowParallelLinear(_SumsAcrossRanks, Linear):
    """y_r = x[:, lo:hi] @ W[:, lo:hi].T: the INPUT dimension is split (rank r holds input columns
    [lo, hi) and receives that slice of x). The outputs are partial sums; a cross-rank sum follows
    (all-gather + rank-ordered sum, `launch_reduce`), launched at the caller's next stage boundary."""

    def __init__(self, full: nn.Linear, group: ParallelGroup, name: str):
        lo, hi = _split(full.in_features, group.world, group.rank, "in_features")
        super().__init__(hi - lo, full.out_features)
        self.weight = nn.Parameter(full.weight.detach()[:, lo:hi].clone(), requires_grad=False)
        self.group, self.reduce_name = group, name


class PartialInputLinear(_SumsAcrossRanks, Linear):
    """y_r = x_r @ W.T with the weight REPLICATED and the input split by data: x_r holds only the
    terms this rank owns (zeros elsewhere), e.g. the Engram rows of a rank's table shard. Linear in x,
    so the sum over ranks of y_r is the full projection; a cross-rank sum follows (`launch_reduce`)."""

    early_buffer = COMM_ENGRAM  # the model sums every Engram layer's projection at once, at the start

    def __init__(self, full: nn.Linear, group: ParallelGroup, name: str):
        super().__init__(full.in_features, full.out_features)
        self.weight = nn.Parameter(full.weight.detach().clone(), requires_grad=False)
        self.group, self.reduce_name = group, name


def head_mean_hook(group: ParallelGroup, total_heads: int):
    """For an index-selecting attention layer: the head-mean of q.k over ALL heads, from this rank's
    sum over its own heads (a synchronous cross-rank sum, same order rule)."""
    def head_mean(local_sum: torch.Tensor) -> torch.Tensor:
        return sum_now(group, local_sum.contiguous(), "index scores") / total_heads
    return head_mean


class ExpertParallelMoE(MoE):
    """Experts split across ranks: rank r holds experts [lo, hi) (the EXPERT dimension of the fused
    w_in [E, 2, I, H] and w_out [H, E, I] is split). The router is replicated, so every rank routes every token the same way; each
    rank runs only the (token, expert) pairs of its own experts and combines them into a partial
    [N, hidden]; the cross-rank sum of the partials follows (launched before the "moe_combine" stage,
    awaited after it). A token's result is the same chain of additions as the unsharded MoE's
    index_add (pairs in expert order), so expert parallelism does not change its bits."""

    def __init__(self, full: MoE, group: ParallelGroup):
        lo, hi = _split(full.num_experts, group.world, group.rank, "n_routed_experts")
        nn.Module.__init__(self)
        self.num_experts, self.top_k = full.num_experts, full.top_k
        self.hidden, self.intermediate = full.hidden, full.intermediate
        self.lo, self.num_local, self.group = lo, hi - lo, group
        self.router = full.router
        self.w_in = nn.Parameter(full.w_in.detach()[lo:hi].clone(), requires_grad=False)
        self.w_out = nn.Parameter(full.w_out.detach()[:, lo:hi].clone(), requires_grad=False)

    def stages(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> Generator[str, None, torch.Tensor]:
        n, k, e_loc = x.shape[0], self.top_k, self.num_local
        ids, w, _ = self.route(x)  # [N, k] global expert ids, identical on every rank
        loc = ids - self.lo
        own = (loc >= 0) & (loc < e_loc)
        key = torch.where(own, loc, torch.full_like(loc, e_loc)).reshape(-1)  # [N*k]; other ranks' pairs last
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=e_loc + 1).tolist()  # one host read (eager path)
        m = sum(counts[:e_loc])
        order = order[:m]
        tok = order // k  # [m] source token of each local pair
        w_sorted = w.reshape(-1)[order].to(x.dtype)
        xs = ys = None
        if ctx is not None:
            xs = ctx.bufs.scratch_view(MOE_DISPATCH, n * k)
            ys = ctx.bufs.scratch_view(MOE_COMBINE, n * k)
        if xs is not None and ys is not None:
            xs, ys = xs[:m], ys[:m]
            torch.index_select(x, 0, tok, out=xs)
            ctx.touch(MOE_DISPATCH, xs)
        else:
            xs, ys = x[tok], torch.empty(m, x.shape[1], dtype=x.dtype, device=x.device)
        yield "moe_dispatch"
        if ctx is not None:
            ctx.touch(MOE_DISPATCH, xs)
        a = 0
        for e in range(e_loc):  # a loop over local experts, never over tokens
            b = a + counts[e]
            if b > a:
                ys[a:b].copy_(self._expert(e, xs[a:b]))  # local expert e (the unsharded MoE's own math)
            a = b
        if ctx is not None:
            ctx.touch(MOE_COMBINE, ys)
        partial = torch.zeros_like(x).index_add(0, tok, ys * w_sorted[:, None])  # [N, hidden]
        pending = launch_sum(self.group, partial, ctx, "moe_combine")
        yield "moe_combine"
        return pending.wait()
