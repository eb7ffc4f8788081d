"""Fused token-wise steps of the forward: one C call each (`_token_kernel.c`) where it can run, else torch.

Each function has two forms that compute the same formula: the C kernel, taken for float32 CPU tensors
outside autograd when the token kernel is loaded (engram_serve/kernels.py), and the torch operators,
taken everywhere else (CUDA, training, the kernel not built or switched off). Which form runs depends
only on devices, dtypes and the loaded kernels, never on a batch, so a serving config always takes the
same one (`runs_in_c`). The C form computes each token alone, in an order fixed per token (see the
kernel's header): a token's bits do not depend on its batch mates, the cut or padding, by construction.
The torch form keeps the batch-invariance rules of model/exactness.py (`pointwise`).

Inputs are never modified: a new residual stream comes back as a new tensor.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import kernels
from . import capture, layers  # (layers imports this module too: names are looked up at call time)
from .exactness import pointwise


def _kernel():
    """The token kernel module (engram_serve/kernels.py); callers checked `runs_in_c`."""
    return kernels.get("token")


def runs_in_c(*tensors: torch.Tensor | None) -> bool:
    """Whether the C form runs on these tensors: the token kernel loaded, float32, on the CPU (the engine's
    devices: CPU or CUDA), no autograd. Never a question of shapes or layouts (a column slice of one row
    is contiguous, of two rows not): the C form takes a contiguous copy where it needs one, so the same
    form runs whatever the batch."""
    if kernels.get("token") is None:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # a plain loop: this runs a few times per layer
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad)):
            return False
    return True


def residual_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta on every branch, rmsnorm(mean over branches) * weight) for h [N, hc, hidden] and
    delta [N, hidden] or None; the second is [N, hidden]."""
    if runs_in_c(h, delta, weight):
        h, delta, weight = h.contiguous(), None if delta is None else delta.contiguous(), weight.contiguous()
        n, hc, dim = h.shape
        x = torch.empty(n, dim)
        out = h if delta is None else torch.empty(n, hc, dim)
        capture.call(_kernel().residual_norm, h.data_ptr(), n, hc, dim, 0 if delta is None else delta.data_ptr(),
                     weight.data_ptr(), eps, out.data_ptr(), x.data_ptr())
        return out, x
    if delta is not None:
        h = h + delta[:, None, :]
    return h, layers.rms_norm(h.mean(1), eps, weight)


