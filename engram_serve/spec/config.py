"""`SpeculativeConfig`: the `--speculative-config` JSON, as vLLM takes it, validated.

    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"method": "dspark", "num_speculative_tokens": 5}

Methods: "dspark" (the checkpoint's DSpark drafter, `mtp.*`; N from 1 to its `dspark_block_size`), "ngram"
(prompt lookup), and the test and benchmark drafters "random", "noise" (always proposes the DSpark noise
token id), which never change a result and only cost time (spec/drafters.py). An unknown key, method
or a value out of range raises ConfigError naming the field and the value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from ..errors import ConfigError

METHODS = ("dspark", "ngram", "random", "noise")
MAX_SPECULATIVE_TOKENS = 16  # methods without a block size of their own (a verify row holds 1 + N tokens)


def _fail(name: str, value, why: str):
    raise ConfigError(f"speculative config field {name}={value!r}: {why}")


def _int(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, "must be an integer")
    if value < lo or (hi is not None and value > hi):
        _fail(name, value, f"must be in [{lo}, {hi}]" if hi is not None else f"must be >= {lo}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Invariants: `method` in METHODS; `1 <= num_speculative_tokens <= max_speculative_tokens(method)`;
    `1 <= prompt_lookup_min <= prompt_lookup_max`; `disable_by_batch_size` None or >= 1 (a step with more
    running decodes drafts nothing, as vLLM's field); `0 <= min_acceptance <= 1` (the planner stops drafting for a
    request whose measured acceptance falls below it, spec/planner.py); `seed` seeds the random drafter;
    `when`: "pays" (default) drafts in a decode step only where such steps measured less time per token than
    plain ones at that batch size, "always" in every decode step (verify and the tests)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    min_acceptance: float = 0.0
    seed: int = 0
    when: str = "pays"
    block_size: int | None = None  # the checkpoint's dspark_block_size (method "dspark")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail("method", self.method, f"must be one of {list(METHODS)}")
        hi = self.block_size if self.method == "dspark" else MAX_SPECULATIVE_TOKENS
        if self.method == "dspark" and hi is None:
            _fail("method", self.method, "the checkpoint has no DSpark drafter (no dspark_block_size in its config)")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1, hi)
        _int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        if self.disable_by_batch_size is not None:
            _int("disable_by_batch_size", self.disable_by_batch_size, 1)
        m = self.min_acceptance
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            _fail("min_acceptance", m, "must be a number in [0, 1]")
        _int("seed", self.seed, 0)
        if self.when not in ("pays", "always"):
            _fail("when", self.when, "must be 'pays' or 'always'")

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig", checkpoint: Path | None = None) -> "SpeculativeConfig":
        """From a JSON string or a dict (the CLI's and `LLM`'s `speculative_config`). `checkpoint`: the model
        directory, whose config.json gives `dspark_block_size`."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative config {value!r:.80}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative config: expected a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)} - {"block_size"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative config: unknown field(s) {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ConfigError(f"speculative config: field {name!r} is required")
        return cls(**value, block_size=dspark_block_size(checkpoint))


def add_speculative_arg(parser) -> None:
    """`--speculative-config JSON` (serve, generate): parsed here, validated against the checkpoint when the
    engine is built (ConfigError naming the field and the value)."""
    def json_object(text: str) -> dict:
        import argparse
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
        return value
    parser.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                             '(methods: dspark, ngram; random and noise for tests): more tokens a step, never '
                             'other tokens')


def dspark_block_size(checkpoint: Path | None) -> int | None:
    """`dspark_block_size` of a checkpoint's config.json (top level or `text_config`), None without one."""
    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return None
    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    for d in (raw, raw.get("text_config") or {}):
        if isinstance(d.get("dspark_block_size"), int) and d.get("num_nextn_predict_layers", 1):
            return d["dspark_block_size"]
    return None


def dspark_noise_token_id(checkpoint: Path | None) -> int | None:
    """`dspark_noise_token_id` of a checkpoint's config.json, None without one."""
    if checkpoint is None or not (Path(checkpoint) / "config.json").is_file():
        return None
    raw = json.loads((Path(checkpoint) / "config.json").read_text())
    for d in (raw, raw.get("text_config") or {}):
        if isinstance(d.get("dspark_noise_token_id"), int):
            return d["dspark_noise_token_id"]
    return None
