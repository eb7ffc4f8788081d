"""Engram embedding tables (docs/contract.md §7): one host table [rows, engram_head_dim] per Engram layer.

A table is a float tensor or an `Fp8Table` (E4M3 rows + E8M0 scales, quantized.py). Tables may be far
larger than device memory, and than RAM: they stay on the host (pinned where CUDA exists, else plain
or memory-mapped from the checkpoint, read on demand) and are gathered row-wise into a persistent
staging buffer. Invariant: `tables[l].shape == (engram_num_embeddings[l], engram_head_dim)` and every
hash id of layer l (docs/contract.md §2) is a valid row of `tables[l]`.

The gather, per layer: the step's ids [T*C] are deduplicated (a step repeats many ids: Zipfian text,
shared prefixes, the same n-gram in many requests), each distinct row is read once (through the
optional byte-bounded cache of hot rows) and dequantized once, then expanded into the staging rows.
On the CPU this is one fused C kernel per layer (staging.py), its cache the kernel's `HotRowCache`,
looked up inside the same call; otherwise torch ops, with the torch `RowCache` (row_cache.py). Dedup
and cache change which bytes are read, never the staged values: the
staged rows are bit for bit those of a direct row-by-row read (tests/test_checkpoint_tables.py).
"""
from __future__ import annotations

import threading

import torch

from ..config import EngramConfig
from .quantized import Fp8Table, dequantize_rows
from .row_cache import HotRowCache, RowCache
from .. import kernels
from .staging import (gather_backend, stage_layers, stage_rows, stage_step, staging_fits, staging_view, table_fits,
                      table_parts, table_views)


def table_key(layer_id: int) -> str:
    """Checkpoint tensor name of the table of Engram layer `layer_id` (the model layer id; its FP8 scales are
    `layers.{id}.engram.embed.scale`)."""
    return f"layers.{layer_id}.engram.embed.weight"


def scale_key(layer_id: int) -> str:
    return f"layers.{layer_id}.engram.embed.scale"


