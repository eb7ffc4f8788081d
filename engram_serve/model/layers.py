"""Token-wise building blocks: the matmul `linear`, RMSNorm, rotary embedding, SwiGLU MLP and a small
top-k MoE.

Everything here maps `[N, hidden]` tokens to `[N, hidden]` with no knowledge of rows or batches, so
the paged (serving) path and the dense (training/reference) path run the very same code. A row's bits
do not depend on its batch: every matmul goes through `linear`, which follows the row rule of
model/exactness.py, and elementwise torch ops go through `exactness.pointwise`.
"""
from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import StaticBufferError
from . import exactness, fused
from .context import MOE_COMBINE, MOE_DISPATCH, ForwardContext
from .exactness import PANEL, in_major, pointwise


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T -> [..., out], batch-invariant (the row rule of model/exactness.py).

    Where `exactness.small_call_kc` allows (not under autograd), every call goes to the C matmul; else a
    call of fewer than min_rows(weight) rows is zero-padded with one `F.pad` (host-side shape checks, no
    device sync); a 2-D input needs no reshape."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    n = x2.shape[0]
    m, kc, panels = exactness.plan(weight)[:3] if exactness.rules_on() else (0, None, None)
    if exactness.kernel_takes(x2, weight, kc):
        y = exactness.matmul_kernel(x2, panels, weight.shape[0], kc)
    elif n >= m:
        y = F.linear(x2, weight)
    else:
        y = F.linear(F.pad(x2, (0, 0, 0, m - n)), weight)[:n]
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, inter: int, weights: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """fused.silu_mul(linear(x, weight), inter, weights) for x [N, in] and weight [G * 2 * inter, in] (G
    groups of gate then up rows): [N, G * inter], the same bits. In one C kernel call where `linear`
    takes it, so the product [N, G * 2 * inter] is never stored; weights [N, G] or None."""
    kc, panels = exactness.plan(weight)[1:3] if exactness.rules_on() else (None, None)
    if inter % PANEL == 0 and exactness.kernel_takes(x, weight, kc) and (weights is None or fused.runs_in_c(weights)):
        return exactness.matmul_kernel(x, panels, weight.shape[0], kc, inter=inter,
                                       weights=None if weights is None else weights.contiguous())
    groups = weight.shape[0] // (2 * inter)
    return fused.silu_mul(linear(x, weight).view(x.shape[0], groups, 2 * inter), inter, weights
                          ).view(x.shape[0], groups * inter)


def matmul_params(module: nn.Module):
    """(module, parameter name, input dims) of every weight `linear` multiplies by in `module` (a model may
    list them itself: `matmul_params()`)."""
    if hasattr(module, "matmul_params"):
        yield from module.matmul_params()
        return
    for m in module.modules():
        if isinstance(m, Linear):
            yield m, "weight", 1
        elif isinstance(m, MLP):
            yield m, "gate_up", 1
        elif isinstance(m, MoE):
            yield m, "w_in", 1
            yield m, "w_out", 2


def layout_weights_(module: nn.Module) -> nn.Module:
    """Lay out every matmul weight of `module` input-major in place (the row rule of exactness.py); returns
    `module`."""
    for m, name, n_in in matmul_params(module):
        p = getattr(m, name)
        if p.device.type != "meta":
            p.data = in_major(p.data, n_in)
    return module


def matmul_weights(module: nn.Module) -> list[torch.Tensor]:
    """The 2-D weights that `linear` multiplies by in `module`'s forward, as it views them (a model may list
    them itself: `matmul_weights()`)."""
    if hasattr(module, "matmul_weights"):
        return module.matmul_weights()
    out = []
    for m in module.modules():
        if isinstance(m, Linear):
            out.append(m.weight)
        elif isinstance(m, MLP):
            out.append(m.gate_up.view(2 * m.intermediate, m.hidden))
        elif isinstance(m, MoE):
            out += [m.w_in.view(-1, m.hidden), m.w_out.view(m.hidden, -1), m.w_in[0].view(-1, m.hidden),
                    m.w_out[:, 0]]
    return out