def add_branches(h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """h + delta on every branch (h [N, hc, hidden], delta [N, hidden] or None)."""
    if delta is None:
        return h
    if runs_in_c(h, delta):
        h, delta = h.contiguous(), delta.contiguous()
        out = torch.empty(h.shape)
        capture.call(_kernel().add_branches, h.data_ptr(), h.shape[0], h.shape[1], h.shape[2], delta.data_ptr(),
                     out.data_ptr())
        return out
    return h + delta[:, None, :]


def gather_rows(src: torch.Tensor, ids: torch.Tensor, copies: int = 1) -> torch.Tensor:
    """[N, copies, width]: row ids[t] of src [rows, width] on each copy (the embedding, the rotary tables);
    ids [N] int64. An id outside [0, rows) raises (ValueError in C, IndexError in torch)."""
    if runs_in_c(src) and ids.dtype == torch.int64 and ids.is_cpu:
        src, ids = src.contiguous(), ids.contiguous()
        out = torch.empty(ids.shape[0], copies, src.shape[1])
        capture.call(_kernel().gather_rows, src.data_ptr(), src.shape[0], src.shape[1], ids.data_ptr(),
                     ids.shape[0], copies, out.data_ptr())
        return out
    rows = src[ids][:, None, :]
    return rows if copies == 1 else rows.expand(ids.shape[0], copies, src.shape[1]).contiguous()


MAX_EXPERTS = 256  # the C router's bound (_token_kernel.c); a model with more experts routes in torch


def moe_route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE router on logits [N, E]: (ids [N, k] int64 of the k most probable experts, best first,
    weights [N, k] float32 = their softmax probabilities renormalised to sum 1, the same weights as a
    dense [N, E] matrix with 0 for experts not chosen). C form: see the kernel (ties to the lower id)."""
    n, e = logits.shape
    if runs_in_c(logits) and e <= MAX_EXPERTS:  # (the expert count is the model's: one form per model)
        logits = logits.contiguous()
        ids, w, dense = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k), torch.empty(n, e)
        capture.call(_kernel().moe_route, logits.data_ptr(), n, e, k, ids.data_ptr(), w.data_ptr(),
                     dense.data_ptr())
        return ids, w, dense
    probs = torch.softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)  # [N, E]
    w, ids = torch.topk(probs, k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return ids, w, torch.zeros_like(probs).scatter_(1, ids, w)


def engram_gate(h: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                dead: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The Engram gate of docs/contract.md §7 (engram/layer.py): h [N, hc, hidden] with gate_i * value added to
    branch i, from the projection kv [N, (hc + 1) * hidden]; dead [N] bool tokens get gate 0."""
    n, hc, dim = h.shape
    if runs_in_c(h, kv, q_w, k_w) and (dead is None or dead.dtype == torch.bool):
        h, kv, q_w, k_w = h.contiguous(), kv.contiguous(), q_w.contiguous(), k_w.contiguous()
        dead = None if dead is None else dead.contiguous()
        out = torch.empty(n, hc, dim)
        capture.call(_kernel().engram_gate, h.data_ptr(), n, hc, dim, kv.data_ptr(), q_w.data_ptr(),
                     k_w.data_ptr(), 0 if dead is None else dead.data_ptr(), eps, out.data_ptr())
        return out
    g, value = gate_torch(h, kv, q_w, k_w, dead, eps)
    return h + g[..., None] * value[:, None, :]  # (not addcmul: a fused multiply-add may round differently
    # in the vectorised body and the scalar tail, which would make a row's bits depend on its place)


def gate_torch(h: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
               dead: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch form's gate [N, hc] and value [N, hidden], computed in float32; dtype conversions only
    where a dtype differs (each is an operator)."""
    n, hc, dim = h.shape
    keys = kv[:, :hc * dim].view(n, hc, dim)
    value = kv[:, hc * dim:]  # [N, hidden], shared by all branches
    q = layers.rms_norm(h.float() if h.dtype != torch.float32 else h, eps, q_w)  # [N, hc, hidden] float32
    k = layers.rms_norm(keys.float() if keys.dtype != torch.float32 else keys, eps, k_w)
    dot = (q * k).sum(-1) / math.sqrt(dim)  # [N, hc]
    mag = torch.sqrt(dot.abs().clamp(min=1e-6))  # (NaN stays NaN)
    g = pointwise(torch.sigmoid, torch.where(dot < 0, -mag, mag))  # the positive root at dot = +-0
    if dead is not None:
        g = g.masked_fill(dead[:, None], 0.0)
    return (g if g.dtype == h.dtype else g.to(h.dtype)), value


def silu_mul(gu: torch.Tensor, inter: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up [* weights] for gu [..., 2 * inter] holding (gate, up) per row: [..., inter];
    weights [...] (one per row) or None."""
    lead = gu.shape[:-1]
    if runs_in_c(gu, weights):
        gu, weights = gu.contiguous(), None if weights is None else weights.contiguous()
        rows = gu.numel() // (2 * inter)
        out = torch.empty(*lead, inter)
        capture.call(_kernel().silu_mul, gu.data_ptr(), rows, inter, 0 if weights is None else weights.data_ptr(),
                     out.data_ptr())
        return out
    act = pointwise(F.silu, gu[..., :inter]) * gu[..., inter:]
    return act if weights is None else act * weights[..., None]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=1) for x [rows, v] (v >= 1): the first index of each row's maximum, a NaN above every
    number. One C pass per row where it runs (torch's CPU argmax is a scalar loop, ~2.5 ns a logit)."""
    if runs_in_c(x) and x.dim() == 2 and x.shape[1] > 0:
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        _kernel().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out
    return x.argmax(dim=1)
