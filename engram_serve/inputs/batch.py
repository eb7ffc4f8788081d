"""The step batch: a flattened ragged batch of tokens from many requests.

Invariants (for a whole step and for every microbatch slice):
  * `qsl[0] == 0`, `qsl` non-decreasing, `qsl[-1] == num_tokens`;
  * `positions[t] == num_computed[row] + (t - qsl[row])` for t in row (positions are absolute);
  * `seq_lens[row] == num_computed[row] + (qsl[row+1] - qsl[row])`;
  * `slot_mapping[t] == block_tables[row, positions[t] // block_size] * block_size + positions[t] % block_size`;
  * `history[row, j]` is the request's token at position `positions[qsl[row]] - 1 - j`
    (-1 before position 0, -2 for a dead token);
  * `sample[row]` is True iff the logits of the row's last token in this batch are sampled.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepBatch:
    # token-indexed [T]
    input_ids: torch.Tensor  # int64 raw ids
    positions: torch.Tensor  # int64 absolute positions
    dead: torch.Tensor  # bool; dead tokens are masked (Engram gate 0) and block n-grams
    slot_mapping: torch.Tensor  # int64 KV-cache slot per token, -1 = write nowhere (padding)
    # row-indexed [R]
    req_slots: torch.Tensor  # int64 token-store slot of each row's request
    num_computed: torch.Tensor  # int64 tokens of the request computed before this batch
    seq_lens: torch.Tensor  # int64 num_computed + tokens of the row in this batch
    block_tables: torch.Tensor  # [R, max_blocks] int64, -1 = null block
    sample: torch.Tensor  # bool
    # row boundaries [R+1] and per-row history [R, D]
    qsl: torch.Tensor  # int64
    history: torch.Tensor  # int64
    qsl_host: np.ndarray  # int64 host copy of qsl: boundaries are planned on the host, no device sync
    block_size: int = 16
    # token-indexed [T, L, C] int64, filled once the hash is computed
    hash_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.qsl.shape[0] - 1

    @property
    def decode_only(self) -> bool:
        """Whether every row holds one token (a decode step), from the host boundaries."""
        q = self.qsl_host
        return bool((q[1:] - q[:-1] == 1).all())

    @property
    def logits_indices(self) -> torch.Tensor:
        """Token indices whose logits are sampled: the last token of each sampled row."""
        return (self.qsl[1:] - 1)[self.sample]

    def fields(self) -> dict:
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in dataclasses.fields(StepBatch))
