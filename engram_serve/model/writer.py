"""Write a DeepSeek-V4.1 checkpoint directory in the official layout (what `loader.load_model` reads).

    config.json                       nested as published: architectures, model_type, quantization_config,
                                      text_config (the text model's fields), vision_config
    model.safetensors.index.json      {"metadata": {"total_size"}, "weight_map": {name: shard}}
    model-0000k-of-0000n.safetensors  shards of at most `shard_bytes` each (a bigger tensor gets its own)
    tokenizer.json

Official names throughout (docs/deepseek_v41.md). Quantized as published where asked (`Quant`):
FP8 E4M3 with one E8M0 scale per 32x32 block for the attention, indexer-query, shared-expert and
Engram `wkv` linears; the routed experts in MXFP4 (or FP8 blocks, or float); the Engram tables as FP8
rows with one E8M0 scale per 32 columns. The other matrices (router, compressor, indexer keys and weights,
mHC, embeddings, head, float experts) in BF16 where asked, as the published checkpoints store them, else
float32; vectors (norms, sinks, biases, mHC bases and scales) float32. Deterministic: same inputs, same bytes.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import EngramConfig, ModelConfig, read_json
from ..engram.layout import build_layout
from ..engram.quantized import Fp8Table, quantize_blocks, quantize_fp4, quantize_rows
from ..engram.tables import EngramTables, scale_key, table_key
from .checkpoint import CONFIG_FILE, INDEX_FILE, TINY_DIR

FP8_BLOCK = 32
FP8_LINEARS = re.compile(r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                         r"|engram\.wkv|main_proj)\.weight")  # (the drafter's as NeMo's adapter stores them)
EXPERTS = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
STACKED = re.compile(r"((?:layers|mtp)\.\d+\.ffn)\.(w13|w2)")  # stacked experts, one tensor per expert on disk


@dataclass(frozen=True)
class Quant:
    """What is stored quantized: `linears` FP8 blocks; `experts` "fp4" (MXFP4), "fp8" or None (float);
    `tables` FP8 rows; `bf16` the other matrices in BF16 (else float32)."""

    linears: bool = True
    experts: str | None = "fp4"
    tables: bool = True
    bf16: bool = False

    def config(self) -> dict:
        """The published `quantization_config` for this choice ({} when nothing is quantized)."""
        if not (self.linears or self.experts or self.tables):
            return {}
        q = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
             "scale_fmt": "ue8m0"}
        return {**q, "expert_dtype": "fp4"} if self.experts == "fp4" else q


def official_tensors(model, tables: EngramTables | None, quant: Quant, drafter=None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by official name: the model's parameters and the drafter's (`mtp.*`; their
    stacked experts split into one tensor per expert and projection) and the Engram tables, quantized per `quant`.
    `model` None: the drafter's alone."""
    out: dict[str, torch.Tensor] = {}
    params = {**(model.state_dict() if model is not None else {}),
              **(drafter.state_dict() if drafter is not None else {})}
    for name, p in params.items():
        m = STACKED.fullmatch(name)
        if m is None:
            out[name] = p
            continue
        pre, which = m.groups()
        for e in range(p.shape[0]):
            if which == "w13":
                w1, w3 = p[e].chunk(2)
                out[f"{pre}.experts.{e}.w1.weight"], out[f"{pre}.experts.{e}.w3.weight"] = w1, w3
            else:
                out[f"{pre}.experts.{e}.w2.weight"] = p[e]
    stored = {}
    for lid, table in zip(tables.layer_ids, tables.tables) if tables is not None else ():
        if isinstance(table, Fp8Table):  # already in the stored form
            stored[table_key(lid)], stored[scale_key(lid)] = table.weight, table.scale
        else:
            out[table_key(lid)] = table
    for name, t in out.items():
        t = t.detach().float().contiguous()
        base = name[: -len(".weight")]
        form = stored_form(name, t.dim(), quant)
        if form == "fp8_rows":
            stored[name], stored[base + ".scale"] = quantize_rows(t)
        elif form == "fp4":
            stored[name], stored[base + ".scale"] = quantize_fp4(t)
        elif form == "fp8_blocks":
            stored[name], stored[base + ".scale"] = quantize_blocks(t, FP8_BLOCK)
        else:
            stored[name] = t.to(torch.bfloat16) if form == "bf16" else t
    return stored


def stored_form(name: str, dim: int, quant: Quant) -> str:
    """How the tensor `name` (official name, `dim` dimensions) is stored under `quant`: "fp8_rows" (an Engram
    table: E4M3 rows, E8M0 per 32 columns), "fp4" (MXFP4: packed E2M1, E8M0 per row and 32 columns),
    "fp8_blocks" (E4M3, E8M0 per FP8_BLOCK-square block), "bf16" or "f32". The one rule of both writers
    (`official_tensors`, random_writer.py)."""
    if name.endswith(".engram.embed.weight") and quant.tables:
        return "fp8_rows"
    if EXPERTS.fullmatch(name) and quant.experts == "fp4":
        return "fp4"
    if (EXPERTS.fullmatch(name) and quant.experts == "fp8") or (FP8_LINEARS.fullmatch(name) and quant.linears):
        return "fp8_blocks"
    return "bf16" if quant.bf16 and dim >= 2 else "f32"


def nested_config(text: dict, quant: Quant) -> dict:
    """The published config.json shape around a text config (vision tower with no layers)."""
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
           "bos_token_id": text.get("bos_token_id", 0), "eos_token_id": text.get("eos_token_id", 1),
           "text_config": {"model_type": "deepseek_v41_text", **text},
           "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 0}}
    if quant.config():
        cfg["quantization_config"] = quant.config()
    return cfg


