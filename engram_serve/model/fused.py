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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=1) for x [rows, v] (v >= 1): the first index of each row's maximum, a NaN above every
    number. One C pass per row where it runs (torch's CPU argmax is a scalar loop, ~2.5 ns a logit)."""
    if runs_in_c(x) and x.dim() == 2 and x.shape[1] > 0:
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        _kernel().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out
    return x.argmax(dim=1)
