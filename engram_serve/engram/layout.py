"""Per-layer hash layout of docs/contract.md §2: moduli, offsets and multipliers.

Invariants: `offsets[l, c] == moduli[l, :c].sum()`; `table_rows[l] == moduli[l].sum()`
and equals `engram_num_embeddings[l]`; all moduli across all layers are distinct primes;
`div_magic[l, c] == 2**64 // moduli[l, c]` (the reciprocal the CPU hash kernel divides by).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import EngramConfig
from ..errors import CheckpointMismatch

_INT64_MAX = np.iinfo(np.int64).max


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (far beyond any table size)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramLayout:
    """Moduli/offsets are [L, (N-1)*H] int64, column c = (n-2)*H + h; multipliers are [L, N] int64.

    div_magic [L, (N-1)*H] uint64 is floor(2**64 / moduli), exact: the C kernel's `n % d` is a
    multiply-high by it plus one correction (see `_hash_kernel.c`). It always stays on the host.
    """

    config: EngramConfig
    moduli: torch.Tensor
    offsets: torch.Tensor
    multipliers: torch.Tensor
    div_magic: torch.Tensor

    @property
    def table_rows(self) -> list[int]:
        return self.moduli.sum(dim=1).tolist()

    def to(self, device) -> "EngramLayout":
        return EngramLayout(self.config, self.moduli.to(device), self.offsets.to(device), self.multipliers.to(device),
                            self.div_magic)


def layer_multipliers(layer_id: int, n: int, compressed_vocab: int) -> np.ndarray:
    rng = np.random.default_rng(10007 * layer_id)
    bound = max(1, (_INT64_MAX // compressed_vocab) // 2)
    return rng.integers(low=0, high=bound, size=n, dtype=np.int64) * 2 + 1


def division_magic(moduli: list[list[int]]) -> torch.Tensor:
    """[L, C] uint64 floor(2**64 / d) per modulus d >= 2, in exact integer arithmetic."""
    for row in moduli:
        for d in row:
            if d < 2:
                raise ValueError(f"hash modulus {d} must be >= 2")
    return torch.tensor([[(1 << 64) // d for d in row] for row in moduli], dtype=torch.uint64)


def build_layout(cfg: EngramConfig, check_rows: bool = True) -> EngramLayout:
    """Compute the layout; with check_rows, table sizes must equal engram_num_embeddings."""
    n_max, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
    used: set[int] = set()
    moduli = []
    for _layer in cfg.engram_layer_ids:
        row = []
        for _n in range(2, n_max + 1):
            cur = cfg.engram_vocab_size - 1
            for _h in range(heads):
                cur += 1
                while cur in used or not is_prime(cur):
                    cur += 1
                used.add(cur)
                row.append(cur)
        moduli.append(row)
    mod = torch.tensor(moduli, dtype=torch.int64).reshape(len(moduli), (n_max - 1) * heads)  # [L, C]
    off = torch.cumsum(mod, dim=1) - mod  # exclusive prefix sums
    if check_rows:
        for lid, want, got in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings, mod.sum(1).tolist()):
            if want != got:
                raise CheckpointMismatch(
                    f"engram_num_embeddings for Engram layer {lid}: config says {want}, the hash layout needs {got}")
    mult = torch.from_numpy(np.array([layer_multipliers(lid, n_max, cfg.engram_compressed_vocab_size)
                                      for lid in cfg.engram_layer_ids], dtype=np.int64).reshape(len(moduli), n_max))  # [L, N]
    return EngramLayout(cfg, mod, off, mult, division_magic(moduli).reshape(mod.shape))
