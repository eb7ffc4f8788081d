"""`DSparkDrafter`: the checkpoint's DSpark drafter (model/dspark.py) behind the `Drafter` protocol.

Its context keys live in a `DSparkState` addressed by the engine's own KV slots: the key of a request's position p
sits at slot block_ids[p // block_size] * block_size + p % block_size of the target cache, so it needs no block
table of its own, and a reused prefix (prefix caching, a recompute after preemption) finds the keys of the
request that computed those blocks (a key depends on the tokens 0 .. p alone, as the target's KV does).

Rollback: `observe` writes keys only for positions computed from committed tokens (the engine never reports a
rejected draft's); a draft at position n reads the keys of n - W .. n - 1, all committed and written; a slot that
held a rejected draft's position keeps whatever it held before, is never read, and is written when that position
is committed. `release` has nothing to drop: the engine owns the blocks.

It implements spec/drafters.py's `Drafter` (whose `make_drafter` builds it, hence no import of that module here:
the annotations name its `DraftRequest` and `PickFn`). `observe` keeps what it is told (positions, slots,
features) and one `write_context` writes everything kept, in the order observed, before the next `draft` reads the
state (or once PENDING_TOKENS are kept): the state a draft reads is the one writing at once would leave (a slot
written twice, e.g. a freed block that another request then computed, holds the later write either way). One
`draft` per drafting step (every drafting request a row, each drawing its draft tokens through the engine's `pick`:
coupled drafting); the draft always has the block's k tokens, a request gets its first `num_drafts`.

Steps the planner will not draft after (`observe(..., keep=False)`) cost no context write: their observations, and
those kept before them, are dropped. Their slots are then stale (`fresh`) until observed again with keep, and a
request whose window holds a stale slot gets no draft (`ready`), so that a draft still reads only keys of its own
committed positions; it drafts again after W steps observed with keep.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..model.deepseek_v41 import DeepseekV41
from ..model.dspark import DSpark, DSparkState
from ..runner.cpu_graphs import CpuGraphs
from ..runner.draft_graphs import DraftGraphs


class _Eager:
    """DraftGraphs' two calls, run eagerly (CPU graphs off or unavailable)."""

    def __init__(self, drafter: DSpark, target: DeepseekV41):
        self.drafter, self.target = drafter, target

    def draft(self, state, last_tokens, positions, block_tables, block_size, pick=None):
        return self.drafter.draft(self.target, state, last_tokens, positions, block_tables, block_size, pick)

    def write_context(self, state, features, positions, slots) -> None:
        self.drafter.write_context(state, features, positions, slots)


def block_tables(requests: Sequence[DraftRequest]) -> np.ndarray:
    """[R, B] int64: each request's KV blocks, -1 past its own; B the most blocks of a request rounded up to a power of
    two, so that a replayed draft's shape (runner/draft_graphs.py keys its captures by it) changes rarely"""
    width = 1 << (max(len(r.block_ids) for r in requests) - 1).bit_length()
    out = np.full((len(requests), width), -1, dtype=np.int64)
    for i, r in enumerate(requests):
        out[i, :len(r.block_ids)] = r.block_ids
    return out


def picked_rows(pick: PickFn, rows: np.ndarray, n: int) -> PickFn:
    """`pick` of n requests, for a draft of its requests `rows` alone (the others' logits zero, their picks unused)."""
    index = torch.from_numpy(rows)

    def sub(j: int, z: torch.Tensor) -> torch.Tensor:
        at = index.to(z.device)
        full = z.new_zeros(n, z.shape[1])
        full[at] = z
        return pick(j, full)[at]
    sub.greedy = getattr(pick, "greedy", False)
    return sub


