"""Static (graph) input buffers, docs/contract.md §6.

One `StaticInputs` per (microbatch, padded size). Each step refreshes it in place: data pointers
never change. Padding is neutral and rewritten every step, so nothing from a previous step is
visible through it: history -1, slot mapping -1, positions 0, dead True, block-table rows -1 (null),
empty rows (qsl repeats the real token count), no sampling.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import StaticBufferError
from .batch import StepBatch

# field -> (fill value for padding, indexed by "token" or "row")
PADDING = {
    "input_ids": (0, "token"), "positions": (0, "token"), "dead": (True, "token"), "slot_mapping": (-1, "token"),
    "hash_ids": (0, "token"),
    "req_slots": (-1, "row"), "num_computed": (0, "row"), "seq_lens": (0, "row"), "block_tables": (-1, "row"),
    "sample": (False, "row"), "history": (-1, "row"),
}


def pad_tokens(batch: StepBatch, size: int) -> StepBatch:
    """`batch` with neutral padding tokens appended up to `size` tokens (eager mode: fresh tensors, rows
    untouched). A padding token belongs to no row (qsl ends at the real count), writes no KV, is dead
    and is sampled nowhere, as in `StaticInputs`."""
    n = size - batch.num_tokens
    if n <= 0:
        return batch
    return dataclasses.replace(batch, **{name: F.pad(getattr(batch, name), (0, n), value=fill)
                                         for name, (fill, kind) in PADDING.items()
                                         if kind == "token" and getattr(batch, name) is not None})


class StaticInputs:
    """Persistent buffers for one microbatch at one padded size (rows are padded to `size` too)."""

    def __init__(self, microbatch: int, size: int, like: StepBatch):
        self.microbatch, self.size = microbatch, size
        self.buffers: dict[str, torch.Tensor] = {}
        for name, (fill, _) in PADDING.items():
            ref = getattr(like, name)
            if ref is not None:
                self.buffers[name] = torch.full((size, *ref.shape[1:]), fill, dtype=ref.dtype, device=ref.device)
        self.qsl = torch.zeros(size + 1, dtype=like.qsl.dtype, device=like.qsl.device)

    def _check(self, name: str, buf: torch.Tensor, value: torch.Tensor) -> None:
        if value.dtype != buf.dtype or value.shape[1:] != buf.shape[1:] or value.shape[0] > buf.shape[0]:
            raise StaticBufferError(
                f"static buffer {name!r} of microbatch {self.microbatch} (padded size {self.size}) holds "
                f"{tuple(buf.shape)} {buf.dtype}; asked for {tuple(value.shape)} {value.dtype}")

    def refresh(self, batch: StepBatch, pad: bool = True) -> StepBatch:
        """Copy `batch` into the buffers in place, pad neutrally, and return a StepBatch viewing them.

        `pad=False` leaves padding stale; it exists only as the negative control of the padding tests."""
        if batch.num_tokens > self.size:
            raise StaticBufferError(f"static buffer 'input_ids' of microbatch {self.microbatch} has padded size "
                                    f"{self.size}; the microbatch has {batch.num_tokens} tokens")
        out = {}
        for name, (fill, kind) in PADDING.items():
            value, buf = getattr(batch, name), self.buffers.get(name)
            if value is None or buf is None:
                if (value is None) != (buf is None):
                    raise StaticBufferError(f"static buffer {name!r} of microbatch {self.microbatch}: "
                                            f"present in {'batch' if buf is None else 'buffers'} only")
                out[name] = None
                continue
            self._check(name, buf, value)
            n = value.shape[0]
            buf[:n].copy_(value)
            if pad:
                buf[n:].fill_(fill)
            out[name] = buf
        rows = batch.num_rows
        self._check("qsl", self.qsl, batch.qsl)
        self.qsl[: rows + 1].copy_(batch.qsl)
        if pad:
            self.qsl[rows + 1:].fill_(batch.num_tokens)
        qsl_host = np.full(self.size + 1, batch.num_tokens, dtype=np.int64)
        qsl_host[: rows + 1] = batch.qsl_host
        return StepBatch(qsl=self.qsl, qsl_host=qsl_host, block_size=batch.block_size, **out)

    def data_ptrs(self) -> dict[str, int]:
        return {name: b.data_ptr() for name, b in {**self.buffers, "qsl": self.qsl}.items()}


class StaticInputPool:
    """`StaticInputs` keyed by (microbatch, padded size), created once and reused for every step."""

    def __init__(self, sizes: list[int]):
        self.sizes = sorted(sizes)
        self._pool: dict[tuple[int, int], StaticInputs] = {}

    def padded_size(self, num_tokens: int) -> int:
        for s in self.sizes:
            if s >= num_tokens:
                return s
        raise StaticBufferError(f"no padded size holds {num_tokens} tokens (sizes: {self.sizes})")

    def part_sizes(self, bounds: list[int]) -> list[int]:
        """Padded size of each microbatch of a step cut at `bounds` (graph buckets, docs/contract.md §6).

        The step is padded to its bucket B (the smallest configured size holding it) and cut into n
        fixed parts: microbatch k is padded to ceil(B / n), or, where its cut left it larger than
        that (request-boundary cuts), to the smallest configured part that holds it. Every padded
        size is one of {ceil(s / n)} | {s} over the configured sizes s, so the (microbatch, padded
        size) keys - buffer sets here - are bounded by n * 2 * len(sizes),
        whatever the steps' sizes."""
        n = len(bounds) - 1
        base = -(-self.padded_size(bounds[-1]) // n)
        parts = sorted({-(-s // n) for s in self.sizes} | set(self.sizes))
        out = []
        for a, b in zip(bounds, bounds[1:]):
            need = max(b - a, base)
            fit = [p for p in parts if p >= need]
            if not fit:
                raise StaticBufferError(f"no padded size holds a microbatch of {b - a} tokens (sizes: {self.sizes})")
            out.append(fit[0])
        return out

    def get(self, microbatch: int, size: int, like: StepBatch) -> StaticInputs:
        key = (microbatch, size)
        if key not in self._pool:
            self._pool[key] = StaticInputs(microbatch, size, like)
        return self._pool[key]
