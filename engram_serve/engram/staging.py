"""The fused staging gather of one table on the CPU: the optional C kernel `_gather_kernel`.

One pass per table: the step's ids are deduplicated in the kernel (an open-addressing set, O(n), no
sort), each distinct row is read from the (memory-mapped) table once and decoded straight into its
first staging row (FP8 E4M3 bytes x E8M0 scale, or a float32 row copied), and the later positions of
the same id copy that staged row. The torch path (`EngramTables.gather` without the kernel: unique,
index_select of the stored bytes, the bit-trick decode, an index_select into staging) is the fallback
for a process without the kernel (not built, or switched off: `ENGRAM_SERVE_KERNELS=-gather`,
engram_serve/kernels.py), for tables or staging off the CPU, and for other dtypes.
Both decode bit for bit the plain definition (tests/kernels/test_gather_kernel.py, against each other and a
plain loop).
"""
from __future__ import annotations

import numpy as np
import torch

from .. import kernels
from .quantized import Fp8Table
from .row_cache import HotRowCache


def table_fits(tab: torch.Tensor | Fp8Table) -> bool:
    """Whether the kernel can read rows of `tab` (wherever it is): an FP8 table or a contiguous float32 one."""
    if isinstance(tab, Fp8Table):
        return tab.weight.is_contiguous() and tab.scale.is_contiguous()
    return tab.dtype == torch.float32 and tab.is_contiguous()


def staging_fits(out: torch.Tensor) -> bool:
    """Whether the kernel can write `out` [n, hd] (wherever it is): contiguous float32 or bfloat16."""
    return out.dtype in (torch.float32, torch.bfloat16) and out.is_contiguous() and out.ndim == 2


def kernel_fits(tab: torch.Tensor | Fp8Table, out: torch.Tensor) -> bool:
    """Whether the kernel can stage rows of `tab` into `out` [n, hd]: an FP8 table or a contiguous float32
    one, a contiguous float32 or bfloat16 `out`, all on the CPU."""
    return table_fits(tab) and staging_fits(out)


def table_parts(tab: torch.Tensor | Fp8Table) -> tuple[torch.Tensor, ...]:
    return (tab.weight, tab.scale) if isinstance(tab, Fp8Table) else (tab,)


def kernel_loaded() -> bool:
    """Whether the gather kernel is loaded (engram_serve/kernels.py)."""
    return kernels.get("gather") is not None


def gather_backend(tab: torch.Tensor | Fp8Table, out: torch.Tensor) -> str:
    """'kernel' or 'torch': the path that stages rows of `tab` into `out`: the kernel where it is loaded,
    every tensor is on the CPU and `kernel_fits`."""
    on_cpu = all(t.device.type == "cpu" for t in (*table_parts(tab), out))
    return "kernel" if kernel_loaded() and on_cpu and kernel_fits(tab, out) else "torch"


def table_views(tab: torch.Tensor | Fp8Table) -> tuple:
    """(table, scale or None) as the kernel takes them: zero-copy numpy views of the stored rows."""
    if isinstance(tab, Fp8Table):
        return tab.weight.view(torch.uint8).numpy(), tab.scale.view(torch.uint8).numpy()
    return tab.numpy(), None


def staging_view(out: torch.Tensor):
    return out.numpy() if out.dtype == torch.float32 else out.view(torch.int16).numpy()  # bf16 bits


def _kernel_args(tab: torch.Tensor | Fp8Table, out: torch.Tensor) -> tuple:
    """(table, scale or None, staging) as the kernel takes them: zero-copy numpy views."""
    return (*table_views(tab), staging_view(out))


def stage_step(tables: list, hash_ids: torch.Tensor, out: torch.Tensor, dedup: bool,
               caches: list[HotRowCache | None] | None = None, views: list[tuple] | None = None) -> None:
    """Every layer of a step: out[l, t*C + c] = row hash_ids[t, l, c] of tables[l] (hash_ids [T, L, C]; out
    [L, T*C, hd], each layer contiguous; `kernel_fits` for every table). A handful of torch ops per step, whatever L:
    at 64 decode requests the per-layer slicing and conversions cost ~0.2 ms of a ~0.75 ms gather.
    caches[l], if given, is layer l's hot-row cache, looked up inside the kernel call (which then dedups).
    views[l], if given, is `table_views(tables[l])` (EngramTables keeps them: ~10 us a step at 64 requests)."""
    ids = np.ascontiguousarray(hash_ids.to("cpu", torch.int64).numpy().transpose(1, 0, 2).reshape(len(tables), -1))
    # [L, T*C] above, in numpy: ~8 us a step less than the same in torch at 64 requests
    stage_layers(tables, ids, staging_view(out), dedup, caches, views)


def stage_layers(tables: list, ids: np.ndarray, staged: np.ndarray, dedup: bool,
                 caches: list[HotRowCache | None] | None = None, views: list[tuple] | None = None) -> None:
    """`stage_step` of ids [L, T*C] int64 into the staging views staged [L, T*C, hd] (numpy: indexing them costs
    ~0.2 us against ~2 us for a tensor's)."""
    kernel = kernels.get("gather")
    for layer, tab in enumerate(tables):
        table, scale = views[layer] if views is not None else table_views(tab)
        cache = caches[layer] if caches else None
        if cache is None:
            kernel.gather_rows(table, scale, ids[layer], staged[layer], dedup)
            continue
        misses, hits = kernel.gather_rows_cached(table, scale, ids[layer], staged[layer], *cache.arrays())
        cache.hits += hits
        cache.lookups += hits + misses  # the step's distinct ids


def stage_rows(tab: torch.Tensor | Fp8Table, ids: torch.Tensor, out: torch.Tensor, dedup: bool) -> int:
    """out[i] = row ids[i] of tab, decoded (ids [n] int64 on the CPU, out [n, hd] float32 or bfloat16, in
    place; `kernel_fits(tab, out)` must hold). Returns the number of rows read from the table: the
    distinct ids with dedup, else n. An id outside the table raises IndexError before anything is written."""
    table, scale, staged = _kernel_args(tab, out)
    return kernels.get("gather").gather_rows(table, scale, ids.contiguous().numpy(), staged, dedup)