class DSparkDrafter:
    """Drafts with `drafter` for the target `target` served over a KV cache of num_blocks x block_size slots and
    at most max_rows running requests (the rows of one draft call). Invariant: the first `_kept` rows of the
    pending buffers (positions, slots, features) are the observations not yet written, in observation order; the
    state plus them, written in order, is the context of every committed position observed."""

    # observed tokens kept before a write without a draft: bounds the features kept (a Flash-size drafter's are
    # 48 KiB a token), and a steady batch of decodes writes the same number of rows each time (a shape its CPU
    # graph replays)
    PENDING_TOKENS = 512
    check_ready = True  # a protection a test subclass turns off (negative control): drafts read stale slots too

    def __init__(self, drafter: DSpark, target: DeepseekV41, num_blocks: int, block_size: int, max_rows: int,
                 graphs: bool = True):
        self.drafter, self.target, self.block_size = drafter, target, block_size
        # drafts and context writes replayed from CPU graphs where they can be (the same bits; runner/draft_graphs.py)
        self.run = DraftGraphs(drafter, target) if graphs and CpuGraphs.available() and \
            target.embed.weight.device.type == "cpu" else _Eager(drafter, target)
        self.feature_layers = tuple(drafter.config.dspark.dspark_target_layer_ids)
        w = target.embed.weight
        self.state = DSparkState(drafter.config, num_blocks, block_size, max_rows, dtype=w.dtype, device=w.device)
        # the last `draft` call's requests and its Draft (tokens [R, k], logits [R, k, V]): for tests and benchmarks
        self.drafted, self.last = [], None
        n, width = self.PENDING_TOKENS, len(self.feature_layers) * drafter.config.hidden_size
        self._pos = torch.empty(n, dtype=torch.int64, device=w.device)
        self._slots = torch.empty(n, dtype=torch.int64, device=w.device)
        self._feats = torch.empty(n, width, dtype=w.dtype, device=w.device)
        self._kept = 0
        self.fresh = np.zeros(self.state.num_slots, dtype=bool)  # see `_mark`

    @property
    def block(self) -> int:
        return self.drafter.block

    @property
    def window(self) -> int:
        return self.drafter.window

    def observe(self, positions: torch.Tensor, slots: torch.Tensor, features: torch.Tensor | None,
                keep: bool = True) -> None:
        """Keeps copies (the arguments may be the step's own buffers, rewritten by the next step). keep=False: drops
        these observations and the kept ones instead (their slots stale until observed again with keep); the
        features may then be None (the engine does not compute them)."""
        t = positions.shape[0]
        if not t:
            return
        if keep and (features is None or features.shape != (t, self._feats.shape[1])):
            raise ValueError(f"DSparkDrafter.observe: {t} positions, features "
                             f"{None if features is None else tuple(features.shape)}, want ({t}, "
                             f"{self._feats.shape[1]})")
        if not keep:
            if self._kept:
                self._mark(self._slots[:self._kept], False)
                self._kept = 0
            self._mark(slots, False)
            return
        self._mark(slots, True)
        if self._kept + t > self.PENDING_TOKENS:
            self.write()
        if t > self.PENDING_TOKENS:  # (a long prompt chunk: written at once)
            self._write(positions, slots, features)
            return
        k, self._kept = self._kept, self._kept + t
        self._pos[k:k + t].copy_(positions)
        self._slots[k:k + t].copy_(slots)
        self._feats[k:k + t].copy_(features)

    def _mark(self, slots: torch.Tensor, fresh: bool) -> None:
        """Whether the keys of these slots' last observations are (or will be, by the next write) in the state."""
        s = slots.cpu().numpy()
        self.fresh[s[s >= 0]] = fresh

    def ready(self, positions: np.ndarray, tables: np.ndarray) -> np.ndarray:
        """[R] bool: whether every slot that a draft at positions [R] (DSpark.draft's n) reads through the block tables
        [R, B] (-1: null) holds its position's keys (a slot before position 0 or in a null block is read as empty)."""
        w, bs = self.window, self.block_size
        wpos = positions[:, None] - w + np.arange(w)
        col = wpos // bs
        ok = (wpos >= 0) & (col < tables.shape[1])
        block = np.take_along_axis(tables, np.where(ok, col, 0), 1)
        ok &= block >= 0
        return (~ok | self.fresh[np.where(ok, block * bs + wpos % bs, 0)]).all(1)

    def write(self) -> None:
        """Write every kept observation's keys, in order, in one `write_context`."""
        k, self._kept = self._kept, 0
        if k:
            self._write(self._pos[:k], self._slots[:k], self._feats[:k])

    def _write(self, pos: torch.Tensor, slots: torch.Tensor, feats: torch.Tensor) -> None:
        ordered, order = torch.sort(slots, stable=True)  # each slot's writes together, in observation order
        earlier = order[:-1][ordered[1:] == ordered[:-1]]  # writes a later one to the same slot replaces
        if len(earlier):
            keep = torch.ones(len(slots), dtype=torch.bool, device=slots.device)
            keep[earlier] = False
            pos, slots, feats = pos[keep], slots[keep], feats[keep.to(feats.device)]
        dev = self.state.window[0].device
        with torch.no_grad():
            self.run.write_context(self.state, feats, pos.to(dev), slots.to(dev))

    def propose(self, requests: Sequence[DraftRequest], pick: PickFn) -> list[list[int]]:
        """Drafts for the requests whose windows are `ready`, nothing for the others."""
        if not requests:
            return []
        positions = np.array([len(r.token_ids) - 1 for r in requests], dtype=np.int64)
        tables = block_tables(requests)
        ready = self.ready(positions, tables) if self.check_ready else np.ones(len(requests), bool)
        self.drafted = [r for r, ok in zip(requests, ready) if ok]
        if not self.drafted:
            return [[] for _ in requests]
        if not ready.all():
            rows = np.flatnonzero(ready)
            positions, tables = positions[rows], tables[rows]
            pick = picked_rows(pick, rows, len(requests))
        self.write()
        dev = self.state.window[0].device
        last = torch.tensor([r.token_ids[-1] for r in self.drafted], dtype=torch.int64, device=dev)
        with torch.no_grad():
            # an all-greedy pick is the drafter's own greedy choice: the whole draft, chain included, replays
            self.last = self.run.draft(self.state, last, torch.from_numpy(positions).to(dev),
                                       torch.from_numpy(tables).to(dev), self.block_size,
                                       None if getattr(pick, "greedy", False) else pick)
        drafts = iter(self.last.tokens.tolist())  # tokens [R, k]
        return [next(drafts)[:r.num_drafts] if ok else [] for r, ok in zip(requests, ready)]

    def release(self, request_id: str) -> None:
        pass  # the keys live at the engine's slots (module docstring)
