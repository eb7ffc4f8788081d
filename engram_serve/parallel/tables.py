"""Row-sharded Engram tables (docs/contract.md §10): rank r of N holds rows [lo_l, hi_l) of every table l, a
contiguous block of ceil(rows / N) rows copied out of the (memory-mapped) checkpoint in its stored form
(FP8 rows stay FP8), plus one zero row; no rank ever holds a whole table.

`gather` is the production gather (EngramTables: dedup, the C kernel, FP8 decoding) over the shard, with
every hash id this rank does not own mapped to the zero row: it writes the owned rows into the staging
buffer and zeros at every other hash id. The Engram projection is linear in the rows, so the per-rank
partial projections of these staging buffers sum to the full projection (`PartialInputLinear`, then the
cross-rank sum). Invariant: the shards of ranks 0..N-1 partition the rows of every table.
"""
from __future__ import annotations

import torch

from ..engram.quantized import Fp8Table
from ..engram.tables import EngramTables


def shard_bounds(rows: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def _owned(table, lo: int, hi: int):
    """Rows [lo, hi) of a float or FP8 table, copied, with one zero row after them."""
    if isinstance(table, Fp8Table):
        w, s = table.weight[lo:hi], table.scale[lo:hi]
        zero_s = torch.full((1, s.shape[1]), 127, dtype=torch.uint8).view(s.dtype)  # 2^0
        return Fp8Table(torch.cat([w, torch.zeros(1, w.shape[1], dtype=w.dtype)]), torch.cat([s, zero_s]))
    return torch.cat([table[lo:hi], torch.zeros(1, table.shape[1], dtype=table.dtype)])


class ShardedEngramTables(EngramTables):
    def __init__(self, full: EngramTables, rank: int, world: int, pin: bool | None = None):
        self.full_rows = full.rows_per_layer
        self.bounds = [shard_bounds(rows, rank, world) for rows in self.full_rows]
        shards = [_owned(t, lo, hi) for t, (lo, hi) in zip(full.tables, self.bounds)]
        super().__init__(full.layer_ids, shards, pin=pin, dedup=full.dedup)
        self.rank, self.world = rank, world

    @property
    def rows_per_layer(self) -> list[int]:
        return list(self.full_rows)

    @property
    def shard_bytes(self) -> int:
        """The bytes this rank holds (its rows, their scales, the zero rows)."""
        return super().nbytes

    def gather(self, hash_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Owned rows of hash_ids [T, L_e, C] into out [L_e, T, C, hd], zeros elsewhere; returns out."""
        lo = torch.tensor([b[0] for b in self.bounds], device=hash_ids.device)[None, :, None]
        n = torch.tensor([b[1] - b[0] for b in self.bounds], device=hash_ids.device)[None, :, None]
        local = hash_ids - lo
        return super().gather(torch.where((local >= 0) & (local < n), local, n), out)  # n: the zero row
