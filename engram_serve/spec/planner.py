"""When drafting pays: how many drafts each decoding request gets in a step (0: it decodes plainly).

A verify row of 1 + k tokens costs more than a decode of one, and pays only by the drafts it keeps. The
planner turns speculation off for a whole step when more decodes run than `disable_by_batch_size` (a large
batch already fills the step's matmuls) or, with `when="pays"`, unless decode steps of this batch size measured
less time per emitted token with drafts than without (as the microbatch planner weighs cuts). A batch size starts
plain; after FIRST_TRIAL decisions one step tries drafting, and from then on the form that measured faster is
taken and the other is tried again in one step later, at least twice as many decisions later each time and so
rarely that trials cost about TRIAL_SHARE of the time at most (a drafted step that costs six plain ones is tried
once in 1,000 steps or fewer). For one request whose measured acceptance fell below `min_acceptance`, it stops
drafting (it probes again every PROBE_EVERY of its steps). None of this changes a token: only how many a step
gives. The class attributes are tuning constants, not protections.
"""
from __future__ import annotations

from .config import SpeculativeConfig


class SpecPlanner:
    WARMUP = 4  # proposals of a request before its acceptance is trusted
    PROBE_EVERY = 8  # a request whose acceptance is too low drafts again once in this many steps
    DECAY = 0.7  # weight of the past in a running acceptance or time
    FIRST_TRIAL = 16  # decisions at a batch size before it first tries drafting
    TRIAL_SHARE = 0.005  # the time trials of the slower form may cost, as a share of the time at that size

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self._rate: dict[str, tuple[float, int]] = {}  # request id -> (running acceptance, proposals)
        self._skipped: dict[str, int] = {}
        self._cost: dict[tuple[int, bool], tuple[float, float]] = {}  # (size, drafted) -> (ms per token, per step)
        self._decisions: dict[int, int] = {}
        self._trial: dict[int, tuple[int, int]] = {}  # size -> (the decision of its next trial, the interval)
        # (a trial is due from that decision on, until a step of the form not chosen runs)

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
        n = self._decisions[size] = self._decisions.get(size, 0) + 1
        return self._best(size) != (n >= self._trial.get(size, (self.FIRST_TRIAL, 0))[0])  # the other form: a trial

    def _best(self, size: int) -> bool:
        """Whether drafting measured less time per token than plain decoding at this batch size."""
        on, off = self._cost.get((size, True)), self._cost.get((size, False))
        return on is not None and off is not None and on[0] < off[0]

    def record_step(self, num_decodes: int, drafted: bool, ms: float, tokens: int) -> None:
        """A decode step (no prefill in it) ran in `ms` and emitted `tokens`. A step of the form not chosen (a trial,
        one that drafted something) puts the next trial later: by twice the interval at least, and so that a trial's
        extra cost, in steps of the chosen form, stays about TRIAL_SHARE of the steps between two trials."""
        if not tokens:
            return
        size = self.size(num_decodes)
        trial = drafted != self._best(size)
        now, past = (ms / tokens, ms), self._cost.get((size, drafted))
        self._cost[(size, drafted)] = now if past is None else tuple(
            self.DECAY * a + (1 - self.DECAY) * b for a, b in zip(past, now))
        if trial:
            slow, fast = self._cost[(size, drafted)], self._cost.get((size, not drafted))
            extra = slow[1] / fast[1] - 1 if fast is not None else 0.0
            every = max(2 * self._trial.get(size, (0, self.FIRST_TRIAL))[1], int(extra / self.TRIAL_SHARE))
            self._trial[size] = (self._decisions.get(size, 0) + every, every)

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
