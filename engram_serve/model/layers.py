"""Token-wise building blocks: the matmul `linear`, `Linear` and RMSNorm, and the layout of matmul weights.

Everything here maps `[N, hidden]` tokens to `[N, hidden]` with no knowledge of rows or batches, so
the paged (serving) path and the full-sequence (training/scoring) path run the very same code. A row's bits
do not depend on its batch: every matmul goes through `linear`, which follows the row rule of
model/exactness.py, and elementwise torch ops go through `exactness.pointwise`.
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from . import exactness, products
from .exactness import in_major
from .weights import StoredWeight, HoldsStored


def linear(x: torch.Tensor, weight: torch.Tensor | StoredWeight) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T -> [..., out], batch-invariant (the row rule of model/exactness.py): the
    weight's product strategy (`products.plan`: bfloat16 tiles, float or FP8 panels, row-wise, torch's sgemm, or
    F.linear padded to min_rows rows) runs it, or a weight as stored (`StoredWeight.run`: its float plan's bits); a
    2-D input needs no reshape."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    y = weight.run(x2) if isinstance(weight, StoredWeight) else products.plan(weight).run(x2, weight)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def linear_groups(x: torch.Tensor, lin: "Linear", ops: ModuleType) -> torch.Tensor:
    """x [T, G, in] through `lin`'s block-diagonal weight [G * out, in] (group g's rows g out .. (g + 1) out multiply
    x[:, g]) -> [T, G * out]: one kernel call where the weight is stored (`StoredWeight.run_groups`, one job for the
    kernels' pool), else a `linear` a group."""
    t, g = x.shape[:2]
    if lin.stored is not None and x.is_contiguous() and (
            y := lin.stored.run_groups(x.view(t, -1), g)) is not None:
        return y
    out = lin.w.shape[0] // g
    return ops.cat_cols([linear(x[:, i], lin.rows(i * out, (i + 1) * out)) for i in range(g)])


_stacks: dict[tuple, tuple] = {}


def stacked(*weights: torch.Tensor | StoredWeight) -> torch.Tensor | StoredWeight:
    """The weights' rows one after the other, as one weight laid out as `linear` takes it (input-major): one call
    for weights that share their input, with no concatenation of outputs. Outside autograd, cached by the weights'
    addresses and versions (a copy of their memory; the entry keeps the weights alive, so their addresses cannot be
    reused by other tensors while cached); under autograd, a plain concatenation. Weights as stored in one format
    stay so (one `StoredWeight` of their parts); stored among float ones, their float copies."""
    if all(isinstance(w, StoredWeight) for w in weights) and len({(w.fmt, w.block) for w in weights}) == 1:
        key = tuple(id(p[0]) for w in weights for p in w.parts)
        if key not in _stacks:
            _stacks[key] = (StoredWeight(weights[0].fmt, [p for w in weights for p in w.parts], weights[0].block,
                                         [q for w in weights for q in w.words]), weights)
        return _stacks[key][0]
    weights = tuple(w.dense() if isinstance(w, StoredWeight) else w for w in weights)
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return torch.cat(weights)
    key = tuple((w.data_ptr(), w.shape, w.stride(), w._version) for w in weights)
    if key not in _stacks:
        if len(_stacks) >= 4096:  # weights replaced many times over (tests): start again
            _stacks.clear()
        _stacks[key] = (exactness.in_major(torch.cat([w.detach() for w in weights])), weights)
    return _stacks[key][0]


def matmul_params(module: nn.Module):
    """(module, parameter name, input dims) of every weight `linear` multiplies by in `module`: its own
    `matmul_params()` where it has one (the model lists its stacked and raw weights), else its Linears."""
    if hasattr(module, "matmul_params"):
        yield from module.matmul_params()
        return
    for m in module.modules():
        if isinstance(m, Linear) and m.stored is None:  # (a weight as stored is laid out as stored)
            yield m, "weight", 1


def layout_weights_(module: nn.Module) -> nn.Module:
    """Lay out every matmul weight of `module` input-major in place (the row rule of exactness.py); returns
    `module`."""
    for m, name, n_in in matmul_params(module):
        p = getattr(m, name)
        if p.device.type != "meta":
            p.data = in_major(p.data, n_in)
    return module


def matmul_weights(module: nn.Module) -> list[torch.Tensor]:
    """The 2-D weights that `linear` multiplies by in `module`'s forward, as it views them (the model's own
    `matmul_weights()` where it has one)."""
    if hasattr(module, "matmul_weights"):
        return module.matmul_weights()
    return [m.w.probe() if m.stored is not None else m.weight for m in module.modules() if isinstance(m, Linear)]


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim) with torch's own initialisation (N(0, 1), the same draws), but on the meta device (the
    loader builds there), where torch's `normal_` would import torch._dynamo: ~1.3 s of every load."""
    e = nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    if not e.weight.is_meta:
        with torch.no_grad():
            e.weight.normal_()
    return e


class Linear(HoldsStored, nn.Linear):
    """nn.Linear without bias whose forward is the batch-invariant `linear`. Its weight may be held as stored
    (`use_stored(StoredWeight)`: model/weights.py); `w` is what `linear` takes, `rows(r0, r1)` a slice of it."""

    STORED = ("weight",)

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    @property
    def w(self) -> torch.Tensor | StoredWeight:
        return self.stored if self.stored is not None else self.weight

    def rows(self, r0: int, r1: int) -> torch.Tensor | StoredWeight:
        part = self.stored.rows(r0, r1) if self.stored is not None else None
        return part if part is not None else self.weight[r0:r1]

    def dense_params(self) -> dict[str, torch.Tensor]:
        return {"weight": self.stored.dense()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.w)


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, by the forward's form of the token-wise steps
    (`ops`: model/ops_torch.py or model/ops_c.py `rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        return ops.rms_norm(x, self.eps, self.weight)
