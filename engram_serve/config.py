"""Validated model configuration, read from a DeepSeek-V4.1 `config.json` as published, nested or flat.

A published V4.1 config nests the text model's fields under `text_config`, beside `vision_config`,
`quantization_config` and Hugging Face bookkeeping; `flatten_config` lifts them to one level (a key
given both at the top level and in `text_config` with different values is an error naming both,
except per-config metadata such as `model_type`). Every field that changes the math is implemented
or refused (ConfigError naming the field and the value); the DSpark drafter's fields are read into
`DSparkConfig`; fields outside the text forward (vision) and other unknown ones are accepted and
listed once per load at debug level (logger `engram_serve.config`), except an unknown `engram_*` field: the Engram fields define the hash
(docs/contract.md §2), so one this project does not know is refused rather than silently ignored.
Our own options (engine, runner, CLI) are separate dataclasses and reject unknown keys.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

log = logging.getLogger(__name__)
TEXT_CONFIG = "text_config"  # where a multimodal (published V4.1) config keeps the text model's fields


# Per-(sub-)config metadata: a multimodal config's top level and its text_config each describe themselves
# (model_type "deepseek_v41" vs "deepseek_v41_text", ...), so these never conflict; the text model's win.
METADATA_FIELDS = frozenset({"model_type", "architectures", "dtype", "torch_dtype", "transformers_version",
                             "auto_map", "_name_or_path", "name_or_path"})


def flatten_config(d: dict) -> dict:
    """One flat dict of a config, nested (`text_config`) or flat. Invariant: every key of
    `d[TEXT_CONFIG]` keeps its value; a top-level key is kept unless text_config has it too, in
    which case both values must agree, except per-config metadata (METADATA_FIELDS), where the text
    model's value is kept."""
    if TEXT_CONFIG not in d:
        return dict(d)
    text = d[TEXT_CONFIG]
    if not isinstance(text, dict):
        raise ConfigError(f"config field {TEXT_CONFIG}={text!r}: must be a JSON object")
    out = {k: v for k, v in d.items() if k != TEXT_CONFIG}
    for k, v in text.items():
        if k in out and out[k] != v and k not in METADATA_FIELDS:
            raise ConfigError(f"config field {k}: the top level says {out[k]!r}, {TEXT_CONFIG} says {v!r}")
        out[k] = v
    return out


def _check(cond: bool, name: str, value, why: str) -> None:
    if not cond:
        raise ConfigError(f"config field {name}={value!r}: {why}")


@dataclass(frozen=True)
class EngramConfig:
    """The Engram fields of docs/contract.md §2 plus the backbone fields the Engram layer needs."""

    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]  # table rows per Engram layer, in engram_layer_ids order
    engram_max_ngram_size: int  # N
    engram_n_heads: int  # H
    engram_head_dim: int
    engram_vocab_size: int
    engram_compressed_vocab_size: int  # V'
    engram_pad_token_id: int
    hidden_size: int = 0
    hc_mult: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "engram_layer_ids", tuple(int(x) for x in self.engram_layer_ids))
        object.__setattr__(self, "engram_num_embeddings", tuple(int(x) for x in self.engram_num_embeddings))
        _check(len(set(self.engram_layer_ids)) == len(self.engram_layer_ids), "engram_layer_ids",
               self.engram_layer_ids, "layer ids must be distinct")
        _check(all(x >= 0 for x in self.engram_layer_ids), "engram_layer_ids", self.engram_layer_ids,
               "layer ids must be >= 0")
        _check(len(self.engram_num_embeddings) == len(self.engram_layer_ids), "engram_num_embeddings",
               self.engram_num_embeddings, f"needs one entry per Engram layer ({len(self.engram_layer_ids)})")
        _check(self.engram_max_ngram_size >= 2, "engram_max_ngram_size", self.engram_max_ngram_size, "must be >= 2")
        _check(self.engram_n_heads >= 1, "engram_n_heads", self.engram_n_heads, "must be >= 1")
        _check(self.engram_head_dim >= 1, "engram_head_dim", self.engram_head_dim, "must be >= 1")
        _check(self.engram_vocab_size >= 2, "engram_vocab_size", self.engram_vocab_size, "must be >= 2")
        _check(self.engram_compressed_vocab_size >= 1, "engram_compressed_vocab_size",
               self.engram_compressed_vocab_size, "must be >= 1")
        _check(self.engram_pad_token_id >= 0, "engram_pad_token_id", self.engram_pad_token_id, "must be >= 0")
        _check(self.hc_mult >= 1, "hc_mult", self.hc_mult, "must be >= 1")

    @property
    def num_layers(self) -> int:
        return len(self.engram_layer_ids)

    @property
    def history_len(self) -> int:
        """D = N - 1: how many tokens before a row's first token its n-grams can reach."""
        return self.engram_max_ngram_size - 1

    @property
    def num_columns(self) -> int:
        """(N-1)*H hash columns per Engram layer."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @classmethod
    def from_dict(cls, d: dict) -> "EngramConfig":
        """Pick the Engram fields (and hidden_size, hc_mult) out of a full model config, nested or
        flat; other keys are the backbone's or unused, and are ignored here."""
        d = flatten_config(d)
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [n for n in names if n.startswith("engram_") and n not in d]
        if missing:
            raise ConfigError(f"config is missing Engram field(s) {sorted(missing)}")
        unknown = [k for k in d if k.startswith("engram_") and k not in names]
        if unknown:  # the hash is defined by these fields: one we do not know may change it, so refuse
            raise ConfigError(f"config has unknown Engram field(s) {sorted(unknown)}")
        for n in names:
            listy = n in ("engram_layer_ids", "engram_num_embeddings")
            if n in d and not _is_int(d[n], listy):
                raise ConfigError(f"config field {n}={d[n]!r}: must be " + ("a list of integers" if listy else "an integer"))
        return cls(**{k: v for k, v in d.items() if k in names})


