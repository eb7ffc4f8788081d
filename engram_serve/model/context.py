"""What one (micro)batch forward gets, passed explicitly: its batch, the KV cache, and its own buffers.

Invariant (docs/contract.md §5): every tensor in a `UbatchBuffers` belongs to exactly one microbatch; two
microbatches of a step never share one. `ForwardContext.touch` reports each use to the debug
`OwnershipTracker`, which raises on a buffer seen from two microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from ..config import ModelConfig
from ..errors import StaticBufferError

if TYPE_CHECKING:  # annotations only: keeps model/ importable from runner/ without a cycle
    from ..inputs.batch import StepBatch
    from ..runner.ownership import OwnershipTracker
    from .kv_cache import KVCache

MOE_DISPATCH, MOE_COMBINE = "moe_dispatch", "moe_combine"


@dataclass
class UbatchBuffers:
    """Persistent per-microbatch buffers, sized for at most `T_cap` tokens.

    staging [L_e, T_cap, C, engram_head_dim]: staged Engram rows, C = (N-1)*H;
    hash_ids [T_cap, L_e, C] int64: the microbatch's Engram hash ids (the staging gather reads them);
    topk_idx [T_cap, index_topk] int64: absolute key positions chosen by an index-selecting layer (-1 = none);
    scratch: MoE dispatch/combine buffers [T_cap * experts_per_tok, hidden] under MOE_DISPATCH / MOE_COMBINE.
    """

    ubatch: int
    staging: torch.Tensor
    hash_ids: torch.Tensor | None = None
    topk_idx: torch.Tensor | None = None
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.staging.shape[1]

    @classmethod
    def allocate(cls, cfg: ModelConfig, ubatch: int, max_tokens: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> "UbatchBuffers":
        e = cfg.engram
        staging = torch.zeros(e.num_layers, max_tokens, e.num_columns, e.engram_head_dim, dtype=dtype, device=device)
        hash_ids = torch.zeros(max_tokens, e.num_layers, e.num_columns, dtype=torch.int64, device=device)
        topk = (torch.full((max_tokens, cfg.index_topk), -1, dtype=torch.int64, device=device)
                if cfg.index_layer_ids else None)
        scratch = {}
        if cfg.moe_layer_ids:
            n = max_tokens * cfg.num_experts_per_tok
            scratch[MOE_DISPATCH] = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
            scratch[MOE_COMBINE] = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)
        return cls(ubatch, staging, hash_ids, topk, scratch)

    def scratch_view(self, name: str, rows: int) -> torch.Tensor | None:
        """The first `rows` rows of scratch buffer `name`; None if there is no such buffer. Never reallocates."""
        buf = self.scratch.get(name)
        if buf is None:
            return None
        if buf.shape[0] < rows:
            raise StaticBufferError(f"scratch buffer {name!r} of microbatch {self.ubatch} holds "
                                    f"{tuple(buf.shape)}; asked for {rows} rows")
        return buf[:rows]


@dataclass
class ForwardContext:
    """One microbatch forward. `batch` is this microbatch's slice (positions absolute, see StepBatch).

    `engram_rows(i)` returns the staged rows [T, C, hd] of Engram layer i (0..L_e-1), normally a view of
    `bufs.staging[i, :T]`; it may block until that gather is done. `max_query_len` / `max_seq_len` are
    optional static bounds (for graph capture); without them they are read from the batch.
    """

    batch: StepBatch
    kv: KVCache
    bufs: UbatchBuffers
    engram_rows: Callable[[int], torch.Tensor]
    tracker: OwnershipTracker | None = None
    max_query_len: int | None = None
    max_seq_len: int | None = None

    def touch(self, name: str, t: torch.Tensor) -> None:
        if self.tracker is not None:
            self.tracker.touch(name, t, self.bufs.ubatch)
