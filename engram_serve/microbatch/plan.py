"""Where a step is cut into microbatches: the config, the planner and its cost model (docs/contract.md §4).

`plan_microbatches` is the pure rule: token boundaries from the row boundaries, the thresholds and how
much a cut could hide. `MicrobatchPlanner` feeds it that last figure from what recent steps measured,
and decides where each microbatch's Engram gather runs (inline, or on the runner's worker thread).
`check_bounds` validates boundaries handed in from outside (tests, verification, `LLMEngine.step`).
"""
from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidRequest


@dataclass(frozen=True)
class MicrobatchConfig:
    """How a step is cut. A step stays whole below the token thresholds.

    `when` says whether cutting must pay for itself:
    - "overlap" (default): cut only when a microbatch has something to hide behind another's compute
      (`plan_microbatches`'s `hideable_ms`: a collective, Engram rows gathered from host memory into a
      device, or a measured table gather of at least `min_hidden_ms` per step). Otherwise the step runs
      whole: two half-size forwards on one CPU only add fixed per-operator cost.
    - "always": cut every step above the thresholds (verification and tests: invariance under cuts must
      be proven on cut steps, whether or not cutting is worth it here).
    """

    num_microbatches: int = 2
    policy: str = "tokens"  # "tokens": even token counts; "requests": prefer request boundaries
    decode_threshold: int = 32  # an all-decode step with fewer tokens is not cut
    prefill_threshold: int = 128  # a step with prefill tokens and fewer tokens than this is not cut
    max_imbalance: float = 0.25  # "requests": |size - ideal| / ideal allowed for a boundary cut
    when: str = "overlap"
    # "overlap": the least hideable time per step worth a cut. A cut costs a second forward's fixed
    # per-operator overhead (about 3-5 ms for the built-in model on one CPU core), so less is not worth it.
    min_hidden_ms: float = 5.0

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches={self.num_microbatches}: must be >= 1")
        if self.policy not in ("tokens", "requests"):
            raise ValueError(f"policy={self.policy!r}: must be 'tokens' or 'requests'")
        if not 0 <= self.max_imbalance < 1:
            raise ValueError(f"max_imbalance={self.max_imbalance}: must be in [0, 1)")
        if self.when not in ("overlap", "always"):
            raise ValueError(f"when={self.when!r}: must be 'overlap' or 'always'")
        if not self.min_hidden_ms >= 0:
            raise ValueError(f"min_hidden_ms={self.min_hidden_ms}: must be >= 0")


def plan_microbatches(qsl: np.ndarray, cfg: MicrobatchConfig, is_decode_only: bool,
                      hideable_ms: float = 0.0) -> list[int]:
    """Token boundaries [0, b1, ..., T] (strictly increasing) for a step with row boundaries qsl.

    `hideable_ms`: how much of this step's time a cut could hide (`MicrobatchPlanner.hideable_ms`). With
    `cfg.when == "overlap"` a step whose hideable time is below `cfg.min_hidden_ms` stays whole."""
    total = int(qsl[-1])
    threshold = cfg.decode_threshold if is_decode_only else cfg.prefill_threshold
    n = min(cfg.num_microbatches, total)
    if n <= 1 or total < threshold or (cfg.when == "overlap" and hideable_ms < cfg.min_hidden_ms):
        return [0, total]
    bounds = [0]
    for k in range(1, n):
        ideal = round(k * total / n)
        boundary = ideal
        if cfg.policy == "requests":
            inner = qsl[(qsl > bounds[-1]) & (qsl < total)]
            if len(inner):
                near = int(inner[np.argmin(np.abs(inner - ideal))])
                if abs(near - ideal) <= cfg.max_imbalance * (total / n):
                    boundary = near
        if bounds[-1] < boundary < total:
            bounds.append(boundary)
    return bounds + [total]


def check_bounds(bounds, num_tokens: int, num_microbatches: int) -> None:
    """Raise InvalidRequest unless `bounds` are increasing ints from 0 to `num_tokens`, at most
    `num_microbatches` microbatches (one set of buffers each)."""
    ok = isinstance(bounds, (list, tuple)) and len(bounds) >= 2 and all(
        isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in bounds)
    if ok:
        b = [int(x) for x in bounds]
        ok = b[0] == 0 and b[-1] == num_tokens and all(x < y for x, y in zip(b, b[1:]))
    if not ok:
        raise InvalidRequest(f"bounds={bounds!r}: must be increasing integers from 0 to the step's "
                             f"{num_tokens} tokens", "bounds")
    if len(bounds) - 1 > num_microbatches:
        raise InvalidRequest(f"bounds={list(bounds)!r}: {len(bounds) - 1} microbatches, the runner has buffers "
                             f"for microbatch.num_microbatches={num_microbatches}", "bounds")


