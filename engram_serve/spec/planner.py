"""When drafting pays: how many drafts each decoding request gets in a step (0: it decodes plainly).

A verify row of 1 + k tokens costs more than a decode of one, and pays only by the drafts it keeps. The
planner turns speculation off for a whole step when more decodes run than `disable_by_batch_size` (a large
batch already fills the step's matmuls) or, with `when="pays"`, when decode steps of this batch size
measured more time per emitted token with drafts than without (as the microbatch planner weighs cuts: both
forms are warmed up, then the faster one is taken, the other once in EXPLORE_EVERY decisions); and for one
request whose measured acceptance fell below `min_acceptance` (it probes again every PROBE_EVERY of its
steps). None of this changes a token: only how many a step gives. The class attributes are tuning constants,
not protections.
"""
from __future__ import annotations

from .config import SpeculativeConfig


class SpecPlanner:
    WARMUP = 4  # proposals of a request before its acceptance is trusted; measured steps of each form per size
    PROBE_EVERY = 8  # a request whose acceptance is too low drafts again once in this many steps
    DECAY = 0.7  # weight of the past in a running acceptance or time per token
    EXPLORE_EVERY = 16  # one decision in this many per batch size takes the form the measurements did not choose

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self._rate: dict[str, tuple[float, int]] = {}  # request id -> (running acceptance, proposals)
        self._skipped: dict[str, int] = {}
        self._cost: dict[tuple[int, bool], tuple[float, int]] = {}  # (size, drafted) -> (ms per token, steps)
        self._decisions: dict[int, int] = {}

    @staticmethod
    def size(num_decodes: int) -> int:
        return 1 << max(num_decodes - 1, 0).bit_length()  # the batch size's power-of-two bucket

    def speculate(self, num_decodes: int) -> bool:
        """Whether a decode step of this many requests drafts at all."""
        cfg = self.cfg
        if cfg.disable_by_batch_size is not None and num_decodes > cfg.disable_by_batch_size:
            return False
        if cfg.when == "always":
            return True
        size = self.size(num_decodes)
        (on, n_on), (off, n_off) = (self._cost.get((size, f), (0.0, 0)) for f in (True, False))
        n = self._decisions[size] = self._decisions.get(size, 0) + 1
        if min(n_on, n_off) < self.WARMUP:
            return n_on <= n_off  # warm-up: the form with fewer measurements
        return (on < off) != (n % self.EXPLORE_EVERY == 0)

    def record_step(self, num_decodes: int, drafted: bool, ms: float, tokens: int) -> None:
        """A decode step (no prefill in it) ran in `ms` and emitted `tokens`."""
        if tokens:
            key = (self.size(num_decodes), drafted)
            cost, n = self._cost.get(key, (0.0, 0))
            now = ms / tokens
            self._cost[key] = (now if n == 0 else self.DECAY * cost + (1 - self.DECAY) * now, n + 1)

    def num_drafts(self, seqs: list, num_decodes: int) -> list[int]:
        """Drafts per request: N, at most the tokens it may still emit after this step's first one (so that no
        draft is verified past max_tokens), 0 where speculation does not pay."""
        cfg = self.cfg
        if not self.speculate(num_decodes):
            return [0] * len(seqs)
        out = []
        for s in seqs:
            k = min(cfg.num_speculative_tokens, s.params.max_tokens - s.num_output_tokens - 1)
            rate, seen = self._rate.get(s.request_id, (1.0, 0))
            if k > 0 and seen >= self.WARMUP and rate < cfg.min_acceptance:
                skipped = self._skipped.get(s.request_id, 0) + 1
                self._skipped[s.request_id] = skipped
                if skipped % self.PROBE_EVERY:
                    k = 0
            out.append(max(k, 0))
        return out

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        rate, seen = self._rate.get(request_id, (1.0, 0))
        now = accepted / proposed
        self._rate[request_id] = (now if seen == 0 else self.DECAY * rate + (1 - self.DECAY) * now, seen + 1)

    def release(self, request_id: str) -> None:
        self._rate.pop(request_id, None)
        self._skipped.pop(request_id, None)
