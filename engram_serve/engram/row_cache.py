"""A byte-bounded cache of hot Engram table rows, in front of a (memory-mapped) table.

Direct-mapped and vectorised: row id `r` may only live in slot `r % num_slots`. A lookup of ids [U]
is one gather of the slot keys; misses are fetched from the table by the caller and inserted, the
newest row winning its slot. Entries hold the rows in their stored form (float rows, or FP8 bytes
plus their E8M0 scales), so a cache of B bytes holds B / row_bytes rows (4x more FP8 rows than
float32 ones).

Invariant: for every slot s with keys[s] = r >= 0, parts[p][s] == the stored row r of part p. Insert
keeps it when several ids of one insert share a slot (only the first of them is written, key and
parts together). Not thread-safe by itself: EngramTables serialises its use.
"""
from __future__ import annotations

import torch


class RowCache:
    def __init__(self, capacity_bytes: int, part_shapes: list[tuple[int, ...]], part_dtypes: list[torch.dtype],
                 device: torch.device | str = "cpu"):
        row_bytes = sum(int(torch.Size(s).numel()) * torch.empty((), dtype=d).element_size()
                        for s, d in zip(part_shapes, part_dtypes))
        self.num_slots = capacity_bytes // row_bytes
        if self.num_slots < 1:
            raise ValueError(f"RowCache: capacity_bytes={capacity_bytes} holds no row of {row_bytes} bytes")
        self.row_bytes = row_bytes
        self.keys = torch.full((self.num_slots,), -1, dtype=torch.int64, device=device)  # [S] row id or -1
        self.parts = [torch.zeros(self.num_slots, *s, dtype=d, device=device) for s, d in zip(part_shapes, part_dtypes)]
        self.hits = self.lookups = 0

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.row_bytes + self.keys.numel() * 8

    def lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [U] int64 -> (hit [U] bool, slot [U] int64)."""
        slot = ids % self.num_slots
        hit = self.keys.index_select(0, slot) == ids
        self.lookups += ids.numel()
        self.hits += int(hit.sum())
        return hit, slot

    def read(self, slot: torch.Tensor) -> list[torch.Tensor]:
        return [p.index_select(0, slot) for p in self.parts]

    def insert(self, ids: torch.Tensor, slot: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """Store rows (parts [n, ...]) of ids [n] at slot [n]; of several ids sharing a slot the first wins."""
        if ids.numel() == 0:
            return
        uslot, inv = torch.unique(slot, return_inverse=True)
        first = torch.full((uslot.numel(),), ids.numel(), dtype=torch.int64, device=ids.device)
        first.scatter_reduce_(0, inv, torch.arange(ids.numel(), device=ids.device), reduce="amin")
        self.keys.index_copy_(0, uslot, ids.index_select(0, first))
        for p, r in zip(self.parts, rows):
            p.index_copy_(0, uslot, r.index_select(0, first))


def _huge_pages(nbytes: int):
    """Zero-filled private anonymous memory, on transparent huge pages where the kernel allows (a hint: fewer
    TLB misses on random reads). Private: a shared anonymous mapping is shmem, which gets no huge pages
    unless shmem_enabled says so (measured: AnonHugePages 0 for the cache with MAP_SHARED)."""
    import mmap
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass
    return buf


class HotRowCache:
    """The hot-row cache of the fused C gather (`_gather_kernel.gather_rows_cached`, which owns the policy:
    8-way set associative, CLOCK within a set, rows admitted with their bit clear; see `Cache` in
    _gather_kernel.c). Its arrays live in anonymous memory apart from the table's mapping, the slab and
    the keys on transparent huge pages where the kernel allows (`_huge_pages`), so that hits read a compact region and
    only misses touch the big mapping.

    Rows are held in their stored form (`row_bytes`: an E4M3 row then its E8M0 scales, 264 bytes at
    width 256, or a float32 row) and decoded on a hit exactly as a miss is from the table, so
    `capacity_bytes` holds capacity_bytes // (row_bytes + 10) rows (with key and CLOCK bit), rounded
    down to whole sets of 8.

    Invariant (kept by the kernel): keys[s] = r >= 0 implies slab[s] == the stored bytes of row r.
    Not thread-safe by itself: EngramTables serialises its use."""

    WAYS = 8

    def __init__(self, capacity_bytes: int, row_bytes: int):
        import numpy as np
        self.row_bytes = row_bytes
        self.num_slots = capacity_bytes // (row_bytes + 10) // self.WAYS * self.WAYS
        if self.num_slots < self.WAYS:
            raise ValueError(f"HotRowCache: capacity_bytes={capacity_bytes} holds no set of {self.WAYS} rows "
                             f"of {row_bytes} bytes")
        self._buf, self._kbuf = _huge_pages(self.num_slots * row_bytes), _huge_pages(self.num_slots * 8)
        self.keys = np.frombuffer(self._kbuf, dtype=np.int64)  # [S] row id or -1
        self.keys[:] = -1
        self.ref = np.zeros(self.num_slots, dtype=np.uint8)  # [S] CLOCK bits
        self.hand = np.zeros(self.num_slots // self.WAYS, dtype=np.uint8)  # [S/8] CLOCK hand per set
        self.slab = np.frombuffer(self._buf, dtype=np.uint8).reshape(self.num_slots, row_bytes)  # [S, row_bytes]
        self.hits = self.lookups = 0

    @classmethod
    def for_table(cls, capacity_bytes: int, tab) -> "HotRowCache":
        """A cache for rows of tab (an Fp8Table: E4M3 row + scales; else a float32 table)."""
        hd = tab.shape[1]
        return cls(capacity_bytes, hd + hd // 32 if hasattr(tab, "scale") else hd * 4)

    def arrays(self) -> tuple:
        return self.keys, self.ref, self.hand, self.slab

    @property
    def nbytes(self) -> int:
        return self.num_slots * (self.row_bytes + 10)
