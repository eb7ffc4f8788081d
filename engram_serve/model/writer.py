"""Write a DeepSeek-V4.1 checkpoint directory in the official layout (what `load_v41_model` reads).

    config.json                       nested as published: architectures, model_type, quantization_config,
                                      text_config (the text model's fields), vision_config
    model.safetensors.index.json      {"metadata": {"total_size"}, "weight_map": {name: shard}}
    model-0000k-of-0000n.safetensors  shards of at most `shard_bytes` each (a bigger tensor gets its own)
    tokenizer.json

Official names throughout (docs/deepseek_v41.md). Quantized as published where asked (`Quant`):
FP8 E4M3 with one E8M0 scale per 32x32 block for the attention, indexer-query, shared-expert and
Engram `wkv` linears; the routed experts in MXFP4 (or FP8 blocks, or float); the Engram tables as FP8
rows with one E8M0 scale per 32 columns. Everything else (norms, mHC, sinks, router, compressor,
indexer keys and weights, embeddings, head) stays float32. Deterministic: same inputs, same bytes.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..engram.quantized import quantize_blocks, quantize_fp4, quantize_rows
from ..engram.tables import EngramTables
from .checkpoint import INDEX_FILE

FP8_BLOCK = 32
FP8_LINEARS = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                         r"|engram\.wkv)\.weight")
EXPERTS = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")


@dataclass(frozen=True)
class Quant:
    """What is stored quantized: `linears` FP8 blocks; `experts` "fp4" (MXFP4), "fp8" or None (float);
    `tables` FP8 rows."""

    linears: bool = True
    experts: str | None = "fp4"
    tables: bool = True

    def config(self) -> dict:
        """The published `quantization_config` for this choice ({} when nothing is quantized)."""
        if not (self.linears or self.experts or self.tables):
            return {}
        q = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
             "scale_fmt": "ue8m0"}
        return {**q, "expert_dtype": "fp4"} if self.experts == "fp4" else q


def official_tensors(model, tables: EngramTables | None, quant: Quant) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by official name: the model's parameters (its stacked experts split
    into one tensor per expert and projection) and the Engram tables, quantized per `quant`."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        m = re.fullmatch(r"(layers\.\d+\.ffn)\.(w13|w2)", name)
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
    if tables is not None:
        for lid, table in zip(tables.layer_ids, tables.tables):
            out[f"layers.{lid}.engram.embed.weight"] = table
    stored = {}
    for name, t in out.items():
        t = t.detach().float().contiguous()
        base = name[: -len(".weight")]
        if name.endswith(".engram.embed.weight") and quant.tables:
            stored[name], stored[base + ".scale"] = quantize_rows(t)
        elif EXPERTS.fullmatch(name) and quant.experts == "fp4":
            stored[name], stored[base + ".scale"] = quantize_fp4(t)
        elif (EXPERTS.fullmatch(name) and quant.experts == "fp8") or (FP8_LINEARS.fullmatch(name) and quant.linears):
            stored[name], stored[base + ".scale"] = quantize_blocks(t, FP8_BLOCK)
        else:
            stored[name] = t
    return stored


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
                        tokenizer_path: str | Path, quant: Quant = Quant(), shard_bytes: int = 64 << 20) -> Path:
    """Write the directory; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(nested_config(text_config, quant), indent=2) + "\n")
    stored = official_tensors(model, tables, quant)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(stored):
        n = stored[name].numel() * stored[name].element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = stored[name]
        size += n
    weight_map = {}
    for k, part in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in part})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if Path(tokenizer_path).resolve() != (out / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_path, out / "tokenizer.json")
    return out
