"""Row-sharded Engram tables (docs/contract.md §10): rank r of N holds rows [lo_l, hi_l) of every table l, a
contiguous block of ceil(rows / N) rows, copied out of the (memory-mapped) checkpoint; no rank ever
holds a whole table, and the full mapping is never touched beyond the owned block.

`gather` writes the rows this rank owns into the staging buffer and zeros at every other hash id.
The Engram projection is linear in the rows, so the per-rank partial projections of these staging
buffers sum to the full projection (`PartialInputLinear`, then the cross-rank sum).
Invariant: the shards of ranks 0..N-1 partition the rows of every table.
"""
from __future__ import annotations

import torch

from ..engram.tables import EngramTables


def shard_bounds(rows: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


class ShardedEngramTables(EngramTables):
    def __init__(self, full: EngramTables, rank: int, world: int, pin: bool | None = None):
        self.bounds = [shard_bounds(t.shape[0], rank, world) for t in full.tables]
        self.full_rows = full.rows_per_layer
        shards = [t[lo:hi].clone() for t, (lo, hi) in zip(full.tables, self.bounds)]  # owned rows only
        super().__init__(full.layer_ids, shards, pin=pin)
        self.rank, self.world = rank, world

    @property
    def rows_per_layer(self) -> list[int]:
        return list(self.full_rows)

    def gather(self, hash_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Owned rows of hash_ids [T, L_e, C] into out [L_e, T, C, hd], zeros elsewhere; returns out."""
        t, n_layers, c = hash_ids.shape
        if n_layers != self.num_layers or out.shape != (n_layers, t, c, self.head_dim):
            raise ValueError(f"gather: hash_ids {tuple(hash_ids.shape)} and out {tuple(out.shape)} do not fit "
                             f"{self.num_layers} tables of width {self.head_dim}")
        for layer, (tab, (lo, hi)) in enumerate(zip(self.tables, self.bounds)):
            if hi == lo:  # a table with fewer rows than ranks: this rank owns none of it
                out[layer].zero_()
                continue
            ids = hash_ids[:, layer, :].reshape(-1).to(tab.device, torch.int64) - lo  # [T*C] local row
            own = (ids >= 0) & (ids < hi - lo)
            rows = tab.index_select(0, torch.where(own, ids, torch.zeros_like(ids)))  # [T*C, hd]
            rows.masked_fill_(~own[:, None], 0.0)
            out[layer].copy_(rows.view(t, c, self.head_dim), non_blocking=True)
        return out