class StepCosts:
    """The cost model behind "cut only where it pays": the measured wall time of recent steps, per step class
    (decode-only or not; tokens rounded up to a power of two) and per form (whole, microbatched), as moving
    averages.

    A cut step's time includes everything a cut costs (every weight read once per microbatch, each
    operator's fixed cost twice) and everything it hides (a microbatch's collectives and gathers behind
    the other's compute), so `gain(key) = whole - cut` is the planner's prediction of what cutting this
    class of step saves. Until both forms of a class have WARMUP samples the planner alternates them; a
    warm-up sample replaces the one before it (the first step of a form is cold: first-touch buffers, lazy
    set-up; averaged in, it would bias the choice for many steps), then the estimates are moving averages."""

    WARMUP = 2
    SMOOTHING = 0.25

    def __init__(self) -> None:
        self.ms: dict[tuple, dict[bool, float]] = {}
        self.samples: dict[tuple, dict[bool, int]] = {}

    @staticmethod
    def key(num_tokens: int, is_decode_only: bool) -> tuple[bool, int]:
        return is_decode_only, 1 << max(0, num_tokens - 1).bit_length()

    def predict(self, key: tuple, microbatched: bool) -> float | None:
        return self.ms.get(key, {}).get(microbatched)

    def count(self, key: tuple, microbatched: bool) -> int:
        return self.samples.get(key, {}).get(microbatched, 0)

    def record(self, key: tuple, microbatched: bool, ms: float) -> None:
        prev = self.predict(key, microbatched)
        warm = self.count(key, microbatched) >= self.WARMUP
        self.ms.setdefault(key, {})[microbatched] = prev + self.SMOOTHING * (ms - prev) if warm else ms
        self.samples.setdefault(key, {})[microbatched] = self.count(key, microbatched) + 1