def _is_int(v, listy: bool) -> bool:
    ok = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
    return isinstance(v, (list, tuple)) and all(ok(x) for x in v) if listy else ok(v)


def read_json(path: str | Path) -> dict:
    """Read a JSON object; any failure is a ConfigError naming the path."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"config {path} must hold a JSON object, got {type(d).__name__}")
    return d


@dataclass(frozen=True)
class DSparkConfig:
    """The DSpark drafter (`mtp.*`, docs/deepseek_v41.md "The DSpark drafter"), in the published field names.

    The defaults mean "no drafter": `enabled` needs at least one draft layer (`num_nextn_predict_layers`) AND
    the target layers it reads (`dspark_target_layer_ids`); a config without them (every config before the
    drafter, and those that name the draft layers but not their features) has none, and its other fields are
    not checked. An enabled drafter is validated here, ConfigError naming the field and the value; the checks
    that need the backbone (layer ids, vocabulary, the draft layers' compress ratios) are `ModelConfig`'s."""

    num_nextn_predict_layers: int = 0  # draft layers, `mtp.0` .. `mtp.{n-1}`
    dspark_block_size: int = 0  # tokens proposed per draft (the last sampled token's block)
    dspark_noise_token_id: int = -1  # the token that fills the block after the last sampled token
    dspark_target_layer_ids: tuple[int, ...] = ()  # target layers whose input streams feed the context
    dspark_markov_rank: int = 0  # rank of the Markov head (embed [V, rank], head [V, rank])
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dspark_target_layer_ids", tuple(int(x) for x in self.dspark_target_layer_ids))
        _check(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", self.num_nextn_predict_layers,
               "must be >= 0")
        if not self.enabled:
            return
        ids = self.dspark_target_layer_ids
        _check(list(ids) == sorted(set(ids)) and ids[0] >= 0, "dspark_target_layer_ids", list(ids),
               "must be increasing layer ids >= 0")
        for name in ("dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts",
                     "dspark_num_experts_per_tok"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1 for a drafter")
        _check(self.dspark_num_experts_per_tok <= self.dspark_n_routed_experts, "dspark_num_experts_per_tok",
               self.dspark_num_experts_per_tok, f"must be <= dspark_n_routed_experts={self.dspark_n_routed_experts}")

    @property
    def enabled(self) -> bool:
        return self.num_nextn_predict_layers > 0 and bool(self.dspark_target_layer_ids)

    @property
    def num_layers(self) -> int:
        """Draft layers (0 without a drafter)."""
        return self.num_nextn_predict_layers if self.enabled else 0


SUPPORTED = {  # fields whose other values would change the math in ways this project does not implement
    "num_key_value_heads": (1,), "n_shared_experts": (1,), "hidden_act": ("silu",), "attention_bias": (False,),
    "scoring_func": ("sqrtsoftplus",), "topk_method": ("noaux_tc",), "n_group": (1, None), "topk_group": (1, None),
    "gate_temp": (1, 1.0, None),
}


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4.1's text model (docs/deepseek_v41.md), read from a published `config.json` as is.

    Invariants (checked here, ConfigError naming the field): `compress_ratios` covers every layer (entries
    past `num_hidden_layers` are the DSpark layers' and are not used) with ratios in {0, 1, 2}; every kv
    source is an index source; ratio-0 layers are neither; every compressed layer has a kv source at or
    before it, and the last such has its ratio; the candidate source, if any (>= 0), is a kv source;
    `num_attention_heads % o_groups == 0`; `qk_rope_head_dim` is even and fits head_dim and index_head_dim.
    `layer_roles` derives each layer's role from these fields alone."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    engram: EngramConfig
    dspark: DSparkConfig = DSparkConfig()
    compress_ratios: tuple[int, ...] = ()
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 1048576
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    quantization: dict = field(default_factory=dict, compare=False)  # the top-level quantization_config
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size",
                     "n_routed_experts", "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_topk",
                     "sliding_window", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings",
                     "candidate_block_size", "candidate_topk_blocks"):
            _check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        n = self.num_hidden_layers
        _check(self.num_attention_heads % self.o_groups == 0, "o_groups", self.o_groups,
               f"must divide num_attention_heads={self.num_attention_heads}")
        _check(self.qk_rope_head_dim % 2 == 0 and self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim),
               "qk_rope_head_dim", self.qk_rope_head_dim, "must be even and <= head_dim and index_head_dim")
        _check(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok", self.num_experts_per_tok,
               f"must be <= n_routed_experts={self.n_routed_experts}")
        _check(len(self.compress_ratios) >= n, "compress_ratios", list(self.compress_ratios),
               f"needs an entry for each of the {n} layers")
        _check(all(r in (0, 1, 2) for r in self.compress_ratios[:n]), "compress_ratios", list(self.compress_ratios),
               "ratios other than 0, 1 and 2 are not supported")
        ratios = self.compress_ratios[:n]
        for name in ("kv_source_layer_ids", "index_source_layer_ids"):
            ids = getattr(self, name)
            _check(list(ids) == sorted(set(ids)) and all(0 <= i < n for i in ids), name, list(ids),
                   f"must be increasing layer ids in [0, {n})")
            _check(all(ratios[i] > 0 for i in ids), name, list(ids), "a source layer must have a compress ratio > 0")
        _check(set(self.kv_source_layer_ids) <= set(self.index_source_layer_ids), "index_source_layer_ids",
               list(self.index_source_layer_ids), f"must contain every kv source {list(self.kv_source_layer_ids)}")
        owner = None
        for i, r in enumerate(ratios):
            owner = r if i in self.kv_source_layer_ids else owner
            _check(r == 0 or owner == r, "compress_ratios", list(self.compress_ratios),
                   f"layer {i} (ratio {r}) needs a kv source at or before it with the same ratio")
        c = self.candidate_source_layer_id
        _check(c == -1 or c in self.kv_source_layer_ids, "candidate_source_layer_id", c,
               "must be -1 (none) or a kv source")
        later = [i for i in self.kv_source_layer_ids if c >= 0 and i > c and ratios[i] != ratios[c]]
        _check(not later, "kv_source_layer_ids", list(self.kv_source_layer_ids),
               f"kv sources {later} follow the candidate source {c} with another ratio: its blocks index entries "
               f"of ratio {ratios[c] if c >= 0 else 0}")
        _check(self.engram.hidden_size == self.hidden_size and self.engram.hc_mult == self.hc_mult, "hidden_size",
               self.hidden_size, "differs from the Engram block's")
        bad = [i for i in self.engram.engram_layer_ids if i >= n]
        _check(not bad, "engram_layer_ids", list(self.engram.engram_layer_ids), f"layer ids must be < {n}")
        for name in ("bos_token_id", "eos_token_id"):
            _check(0 <= getattr(self, name) < self.vocab_size, name, getattr(self, name),
                   f"must be in [0, vocab_size={self.vocab_size})")
        _check(0 <= self.engram.engram_pad_token_id < self.vocab_size, "engram_pad_token_id",
               self.engram.engram_pad_token_id, f"must be in [0, vocab_size={self.vocab_size})")
        ds = self.dspark
        if ds.enabled:
            bad = [i for i in ds.dspark_target_layer_ids if i >= n]
            _check(not bad, "dspark_target_layer_ids", list(ds.dspark_target_layer_ids), f"layer ids must be < {n}")
            _check(0 <= ds.dspark_noise_token_id < self.vocab_size, "dspark_noise_token_id", ds.dspark_noise_token_id,
                   f"must be in [0, vocab_size={self.vocab_size})")
            drafts = list(self.compress_ratios[n:n + ds.num_layers])
            _check(drafts == [0] * ds.num_layers, "compress_ratios", list(self.compress_ratios),
                   f"the {ds.num_layers} draft layers after layer {n - 1} need ratio 0 (window attention only)")
        rs = self.rope_scaling
        _check(rs is None or (isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) == "yarn"), "rope_scaling",
               rs, "only YaRN scaling (rope_type 'yarn') is supported")
        _check(self.rms_norm_eps > 0 and self.hc_eps > 0, "rms_norm_eps", self.rms_norm_eps, "eps must be > 0")

    def to_dict(self) -> dict:
        """The flat text config (the fields of `from_dict`, the Engram fields and the unused ones kept in
        `extra`): ModelConfig.from_dict(cfg.to_dict()) == cfg."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("engram", "dspark", "extra", "quantization")}
        eng = dataclasses.asdict(self.engram)
        eng.pop("hidden_size"), eng.pop("hc_mult")
        out.update(eng)
        if self.dspark != DSparkConfig():
            out.update(dataclasses.asdict(self.dspark))
        out.update(self.extra)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @property
    def ratios(self) -> tuple[int, ...]:
        """The compress ratio of each backbone layer (the DSpark layers' entries dropped)."""
        return self.compress_ratios[: self.num_hidden_layers]

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """From a published V4.1 config, nested or flat. Fields that change the math are implemented or
        refused (ConfigError); the DSpark fields go to `dspark`; vision fields are not part of the text
        forward; other unknown fields are kept in `extra` and listed once at debug level."""
        quant = d.get("quantization_config") or {}
        d = flatten_config(d)
        for name, ok in SUPPORTED.items():  # absent: the published value
            if d.get(name, ok[0]) not in ok:
                raise ConfigError(f"config field {name}={d.get(name)!r}: only {[v for v in ok if v is not None]} "
                                  "is supported")
        engram = EngramConfig.from_dict({**d, "hidden_size": d.get("hidden_size", 0), "hc_mult": d.get("hc_mult", 4)})
        dspark = DSparkConfig(**_dspark_fields(d))
        names = {f.name for f in dataclasses.fields(cls)} - {"engram", "dspark", "extra", "quantization"}
        known = (names | {f.name for f in dataclasses.fields(EngramConfig)}
                 | {f.name for f in dataclasses.fields(DSparkConfig)} | set(SUPPORTED) | METADATA_FIELDS)
        unused = sorted(k for k in d if k not in known)
        if unused:
            log.debug("config: %d field(s) not used by the text forward: %s", len(unused), unused)
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING and f.name != "engram"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config is missing field(s) {missing}")
        for k in names & d.keys():
            v = d[k]
            if k.endswith("_ids") or k == "compress_ratios":
                if not _is_int(v, True):
                    raise ConfigError(f"config field {k}={v!r}: must be a list of integers")
            elif k in ("rope_scaling",):
                continue
            elif isinstance(getattr(cls, k, None), float) or k in ("rope_theta", "compress_rope_theta", "swiglu_limit",
                                                                   "rms_norm_eps", "routed_scaling_factor", "hc_eps"):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ConfigError(f"config field {k}={v!r}: must be a number")
            elif k in ("norm_topk_prob", "tie_word_embeddings"):
                if not isinstance(v, bool):
                    raise ConfigError(f"config field {k}={v!r}: must be true or false")
            elif not _is_int(v, False):
                raise ConfigError(f"config field {k}={v!r}: must be an integer")
        return cls(engram=engram, dspark=dspark, quantization=dict(quant), extra={k: d[k] for k in unused},
                   **{k: d[k] for k in names & d.keys()})


def _dspark_fields(d: dict) -> dict:
    """The DSpark fields present in the flat config d, type-checked (ConfigError naming the field and value)."""
    out = {}
    for f in dataclasses.fields(DSparkConfig):
        if f.name in d:
            listy = f.name == "dspark_target_layer_ids"
            if not _is_int(d[f.name], listy):
                raise ConfigError(f"config field {f.name}={d[f.name]!r}: must be "
                                  + ("a list of integers" if listy else "an integer"))
            out[f.name] = d[f.name]
    return out
