"""Continuous batching with chunked prefill, prefix caching and preemption by recompute (torch-free).

One `schedule()` call picks the work of one engine step; `update()` records that the step ran.
The caller owns sampling: it appends each sampled row's token with `seq.append_token` and
decides when a request stops (`finish`), between `update()` and the next `schedule()`.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from ..errors import InvalidRequest, QueueFull
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

MAX_WAITING = 4096  # default SchedulerConfig.max_waiting


@dataclass(frozen=True)
class SchedulerConfig:
    """Validated scheduler limits; a bad value raises ValueError naming the field.

    Cross-field rules, each of which would otherwise let a request wait forever:
    - `num_blocks * block_size >= max_model_len`: one request of maximal length fits alone;
    - `max_num_batched_tokens >= max_num_seqs`: every running decode fits into every step;
    - without chunked prefill, `max_num_batched_tokens >= max_model_len`: a whole (re)prefill fits.

    `max_waiting` bounds the waiting queue (the engine's only one): `add` refuses a new request
    with QueueFull while that many wait; None = no bound. Preempted requests go back regardless.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    block_size: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_waiting: int | None = MAX_WAITING

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "max_model_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SchedulerConfig field {name}={v!r}: must be an int >= 1")
        for name in ("enable_chunked_prefill", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SchedulerConfig field {name}={getattr(self, name)!r}: must be a bool")
        w = self.max_waiting
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"SchedulerConfig field max_waiting={w!r}: must be None or an int >= 1")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"SchedulerConfig field num_blocks={self.num_blocks}: num_blocks * block_size "
                             f"({self.num_blocks * self.block_size}) < max_model_len={self.max_model_len}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"SchedulerConfig field max_num_batched_tokens={self.max_num_batched_tokens}: "
                             f"must be >= max_num_seqs={self.max_num_seqs}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"SchedulerConfig field max_num_batched_tokens={self.max_num_batched_tokens}: "
                             f"must be >= max_model_len={self.max_model_len} when enable_chunked_prefill=False")


@dataclass(frozen=True)
class ScheduledRow:
    """One sequence's tokens in a step: absolute positions `num_computed .. num_computed+num_new-1`.

    `num_draft` > 0 (a verify row): the row is the sequence's last token followed by its `num_draft` drafts
    (`seq.draft_ids`), at positions `seq.num_tokens .. seq.num_tokens + num_draft - 1`.

    Invariants: `num_new >= 1`; `num_computed + num_new <= seq.num_tokens + num_draft`;
    `len(seq.block_ids) * block_size >= num_computed + num_new`; `num_draft > 0` only when `num_new ==
    num_draft + 1` and `num_computed + 1 == seq.num_tokens`.
    """

    seq: Sequence
    num_computed: int
    num_new: int
    num_draft: int = 0

    @property
    def sample(self) -> bool:
        """True iff this row reaches the sequence's last token (prompt complete, or a decode)."""
        return self.num_computed + self.num_new == self.seq.num_tokens + self.num_draft


@dataclass
class SchedulerOutput:
    """The work of one step: decodes first, then prefill chunks. Each sequence appears at most once.

    `preempted`: sequences that lost their blocks this step (back in the waiting queue, never in
    `rows`); `finished`: sequences the scheduler ended with finish_reason "length" because their
    next token would sit at a position >= max_model_len.
    """

    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new for r in self.rows)

    def block_table_array(self, max_blocks: int) -> list[list[int]]:
        """Per row, its block ids padded with -1 to `max_blocks`. Call before `update`/`finish`.

        O(rows x max_blocks): for tests and inspection. The engine never builds this; it keeps the
        persistent device tables of `inputs/step_state.py` up to date incrementally instead."""
        out = []
        for r in self.rows:
            ids = r.seq.block_ids
            if len(ids) > max_blocks:
                raise ValueError(f"block_table_array: {r.seq.request_id!r} holds {len(ids)} blocks > "
                                 f"max_blocks={max_blocks}")
            out.append(ids + [-1] * (max_blocks - len(ids)))
        return out


