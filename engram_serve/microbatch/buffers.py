"""Per-microbatch buffers: everything a forward writes and reads back later in that forward (docs/contract.md §5).

Invariant: every tensor in a `MicrobatchBuffers` belongs to exactly one microbatch; two microbatches of
a step never share one. `ForwardContext.touch` (model/context.py) reports each use to the debug
`OwnershipTracker`, which raises on a buffer seen from two microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..errors import StaticBufferError


@dataclass
class MicrobatchBuffers:
    """Persistent buffers of microbatch `microbatch`, sized for at most `T_cap` tokens.

    staging [L_e, T_cap, C, engram_head_dim]: staged Engram rows, C = (N-1)*H;
    hash_ids [T_cap, L_e, C] int64: the microbatch's Engram hash ids (the staging gather reads them);
    topk_idx [T_cap, index_topk] int64: the entries an index source chose, read by the layers that reuse
    its top-k (-1 = none);
    candidates [T_cap, candidate_topk_blocks] int64: the candidate source's blocks, read by later index
    sources (-1 = none);
    scratch: named 1-D buffers a runner adds (tensor parallelism: the communication buffers).
    """

    microbatch: int
    staging: torch.Tensor
    hash_ids: torch.Tensor | None = None
    topk_idx: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    scratch: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def capacity(self) -> int:
        return self.staging.shape[1]

    @classmethod
    def allocate(cls, cfg: ModelConfig, microbatch: int, max_tokens: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> "MicrobatchBuffers":
        e = cfg.engram
        staging = torch.zeros(e.num_layers, max_tokens, e.num_columns, e.engram_head_dim, dtype=dtype, device=device)
        hash_ids = torch.zeros(max_tokens, e.num_layers, e.num_columns, dtype=torch.int64, device=device)
        topk = torch.full((max_tokens, cfg.index_topk), -1, dtype=torch.int64, device=device)
        cands = torch.full((max_tokens, cfg.candidate_topk_blocks), -1, dtype=torch.int64, device=device)
        return cls(microbatch, staging, hash_ids, topk, cands)

    def scratch_view(self, name: str, rows: int) -> torch.Tensor | None:
        """The first `rows` rows of scratch buffer `name`; None if there is no such buffer. Never reallocates."""
        buf = self.scratch.get(name)
        if buf is None:
            return None
        if buf.shape[0] < rows:
            raise StaticBufferError(f"scratch buffer {name!r} of microbatch {self.microbatch} holds "
                                    f"{tuple(buf.shape)}; asked for {rows} rows")
        return buf[:rows]
