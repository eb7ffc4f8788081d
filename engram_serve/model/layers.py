"""Token-wise building blocks: RMSNorm, rotary embedding, SwiGLU MLP and a small top-k MoE.

Everything here maps `[N, hidden]` tokens to `[N, hidden]` with no knowledge of rows or batches, so
the paged (serving) path and the dense (training/reference) path run the very same code.
"""
from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import StaticBufferError
from .context import MOE_COMBINE, MOE_DISPATCH, ForwardContext


# Batch invariance of matmuls (spec §9). On CPU, torch's float32 matmul (MKL sgemm) computes a row
# with a different kernel when the call holds 1, 2-3 or >= 4 rows, so the same row's bits would depend
# on how many rows share its call. Rule: every matmul of the forward goes through `linear`, which pads
# a call of fewer than MIN_ROWS rows with zero rows. From MIN_ROWS rows on, a row's result does not
# depend on the row count or its place in the call (tests/test_batch_invariance.py sweeps this).
MIN_ROWS = 4
_exact = True  # the batch-invariance rules of this module are on; `batch_invariant(False)` turns them off


@contextmanager
def batch_invariant(enabled: bool):
    """Run the block with the batch-invariance rules (MIN_ROWS, VEC_PAD) on or off. Off is the fastest
    non-exact configuration (benchmarks) and the negative control of the bit-exactness tests."""
    global _exact
    before, _exact = _exact, enabled
    try:
        yield
    finally:
        _exact = before


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T -> [..., out], batch-invariant (rule above)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[0]
    if n < MIN_ROWS and _exact:  # a host-side shape check: no device sync
        x2 = torch.cat([x2, x2.new_zeros(MIN_ROWS - n, x2.shape[1])])
    return F.linear(x2, weight)[:n].reshape(*lead, weight.shape[0])


# Batch invariance of elementwise ops. torch's CPU loops run the vectorised form of an op over whole
# vectors and a scalar form over the tail of the call, and for sigmoid and silu the two differ in the
# last bit. Rule: `pointwise` pads the flat input to a multiple of VEC_PAD elements, so every element
# takes the vectorised path whatever the call's size (with one intra-op thread; see README).
VEC_PAD = 64


def pointwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, computed on the vectorised path for every element (rule above)."""
    n = x.numel()
    if not _exact or (n % VEC_PAD == 0 and x.is_contiguous()):
        return fn(x)
    return fn(F.pad(x.reshape(-1), (0, (-n) % VEC_PAD)))[:n].view(x.shape)


class Linear(nn.Linear):
    """nn.Linear without bias whose forward is the batch-invariant `linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight], computed in float32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, head_dim/2] float32 for absolute positions [N] (computed once per forward)."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) * 2 / head_dim)
    ang = positions.float()[:, None] * inv_freq[None, :]  # [N, half]
    return ang.cos()[:, None, :], ang.sin()[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x [N, heads, head_dim]."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(pointwise(F.silu, self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Softmax router, top-k experts with renormalised weights, SwiGLU experts stacked as [E, ...].

    Dispatch is vectorised: token-expert pairs are sorted by expert (stable), gathered into one
    contiguous dispatch buffer, each expert runs on its contiguous slice (a loop over experts, never
    over tokens), and the weighted results are scattered back with one index_add.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Linear(hidden, num_experts)
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return linear(pointwise(F.silu, linear(x, self.w_gate[e])) * linear(x, self.w_up[e]), self.w_down[e])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [N, k] int64 and renormalised weights [N, k] float32."""
        probs = torch.softmax(self.router(x).float(), dim=-1)  # [N, E]
        w, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, w / w.sum(-1, keepdim=True)

    def stages(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> Generator[str, None, torch.Tensor]:
        """Yields "moe_dispatch" after the dispatch and "moe_combine" after the experts; returns [N, hidden]."""
        n, k = x.shape[0], self.top_k
        ids, w = self.route(x)
        flat = ids.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept inside
        tok = order // k  # [N*k] source token of each dispatched row
        w_sorted = w.reshape(-1)[order].to(x.dtype)
        static = ctx is not None and ctx.max_query_len is not None  # graph capture: no host reads
        counts = None if static else torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read
        # persistent per-microbatch buffers when serving; autograd-friendly temporaries otherwise
        xs = ys = None
        if ctx is not None and not x.requires_grad:
            xs = ctx.bufs.scratch_view(MOE_DISPATCH, n * k)
            ys = ctx.bufs.scratch_view(MOE_COMBINE, n * k)
        scratch = xs is not None and ys is not None
        if scratch and (xs.dtype != x.dtype or ys.dtype != x.dtype):
            raise StaticBufferError(f"MoE scratch buffers of microbatch {ctx.bufs.ubatch} are {xs.dtype}/{ys.dtype}; "
                                    f"the activations are {x.dtype}")
        if scratch:
            torch.index_select(x, 0, tok, out=xs)
            ctx.touch(MOE_DISPATCH, xs)
        else:
            xs = x[tok]  # [N*k, hidden]
        yield "moe_dispatch"
        if static:  # every expert over every dispatched row, masked: E x the compute, shapes fixed
            if scratch:
                ctx.touch(MOE_DISPATCH, xs)
            expert_of = flat[order]  # [N*k]
            out_rows = torch.zeros_like(xs)
            for e in range(self.num_experts):
                out_rows += (expert_of == e)[:, None].to(xs.dtype) * self._expert(e, xs)
            if scratch:
                ys.copy_(out_rows)
                ctx.touch(MOE_COMBINE, ys)
            else:
                ys = out_rows
            yield "moe_combine"
            return torch.zeros_like(x).index_add(0, tok, ys * w_sorted[:, None])
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        if scratch:
            ctx.touch(MOE_DISPATCH, xs)  # read after the yield
            for e in range(self.num_experts):
                a, b = bounds[e], bounds[e + 1]
                if b > a:
                    ys[a:b].copy_(self._expert(e, xs[a:b]))
            ctx.touch(MOE_COMBINE, ys)
        else:
            parts = [self._expert(e, xs[bounds[e]:bounds[e + 1]]) for e in range(self.num_experts)]
            ys = torch.cat(parts, dim=0) if parts else xs
        yield "moe_combine"
        if scratch:
            ctx.touch(MOE_COMBINE, ys)  # read back after the yield: the other microbatch ran meanwhile
        out = torch.zeros_like(x)
        return out.index_add(0, tok, ys * w_sorted[:, None])  # [N, hidden]
