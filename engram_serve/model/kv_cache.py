"""Paged KV cache: one flat slot pool per layer and KV head, addressed by `slot = block * block_size + offset`.

Layout [layers, kv_heads, slots, head_dim] (head-major): attention gathers a pair's keys for every KV
head in one index_select that lands in its bmm's batch layout (attention_kernels.py), with no copy.

Invariants: a token at absolute position p of a request whose block table is `bt` lives in slot
`bt[p // block_size] * block_size + p % block_size`; slot -1 means "write nowhere" (padding). An
extra trash slot at the end of every layer absorbs those writes, so writing needs no boolean
indexing (no device sync) and the trash slot is never read. A second extra slot, the zero slot, is
never written: attention reads it in place of every key position a row may not read (past its
length, a null block), so what other requests or padding left in the pool cannot reach the row.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if v < 1:
                raise ValueError(f"KVCache {name}={v}: must be >= 1")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.num_slots = num_blocks * block_size
        self.trash_slot, self.zero_slot = self.num_slots, self.num_slots + 1
        shape = (num_layers, num_kv_heads, self.num_slots + 2, head_dim)  # + the trash and zero slots
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._layers = [(self._k[i], self._v[i]) for i in range(num_layers)]  # views, made once

    @classmethod
    def for_config(cls, cfg, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> "KVCache":
        return cls(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                   dtype, device)

    def _blocks(self, pool: torch.Tensor) -> torch.Tensor:
        return pool[:, :, :self.num_slots].view(self.num_layers, self.num_kv_heads, self.num_blocks, self.block_size,
                                                self.head_dim).permute(0, 2, 3, 1, 4)

    @property
    def k(self) -> torch.Tensor:
        """[layers, num_blocks, block_size, kv_heads, head_dim] (strided) view of the key pool (no trash or zero slot)."""
        return self._blocks(self._k)

    @property
    def v(self) -> torch.Tensor:
        return self._blocks(self._v)

    @property
    def nbytes(self) -> int:
        return 2 * self._k.numel() * self._k.element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, kv_heads, head_dim] at slot_mapping [T]; slots < 0 go to the trash slot."""
        slots = torch.where(slot_mapping < 0, torch.full_like(slot_mapping, self.trash_slot), slot_mapping)
        self._k[layer].index_copy_(1, slots, k.to(self.dtype).transpose(0, 1))
        self._v[layer].index_copy_(1, slots, v.to(self.dtype).transpose(0, 1))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value pools [kv_heads, slots + 2, head_dim] of one layer (trash and zero slots last)."""
        return self._layers[layer]
