"""Write a deterministic random DeepSeek-V4.1 checkpoint in the official layout (config.json, a shard index
and its shards, tokenizer.json): engram_serve.model.writer.make_random_checkpoint.

    python scripts/make_random_checkpoint.py --out DIR [--seed 0] [--config PATH] [--tokenizer PATH]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from engram_serve.model.writer import make_random_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="config.json (default: the built-in tiny config)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the built-in tiny one)")
    args = ap.parse_args()
    out = make_random_checkpoint(args.out, args.seed, args.config, tokenizer_path=args.tokenizer)
    size = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    print(f"wrote {out} ({size / 2**20:.1f} MiB of weights)")


if __name__ == "__main__":
    main()
