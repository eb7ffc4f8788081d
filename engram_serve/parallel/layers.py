"""Sharded layers in the Megatron style. Each rank holds 1/world of a layer's weights; the model code
calls them exactly as it calls the unsharded layers. Every matmul goes through the batch-invariant
`engram_serve.model.layers.linear` (the row rule of model/exactness.py).

A module whose output is a per-rank partial sum exposes `launch_reduce(x, ctx)`: the model launches
the cross-rank sum at its next stage boundary and waits on it when the microbatch resumes
(`deepseek_v41.collective_point`), so the other microbatch computes while the sum is in flight.
"""
from __future__ import annotations

from collections.abc import Generator
from types import ModuleType

import torch
from torch import nn

from ..model import deepseek_v41 as v41
from ..model.context import ForwardContext
from ..model.layers import Linear, linear
from .collectives import COMM, COMM_ENGRAM, PendingSum, launch_sum
from .group import ParallelGroup


def _split(n: int, world: int, rank: int, what: str) -> tuple[int, int]:
    if n % world:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {world}")
    part = n // world
    return rank * part, (rank + 1) * part


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=False)


def shard_attention(attn, group: "ParallelGroup", name: str) -> None:
    """Split an attention module by heads in place: rank r keeps heads [r*H/N, (r+1)*H/N) (its rows of `wq_b`,
    its `attn_sink` entries) and with them whole output groups (consecutive heads: its rows of the
    block-diagonal `wo_a`); `wo_b` becomes row-parallel over those groups' columns, a cross-rank sum. The
    MQA latent (`wq_a`, `q_norm`, `wkv`, `kv_norm`), the compressor and the indexer stay replicated."""
    cfg, world, rank = attn.cfg, group.world, group.rank
    h0, h1 = _split(attn.heads, world, rank, "num_attention_heads")
    g0, g1 = _split(attn.groups, world, rank, "o_groups")
    hd, ol = cfg.head_dim, cfg.o_lora_rank
    attn.wq_b.weight = _param(attn.wq_b.weight[h0 * hd:h1 * hd])
    attn.attn_sink = _param(attn.attn_sink[h0:h1])
    attn.wo_a.weight = _param(attn.wo_a.weight[g0 * ol:g1 * ol])
    attn.wo_b = RowParallelLinear(attn.wo_b, group, name, (g0 * ol, g1 * ol))
    attn.heads, attn.groups = h1 - h0, g1 - g0


class _SumsAcrossRanks:
    """Output is this rank's partial sum; `launch_reduce` starts the deterministic cross-rank sum."""

    group: ParallelGroup

    def launch_reduce(self, x: torch.Tensor, ctx: ForwardContext | None, buffer: str = COMM) -> PendingSum:
        return launch_sum(self.group, x, ctx, self.reduce_name, buffer)


class RowParallelLinear(_SumsAcrossRanks, Linear):
    """y_r = x_r @ W[:, lo:hi].T: the INPUT dimension is split (rank r holds input columns [lo, hi) and
    computes on its own slice of the activations). The outputs are partial sums; a cross-rank sum follows
    (all-gather + rank-ordered sum, `launch_reduce`), launched at the caller's next stage boundary."""

    def __init__(self, full: nn.Linear, group: ParallelGroup, name: str, cols: tuple[int, int] | None = None):
        lo, hi = cols or _split(full.in_features, group.world, group.rank, "in_features")
        super().__init__(hi - lo, full.out_features)
        self.weight = _param(full.weight[:, lo:hi])
        self.group, self.reduce_name = group, name


class PartialInputLinear(_SumsAcrossRanks, Linear):
    """y_r = x_r @ W.T with the weight REPLICATED and the input split by data: x_r holds only the
    terms this rank owns (zeros elsewhere), e.g. the Engram rows of a rank's table shard. Linear in x,
    so the sum over ranks of y_r is the full projection; a cross-rank sum follows (`launch_reduce`)."""

    early_buffer = COMM_ENGRAM  # the model sums every Engram layer's projection at once, at the start

    def __init__(self, full: nn.Linear, group: ParallelGroup, name: str):
        super().__init__(full.in_features, full.out_features)
        self.weight = _param(full.weight)
        self.group, self.reduce_name = group, name


class ExpertParallelMoE(v41.MoE):
    """The MoE split across ranks: rank r holds routed experts [lo, hi) and the columns [i0, i1) of the shared
    expert's intermediate dimension. The router is replicated, so every rank routes every token the same
    way; each rank runs the (token, expert) pairs of its own experts and its slice of the shared expert,
    and adds them into a partial [N, D] (its experts in ascending order, then its shared slice); the
    rank-ordered cross-rank sum of the partials is launched before the "moe" stage and awaited
    after it. A token's chain of additions is fixed per token, so a cut does not change its bits."""

    def __init__(self, full: v41.MoE, group: ParallelGroup, name: str):
        nn.Module.__init__(self)
        cfg = full.cfg
        lo, hi = _split(cfg.n_routed_experts, group.world, group.rank, "n_routed_experts")
        i0, i1 = _split(full.inter, group.world, group.rank, "moe_intermediate_size")
        self.cfg, self.inter, self.lo, self.num_local = cfg, full.inter, lo, hi - lo
        self.group, self.reduce_name = group, name
        self.gate = full.gate
        self.w13 = _param(full.w13[lo:hi])
        self.w2 = _param(full.w2[lo:hi])
        s = full.shared_experts
        self.shared_experts = nn.Module()
        self.shared_experts.w1, self.shared_experts.w3 = Linear(cfg.hidden_size, i1 - i0), Linear(cfg.hidden_size, i1 - i0)
        self.shared_experts.w2 = Linear(i1 - i0, cfg.hidden_size)
        self.shared_experts.w1.weight = _param(s.w1.weight[i0:i1])
        self.shared_experts.w3.weight = _param(s.w3.weight[i0:i1])
        self.shared_experts.w2.weight = _param(s.w2.weight[:, i0:i1])
        self.shared_inter = i1 - i0

    def shared(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        s = self.shared_experts
        gu = torch.cat([linear(x, s.w1.weight), linear(x, s.w3.weight)], 1)
        return linear(ops.swiglu(gu, self.shared_inter, self.cfg.swiglu_limit), s.w2.weight)

    def stages(self, x: torch.Tensor, ops: ModuleType, ctx: ForwardContext | None = None
               ) -> Generator[str, None, torch.Tensor]:
        k, e_loc = self.cfg.num_experts_per_tok, self.num_local
        ids, w = self.route(x, ops)  # [N, k] global expert ids, identical on every rank
        loc = ids - self.lo
        key = torch.where((loc >= 0) & (loc < e_loc), loc, e_loc).reshape(-1)  # [N*k]; other ranks' pairs last
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=e_loc + 1).tolist()  # one host read
        order = order[:sum(counts[:e_loc])]
        tok = torch.div(order, k, rounding_mode="floor")
        xs = x[tok]
        parts, start = [], 0
        for e in range(e_loc):  # a loop over local experts, never over tokens
            if counts[e]:
                parts.append(self.expert(e, xs[start:start + counts[e]], ops))
            start += counts[e]
        ys = torch.cat(parts) if parts else xs
        partial = torch.zeros_like(x).index_add_(0, tok, ys * w.reshape(-1)[order][:, None]) + self.shared(x, ops)
        pending = launch_sum(self.group, partial, ctx, self.reduce_name)
        yield v41.STAGE_MOE
        return pending.wait()
