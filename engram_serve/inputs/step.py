"""Build a StepBatch from a schedule, vectorised (no Python loop per request or per token)."""
from __future__ import annotations

import numpy as np
import torch

from .batch import StepBatch
from .step_state import StepState
from .token_store import TokenStore


def build_step(store: TokenStore, slots: np.ndarray, num_computed: np.ndarray, num_new: np.ndarray,
               block_tables: np.ndarray | StepState, block_size: int, history_len: int,
               sample: np.ndarray | None = None, table_width: int | None = None, on_host: bool | None = None
               ) -> StepBatch:
    """One step over rows r with `num_new[r]` tokens starting at absolute position `num_computed[r]`.

    The tokens are read from the token store (prompts and committed samples live there), so a
    decode's input is the token sampled last step without passing through Python. `sample`
    defaults to "every row" (the caller knows which rows complete their prompt).

    `block_tables` is either an explicit [R, max_blocks] array (-1 = null) or the persistent
    `StepState`, whose rows for these slots are gathered on the device, `table_width` columns wide
    (default: the blocks this step's longest row needs). The host arrays (slots, computed, new,
    sample, qsl and each token's row) travel to the device in ONE copy. With a CPU store the batch is
    computed in numpy instead (`on_host`, default: the store is on the CPU; the same values, tested).
    """
    dev = store.device
    num_new = np.asarray(num_new, dtype=np.int64)
    num_rows = len(num_new)
    qsl_host = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(num_new, out=qsl_host[1:])
    num_tokens = int(qsl_host[-1])
    computed_host = np.asarray(num_computed, dtype=np.int64)
    # one packed host array -> one copy: [slots R | computed R | seq_lens R | sample R | qsl R+1 | row T]
    host = np.empty(5 * num_rows + 1 + num_tokens, dtype=np.int64)
    r = num_rows
    host[:r] = slots
    host[r:2 * r] = computed_host
    np.add(computed_host, num_new, out=host[2 * r:3 * r])
    host[3 * r:4 * r] = 1 if sample is None else np.asarray(sample, dtype=bool)
    host[4 * r:5 * r + 1] = qsl_host
    host[5 * r + 1:] = np.repeat(np.arange(num_rows), num_new)
    if isinstance(block_tables, StepState):
        width = table_width if table_width is not None else max(1, -(-int(host[2 * r:3 * r].max(initial=1))
                                                                   // block_size))
    if dev.type == "cpu" if on_host is None else on_host:  # numpy views: ~0.25 ms a step less than the torch ops
        tables = block_tables.host_rows(host[:r], width) if isinstance(block_tables, StepState) else \
            np.asarray(block_tables, dtype=np.int64).reshape(num_rows, -1)
        return _host_batch(store, host, r, tables, block_size, history_len, qsl_host)
    if isinstance(block_tables, StepState):
        packed = block_tables.upload(host)
    else:
        packed = torch.from_numpy(host).to(dev)
    slot_t, computed, seq_lens = packed[:r], packed[r:2 * r], packed[2 * r:3 * r]
    sample_t, qsl, row = packed[3 * r:4 * r].bool(), packed[4 * r:5 * r + 1], packed[5 * r + 1:]  # row: [T]
    if isinstance(block_tables, StepState):
        tables = block_tables.rows(slot_t, width)  # [R, W] device gather, no host work per block
    else:
        tables = torch.from_numpy(np.asarray(block_tables, dtype=np.int64).reshape(num_rows, -1)).to(dev)  # [R, B]
    positions = computed[row] + torch.arange(num_tokens, device=dev) - qsl[row]  # [T] absolute
    tok_slot = slot_t[row]
    block = tables[row, positions // block_size]
    slot_mapping = torch.where(block >= 0, block * block_size + positions % block_size, torch.full_like(block, -1))
    return StepBatch(
        input_ids=store.ids[tok_slot, positions].long(),
        positions=positions,
        dead=store.dead[tok_slot, positions],
        slot_mapping=slot_mapping,
        req_slots=slot_t,
        num_computed=computed,
        seq_lens=seq_lens,
        block_tables=tables,
        sample=sample_t,
        qsl=qsl,
        history=store.history(slot_t, computed, history_len),
        qsl_host=qsl_host,
        block_size=block_size,
    )


def _host_batch(store: TokenStore, host: np.ndarray, r: int, tables: np.ndarray, block_size: int, history_len: int,
                qsl_host: np.ndarray) -> StepBatch:
    """build_step's batch for a CPU store, computed in numpy over views of its tensors (the same values)."""
    slots, computed, qsl, row = host[:r], host[r:2 * r], host[4 * r:5 * r + 1], host[5 * r + 1:]
    positions = computed[row] + np.arange(len(row)) - qsl[row]  # [T] absolute
    tok_slot = slots[row]
    block = tables[row, positions // block_size]
    ids, dead = store.ids.numpy(), store.dead.numpy()
    t = torch.from_numpy
    return StepBatch(
        input_ids=t(ids[tok_slot, positions].astype(np.int64)),
        positions=t(positions),
        dead=t(dead[tok_slot, positions]),
        slot_mapping=t(np.where(block >= 0, block * block_size + positions % block_size, -1)),
        req_slots=t(slots),
        num_computed=t(computed),
        seq_lens=t(host[2 * r:3 * r]),
        block_tables=t(tables),
        sample=t(host[3 * r:4 * r].astype(bool)),
        qsl=t(qsl),
        history=t(store.history_host(slots, computed, history_len)),
        qsl_host=qsl_host,
        block_size=block_size,
    )