class MicrobatchPlanner:
    """The runner's planning state: a cost model measured on recent steps.

    `gather_ms_per_token` is a moving average over the Engram gathers run inline (one step in
    MEASURE_EVERY), `step_ms_per_token` one over whole steps. Both start at 0: until a gather is
    measured, nothing counts as hideable except collectives and tables off the device. Where the rule
    would cut a step (`when="overlap"`), `costs` decides: the step is cut only if cut steps of its class
    ran faster than whole ones (StepCosts); one decision in EXPLORE_EVERY of a class takes the other form,
    so the estimate of the form not taken stays current. `predictions` keeps (predicted ms, actual ms) of
    recent steps, to measure the model against what the steps then took.
    The class attributes are tuning constants, not protections."""

    HIDE_FRACTION = 0.25  # a measured gather below this share of a step's time is not worth a cut
    PREFETCH_MIN_MS = 0.1  # a whole step's gather expected to take at least this long runs on the worker,
    # overlapped with the layers before the first Engram layer; a shorter one runs inline (a thread
    # handoff costs tens of microseconds)
    MEASURE_EVERY = 32  # one step in this many runs its gathers inline, which measures them. Only those
    # runs update the estimate: on the worker a gather's wall time also counts its waits for the GIL,
    # which the forward holds, so a 0.04 ms gather of one token measured 0.3 ms there and stayed there
    SMOOTHING = 0.25  # weight of the newest measurement in the moving averages
    EXPLORE_EVERY = 16  # one decision in this many per step class takes the form the model did not choose

    def __init__(self, cfg: MicrobatchConfig, tables_off_device: bool):
        self.cfg = cfg
        self.tables_off_device = tables_off_device  # Engram tables in host memory feeding a device
        self.gather_ms_per_token = 0.0
        self.step_ms_per_token = 0.0
        self.steps = 0  # steps started (which of them measure the gather)
        self.costs = StepCosts()
        self.decisions: dict[tuple, int] = {}
        self.pending: tuple | None = None  # (class, microbatched, predicted ms) of the step being run
        self.predictions: deque[tuple[float, float]] = deque(maxlen=256)

    def hideable_ms(self, num_tokens: int, collectives: bool) -> float:
        """What cutting a step of `num_tokens` tokens could hide behind another microbatch's compute:
        unbounded with `collectives` (each layer launches one: tensor/expert parallelism) or with Engram
        tables in host memory feeding a device; otherwise the Engram gather time measured on recent steps,
        when it is at least HIDE_FRACTION of a step's time per token (a relative test: on a loaded
        machine both grow)."""
        if collectives or self.tables_off_device:
            return float("inf")
        if self.gather_ms_per_token < self.HIDE_FRACTION * self.step_ms_per_token:
            return 0.0  # the gather is a small part of a step's time (both slow down alike under load)
        return self.gather_ms_per_token * num_tokens

    def plan(self, qsl: np.ndarray, is_decode_only: bool, collectives: bool,
             cfg: MicrobatchConfig | None = None) -> list[int]:
        """The step's boundaries. Under `when="overlap"` only a step with something to hide is cut, and
        only where the cost model predicts that cutting it pays."""
        cfg = cfg or self.cfg
        total = int(qsl[-1])
        bounds = plan_microbatches(qsl, cfg, is_decode_only, self.hideable_ms(total, collectives))
        key = StepCosts.key(total, is_decode_only)
        if len(bounds) > 2 and cfg.when == "overlap":
            microbatched = self._choose(key)
            bounds = bounds if microbatched else [0, total]
        microbatched = len(bounds) > 2
        self.pending = (key, microbatched, self.costs.predict(key, microbatched))
        return bounds

    def _choose(self, key: tuple) -> bool:
        """Cut a step of class `key`? Warm-up alternates; then the faster form, the other one in EXPLORE_EVERY."""
        n = self.decisions[key] = self.decisions.get(key, 0) + 1
        whole, microbatched = self.costs.count(key, False), self.costs.count(key, True)
        if min(whole, microbatched) < StepCosts.WARMUP:
            return microbatched <= whole
        pays = self.costs.predict(key, True) < self.costs.predict(key, False)
        return pays != (n % self.EXPLORE_EVERY == 0)

    def predicted_gain(self, num_tokens: int, is_decode_only: bool) -> float | None:
        """Predicted ms a cut saves on a step of this class (negative: it costs), None before warm-up."""
        key = StepCosts.key(num_tokens, is_decode_only)
        whole, microbatched = self.costs.predict(key, False), self.costs.predict(key, True)
        return None if whole is None or microbatched is None else whole - microbatched

    def start_step(self) -> bool:
        """Count a step; True if it measures its gathers (runs them inline)."""
        measure = self.steps % self.MEASURE_EVERY == 0
        self.steps += 1
        return measure

    def gather_on_worker(self, num_microbatches: int, num_tokens: int, measure: bool) -> bool:
        """Whether a microbatch's gather runs on the worker thread, overlapped with another microbatch's
        compute and with its own layers before its first Engram layer; else inline (a short gather, where
        a thread handoff would cost more than it hides, or a measuring step)."""
        return not measure and (num_microbatches > 1 or self.tables_off_device
                                or self.gather_ms_per_token * num_tokens >= self.PREFETCH_MIN_MS)

    def record_gather(self, ms: float, num_tokens: int) -> None:
        """An inline gather of `num_tokens` rows took `ms`."""
        if num_tokens:
            self.gather_ms_per_token += self.SMOOTHING * (ms / num_tokens - self.gather_ms_per_token)

    def record_step(self, ms: float, num_tokens: int, microbatched: bool) -> None:
        """A step of `num_tokens` tokens, cut or whole, took `ms` (from planning to its logits)."""
        if num_tokens:
            self.step_ms_per_token += self.SMOOTHING * (ms / num_tokens - self.step_ms_per_token)
        if self.pending is not None and self.pending[1] == microbatched:
            key, _, predicted = self.pending
            if predicted is not None:
                self.predictions.append((predicted, ms))
            self.costs.record(key, microbatched, ms)
        self.pending = None

    def prediction_error(self) -> float | None:
        """Median |predicted - actual| / actual over recent steps that had a prediction."""
        errs = sorted(abs(p - a) / a for p, a in self.predictions if a > 0)
        return errs[len(errs) // 2] if errs else None
