"""Per-request sampling parameters, validated when built: a bad value never reaches the batch."""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

from .errors import InvalidRequest

_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def _fail(name: str, value, why: str):
    raise InvalidRequest(f"{name}={value!r}: {why}")


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, value, f"must be an integer, got {type(value).__name__}")
    return int(value)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, value, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        _fail(name, value, "must be finite")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Invariants (checked in `__post_init__`, InvalidRequest otherwise):
    `max_tokens >= 1`; `temperature >= 0` (0 = greedy: argmax); `0 < top_p <= 1`;
    `top_k == 0` (off) or `top_k >= 1`; `seed` None or an int64; every `stop` string non-empty;
    every `stop_token_ids` entry `>= 0`. `stop` may be given as one string.
    With `seed` None the engine draws a seed for the request."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        put("max_tokens", _int("max_tokens", self.max_tokens))
        if self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "must be >= 1")
        put("temperature", _real("temperature", self.temperature))
        if self.temperature < 0:
            _fail("temperature", self.temperature, "must be >= 0 (0 = greedy)")
        put("top_p", _real("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "must be in (0, 1]")
        put("top_k", _int("top_k", self.top_k))
        if self.top_k < 0:
            _fail("top_k", self.top_k, "must be 0 (off) or >= 1")
        if self.seed is not None:
            put("seed", _int("seed", self.seed))
            if not _INT64_MIN <= self.seed <= _INT64_MAX:
                _fail("seed", self.seed, "must fit in a signed 64-bit integer")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            _fail("stop", self.stop, f"must be a string or a list of strings, got {type(self.stop).__name__}")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                _fail(f"stop[{i}]", s, f"must be a string, got {type(s).__name__}")
            if not s:
                _fail(f"stop[{i}]", s, "must be non-empty")
        put("stop", list(stop))
        if not isinstance(self.stop_token_ids, (list, tuple)):
            _fail("stop_token_ids", self.stop_token_ids,
                  f"must be a list of integers, got {type(self.stop_token_ids).__name__}")
        ids = [_int(f"stop_token_ids[{i}]", t) for i, t in enumerate(self.stop_token_ids)]
        for i, t in enumerate(ids):
            if t < 0:
                _fail(f"stop_token_ids[{i}]", t, "must be >= 0")
        put("stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            _fail("ignore_eos", self.ignore_eos, f"must be true or false, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Build from a plain dict (e.g. request JSON); unknown keys are an InvalidRequest."""
        if not isinstance(d, dict):
            raise InvalidRequest(f"sampling parameters must be an object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(k for k in d if k not in names)
        if unknown:
            raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; known: {names}")
        return cls(**d)
