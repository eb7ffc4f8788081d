"""When drafting pays: how many drafts each decoding request gets in a step (0: it decodes plainly).

A verify row of 1 + k tokens costs more than a decode of one, and pays only by the drafts it keeps. The
planner turns speculation off for a whole step when more decodes run than `disable_by_batch_size` (a large
batch already fills the step's matmuls) or, with `when="pays"`, unless decode steps of this batch size measured
less time per emitted token with drafts than without (as the microbatch planner weighs cuts). A batch size starts
plain; after FIRST_TRIAL decisions a trial of TRIAL_STEPS steps drafts (enough for the graphs of a new shape to
be captured and replayed), and from then on the form that measured faster is taken and the other is tried again
in a trial, at least twice as many decisions later each time and so rarely that trials cost about TRIAL_SHARE of
the time (a drafted step that costs six plain ones is tried in 3 steps of 3,000 or fewer). A form's cost is the
least time per token among its last WINDOW steps: the warmed-up cost, which a stall, a capture or a collection
pause in one step cannot inflate. For one request whose measured acceptance fell below `min_acceptance`, it stops
drafting (it probes again every PROBE_EVERY of its steps). Far from a drafting step (`needs_context`) the drafter
may drop its context of a step's tokens. None of this changes a token: only how many a step gives. The class
attributes are tuning constants, not protections.
"""
from __future__ import annotations

from collections import deque

from .config import SpeculativeConfig


class SpecPlanner:
    WARMUP = 4  # proposals of a request before its acceptance is trusted
    PROBE_EVERY = 8  # a request whose acceptance is too low drafts again once in this many steps
    DECAY = 0.7  # weight of the past in a running acceptance
    FIRST_TRIAL = 16  # decisions at a batch size before it first tries drafting
    TRIAL_STEPS = 3  # steps of a trial: a new shape runs eagerly, is captured, then replays
    TRIAL_SHARE = 0.005  # the time trials of the slower form may cost, as a share of the time at that size
    WINDOW = 8  # a form's recent steps whose least time per token is its cost

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg
        self._rate: dict[str, tuple[float, int]] = {}  # request id -> (running acceptance, proposals)
        self._skipped: dict[str, int] = {}
        self._steps: dict[tuple[int, bool], deque] = {}  # (size, drafted) -> its last (ms per token, ms) steps
        self._decisions: dict[int, int] = {}
        # size -> (the decision from which a trial is due, the interval, the trial's steps still to run)
        self._trial: dict[int, tuple[int, int, int]] = {}

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
        return self._best(size) != (n >= self._trial.get(size, (self.FIRST_TRIAL,))[0])  # the other form: a trial

    def needs_context(self, num_decodes: int, lead: int) -> bool:
        """Whether the drafter must keep its context of this step's tokens (after `speculate` decided the step):
        a step of no decodes (prompts), drafting chosen at this size, or a trial of it due within `lead`
        decisions (a drafter reads `lead` committed positions before a draft's). Else it may drop them: it then
        drafts for a request again only once that request's window holds none of them, which changes no token."""
        if self.cfg.when == "always" or not num_decodes:
            return True
        if self.cfg.disable_by_batch_size is not None and num_decodes > self.cfg.disable_by_batch_size:
            return False
        size = self.size(num_decodes)
        due = self._trial.get(size, (self.FIRST_TRIAL,))[0]
        return self._best(size) or self._decisions.get(size, 0) + lead >= due

    def _cost(self, size: int, drafted: bool) -> tuple[float, float] | None:
        """(ms per token, ms) of the form's cheapest recent step per token, or None if it never ran."""
        steps = self._steps.get((size, drafted))
        return min(steps) if steps else None

    def _best(self, size: int) -> bool:
        """Whether drafting measured less time per token than plain decoding at this batch size."""
        on, off = self._cost(size, True), self._cost(size, False)
        return on is not None and off is not None and on[0] < off[0]

    def record_step(self, num_decodes: int, drafted: bool, ms: float, tokens: int) -> None:
        """A decode step (no prefill in it) ran in `ms` and emitted `tokens`. The last step of a trial (of the form
        not chosen, one that drafted something if it is drafting) puts the next trial later: by twice the interval
        at least, and so that a trial's extra cost, in steps of the chosen form, stays about TRIAL_SHARE of the
        steps between two trials."""
        if not tokens:
            return
        size = self.size(num_decodes)
        trial = drafted != self._best(size)
        self._steps.setdefault((size, drafted), deque(maxlen=self.WINDOW)).append((ms / tokens, ms))
        if not trial:
            return
        due, every, left = self._trial.get(size, (self.FIRST_TRIAL, self.FIRST_TRIAL, self.TRIAL_STEPS))
        if left > 1:
            self._trial[size] = (due, every, left - 1)
            return
        slow, fast = self._cost(size, drafted), self._cost(size, not drafted)
        extra = slow[1] / fast[1] - 1 if fast is not None else 0.0
        every = max(2 * every, int(self.TRIAL_STEPS * extra / self.TRIAL_SHARE))
        self._trial[size] = (self._decisions.get(size, 0) + every, every, self.TRIAL_STEPS)

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