def save_v41_checkpoint(out_dir: str | Path, text_config: dict, model, tables: EngramTables | None,
                        tokenizer_path: str | Path, quant: Quant = Quant(), shard_bytes: int = 64 << 20,
                        drafter=None) -> Path:
    """Write the directory (with the DSpark `drafter`'s `mtp.*` where given); returns it."""
    out = start_directory(out_dir, text_config, quant, tokenizer_path)
    stored = official_tensors(model, tables, quant, drafter)
    shards = assign_shards({name: t.numel() * t.element_size() for name, t in stored.items()}, shard_bytes)
    for k, names in enumerate(shards):
        save_file({name: stored[name] for name in names}, str(out / shard_file(k, len(shards))),
                  metadata={"format": "pt"})
    write_index(out, shards, sum(t.numel() * t.element_size() for t in stored.values()))
    return out


def start_directory(out_dir: str | Path, text_config: dict, quant: Quant, tokenizer_path: str | Path) -> Path:
    """The directory with its config.json and tokenizer.json (the tensors come next)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(nested_config(text_config, quant), indent=2) + "\n")
    if Path(tokenizer_path).resolve() != (out / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_path, out / "tokenizer.json")
    return out


def assign_shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensor names by shard: in name order, a shard closed when the next tensor would take it past
    `shard_bytes` (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes):
        if shards[-1] and size + sizes[name] > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += sizes[name]
    return shards


def shard_file(k: int, n: int) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def write_index(out: Path, shards: list[list[str]], total: int) -> None:
    weight_map = {name: shard_file(k, len(shards)) for k, names in enumerate(shards) for name in names}
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


# The published V4.1-Flash structure scaled down (window-only layers first, ratio-2 layers with their kv
# sources, then ratio-1 layers reading the candidate source, Engram on two layers, one DSpark layer after
# the backbone), with the built-in tokenizer's vocabulary.
SMALL_TEXT_CONFIG = dict(
    vocab_size=4096, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_lora_rank=16, o_groups=2,
    hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
    max_position_embeddings=4096, rope_theta=10000.0,
    rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 256},
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, scoring_func="sqrtsoftplus", topk_method="noaux_tc",
    norm_topk_prob=True, routed_scaling_factor=1.5, sliding_window=8, compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1, 0],
    compress_rope_theta=160000.0, kv_source_layer_ids=[1, 3, 4], index_source_layer_ids=[1, 3, 4, 6],
    index_n_heads=2, index_head_dim=16, index_topk=4, candidate_source_layer_id=4, candidate_topk_blocks=2,
    candidate_block_size=2, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, engram_layer_ids=[1, 3],
    engram_max_ngram_size=3, engram_vocab_size=97, engram_n_heads=2, engram_head_dim=32, engram_pad_token_id=1,
    engram_compressed_vocab_size=2726, num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=0)


def with_engram_rows(text: dict) -> dict:
    """`text` with `engram_num_embeddings` set to what its hash layout needs."""

    if not text["engram_layer_ids"]:
        return {**text, "engram_num_embeddings": []}
    e = EngramConfig.from_dict({**text, "engram_num_embeddings": [0] * len(text["engram_layer_ids"])})
    return {**text, "engram_num_embeddings": build_layout(e, check_rows=False).moduli.sum(1).tolist()}


def random_v41_checkpoint(out_dir: str | Path, text_config: dict | None = None, seed: int = 0, quant: Quant = Quant(),
                          std: float = 0.05, tokenizer_path: str | Path | None = None, shard_bytes: int = 64 << 20,
                          extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A deterministic random V4.1 checkpoint in the official layout (SMALL_TEXT_CONFIG by default; the
    built-in tokenizer), with a random DSpark drafter where the config describes one. `extra_tensors` are
    written beside the model's (e.g. tensors the text forward leaves out)."""
    from .deepseek_v41 import DeepseekV41, init_weights
    from .dspark import DSpark

    text = with_engram_rows(dict(text_config or SMALL_TEXT_CONFIG))
    cfg = ModelConfig.from_dict(text)
    model = init_weights(DeepseekV41(cfg), seed, std)
    drafter = init_weights(DSpark(cfg), seed + 2, std) if cfg.dspark.enabled else None
    tables = EngramTables.random(cfg.engram, seed + 1, pin=False) if cfg.engram.engram_layer_ids else None
    out = save_v41_checkpoint(out_dir, text, model, tables, tokenizer_path or TINY_DIR / "tokenizer.json", quant,
                              shard_bytes, drafter)
    if extra_tensors:
        save_file({k: v.contiguous() for k, v in extra_tensors.items()}, str(out / "model-extra.safetensors"))
        index = json.loads((out / INDEX_FILE).read_text())
        index["weight_map"].update({k: "model-extra.safetensors" for k in extra_tensors})
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return out


def make_random_checkpoint(out_dir: str | Path, seed: int = 0, config: dict | str | Path | None = None,
                           **kw) -> Path:
    """A deterministic random checkpoint in the official layout (`random_v41_checkpoint`): `config` a
    text config dict, a config.json path, or None for the built-in model's shape."""
    if config is None or not isinstance(config, dict):
        d = read_json(Path(config) if config is not None else TINY_DIR / CONFIG_FILE)
        config = d.get("text_config", d)
    return random_v41_checkpoint(out_dir, dict(config), seed, **kw)