class EngramTables:
    """The Engram tables of a model. `dedup` (default on) reads each distinct row of a step once;
    `cache_bytes` > 0 puts a RowCache of that many bytes (split evenly over the layers) in front."""

    def __init__(self, layer_ids: tuple[int, ...] | list[int], tables: list[torch.Tensor | Fp8Table],
                 pin: bool | None = None, dedup: bool = True, cache_bytes: int = 0):
        if len(layer_ids) != len(tables):
            raise ValueError(f"EngramTables: {len(layer_ids)} layer ids but {len(tables)} tables")
        widths = {t.shape[1] for t in tables if t.ndim == 2}
        if any(t.ndim != 2 for t in tables) or len(widths) > 1:
            raise ValueError(f"EngramTables: tables must be 2-D with one width, got {[tuple(t.shape) for t in tables]}")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:  # page-locked host memory, so staging copies to the GPU are truly asynchronous
            tables = [t if t.device.type == "cuda" or t.is_pinned() else t.pin_memory() for t in tables]
        self.layer_ids = tuple(int(x) for x in layer_ids)
        self.tables = list(tables)
        self.dedup = dedup
        self._kernel_tables: tuple = ()  # the tables that _kernel_facts was computed for (see _kernel_serves)
        self._kernel_facts: tuple = (False, None)
        self._serves: tuple = (None, False)  # (staging facts, whether the kernel serves them) of the last gather
        self.caches: list[RowCache | HotRowCache | None] = [None] * len(tables)
        self.cache_bytes = 0
        if cache_bytes > 0:
            self.set_cache(cache_bytes)
        self._lock = threading.Lock()  # the caches are shared state; a gather holds the lock

    def set_cache(self, cache_bytes: int, kernel: bool | None = None) -> None:
        """Replace the hot-row caches by empty ones of cache_bytes in all (0: no cache): the C kernel's
        HotRowCache where the fused gather serves these tables (`kernel`; None: as the `auto` backend
        would choose for float32 staging), else the torch RowCache. A gather that takes the other path
        replaces them by empty ones of its kind (the rows cached are the same values either way)."""
        self.cache_bytes = max(0, cache_bytes)
        if kernel is None:
            kernel = self._kernel_serves(torch.empty(1, self.head_dim if self.tables else 1))
        per = self.cache_bytes // max(1, len(self.tables))
        self.caches = [None if self.cache_bytes <= 0 else self._make_cache(t, per, kernel) for t in self.tables]

    def _kernel_serves(self, out_row: torch.Tensor) -> bool:
        """Whether the fused kernel stages every table into staging like out_row: `gather_backend(tab, out_row)`
        for each table, with what depends only on the tables (on the CPU, their layout, the kernel's views
        of them) computed once for these table objects; whether the kernel is loaded is asked per call."""
        fit, _ = self._table_facts()
        kernel = kernels.get("gather")
        key = (out_row.dtype, out_row.device, out_row.shape, out_row.stride(), kernel)  # what the answer depends on
        if fit and self._serves[0] != key:  # ~8 us a gather saved at 64 requests
            self._serves = (key, kernel is not None and out_row.device.type == "cpu" and staging_fits(out_row))
        return fit and self._serves[1]

    def _table_facts(self) -> tuple[bool, list | None]:
        """(every table on the CPU in a layout the kernel reads, their `table_views` or None)."""
        same = len(self._kernel_tables) == len(self.tables) and all(
            a is b for a, b in zip(self._kernel_tables, self.tables))
        if not same:  # first call, or self.tables was changed
            fit = bool(self.tables) and all(
                table_fits(t) and all(p.device.type == "cpu" for p in table_parts(t)) for t in self.tables)
            views = [table_views(t) for t in self.tables] if fit else None
            self._kernel_tables, self._kernel_facts = tuple(self.tables), (fit, views)
        return self._kernel_facts

    @staticmethod
    def _make_cache(tab, nbytes: int, kernel: bool) -> RowCache | HotRowCache:
        """The kernel's cache holds stored rows (264 bytes per 256-wide FP8 row), decoded on a hit: a
        dequantized float32 row is 1 KiB, and copying it from a cache larger than the CPU caches took
        as long as reading and decoding the row from the mapped table (measured: the cache with 88%
        hits was slower than none). The torch RowCache holds dequantized float32 rows."""
        if kernel:
            return HotRowCache.for_table(nbytes, tab)
        return RowCache(nbytes, [(tab.shape[1],)], [torch.float32], tab.device)

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
        return sum(t.nbytes if isinstance(t, Fp8Table) else t.numel() * t.element_size() for t in self.tables)

    @property
    def quantized(self) -> bool:
        return any(isinstance(t, Fp8Table) for t in self.tables)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor names; an FP8 table gives its E4M3 rows and its E8M0 scales."""
        out = {}
        for lid, t in zip(self.layer_ids, self.tables):
            if isinstance(t, Fp8Table):
                out[table_key(lid)], out[scale_key(lid)] = t.weight, t.scale
            else:
                out[table_key(lid)] = t
        return out

    @classmethod
    def random(cls, cfg: EngramConfig, seed: int, std: float = 0.5, dtype: torch.dtype = torch.float32,
               pin: bool | None = False) -> "EngramTables":
        """Deterministic random tables of the configured sizes (for random checkpoints and tests)."""
        g = torch.Generator().manual_seed(seed)
        tabs = [(torch.randn(rows, cfg.engram_head_dim, generator=g) * std).to(dtype)
                for rows in cfg.engram_num_embeddings]
        return cls(cfg.engram_layer_ids, tabs, pin=pin)

    def stager(self, hash_ids: torch.Tensor, out: torch.Tensor):
        """`gather(hash_ids, out)` prepared for these buffers (CPU int64 hash_ids [T, L_e, C] and out, which keep
        their memory): a function of no arguments that stages their current ids into out and returns True, with
        the views the fused kernel takes made once (a decode step's gather: a few us of glue instead of ~40), or
        returns False, staging nothing, where the tables changed to ones the kernel does not read (`gather`
        then). None where the kernel does not serve these buffers."""
        t, n_layers, c = hash_ids.shape
        if not n_layers or n_layers != self.num_layers or out.shape != (n_layers, t, c, self.head_dim) \
                or hash_ids.dtype != torch.int64 or not hash_ids.is_cpu or not hash_ids.is_contiguous():
            return None
        with self._lock:
            if not (out[0].is_contiguous() and self._kernel_serves(out[0, 0])):
                return None
        src, ids = hash_ids.numpy().transpose(1, 0, 2), torch.empty(n_layers, t, c, dtype=torch.int64).numpy()
        staged, flat = staging_view(out.view(n_layers, t * c, self.head_dim)), ids.reshape(n_layers, t * c)

        def stage() -> bool:
            with self._lock:
                fit, views = self._table_facts()
                if not fit:
                    return False
                if self.cache_bytes and not isinstance(self.caches[0], HotRowCache):
                    self.set_cache(self.cache_bytes, True)  # (as `gather` does when the kernel serves)
                ids[...] = src
                stage_layers(self.tables, flat, staged, self.dedup, self.caches if self.cache_bytes else None, views)
                return True
        return stage

    def gather(self, hash_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Rows of hash_ids [T, L_e, C] into out [L_e, T, C, head_dim] (float32 or bfloat16), in place; returns out.

        Vectorised over all tokens and columns, per layer. `out` may be a slice of a persistent staging
        buffer on another device; ids are moved to the table's device first, stored rows to out's."""
        t, n_layers, c = hash_ids.shape
        if n_layers == self.num_layers == 0 and out.shape[:3] == (0, t, c):
            return out  # a model without Engram layers: nothing to stage
        if n_layers != self.num_layers or out.shape != (n_layers, t, c, self.head_dim):
            raise ValueError(f"gather: hash_ids {tuple(hash_ids.shape)} and out {tuple(out.shape)} do not fit "
                             f"{self.num_layers} tables of width {self.head_dim}")
        with self._lock:
            # per layer contiguous (a token-prefix slice of a persistent staging buffer is): one kernel call per layer
            kernel = out[0].is_contiguous() and self._kernel_serves(out[0, 0])
            if self.cache_bytes and kernel != isinstance(self.caches[0], HotRowCache):
                self.set_cache(self.cache_bytes, kernel)  # the other path serves now: empty caches of its kind
            if kernel:
                # fused: dedup, cache, read, decode into staging, one pass per layer (few torch ops per step)
                stage_step(self.tables, hash_ids, out.view(n_layers, t * c, self.head_dim), self.dedup,
                           self.caches if self.cache_bytes else None, self._table_facts()[1])
                return out
            for layer, tab in enumerate(self.tables):
                ids = hash_ids[:, layer, :].reshape(-1).to(tab.device, torch.int64)  # [T*C]
                dst = out[layer].view(t * c, self.head_dim) if out[layer].is_contiguous() else None  # [T*C, hd]
                if self.dedup or self.caches[layer] is not None:
                    uniq, inv = torch.unique(ids, return_inverse=True) if self.dedup else (ids, None)  # [U] ascending
                    rows = self._rows(layer, uniq, out.dtype, out.device)  # [U, hd]
                    if inv is None:
                        out[layer].copy_(rows.view(t, c, self.head_dim))
                    elif dst is not None:
                        torch.index_select(rows, 0, inv.to(out.device), out=dst)
                    else:
                        out[layer].copy_(rows.index_select(0, inv.to(out.device)).view(t, c, self.head_dim))
                elif dst is not None and not isinstance(tab, Fp8Table) and tab.dtype == dst.dtype \
                        and tab.device == dst.device:
                    torch.index_select(tab, 0, ids, out=dst)  # straight from the table into staging
                elif dst is not None:
                    self._dequantize(self._fetch(layer, ids), out.dtype, out.device, dst)  # straight into staging
                else:
                    rows = self._dequantize(self._fetch(layer, ids), out.dtype, out.device)
                    out[layer].copy_(rows.view(t, c, self.head_dim))
        return out

    def _fetch(self, layer: int, ids: torch.Tensor) -> list[torch.Tensor]:
        """Stored rows of ids [n]: [float rows [n, hd]] or [E4M3 bytes [n, hd], E8M0 bytes [n, hd/32]]."""
        tab = self.tables[layer]
        return list(tab.fetch(ids)) if isinstance(tab, Fp8Table) else [tab.index_select(0, ids)]

    def _rows(self, layer: int, ids: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Dequantized rows [n, hd] of ids [n], through the hot-row cache if there is one: hits are copied
        from it, misses fetched, dequantized, inserted."""
        cache = self.caches[layer]
        if cache is None:
            return self._decode(layer, ids, dtype, device)
        hit, slot = cache.lookup(ids)
        miss = (~hit).nonzero().squeeze(1)  # [M]
        hit_idx = hit.nonzero().squeeze(1)  # [n - M]
        fresh = self._decode(layer, ids.index_select(0, miss), cache.parts[0].dtype, cache.parts[0].device)  # [M, hd]
        if miss.numel() == 0:
            rows = cache.read(slot)[0]
        else:
            rows = torch.empty((ids.numel(), self.head_dim), dtype=cache.parts[0].dtype, device=cache.parts[0].device)
            rows.index_copy_(0, hit_idx, cache.read(slot.index_select(0, hit_idx))[0])  # (index_copy_: ~10x
            rows.index_copy_(0, miss, fresh)  # faster than rows[idx] = ... on CPU)
            cache.insert(ids.index_select(0, miss), slot.index_select(0, miss), [fresh])
        return rows.to(device, dtype, non_blocking=True)

    def _decode(self, layer: int, ids: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Rows [n, hd] dtype on device of ids [n]: the fused kernel where it fits, else fetch + dequantize."""
        rows = torch.empty((ids.numel(), self.head_dim), dtype=dtype, device=device)
        if gather_backend(self.tables[layer], rows) == "kernel":
            stage_rows(self.tables[layer], ids, rows, dedup=False)
            return rows
        return self._dequantize(self._fetch(layer, ids), dtype, device, rows)

    @staticmethod
    def _dequantize(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows -> [n, hd] dtype on device (into out if given). FP8 bytes travel before they expand."""
        parts = [p.to(device, non_blocking=True) for p in parts]
        if len(parts) == 2:
            w, s = parts
            return dequantize_rows(w, s, out if out is not None else torch.empty(w.shape, dtype=dtype, device=device))
        if out is None:
            return parts[0].to(dtype)
        return out.copy_(parts[0])