class Linear(nn.Linear):
    """nn.Linear without bias whose forward is the batch-invariant `linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) [* weight], computed in float32, returned in x's dtype.

    A float32 input is used as is (no `.float()` / `.to()` calls: each is an operator even when it
    copies nothing)."""
    xf = x if x.dtype == torch.float32 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight if weight.dtype == torch.float32 else weight.float())
    return y if x.dtype == torch.float32 else y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Computed once per forward for absolute positions [N]: cos [N, 1, head_dim] = (cos, cos) and
    sin [N, 1, head_dim] = (-sin, sin) over the two halves, float32 (the signs of rotate-half folded in)."""
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=positions.device) * 2 / head_dim)
    ang = positions.float()[:, None] * inv_freq[None, :]  # [N, half]
    cos, sin = ang.cos(), ang.sin()
    return torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]


class RotaryTable:
    """`rotary_cos_sin` of positions 0..rows-1, computed once (grown on demand by `ensure`) and gathered
    per forward by position: two row copies instead of eight operators. The bits are those of
    `rotary_cos_sin` on the step's own positions: its cos and sin run elementwise on whole vectors
    ([N, head_dim / 2] float32, N * head_dim / 2 a multiple of the vector width), whatever N."""

    def __init__(self, head_dim: int, theta: float, rows: int = 4096):
        self.head_dim, self.theta, self.initial = head_dim, theta, rows
        self.cos = self.sin = None

    def ensure(self, rows: int, device: torch.device | str = "cpu") -> None:
        """Hold at least `rows` positions on `device` (doubling, so growth is rare)."""
        have = 0 if self.cos is None else self.cos.shape[0]
        if have >= rows and self.cos.device == torch.device(device):
            return
        n = max(rows, 2 * have, self.initial)
        cos, sin = rotary_cos_sin(torch.arange(n, device=device), self.head_dim, self.theta)
        self.cos, self.sin = cos[:, 0].contiguous(), sin[:, 0].contiguous()  # [n, head_dim]

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim] for positions [N] int64 (a position past the table raises)."""
        if self.cos is None or self.cos.device != positions.device:
            self.ensure(self.initial, positions.device)
        return fused.gather_rows(self.cos, positions), fused.gather_rows(self.sin, positions)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on x [N, heads, head_dim] with `rotary_cos_sin`'s tables:
    x * cos + swap_halves(x) * sin == (x1 cos - x2 sin, x2 cos + x1 sin), bit for bit (a - b == a + (-b)).
    The halves are swapped by a flip of a [2, half] view (fewer operators than `roll`, same values)."""
    xf = x if x.dtype == torch.float32 else x.float()
    n, h, d = xf.shape
    out = xf * cos + xf.reshape(n, h, 2, d // 2).flip(2).view(n, h, d) * sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def fuse_on_load(names: dict[str, tuple[tuple[str, ...], callable]]):
    """A load_state_dict pre-hook: build fused parameter `k` from checkpoint tensors `parts` with `fuse`."""
    def hook(module, state_dict, prefix, *_):
        for fused, (parts, fuse) in names.items():
            keys = [prefix + p for p in parts]
            if all(k in state_dict for k in keys):
                state_dict[prefix + fused] = fuse(*(state_dict.pop(k) for k in keys))
    return hook


def split_on_save(names: dict[str, tuple[tuple[str, ...], callable]]):
    """A state_dict post-hook: write fused parameter `k` back as its checkpoint tensors (`split`)."""
    def hook(module, state_dict, prefix, *_):
        for fused, (parts, split) in names.items():
            if prefix + fused in state_dict:
                for name, t in zip(parts, split(state_dict.pop(prefix + fused))):
                    state_dict[prefix + name] = t
    return hook


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as ONE matmul.

    Parameter `gate_up` [2, intermediate, hidden] stacks the gate and up projections. Checkpoints keep
    the usual names `gate_proj.weight` and `up_proj.weight`: they are stacked when loading and split
    again by `state_dict()`, so the on-disk format does not change.
    """

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.gate_up = nn.Parameter(torch.empty(2, intermediate, hidden))
        self.down_proj = Linear(intermediate, hidden)
        self.register_load_state_dict_pre_hook(fuse_on_load(
            {"gate_up": (("gate_proj.weight", "up_proj.weight"), lambda g, u: torch.stack([g, u]))}))
        self.register_state_dict_post_hook(split_on_save(
            {"gate_up": (("gate_proj.weight", "up_proj.weight"), lambda gu: (gu[0], gu[1]))}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        act = linear_swiglu(x2, self.gate_up.view(2 * self.intermediate, self.hidden), self.intermediate)  # [N, I]
        return self.down_proj(act.view(*x.shape[:-1], self.intermediate))


# Dense MoE evaluation costs num_experts / top_k times the routed compute; up to this ratio it runs
# every expert over every token in two matmuls (no host sync, a fixed operator count), above it the
# tokens are sorted by expert and each expert runs on its own rows (one host read of the counts).
DENSE_MOE_MAX_RATIO = 2


class MoE(nn.Module):
    """Softmax router, top-k experts with renormalised weights, SwiGLU experts.

    Parameters: `w_in` [E, 2, I, H] (each expert's gate and up projections) and `w_out` [H, E, I] (the
    down projections side by side). Checkpoints keep `w_gate` [E, I, H], `w_up` [E, I, H] and
    `w_down` [E, H, I]: converted when loading and back by `state_dict()`.

    Combine order (docs/contract.md §9): a token's output is the sum of its experts' weighted outputs in an order
    fixed per token, never dependent on its batch mates:
    - dense path (num_experts <= DENSE_MOE_MAX_RATIO * top_k): the routing weights are scattered into
      a dense [N, E] matrix (0 for experts not chosen), every expert's gate/up runs in one matmul
      [N, H] x [H, E*2I], the weighted activations [N, E*I] go through one down matmul against
      `w_out` [H, E*I]: the experts are summed in the matmul's reduction order over (expert, I),
      which is per row and, through `linear`'s row rule, independent of the row count. No host sync.
    - sorted path: token-expert pairs sorted by expert (stable), each expert on its contiguous slice
      (a loop over experts, never over tokens), weighted results added back with index_add in
      ascending expert order per token; it reads the per-expert counts on the host once per call.
      Graph capture (fixed shapes, no host read) runs every expert over every dispatched row, masked.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k, self.hidden, self.intermediate = num_experts, top_k, hidden, intermediate
        self.router = Linear(hidden, num_experts)
        self.w_in = nn.Parameter(torch.empty(num_experts, 2, intermediate, hidden))
        self.w_out = nn.Parameter(torch.empty(hidden, num_experts, intermediate))
        names = ("w_gate", "w_up", "w_down")
        self.register_load_state_dict_pre_hook(fuse_on_load(
            {"w_in": (names[:2], lambda g, u: torch.stack([g, u], 1)),
             "w_out": (names[2:], lambda d: d.permute(1, 0, 2).contiguous())}))
        self.register_state_dict_post_hook(split_on_save(
            {"w_in": (names[:2], lambda w: (w[:, 0], w[:, 1])),
             "w_out": (names[2:], lambda w: (w.permute(1, 0, 2),))}))

    @property
    def dense(self) -> bool:
        return self.num_experts <= DENSE_MOE_MAX_RATIO * self.top_k

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gu = linear(x, self.w_in[e].view(2 * self.intermediate, self.hidden))  # [n, 2I]
        return linear(pointwise(F.silu, gu[:, :self.intermediate]) * gu[:, self.intermediate:], self.w_out[:, e])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Top-k expert ids [N, k] int64, renormalised weights [N, k] float32, and the weights as a dense
        [N, E] matrix (0 for experts not chosen): `fused.moe_route`."""
        return fused.moe_route(self.router(x), self.top_k)

    def _scratch(self, ctx: ForwardContext | None, x: torch.Tensor, rows: int):
        """The microbatch's persistent dispatch/combine buffers when serving; None otherwise (training)."""
        if ctx is None or x.requires_grad:
            return None, None
        xs, ys = ctx.bufs.scratch_view(MOE_DISPATCH, rows), ctx.bufs.scratch_view(MOE_COMBINE, rows)
        if xs is None or ys is None:
            return None, None
        if xs.dtype != x.dtype or ys.dtype != x.dtype:
            raise StaticBufferError(f"MoE scratch buffers of microbatch {ctx.bufs.microbatch} are {xs.dtype}/{ys.dtype}; "
                                    f"the activations are {x.dtype}")
        return xs, ys

    def stages(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> Generator[str, None, torch.Tensor]:
        """Yields "moe_dispatch" after the dispatch and "moe_combine" after the experts; returns [N, hidden]."""
        if self.dense:
            return (yield from self._dense_stages(x, ctx))
        return (yield from self._sorted_stages(x, ctx))

    def _dense_stages(self, x: torch.Tensor, ctx: ForwardContext | None) -> Generator[str, None, torch.Tensor]:
        n, e, i = x.shape[0], self.num_experts, self.intermediate
        dense_w = self.route(x)[2]  # [N, E]
        dense_w = dense_w if dense_w.dtype == x.dtype else dense_w.to(x.dtype)
        xs, ys = self._scratch(ctx, x, n)
        if xs is not None:
            xs.copy_(x)
            ctx.touch(MOE_DISPATCH, xs)
        else:
            xs = x
        yield "moe_dispatch"
        if ys is not None:
            ctx.touch(MOE_DISPATCH, xs)  # read after the yield
        act = linear_swiglu(xs, self.w_in.view(e * 2 * i, self.hidden), i, dense_w)  # [N, E*I]: every expert
        # in one matmul, 0 for experts not chosen
        y = linear(act, self.w_out.view(self.hidden, e * i))  # [N, H]: experts summed per row
        if ys is not None:
            ys.copy_(y)
            ctx.touch(MOE_COMBINE, ys)
        else:
            ys = y
        yield "moe_combine"
        if ctx is not None and ys is not y:
            ctx.touch(MOE_COMBINE, ys)  # read back after the yield: the other microbatch ran meanwhile
        return ys  # a view of this microbatch's combine buffer: consumed at once by the caller

    def _sorted_stages(self, x: torch.Tensor, ctx: ForwardContext | None) -> Generator[str, None, torch.Tensor]:
        n, k = x.shape[0], self.top_k
        ids, w, _ = self.route(x)
        flat = ids.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept inside
        tok = order // k  # [N*k] source token of each dispatched row
        w_sorted = w.reshape(-1)[order].to(x.dtype)
        static = ctx is not None and ctx.max_query_len is not None  # graph capture: no host reads
        counts = None if static else torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read
        xs, ys = self._scratch(ctx, x, n * k)
        scratch = xs is not None
        if scratch:
            torch.index_select(x, 0, tok, out=xs)
            ctx.touch(MOE_DISPATCH, xs)
        else:
            xs = x[tok]  # [N*k, hidden]
        yield "moe_dispatch"
        if scratch:
            ctx.touch(MOE_DISPATCH, xs)  # read after the yield
        if static:  # every expert over every dispatched row, masked: E x the compute, shapes fixed
            expert_of = flat[order]  # [N*k]
            out_rows = torch.zeros_like(xs)
            for e in range(self.num_experts):
                out_rows += (expert_of == e)[:, None].to(xs.dtype) * self._expert(e, xs)
        else:
            bounds = [0]
            for c in counts:
                bounds.append(bounds[-1] + c)
            parts = [self._expert(e, xs[bounds[e]:bounds[e + 1]]) for e in range(self.num_experts)
                     if bounds[e + 1] > bounds[e]]
            out_rows = torch.cat(parts, dim=0) if parts else xs
        if scratch:
            ys.copy_(out_rows)
            ctx.touch(MOE_COMBINE, ys)
        else:
            ys = out_rows
        yield "moe_combine"
        if scratch:
            ctx.touch(MOE_COMBINE, ys)  # read back after the yield: the other microbatch ran meanwhile
        return torch.zeros_like(x).index_add(0, tok, ys * w_sorted[:, None])  # [N, hidden]
