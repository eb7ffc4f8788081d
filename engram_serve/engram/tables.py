"""Engram embedding tables (spec §7): one host tensor [rows, engram_head_dim] per Engram layer.

Tables may be far larger than device memory, so they stay on the host (pinned where CUDA exists,
else plain or memory-mapped) and are gathered row-wise into a persistent staging buffer.
Invariant: `tables[l].shape == (engram_num_embeddings[l], engram_head_dim)` and every hash id of
layer l (spec §2) is a valid row of `tables[l]`.
"""
from __future__ import annotations

import torch

from ..config import EngramConfig


def table_key(layer_id: int) -> str:
    """Checkpoint tensor name of the table of Engram layer `layer_id` (the model layer id)."""
    return f"engram.{layer_id}.table"


class EngramTables:
    def __init__(self, layer_ids: tuple[int, ...] | list[int], tables: list[torch.Tensor], pin: bool | None = None):
        if len(layer_ids) != len(tables):
            raise ValueError(f"EngramTables: {len(layer_ids)} layer ids but {len(tables)} tables")
        widths = {t.shape[1] for t in tables if t.ndim == 2}
        if any(t.ndim != 2 for t in tables) or len(widths) > 1:
            raise ValueError(f"EngramTables: tables must be 2-D with one width, got {[tuple(t.shape) for t in tables]}")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:  # page-locked host memory, so staging copies to the GPU are truly asynchronous
            tables = [t if t.is_cuda or t.is_pinned() else t.pin_memory() for t in tables]
        self.layer_ids = tuple(int(x) for x in layer_ids)
        self.tables = list(tables)

    @property
    def num_layers(self) -> int:
        return len(self.tables)

    @property
    def rows_per_layer(self) -> list[int]:
        return [t.shape[0] for t in self.tables]

    @property
    def head_dim(self) -> int:
        return self.tables[0].shape[1] if self.tables else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tables)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {table_key(lid): t for lid, t in zip(self.layer_ids, self.tables)}

    @classmethod
    def random(cls, cfg: EngramConfig, seed: int, std: float = 0.5, dtype: torch.dtype = torch.float32,
               pin: bool | None = False) -> "EngramTables":
        """Deterministic random tables of the configured sizes (for random checkpoints and tests)."""
        g = torch.Generator().manual_seed(seed)
        tabs = [(torch.randn(rows, cfg.engram_head_dim, generator=g) * std).to(dtype)
                for rows in cfg.engram_num_embeddings]
        return cls(cfg.engram_layer_ids, tabs, pin=pin)

    def gather(self, hash_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of hash_ids [T, L_e, C] into out [L_e, T, C, head_dim], in place; returns out.

        One index_select per layer (vectorised over all tokens and columns). `out` may be a slice of a
        persistent staging buffer on another device; ids are moved to the table's device first."""
        t, n_layers, c = hash_ids.shape
        if n_layers != self.num_layers or out.shape != (n_layers, t, c, self.head_dim):
            raise ValueError(f"gather: hash_ids {tuple(hash_ids.shape)} and out {tuple(out.shape)} do not fit "
                             f"{self.num_layers} tables of width {self.head_dim}")
        for layer, tab in enumerate(self.tables):
            ids = hash_ids[:, layer, :].reshape(-1).to(tab.device, torch.int64)  # [T*C]
            dst = out[layer]  # [T, C, hd]
            if dst.device == tab.device and dst.dtype == tab.dtype and dst.is_contiguous():
                torch.index_select(tab, 0, ids, out=dst.view(t * c, self.head_dim))
            else:
                dst.copy_(tab.index_select(0, ids).view(t, c, self.head_dim), non_blocking=True)
        return out
