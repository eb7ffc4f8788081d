"""Per-request sampling parameters, validated when built: a bad value never reaches the batch.

Limits that depend on the model (token ids in `stop_token_ids` / `logit_bias` inside the
tokenizer, `max_tokens` against `max_model_len`) are checked by `LLMEngine.validate`; everything
that can be checked without the model is checked here, and every message names the field and
the value.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequest

_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_STOP_STRINGS = 32  # stop strings per request
MAX_STOP_CHARS = 4096  # their total length
MAX_LOGPROBS = 20  # top logprobs per token (vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_STOP_TOKEN_IDS = 1024


def _fail(name: str, value, why: str, at: str = ""):
    """InvalidRequest "name<at>=value: why" with param `name` (the field; `at` names the item in it)."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    raise InvalidRequest(f"{name}{at}={shown}: {why}", name)


def _int(name: str, value, at: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, value, f"must be an integer, got {type(value).__name__}", at)
    v = int(value)
    if not _INT64_MIN <= v <= _INT64_MAX:
        _fail(name, v, "must fit in a signed 64-bit integer", at)
    return v


def _real(name: str, value, at: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, value, f"must be a number, got {type(value).__name__}", at)
    try:
        v = float(value)
    except OverflowError:  # an int too large for a float
        _fail(name, value, "must be finite", at)
    if not math.isfinite(v):
        _fail(name, value, "must be finite", at)
    return v


def _in(name: str, v: float, lo: float, hi: float, lo_open: bool = False, at: str = "") -> None:
    if not ((lo < v) if lo_open else (lo <= v)) or not v <= hi:
        _fail(name, v, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}]", at)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Invariants (checked in `__post_init__`, InvalidRequest otherwise):

    - `max_tokens >= 1`, or 0 with `prompt_logprobs` (score the prompt alone); `0 <= min_tokens <= max_tokens` (EOS and `stop_token_ids` are masked
      until `min_tokens` tokens exist);
    - `temperature >= 0` (0 = greedy: argmax); `0 < top_p <= 1` and top_p does not round to 0 in
      float32; `top_k == 0` (off) or `1 <= top_k < 2**63`; `0 <= min_p <= 1`;
    - `presence_penalty`, `frequency_penalty` in [-2, 2]; `repetition_penalty` in [0.01, 100]
      (1 = off); `logit_bias` maps token ids >= 0 to biases in [-100, 100], at most 1024 entries;
    - `seed` None or an int64 (None: the engine draws one); `logprobs` None (off) or 0..20 (0 = the
      sampled token's logprob only); `prompt_logprobs` None (off) or 0..20: each prompt token's logprob
      (the first: None) and the top ones at its position, from the same float32 logits as sampling;
    - `stop`: at most 32 non-empty strings, 4096 characters in all (may be given as one string);
      `stop_token_ids`: at most 1024 ids >= 0.

    Every field is a plain Python value; all floats are finite.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        put("max_tokens", _int("max_tokens", self.max_tokens))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                put(name, _int(name, v))
                if not 0 <= getattr(self, name) <= MAX_LOGPROBS:
                    _fail(name, v, f"must be in [0, {MAX_LOGPROBS}] (0 = the token's own logprob only)")
        if self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            _fail("max_tokens", self.max_tokens, "must be >= 1 (0 only with prompt_logprobs: score the prompt alone)")
        put("min_tokens", _int("min_tokens", self.min_tokens))
        if not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"must be in [0, max_tokens={self.max_tokens}]")
        put("temperature", _real("temperature", self.temperature))
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be >= 0 (0 = greedy)")
        put("top_p", _real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        if np.float32(self.top_p) == 0:
            _fail("top_p", self.top_p, "rounds to 0 in float32 (it would mask every token); use >= 1e-38")
        put("top_k", _int("top_k", self.top_k))
        if self.top_k < 0:
            _fail("top_k", self.top_k, "must be 0 (off) or >= 1")
        put("min_p", _real("min_p", self.min_p))
        _in("min_p", self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            put(name, _real(name, getattr(self, name)))
            _in(name, getattr(self, name), -2.0, 2.0)
        put("repetition_penalty", _real("repetition_penalty", self.repetition_penalty))
        _in("repetition_penalty", self.repetition_penalty, 0.01, 100.0)
        if self.seed is not None:
            put("seed", _int("seed", self.seed))
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            _fail("stop", self.stop, f"must be a string or a list of strings, got {type(self.stop).__name__}")
        if len(stop) > MAX_STOP_STRINGS:
            _fail("stop", f"<{len(stop)} strings>", f"at most {MAX_STOP_STRINGS} stop strings")
        total = 0
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                _fail("stop", s, f"must be a string, got {type(s).__name__}", f"[{i}]")
            if not s:
                _fail("stop", s, "must be non-empty", f"[{i}]")
            total += len(s)
        if total > MAX_STOP_CHARS:
            _fail("stop", f"<{total} characters>", f"the stop strings may hold {MAX_STOP_CHARS} characters in all")
        put("stop", list(stop))
        if not isinstance(self.stop_token_ids, (list, tuple)):
            _fail("stop_token_ids", self.stop_token_ids,
                  f"must be a list of integers, got {type(self.stop_token_ids).__name__}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", f"<{len(self.stop_token_ids)} ids>", f"at most {MAX_STOP_TOKEN_IDS} ids")
        ids = [_int("stop_token_ids", t, f"[{i}]") for i, t in enumerate(self.stop_token_ids)]
        for i, t in enumerate(ids):
            if t < 0:
                _fail("stop_token_ids", t, "must be >= 0", f"[{i}]")
        put("stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, f"must be true or false, got {type(self.ignore_eos).__name__}")
        if not isinstance(self.logit_bias, dict):
            _fail("logit_bias", self.logit_bias, f"must be a mapping token id -> bias, got "
                                                 f"{type(self.logit_bias).__name__}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            _fail("logit_bias", f"<{len(self.logit_bias)} entries>", f"at most {MAX_LOGIT_BIAS} entries")
        bias = {}
        for k, v in self.logit_bias.items():
            key = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdigit() else k
            tok = _int("logit_bias", key, " key")
            if tok < 0:
                _fail("logit_bias", tok, "token ids must be >= 0", f"[{k!r}]")
            b = _real("logit_bias", v, f"[{k!r}]")
            _in("logit_bias", b, -100.0, 100.0, at=f"[{k!r}]")
            bias[tok] = b
        put("logit_bias", bias)

    def with_seed(self, seed: int) -> "SamplingParams":
        """These params with `seed` (an int64), the rest as validated already: what `dataclasses.replace`
        gives, without checking every field again (the engine gives each seedless request one)."""
        new = copy.copy(self)
        own = {"seed": _int("seed", seed), "stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids),
               "logit_bias": dict(self.logit_bias)}  # containers of its own, as replace() makes
        for name, value in own.items():
            object.__setattr__(new, name, value)
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether the request's logits depend on its own earlier tokens (penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Build from a plain dict (e.g. request JSON); unknown keys are an InvalidRequest."""
        if not isinstance(d, dict):
            raise InvalidRequest(f"sampling parameters must be an object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; known: {names}", unknown[0])
        return cls(**d)
