"""Which form the forward's token-wise steps take: model/ops_torch.py (the torch operators) or model/ops_c.py (one
C call each), two modules with the same functions and signatures.

`choose` picks one per forward (or per standalone call of a layer), from devices, dtypes, autograd and whether the
token kernel is loaded (engram_serve/kernels.py), never from a batch's shapes or layout: a serving config always
takes the same form, so a token's bits never depend on its batch. The forward passes the module it chose down
explicitly (`V41Step.ops`); nothing reads it from a global.
"""
from __future__ import annotations

from types import ModuleType

import torch

from .. import kernels
from . import ops_c, ops_torch


def choose(*tensors: torch.Tensor | None) -> ModuleType:
    """ops_c where the token kernel is loaded and every tensor is float32, on the CPU, and outside autograd (grad
    enabled and it requires grad); else ops_torch (CUDA, training, another dtype, the kernel not built or switched
    off). The model asks with its embedding weight (a model trains all its weights or none); a layer called alone,
    with its input and its weights."""
    if kernels.get("token") is None:
        return ops_torch
    grad = torch.is_grad_enabled()
    for t in tensors:  # a plain loop: this runs once per forward
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu or (grad and t.requires_grad)):
            return ops_torch
    return ops_c
