"""Write a scaled-down DeepSeek-V4.1 checkpoint in the official layout, quantized as published (or convert one).

    config.json                           nested: architectures, model_type, text_config, vision_config,
                                          quantization_config
    model.safetensors.index.json          {"metadata": {"total_size"}, "weight_map": {name: shard}}
    model-0000k-of-0000n.safetensors      shards of at most --shard-mib each (a bigger tensor gets a shard
                                          of its own, as the Engram tables do)
    tokenizer.json

Official names throughout (docs/deepseek_v41.md); the storage is engram_serve/model/writer.py's `Quant()`:
FP8 E4M3 blocks with E8M0 scales for the attention, indexer-query, shared-expert and Engram `wkv` linears,
MXFP4 routed experts, FP8 Engram tables (`layers.{L}.engram.embed.weight` F8_E4M3 [rows, head_dim] with
`layers.{L}.engram.embed.scale` F8_E8M0 [rows, head_dim/32]). The model has the built-in model's shape.

    python scripts/make_official_checkpoint.py --out DIR [--seed 0] [--shard-mib 0.25]
    python scripts/make_official_checkpoint.py --out DIR --from CHECKPOINT_DIR   # re-store a checkpoint quantized

Deterministic: same arguments, same bytes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engram_serve.config import read_json
from engram_serve.engram.quantized import Fp8Table
from engram_serve.engram.tables import EngramTables
from engram_serve.model.loader import CONFIG_FILE, TINY_DIR, TOKENIZER_FILE, load_model
from engram_serve.model.writer import Quant, random_v41_checkpoint, save_v41_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mib", type=float, default=0.25, help="shard size limit in MiB (default 0.25)")
    p.add_argument("--from", dest="src", type=Path, default=None,
                   help="re-store this checkpoint directory quantized instead of writing a random one")
    args = p.parse_args(argv)
    shard_bytes = int(args.shard_mib * 2**20)
    if args.src is not None:
        loaded = load_model(args.src, pin_tables=False)
        raw = read_json(args.src / CONFIG_FILE)
        tabs = loaded.tables
        tables = EngramTables(tabs.layer_ids, [t.dequantize() if isinstance(t, Fp8Table) else t for t in tabs.tables],
                              pin=False)
        out = save_v41_checkpoint(args.out, raw.get("text_config", raw), loaded.model, tables,
                                  args.src / TOKENIZER_FILE, Quant(), shard_bytes)
    else:
        text = read_json(TINY_DIR / CONFIG_FILE)["text_config"]
        out = random_v41_checkpoint(args.out, text, args.seed, Quant(), shard_bytes=shard_bytes)
    print(f"wrote {out}: {len(list(Path(out).glob('model-*.safetensors')))} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