class Scheduler:
    """FCFS continuous batching.

    Invariants (`check_invariants`): `running` is sorted by arrival and holds RUNNING sequences
    whose blocks cover their computed tokens; `waiting` holds WAITING sequences with no blocks
    and nothing computed; the two are disjoint; `len(running) <= max_num_seqs`; the block
    manager's holders are exactly the running sequences that hold blocks.
    """

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival
        self._live: dict[str, Sequence] = {}  # request_id -> waiting or running sequence
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new request; refuse it (InvalidRequest, QueueFull) before it can touch the batch."""
        n, cfg = seq.num_prompt_tokens, self.config
        if n == 0:
            raise InvalidRequest(f"request {seq.request_id!r}: prompt is empty (num_prompt_tokens=0)", "prompt")
        if n > cfg.max_model_len:
            raise InvalidRequest(f"request {seq.request_id!r}: num_prompt_tokens={n} > "
                                 f"max_model_len={cfg.max_model_len}", "prompt")
        if seq.num_tokens != n or seq.status is not SequenceStatus.WAITING or seq.block_ids or seq.num_computed_tokens:
            raise InvalidRequest(f"request {seq.request_id!r}: not a fresh sequence ({seq!r})")
        if seq.request_id in self._live:
            raise InvalidRequest(f"request_id={seq.request_id!r} is already in use by a live request", "request_id")
        if cfg.max_waiting is not None and len(self.waiting) >= cfg.max_waiting:
            raise QueueFull(f"request {seq.request_id!r}: {len(self.waiting)} requests are waiting, "
                            f"max_waiting={cfg.max_waiting}; retry later")
        self._live[seq.request_id] = seq
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (stop, length, abort, error): free its blocks and drop it from the queues."""
        if seq.is_finished:
            return
        if self._live.get(seq.request_id) is not seq:
            raise ValueError(f"finish: {seq.request_id!r} is not a request of this scheduler")
        del self._live[seq.request_id]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def abort(self, request_id: str) -> bool:
        """Finish with reason "abort"; False (and nothing done) for an unknown or finished id."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        self.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.block_manager
        out = SchedulerOutput()
        # a waiting sequence never grew since it last ran (when this check saw it): running ones suffice
        for seq in [s for s in self.running if s.num_tokens > cfg.max_model_len]:
            self.finish(seq, "length")  # its next position would be >= max_model_len
            out.finished.append(seq)
        budget, scheduled = cfg.max_num_batched_tokens, set()

        def add_row(seq: Sequence, n: int, drafts: int = 0) -> None:
            nonlocal budget
            out.rows.append(ScheduledRow(seq, seq.num_computed_tokens, n + drafts, drafts))
            scheduled.add(id(seq))
            budget -= n + drafts

        # drafts (speculative decoding) take only the budget that every running decode's own token leaves
        spare = budget - sum(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        # 1. running decodes, then 2. running partial prefills; both may preempt for a block.
        for decode in (True, False):
            for seq in list(self.running):
                if seq.status is not SequenceStatus.RUNNING or id(seq) in scheduled:
                    continue  # preempted earlier in this step
                remaining = seq.num_tokens - seq.num_computed_tokens
                if remaining == 0 or (remaining == 1) != decode:
                    continue  # remaining == 0: the caller has not appended the sampled token yet
                if budget == 0:
                    break
                n = min(remaining, budget)
                if len(seq.block_ids) * cfg.block_size < seq.num_computed_tokens + n:
                    n = self._fit_or_preempt(seq, n, scheduled, out)
                    if not n:
                        continue
                    bm.allocate(seq, seq.num_computed_tokens + n)
                drafts = 0
                if decode and seq.draft_ids:  # lookahead slots: never preempts anyone, trimmed to what is free
                    end = seq.num_computed_tokens + n
                    drafts = max(0, min(len(seq.draft_ids), spare, budget - n, cfg.max_model_len - end,
                                        bm.capacity(seq) - end))
                    if drafts:
                        bm.allocate(seq, end + drafts)
                    spare -= drafts
                seq.draft_ids = seq.draft_ids[:drafts]
                add_row(seq, n, drafts)
        # 3. waiting sequences, FCFS; none after a preemption (that would undo it).
        while self.waiting and not out.preempted and budget and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            prefix = bm.match_prefix(seq.token_ids, seq.dead) if seq.reuse_prefix else []
            prefix = prefix[:(seq.num_tokens - 1) // cfg.block_size]  # leave >= 1 token to compute
            computed = len(prefix) * cfg.block_size
            n = self._chunk(seq.num_tokens - computed, budget, bm.capacity(seq, prefix) - computed)
            if n == 0:
                break  # strict FCFS: later requests do not overtake the head
            self.waiting.popleft()
            bm.allocate(seq, computed + n, prefix)
            seq.num_computed_tokens, seq.status = computed, SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            add_row(seq, n)
        return out

    def _chunk(self, remaining: int, budget: int, room: int) -> int:
        """Tokens of a prefill to run now: all of `remaining`, or (chunked) as many as fit, or 0."""
        n = min(remaining, budget, room)
        if n < remaining and not self.config.enable_chunked_prefill:
            return 0
        return max(n, 0)

    def _fit_or_preempt(self, seq: Sequence, want: int, scheduled: set[int], out: SchedulerOutput) -> int:
        """Tokens of running `seq` to run now (<= want), preempting the latest arrivals if no block is free.

        Returns 0 if `seq` itself was preempted. Only unscheduled sequences are victims.
        """
        bm, start = self.block_manager, seq.num_computed_tokens
        while True:
            n = self._chunk(want, want, bm.capacity(seq) - start)
            if n:
                return n
            victim = max((s for s in self.running if id(s) not in scheduled), key=lambda s: s.arrival)
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop all blocks, back to the FRONT of the waiting queue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens, seq.status, seq.draft_ids = 0, SequenceStatus.WAITING, []
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def update(self, output: SchedulerOutput) -> None:
        """Record that `output`'s step ran: advance computed counts, register newly full blocks.

        Rows of sequences finished or aborted since `schedule()` are skipped. A verify row advances by its
        committed token alone: its drafts count as computed only once accepted (`accept`).
        """
        for r in output.rows:
            seq = r.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_computed_tokens != r.num_computed:
                raise ValueError(f"update: {seq.request_id!r} has num_computed_tokens={seq.num_computed_tokens}, "
                                 f"the row was scheduled at num_computed={r.num_computed} (stale output?)")
            seq.num_computed_tokens += r.num_new - r.num_draft
            self.block_manager.register_full_blocks(seq)

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """After a verify step whose tokens are committed: its first `num_accepted` drafts were computed from
        committed tokens, so their positions count as computed (and their full blocks may be cached). The
        positions past them held rejected drafts: they stay uncomputed, and the next step overwrites them."""
        if seq.status is not SequenceStatus.RUNNING or not num_accepted:
            return
        if seq.num_computed_tokens + num_accepted >= seq.num_tokens:
            raise ValueError(f"accept: {seq.request_id!r} would count {seq.num_computed_tokens} + {num_accepted} "
                             f"positions computed of its {seq.num_tokens} tokens (its last token is not computed)")
        seq.num_computed_tokens += num_accepted
        self.block_manager.register_full_blocks(seq)

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant (see the class docstring)."""
        bm, bs = self.block_manager, self.config.block_size
        bm.check_invariants()
        if [s.arrival for s in self.running] != sorted(s.arrival for s in self.running):
            raise AssertionError("running is not sorted by arrival")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs={self.config.max_num_seqs}")
        for s in self.running:
            if s.status is not SequenceStatus.RUNNING or len(s.block_ids) * bs < s.num_computed_tokens:
                raise AssertionError(f"bad running sequence {s!r}")
            if not 0 <= s.num_computed_tokens <= s.num_tokens:
                raise AssertionError(f"{s!r}: num_computed_tokens out of [0, num_tokens]")
        for s in self.waiting:
            if s.status is not SequenceStatus.WAITING or s.block_ids or s.num_computed_tokens:
                raise AssertionError(f"bad waiting sequence {s!r}")
        queued = {id(s) for s in self.running} | {id(s) for s in self.waiting}
        if len(queued) != len(self.running) + len(self.waiting) or queued != {id(s) for s in self._live.values()}:
            raise AssertionError("running and waiting are not a partition of the live requests")
        holders = {id(s) for s in self.running if s.block_ids}
        if set(bm._holders) != holders:
            raise AssertionError("block holders are not exactly the running sequences with blocks")
