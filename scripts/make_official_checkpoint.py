"""Write a checkpoint directory in the official DeepSeek-V4.1 layout, scaled down (or convert one).

    config.json                           nested: architectures, model_type, text_config, vision_config,
                                          quantization_config (+ official fields this project does not use)
    model.safetensors.index.json          {"metadata": {"total_size"}, "weight_map": {name: shard}}
    model-0000k-of-0000n.safetensors      shards of at most --shard-mib each (a bigger tensor gets a shard
                                          of its own, as the Engram tables do)
    tokenizer.json

Tensor names are the official ones (engram_serve/model/names.py). Engram tables are FP8:
`layers.{L}.engram.embed.weight` F8_E4M3 [rows, head_dim] with `layers.{L}.engram.embed.scale`
F8_E8M0 [rows, head_dim/32]; `layers.{L}.engram.wkv.weight` F8_E4M3 with `.scale` F8_E8M0 per 32x32
block. Other weights stay float32.

    python scripts/make_official_checkpoint.py --out DIR [--seed 0] [--shard-mib 0.25]
    python scripts/make_official_checkpoint.py --out DIR --from NATIVE_DIR   # convert a checkpoint's tables to FP8

Deterministic: same arguments, same bytes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from engram_serve.config import EngramConfig, ModelConfig, read_json
from engram_serve.engram.layout import build_layout
from engram_serve.engram.quantized import Fp8Table, quantize_blocks, quantize_rows
from engram_serve.engram.tables import EngramTables, table_key
from engram_serve.model.loader import CONFIG_FILE, TINY_DIR, TOKENIZER_FILE, load_model
from engram_serve.model.model import EngramModel, init_weights
from engram_serve.model.names import official_name, scale_name

WKV_BLOCK = 32

# The scaled-down model: the built-in tokenizer (4096 tokens, 2726 compressed keys), Engram on layers 1
# and 2 with head_dim 32 (one E8M0 scale per row and layer group of 32 columns), a 4-expert MoE.
SMALL = dict(
    vocab_size=4096, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
    bos_token_id=0, eos_token_id=0, hc_mult=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    moe_layer_ids=[2], index_topk=0, index_layer_ids=[], tie_word_embeddings=False,
    engram_layer_ids=[1, 2], engram_max_ngram_size=3, engram_n_heads=4, engram_head_dim=32,
    engram_vocab_size=4096, engram_compressed_vocab_size=2726, engram_pad_token_id=1,
)
# Fields of the published config that this project does not use (accepted, listed at debug level).
UNUSED_TEXT_FIELDS = dict(
    q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1,
    routed_scaling_factor=2.5, scoring_func="sqrtsoftplus", topk_method="noaux_tc", compress_ratios=[0, 4, 128],
    num_nextn_predict_layers=1, rope_scaling={"type": "yarn", "factor": 4.0}, torch_dtype="bfloat16",
)


def official_config(flat: dict) -> dict:
    text = {**flat, **UNUSED_TEXT_FIELDS}
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 32, "patch_size": 14},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128]},
        "torch_dtype": "bfloat16", "transformers_version": "4.57.0",
    }


def official_tensors(cfg: ModelConfig, model: EngramModel, tables: EngramTables) -> dict[str, torch.Tensor]:
    """Every tensor under its official name; FP8 (+ E8M0 scales) for the Engram tables and wkv."""
    out: dict[str, torch.Tensor] = {}
    for native, t in model.state_dict().items():
        name = official_name(native)
        t = t.detach().float().contiguous()
        if "{e}" in name:  # one tensor per expert
            for e in range(t.shape[0]):
                out[name.replace("{e}", str(e))] = t[e].clone()
        elif native.endswith("engram.wkv.weight"):
            out[name], out[scale_name(name)] = quantize_blocks(t, WKV_BLOCK)
        else:
            out[name] = t
    for lid, tab in zip(tables.layer_ids, tables.tables):
        name = official_name(table_key(lid))
        w, s = (tab.weight, tab.scale) if isinstance(tab, Fp8Table) else quantize_rows(tab.float())
        out[name], out[scale_name(name)] = w.contiguous(), s.contiguous()
    return out


def write_sharded(out: Path, tensors: dict[str, torch.Tensor], shard_bytes: int) -> list[str]:
    """Greedy shards in name order, each at most shard_bytes unless one tensor alone is bigger."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    files, weight_map = [], {}
    for k, names in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mib", type=float, default=0.25, help="shard size limit in MiB (default 0.25)")
    p.add_argument("--from", dest="src", type=Path, default=None,
                   help="convert this native checkpoint directory instead of writing a random one")
    args = p.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.src is not None:
        loaded = load_model(args.src, pin_tables=False)
        cfg, model, tables, tok_path = loaded.config, loaded.model, loaded.tables, args.src / TOKENIZER_FILE
        flat = cfg.to_dict()
        for k in list(flat):
            if k in cfg.extra:
                del flat[k]
    else:
        flat = dict(SMALL)
        flat["engram_num_embeddings"] = build_layout(EngramConfig.from_dict({**flat, "engram_num_embeddings": [0, 0]}), check_rows=False).table_rows
        cfg = ModelConfig.from_dict(flat)
        model = init_weights(EngramModel(cfg), args.seed)
        tables = EngramTables.random(cfg.engram, args.seed + 1, pin=False)
        tok_path = TINY_DIR / TOKENIZER_FILE
    if cfg.engram.engram_head_dim % 32:
        raise SystemExit(f"engram_head_dim={cfg.engram.engram_head_dim}: FP8 tables need a multiple of 32")
    (out / CONFIG_FILE).write_text(json.dumps(official_config(flat), indent=2) + "\n")
    files = write_sharded(out, official_tensors(cfg, model, tables), int(args.shard_mib * 2**20))
    shutil.copyfile(tok_path, out / TOKENIZER_FILE)
    print(f"wrote {out}: {len(files)} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
