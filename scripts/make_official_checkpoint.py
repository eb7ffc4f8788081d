"""Write a DeepSeek-V4.1 checkpoint directory in the official layout, scaled down (or re-quantize one).

    config.json                           nested as published: architectures, model_type, text_config,
                                          vision_config (no layers), quantization_config
    model.safetensors.index.json          {"metadata": {"total_size"}, "weight_map": {name: shard}}
    model-0000k-of-0000n.safetensors      shards of at most --shard-mib each (a bigger tensor gets its own)
    tokenizer.json

Official names and dtypes (docs/deepseek_v41.md): FP8 E4M3 linears with one E8M0 scale per 32x32 block,
routed experts in MXFP4 (`--experts fp8|float` for the other forms), FP8 Engram tables (E8M0 scale per
32 columns), the other matrices in BF16 with `--bf16` (as published) or float32, vectors float32. The
default model is the published V4.1-Flash structure scaled down (engram_serve.model.writer.SMALL_TEXT_CONFIG:
window-only, ratio-2 and ratio-1 layers, kv, index and candidate sources, Engram on two layers, mHC with 4
streams, 4 experts + a shared expert) with random weights and the built-in tokenizer; `--config` takes
another text config (a config.json, nested or flat).

    python scripts/make_official_checkpoint.py --out DIR [--seed 0] [--shard-mib 0.25] [--experts fp4]
    python scripts/make_official_checkpoint.py --out DIR --from CHECKPOINT_DIR   # re-write a checkpoint
    python scripts/make_official_checkpoint.py --out DIR --fast --bf16 --shard-mib 2048 \
        --config scripts/v41_beyond_ram_config.json   # 34.1 GiB, at disk speed

A random checkpoint is a float model quantized (writer.py `random_v41_checkpoint`, about 1 MB/s: for the small
shapes the tests compare with a float reference), or with `--fast` random bytes drawn in the stored formats,
shard by shard (model/random_writer.py: the same names, dtypes, shapes and shards, about disk speed, two
shards in memory at most). scripts/v41_beyond_ram_config.json is a V4.1-shaped text config whose fast
checkpoint is larger than this machine's RAM (34.1 GiB with --bf16: 28.7 GiB of MXFP4 experts, 24 layers
of 384 experts of 2048 x 1024, 3.8 GiB of FP8 Engram tables, 1.1 GiB of BF16 embedding and head).

The built-in model (engram_serve/data/tiny) is its trained checkpoint re-written with
`--from <it> --experts float --bf16 --shard-mib 1024`.

Deterministic: same arguments, same bytes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engram_serve.config import read_json
from engram_serve.model.loader import TOKENIZER_FILE, load_model
from engram_serve.model.random_writer import fast_v41_checkpoint
from engram_serve.model.writer import Quant, random_v41_checkpoint, save_v41_checkpoint


def text_config(path: Path) -> dict:
    """The text model's fields of a config.json, nested (text_config) or flat."""
    d = read_json(path)
    return dict(d.get("text_config", d))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mib", type=float, default=0.25, help="shard size limit in MiB (default 0.25)")
    p.add_argument("--experts", choices=("fp4", "fp8", "float"), default="fp4", help="routed experts (default fp4)")
    p.add_argument("--bf16", action="store_true", help="store the other matrices in BF16 (default float32)")
    p.add_argument("--config", type=Path, default=None, help="a text config (config.json) instead of the small one")
    p.add_argument("--from", dest="src", type=Path, default=None, help="re-write this checkpoint directory instead")
    p.add_argument("--fast", action="store_true", help="random bytes in the stored formats, at disk speed "
                   "(no float model)")
    args = p.parse_args(argv)
    if args.fast and args.src is not None:
        p.error("--fast writes a random checkpoint; --from re-writes one: choose one")
    quant = Quant(experts=None if args.experts == "float" else args.experts, bf16=args.bf16)
    shard = int(args.shard_mib * 2**20)
    if args.src is not None:
        loaded = load_model(args.src, pin_tables=False)
        text = text_config(args.src / "config.json")
        out = save_v41_checkpoint(args.out, text, loaded.model, loaded.tables, args.src / TOKENIZER_FILE, quant, shard,
                                  loaded.drafter)
    else:
        text = None if args.config is None else text_config(args.config)
        write = fast_v41_checkpoint if args.fast else random_v41_checkpoint
        out = write(args.out, text, args.seed, quant, shard_bytes=shard)
    print(f"wrote {out}: {len(list(out.glob('*.safetensors')))} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
