"""When drafting pays: how many drafts each decoding request gets in a step (0: it decodes plainly).

A verify row of 1 + k tokens costs more than a decode of one, and pays only by the drafts it keeps. The
planner turns speculation off for a whole step when more decodes run than `disable_by_batch_size` (a large
batch already fills the step's matmuls), and for one request whose measured acceptance fell below
`min_acceptance` (it probes again every PROBE_EVERY of its steps). None of this changes a token: only how many
a step gives. The class attributes are tuning constants, not protections.
"""
from __future__ import annotations

from .config import SpeculativeConfig


class SpecPlanner:
    WARMUP = 4  # proposals of a request before its acceptance is trusted
    PROBE_EVERY = 8  # a request whose acceptance is too low drafts again once in this many steps
    DECAY = 0.7  # weight of the past in a request's running acceptance

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self._rate: dict[str, tuple[float, int]] = {}  # request id -> (running acceptance, proposals)
        self._skipped: dict[str, int] = {}

    def num_drafts(self, seqs: list, num_decodes: int) -> list[int]:
        """Drafts per request: N, at most the tokens it may still emit after this step's first one (so that no
        draft is verified past max_tokens), 0 where speculation does not pay."""
        cfg = self.cfg
        if cfg.disable_by_batch_size is not None and num_decodes > cfg.disable_by_batch_size:
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
