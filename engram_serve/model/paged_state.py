"""DeepSeek-V4.1's per-request state in the paged cache, and the slot plan of one forward.

Every piece of state is stored at the cache slot of the position that produced it, through the
request's own block table (`slot = table[p // block_size] * block_size + p % block_size`), so that
preemption, prefix reuse and freeing handle all of it as they handle blocks:

  * window [layer]: the post-RoPE KV of every token (attention reads the last `sliding_window` of them);
  * entries [kv source]: compressed entry g, post-RoPE, at the slot of position g*r + r - 1, the token
    that completes it;
  * index keys [kv source]: the index key of entry g, at the same slot;
  * open [ratio-2 kv source]: every token's float32 [kv, gate] compressor row (`wkv x`, `wgate x`):
    the row of an unpaired token 2g is the request's open group, read when token 2g + 1 runs,
    whether that is in this microbatch, a later one, a later chunk or a later step.

Each pool has two extra slots: the trash slot (writes of padding and of tokens that complete no
entry go there; never read) and the zero slot (never written; every key position a token may not
read — before position 0, an entry not yet complete, a null block — reads it, and the attention masks
it). Invariant: a token's reads go through its own row's block table only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..config import ModelConfig
from . import ops_c


class PagedState:
    """The pools of every layer. `window[l]` [slots + 2, head_dim]; for each kv source s,
    `entries[s]` [slots + 2, head_dim], `index_keys[s]` [slots + 2, index_head_dim] and, if its ratio
    is 2, `open[s]` [slots + 2, 2 * head_dim] float32."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if v < 1:
                raise ValueError(f"PagedState {name}={v}: must be >= 1")
        self.num_blocks, self.block_size, self.dtype, self.device = num_blocks, block_size, dtype, torch.device(device)
        self.num_slots = num_blocks * block_size
        self.trash_slot, self.zero_slot = self.num_slots, self.num_slots + 1
        rows, hd = self.num_slots + 2, cfg.head_dim

        def pool(width: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(rows, width, dtype=dt, device=self.device)

        self.window = [pool(hd) for _ in range(cfg.num_hidden_layers)]
        self.entries = {s: pool(hd) for s in cfg.kv_source_layer_ids}
        self.index_keys = {s: pool(cfg.index_head_dim) for s in cfg.kv_source_layer_ids}
        self.open = {s: pool(2 * hd, torch.float32) for s in cfg.kv_source_layer_ids if cfg.ratios[s] == 2}

    @property
    def nbytes(self) -> int:
        pools = [*self.window, *self.entries.values(), *self.index_keys.values(), *self.open.values()]
        return sum(p.numel() * p.element_size() for p in pools)

    def write(self, pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """pool[slots[t]] = values[t]; slots < 0 write to the trash slot (no boolean indexing, no sync)."""
        pool.index_copy_(0, torch.where(slots < 0, self.trash_slot, slots), values.to(pool.dtype))


@dataclass
class SlotPlan:
    """The cache slots one forward reads and writes, computed once and shared by every layer.

    positions [T] absolute; `slots` [T] (-1: padding, writes go to the trash slot);
    `window` [T, W] the slots of positions p - W + 1 .. p, the zero slot before position 0, and
    `window_ok` [T, W] which of them exist. For each ratio r of the model: `entry_count[r]` [T] =
    (p + 1) // r (the entries complete at p), `entry_slots[r]` [T, E_r] the slot of entry g (position
    g*r + r - 1) for g < E_r, the zero slot where g >= entry_count, and `prev_slots` [T] the slot of
    position p - 1 (the open group's partner), the zero slot at p = 0."""

    positions: torch.Tensor
    slots: torch.Tensor
    window: torch.Tensor
    window_ok: torch.Tensor
    entry_count: dict[int, torch.Tensor]
    entry_slots: dict[int, torch.Tensor]
    prev_slots: torch.Tensor

    @classmethod
    def build(cls, positions: torch.Tensor, rows: torch.Tensor, block_tables: torch.Tensor, block_size: int,
              slots: torch.Tensor, zero_slot: int, window: int, ratios: tuple[int, ...],
              max_position: int | None = None) -> "SlotPlan":
        """rows [T] the row of each token in `block_tables` [R, B] (-1: a null block). `max_position`
        bounds every token's position (a static bound for graph capture; default: read from positions)."""
        def slot_of(pos: torch.Tensor) -> torch.Tensor:  # [T, k] positions -> slots, the zero slot if unreadable
            ok = pos >= 0
            col = torch.where(ok, pos // block_size, 0).clamp_(max=block_tables.shape[1] - 1)
            block = block_tables[rows[:, None].expand_as(pos), col]
            ok = ok & (block >= 0) & (pos // block_size < block_tables.shape[1])
            return torch.where(ok, block * block_size + pos % block_size, zero_slot)

        top = int(positions.max()) if max_position is None and positions.numel() else (max_position or 0)
        if kernels.get("token") is not None and all(t.is_cpu and t.dtype == torch.int64
                                                    for t in (positions, rows, block_tables)):
            # the same slots from one C call per part (model/ops_c.py)
            win, ok, prev = ops_c.plan_window(positions, rows, block_tables, block_size, zero_slot, window)
            count, eslots = {}, {}
            for r in sorted(set(x for x in ratios if x)):
                count[r], eslots[r] = ops_c.plan_entries(positions, rows, block_tables, block_size, zero_slot, r,
                                                         max(1, (top + 1) // r))
            return cls(positions, slots, win, ok, count, eslots, prev)
        dev = positions.device
        wpos = positions[:, None] - window + 1 + torch.arange(window, device=dev)  # [T, W]
        win = slot_of(wpos)
        count, eslots = {}, {}
        for r in sorted(set(x for x in ratios if x)):
            count[r] = torch.div(positions + 1, r, rounding_mode="floor")  # [T]
            width = max(1, (top + 1) // r)  # at least one column: a gather over it reads the zero slot
            g = torch.arange(width, device=dev)
            epos = (g * r + r - 1)[None, :].expand(positions.shape[0], width)
            eslots[r] = torch.where(g[None, :] < count[r][:, None], slot_of(epos), zero_slot)  # [T, E_r]
        prev = slot_of((positions - 1)[:, None])[:, 0]
        return cls(positions, slots, win, wpos >= 0, count, eslots, prev)

    def rows(self, keep: torch.Tensor) -> "SlotPlan":
        """The plan of the tokens `keep` [K] alone (index into this plan's tokens)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, keep)
        return SlotPlan(pick(self.positions), pick(self.slots), pick(self.window), pick(self.window_ok),
                        {r: pick(c) for r, c in self.entry_count.items()},
                        {r: pick(s) for r, s in self.entry_slots.items()}, pick(self.prev_slots))
