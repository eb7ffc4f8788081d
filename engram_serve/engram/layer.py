"""The Engram gate of docs/contract.md §7 (DeepSeek-V4.1 form), one per configured layer.

Input: the residual stream h [T, hc_mult, hidden] and the staged table rows [T, C, head_dim]
(C = (N-1)*H hash columns). Output: h with a gated, shared value added to every branch:
    e          = rows flattened to [T, C*head_dim]
    keys, v    = wkv(e) split into hc_mult keys and one value (each [T, hidden])
    dot_i      = sum(rmsnorm(h_i) * q_weight[i] * rmsnorm(key_i) * k_weight[i]) / sqrt(hidden)
    gate_i     = sigmoid(sign(dot_i) * sqrt(max(|dot_i|, 1e-6)))   (0 for dead / padding tokens)
    h_i       += gate_i * v
"""
from __future__ import annotations

import torch
from torch import nn

from types import ModuleType

from ..model import ops_torch
from ..model.layers import Linear


class EngramGate(nn.Module):
    def __init__(self, hidden: int, hc_mult: int, num_columns: int, head_dim: int, eps: float):
        super().__init__()
        self.hidden, self.hc_mult, self.num_columns, self.head_dim, self.eps = hidden, hc_mult, num_columns, head_dim, eps
        self.wkv = Linear(num_columns * head_dim, (hc_mult + 1) * hidden)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, hidden))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, hidden))

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """kv [T, (hc+1)*hidden] = wkv(rows flattened) for rows [T, C, hd]. Linear in the rows: under
        tensor parallelism each rank projects its own table shard's rows and the partials are summed."""
        t = rows.shape[0]
        if rows.shape != (t, self.num_columns, self.head_dim):
            raise ValueError(f"Engram rows have shape {tuple(rows.shape)}; expected "
                             f"{(t, self.num_columns, self.head_dim)}")
        e = rows.reshape(t, self.num_columns * self.head_dim)
        return self.wkv(e if e.dtype == self.wkv.w.dtype else e.to(self.wkv.w.dtype))

    def gate(self, h: torch.Tensor, rows: torch.Tensor, dead: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """gate [T, hc_mult] and value [T, hidden] for h [T, hc, hidden], rows [T, C, hd], dead [T] bool (the
        torch form of model/ops_torch.py; the forward adds them in `apply`)."""
        return ops_torch.engram_gate_value(h, self.project(rows), self.q_weight, self.k_weight, dead, self.eps)

    def apply(self, h: torch.Tensor, kv: torch.Tensor, dead: torch.Tensor | None, ops: ModuleType) -> torch.Tensor:
        """h with the gated value added, from an already computed (e.g. cross-rank summed) projection kv, by the
        forward's form ops (model/ops.py `choose`)."""
        return ops.engram_gate(h, kv, self.q_weight, self.k_weight, dead, self.eps)

    def forward(self, h: torch.Tensor, rows: torch.Tensor, dead: torch.Tensor | None, ops: ModuleType) -> torch.Tensor:
        return self.apply(h, self.project(rows), dead, ops)
