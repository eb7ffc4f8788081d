"""Reproduce the shipped tiny model: train, run the ablation, write docs/, install the weights.

    python scripts/train_default.py [more `engram-serve train` options]

Equivalent to `engram-serve train --out build/train_default --report-dir docs --install` run from the
repository root: about 20-25 minutes on 2 CPU cores (see docs/TRAINING.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

from engram_serve.train import build_parser, run_args

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    args = ["--out", str(ROOT / "build" / "train_default"), "--report-dir", str(ROOT / "docs"), "--install", *argv]
    command = " ".join(["python scripts/train_default.py", *argv])
    return run_args(build_parser().parse_args(args), command)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
