"""Build a StepBatch from a schedule, vectorised (no Python loop per request or per token)."""
from __future__ import annotations

import numpy as np
import torch

from .batch import StepBatch
from .token_store import TokenStore


def build_step(store: TokenStore, slots: np.ndarray, num_computed: np.ndarray, num_new: np.ndarray,
               block_tables: np.ndarray, block_size: int, history_len: int,
               sample: np.ndarray | None = None) -> StepBatch:
    """One step over rows r with `num_new[r]` tokens starting at absolute position `num_computed[r]`.

    The tokens are read from the token store (prompts and committed samples live there), so a
    decode's input is the token sampled last step without passing through Python. `block_tables`
    is [R, max_blocks] (-1 = null). `sample` defaults to "every row" (the caller knows which rows
    complete their prompt).
    """
    dev = store.device
    num_new = np.asarray(num_new, dtype=np.int64)
    qsl_host = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int64)
    num_rows, num_tokens = len(num_new), int(qsl_host[-1])
    row = torch.from_numpy(np.repeat(np.arange(num_rows), num_new)).to(dev)  # [T]
    qsl = torch.from_numpy(qsl_host).to(dev)
    computed = torch.from_numpy(np.asarray(num_computed, dtype=np.int64)).to(dev)  # [R]
    slot_t = torch.from_numpy(np.asarray(slots, dtype=np.int64)).to(dev)  # [R]
    tables = torch.from_numpy(np.asarray(block_tables, dtype=np.int64).reshape(num_rows, -1)).to(dev)  # [R, B]
    positions = computed[row] + torch.arange(num_tokens, device=dev) - qsl[row]  # [T] absolute
    tok_slot = slot_t[row]
    block = tables[row, positions // block_size]
    slot_mapping = torch.where(block >= 0, block * block_size + positions % block_size, torch.full_like(block, -1))
    sample_t = torch.ones(num_rows, dtype=torch.bool) if sample is None else torch.from_numpy(np.asarray(sample, bool))
    return StepBatch(
        input_ids=store.ids[tok_slot, positions].long(),
        positions=positions,
        dead=store.dead[tok_slot, positions],
        slot_mapping=slot_mapping,
        req_slots=slot_t,
        num_computed=computed,
        seq_lens=computed + torch.from_numpy(num_new).to(dev),
        block_tables=tables,
        sample=sample_t.to(dev),
        qsl=qsl,
        history=store.history(slot_t, computed, history_len),
        qsl_host=qsl_host,
        block_size=block_size,
    )
