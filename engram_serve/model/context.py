"""What one microbatch forward gets, passed explicitly: its batch, the KV cache, and its own buffers.

The buffers are a `MicrobatchBuffers` (microbatch/buffers.py): each belongs to exactly one microbatch
(docs/contract.md §5). `ForwardContext.touch` reports each use to the debug `OwnershipTracker`, which raises on a
buffer seen from two microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..microbatch.buffers import MicrobatchBuffers

if TYPE_CHECKING:  # annotations only: keeps model/ importable from runner/ without a cycle
    from ..inputs.batch import StepBatch
    from ..runner.ownership import OwnershipTracker
    from .paged_state import PagedState


@dataclass
class ForwardContext:
    """One microbatch forward. `batch` is this microbatch's slice (positions absolute, see StepBatch).

    `engram_rows(i)` returns the staged rows [T, C, hd] of Engram layer i (0..L_e-1), normally a view of
    `bufs.staging[i, :T]`; it may block until that gather is done. `max_query_len` / `max_seq_len` are
    optional static bounds (for graph capture); without them they are read from the batch. `keep`: the
    token indices whose final hidden the forward returns (increasing; None: every token). `capture_features`:
    the forward also writes the DSpark drafter's features of every token into the field `features` (for
    model/dspark.py).
    """

    batch: StepBatch
    kv: PagedState
    bufs: MicrobatchBuffers
    engram_rows: Callable[[int], torch.Tensor]
    tracker: OwnershipTracker | None = None
    max_query_len: int | None = None
    max_seq_len: int | None = None
    keep: torch.Tensor | None = None
    capture_features: bool = False
    features: torch.Tensor | None = None  # [T, nL D], written by the forward when capture_features

    def touch(self, name: str, t: torch.Tensor) -> None:
        if self.tracker is not None:
            self.tracker.touch(name, t, self.bufs.microbatch)
