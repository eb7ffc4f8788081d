"""The inputs of a decode step on the CPU, written in place: the StepBatch that `build_step` makes for a step in
which every row computes one token and samples it, and the one `pad_tokens` makes of it, with the same values.

A decode step is most of a generation's steps, and at small batches its host work is most of its time.
`build_step` makes a fresh batch for any schedule (ragged rows, chunks, microbatch cuts); this fills
persistent buffers sized once for `max_rows` rows, in one call of the `decode` kernel (inputs/_decode_kernel.c;
without it, `build_step`'s batch is copied in); every field keeps its address from one step to the next.
Padding tokens (up to `pad_to`) are neutral, as `pad_tokens` makes them: id 0, position 0, dead, no KV slot,
in no row.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import kernels
from .batch import StepBatch
from .step import build_step
from .step_state import StepState
from .token_store import TokenStore

_OUTPUTS = ("input_ids", "positions", "dead", "slot_mapping", "seq_lens", "history")  # the kernel's order
# the decode kernel's buffer fields -> the arrays of DecodeInputs they address
_KERNEL_BUFFERS = {"slots": "req_slots", "positions": "num_computed", "input_ids": "input_ids",
                   "out_positions": "positions", "out_dead": "dead", "slot_mapping": "slot_mapping",
                   "seq_lens": "seq_lens", "history": "history"}


class DecodeInputs:
    neutral_padding = True  # a protection a test subclass turns off (negative control): padding left as it was

    def __init__(self, max_rows: int, pad_to: int, block_size: int, history_len: int, max_blocks: int):
        cap = max(max_rows, pad_to)
        self.max_rows, self.pad_to, self.block_size, self.history_len = max_rows, pad_to, block_size, history_len
        self.max_blocks = max_blocks
        z = np.zeros
        self.input_ids, self.positions = z(cap, np.int64), z(cap, np.int64)
        self.slot_mapping, self.dead = np.full(cap, -1, dtype=np.int64), np.ones(cap, bool)  # padding until written
        self.req_slots, self.num_computed, self.seq_lens = z(max_rows, np.int64), z(max_rows, np.int64), \
            z(max_rows, np.int64)
        self.sample = np.ones(max_rows, bool)
        self.qsl = np.arange(max_rows + 1, dtype=np.int64)  # one token a row
        self.history = z((max_rows, history_len), np.int64)
        self._tables = torch.empty(max_rows * max_blocks, dtype=torch.int64)  # a batch's block tables
        self._wide = torch.empty((max_rows + 1) * max_blocks, dtype=torch.int64)  # plan_rows' tables
        self._batches: dict[int, tuple[StepBatch, StepBatch, torch.Tensor]] = {}  # by row count: views, rows
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}  # of the tables
        self._addresses = {field: getattr(self, name).ctypes.data for field, name in _KERNEL_BUFFERS.items()}
        self.last: StepBatch | None = None  # the batch of the last fill (valid until the next one)
        self.padded: StepBatch | None = None  # the same, with the padding tokens (`pad_tokens` to pad_to)
        self.planned: tuple[torch.Tensor, torch.Tensor] | None = None  # its `plan_rows` for the last fill's bound
        self.bound: int | None = None

    def fill(self, store: TokenStore, state: StepState, slots: np.ndarray, positions: np.ndarray,
             bound: int | None = None) -> StepBatch:
        """The batch of rows in token-store `slots` computing the token at `positions` (one each, sampled). With
        a static `bound` on the positions, also `planned`: what `plan_rows` gives for it (model/deepseek_v41.py)."""
        r = len(slots)
        if r > self.max_rows:
            raise ValueError(f"DecodeInputs.fill: {r} rows > max_rows={self.max_rows}")
        n, bs = max(r, self.pad_to), self.block_size
        self.req_slots[:r], self.num_computed[:r] = slots, positions
        width = -(-(int(positions.max(initial=0)) + 1) // bs)  # the blocks the longest row needs
        wide_width = 0 if bound is None else max(width, -(-bound // bs))
        if max(width, wide_width) > self.max_blocks:
            raise ValueError(f"DecodeInputs.fill: {max(width, wide_width)} blocks > max_blocks={self.max_blocks}")
        tables, wide = self._table_views(r, width, wide_width)
        state.flush()
        kernel = kernels.get("decode")
        if kernel is not None:
            kernel.decode_inputs(ids=store.ids.data_ptr(), dead=store.dead.data_ptr(),
                                 num_slots=min(store.max_slots, state.max_slots), max_len=store.max_len,
                                 tables=state.tables.data_ptr(), max_blocks=state.max_blocks, r=r, n=n, block_size=bs,
                                 width=width, wide_width=wide_width, history_len=self.history_len,
                                 neutral=self.neutral_padding, block_tables=tables.data_ptr(),
                                 wide=0 if wide is None else wide.data_ptr(), **self._addresses)
        else:
            self._fill_numpy(store, state, slots, positions, r, n, tables.numpy(),
                             None if wide is None else wide.numpy())
        batch, padded, rows = self._batches.get(r, (None, None, None))
        if batch is None:
            t = {name: torch.from_numpy(getattr(self, name)) for name in (
                "input_ids", "positions", "slot_mapping", "dead", "req_slots", "num_computed", "seq_lens", "sample",
                "qsl", "history")}
            batch = StepBatch(
                input_ids=t["input_ids"][:r], positions=t["positions"][:r], dead=t["dead"][:r],
                slot_mapping=t["slot_mapping"][:r], req_slots=t["req_slots"][:r], num_computed=t["num_computed"][:r],
                seq_lens=t["seq_lens"][:r], block_tables=tables, sample=t["sample"][:r], qsl=t["qsl"][:r + 1],
                history=t["history"][:r], qsl_host=self.qsl[:r + 1], block_size=bs)
            padded = batch if n == r else dataclasses.replace(
                batch, input_ids=t["input_ids"][:n], positions=t["positions"][:n], dead=t["dead"][:n],
                slot_mapping=t["slot_mapping"][:n])
            rows = torch.from_numpy(np.minimum(np.arange(n), r))  # a token's row; padding in the null row r
            self._batches[r] = batch, padded, rows
        batch.block_tables = padded.block_tables = tables
        batch.hash_ids = padded.hash_ids = None
        self.last, self.padded, self.bound = batch, padded, bound
        self.planned = None if wide is None else (rows, wide)
        return batch

    def _table_views(self, r: int, width: int, wide_width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[r, width] and [r + 1, wide_width] (None for 0) contiguous views of the table buffers."""
        key = (r, width, wide_width)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 4096:  # (r, width) pairs a long decode passes through: bounded
                self._views.clear()
            wide = self._wide[:(r + 1) * wide_width].view(r + 1, wide_width) if wide_width else None
            views = self._views[key] = self._tables[:r * width].view(r, width), wide
        return views

    def _fill_numpy(self, store: TokenStore, state: StepState, slots: np.ndarray, positions: np.ndarray, r: int,
                    n: int, tables: np.ndarray, wide: np.ndarray | None) -> None:
        """The decode kernel's writes, copied from `build_step`'s batch (a build without the kernel)."""
        one = np.ones(r, dtype=np.int64)
        b = build_step(store, slots, positions, one, state, self.block_size, self.history_len, one.astype(bool),
                       table_width=tables.shape[1])
        for name in _OUTPUTS:
            getattr(self, name)[:r] = getattr(b, name).numpy()
        tables[:] = b.block_tables.numpy()
        if self.neutral_padding and n > r:
            self.positions[r:n], self.input_ids[r:n], self.dead[r:n], self.slot_mapping[r:n] = 0, 0, True, -1
        if wide is not None:
            wide.fill(-1)
            wide[:r, :tables.shape[1]] = tables
