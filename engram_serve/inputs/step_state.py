"""Persistent step state on the model's device: the running requests' block tables, kept up to date
incrementally, and the one host-to-device copy of a step's row fields.

Block tables. `tables[slot]` is the block table of the request in token-store slot `slot`:
    tables[slot, i] == seq.block_ids[i]  for i < count[slot];   tables[slot, i] == -1 (null) beyond.
A request's block list only grows while it runs and is dropped whole when it leaves (finish, abort,
preemption), so the table is updated by
    - `sync(slot, block_ids)` once per scheduled row and step: appends the blocks added since the last
      sync (none for most decode steps, one per `block_size` tokens, the whole list once when a request
      joins); the appends of a step are applied together by `flush()` in one indexed write;
    - `clear(slot)` when the request leaves or is preempted: its row goes back to all -1.
So per step the work is O(rows + new blocks): never rows x blocks, never proportional to context.
`sync` checks in O(1) that the list still starts and ends where the table says (a free that was not
followed by `clear` would be caught there, not silently served from stale blocks).

Row fields. A step's per-row and per-token host arrays are packed into one int64 array and moved with
ONE copy (`upload`): pinned and non-blocking on CUDA, zero-copy on CPU. The pinned staging buffer is
reused every step: before it is rewritten, the event recorded after the previous copy is waited on
(a step ends with a host read of its sampled tokens anyway, so that wait is normally free).
"""
from __future__ import annotations

import numpy as np
import torch


class StepState:
    def __init__(self, max_slots: int, max_blocks: int, device: str | torch.device = "cpu", pack_capacity: int = 0):
        self.max_slots, self.max_blocks, self.device = max_slots, max_blocks, torch.device(device)
        self.tables = torch.full((max_slots, max_blocks), -1, dtype=torch.int64, device=self.device)  # [S, B]
        self.count = np.zeros(max_slots, dtype=np.int64)  # entries set in each row
        self._ends = [(-1, -1)] * max_slots  # (first, last) block id of each synced row, for the O(1) check
        self._pending: list[tuple[int, int, list[int]]] = []  # (slot, first column, block ids) to write
        self._pinned, self._copied = None, None
        if self.device.type == "cuda" and pack_capacity:
            self._pinned = torch.empty(pack_capacity, dtype=torch.int64, pin_memory=True)

    # ---- block tables -------------------------------------------------------------------------
    def sync(self, slot: int, block_ids: list[int]) -> None:
        """Record the blocks of `slot`'s request added since the last sync (written by `flush`)."""
        n, m = int(self.count[slot]), len(block_ids)
        if m > self.max_blocks:
            raise ValueError(f"slot {slot}: {m} blocks > max_blocks={self.max_blocks}")
        if n and (m < n or block_ids[0] != self._ends[slot][0] or block_ids[n - 1] != self._ends[slot][1]):
            raise RuntimeError(f"slot {slot}: block list {block_ids[:3]}... ({m} blocks) no longer extends the "
                               f"synced table ({n} blocks, first/last {self._ends[slot]}): a free was not cleared")
        if m > n:
            self._pending.append((slot, n, block_ids[n:]))
            self.count[slot] = m
            self._ends[slot] = (block_ids[0], block_ids[m - 1])

    def clear(self, slot: int) -> None:
        """The request in `slot` left or was preempted: its row becomes null (-1) again."""
        self.flush()
        n = int(self.count[slot])
        if n:
            self.tables[slot, :n] = -1
        self.count[slot] = 0
        self._ends[slot] = (-1, -1)

    def flush(self) -> None:
        """Write every pending append with one indexed write (one host-to-device copy of the updates)."""
        if not self._pending:
            return
        sizes = [len(ids) for _, _, ids in self._pending]
        upd = np.empty((3, sum(sizes)), dtype=np.int64)  # rows: slot, column, block id
        upd[0] = np.repeat([s for s, _, _ in self._pending], sizes)
        starts = np.repeat([c for _, c, _ in self._pending], sizes)
        upd[1] = starts + np.arange(upd.shape[1]) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        upd[2] = np.concatenate([ids for _, _, ids in self._pending])
        self._pending.clear()
        u = self._to_device(upd.reshape(-1)).view(3, -1)
        self.tables[u[0], u[1]] = u[2]

    def rows(self, slots: torch.Tensor, width: int) -> torch.Tensor:
        """[R, width] block tables of the step's rows (slots [R] on the device): one device gather."""
        self.flush()
        return self.tables[:, :width].index_select(0, slots)

    def host_rows(self, slots: np.ndarray, width: int) -> np.ndarray:
        """`rows` for a CPU state, in numpy: [R, width] copies of the rows of host slots [R]."""
        self.flush()
        return self.tables.numpy()[slots, :width]

    # ---- the step's one copy ------------------------------------------------------------------
    def _to_device(self, host: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(host)
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)

    def upload(self, host: np.ndarray) -> torch.Tensor:
        """One int64 host array -> the device: zero-copy on CPU, one pinned non-blocking copy on CUDA."""
        t = torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64))
        if self.device.type == "cpu":
            return t
        if self._pinned is not None and t.numel() <= self._pinned.numel():
            if self._copied is not None:
                self._copied.synchronize()  # the previous copy has read the staging buffer (normally long done)
            staged = self._pinned[: t.numel()]
            staged.copy_(t)
            out = staged.to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
            return out
        return t.pin_memory().to(self.device, non_blocking=True)  # a fresh pinned tensor (updates, big steps)

    def check(self, slot: int, block_ids: list[int]) -> None:
        """Raise AssertionError unless the device row of `slot` is exactly `block_ids` then nulls (tests)."""
        self.flush()
        row = self.tables[slot].cpu().tolist()
        want = list(block_ids) + [-1] * (self.max_blocks - len(block_ids))
        if row != want:
            raise AssertionError(f"slot {slot}: table row {row[:8]}... != block ids {want[:8]}...")
