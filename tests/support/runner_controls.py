"""Test-only ModelRunner subclasses, each with one protection switched off (negative controls).

They are not options: the runner's protections have no public switch. Each must make a bit-exact
comparison fail through the real forward (wrong logits or tokens), not through a recording.
"""
from __future__ import annotations

import torch

from engram_serve.model import paged_state
from engram_serve.runner.model_runner import ModelRunner


class NoHistoryRebuild(ModelRunner):
    """A straddling row's first token in microbatch k+1 gets the history of the row's first token in
    the step: the n-grams across the cut are hashed from the wrong tokens."""

    rebuild_history = False


class StalePadding(ModelRunner):
    """Static-buffer padding is left from the previous step instead of rewritten."""

    neutral_padding = False


class SharedStaging(ModelRunner):
    """Both microbatches gather their Engram rows into one staging buffer. The gather worker runs
    ahead of the forward, so microbatch 1's rows overwrite microbatch 0's before microbatch 0 reads
    them (the forward waits for every gather first, which is the usual timing made certain)."""

    def allocate_buffers(self, capacity):
        bufs = super().allocate_buffers(capacity)
        for b in bufs[1:]:
            b.staging = bufs[0].staging
        return bufs

    def forward(self, batch, ctxs, futures):
        for f in futures:
            f.result()
        return super().forward(batch, ctxs, futures)


class SharedTopk(ModelRunner):
    """Both microbatches keep an index source's top-k in ONE buffer (the race vLLM's shared top-k
    buffer had under dual-batch overlap): the executor runs microbatch 0's index source, then microbatch
    1's, which overwrites the shared top-k before microbatch 0's consumer layers (those that reuse it)
    read it."""

    def allocate_buffers(self, capacity):
        bufs = super().allocate_buffers(capacity)
        for b in bufs[1:]:
            b.topk_idx = bufs[0].topk_idx
        return bufs


class NoRowsWait(ModelRunner):
    """An Engram layer reads its microbatch's staging buffer without waiting for the gather running on
    the worker: it reads whatever the buffer held before the rows land."""

    def _rows_fn(self, future, staging):
        return lambda i: staging[i]


def read_windows_by_position(monkeypatch) -> None:
    """Window slots computed without the block table, as if every request owned slots 0..: a request that
    does not own the first blocks reads another request's keys."""
    build = paged_state.SlotPlan.build.__func__

    def build_ignoring_tables(cls, positions, rows, block_tables, block_size, slots, zero_slot, window, ratios,
                              max_position=None):
        plan = build(cls, positions, rows, block_tables, block_size, slots, zero_slot, window, ratios, max_position)
        wpos = positions[:, None] - window + 1 + torch.arange(window)
        plan.window = torch.where(wpos >= 0, wpos, zero_slot)  # slot = position: past the row's own blocks
        return plan

    monkeypatch.setattr(paged_state.SlotPlan, "build", classmethod(build_ignoring_tables))
