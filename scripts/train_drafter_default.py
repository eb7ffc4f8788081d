"""Reproduce the shipped DSpark drafter of the built-in model: train it (target frozen), measure acceptance on
held-out code, write docs/drafter.md, install the checkpoint (the target's tensors unchanged, plus `mtp.*`).

    python scripts/train_drafter_default.py [more `engram-serve train-drafter` options]

Equivalent to `engram-serve train-drafter --out build/train_drafter_default --report-dir docs --install --steps 2000`
run from the repository root: about 20 minutes on one core (see docs/drafter.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

from engram_serve.train_drafter import build_parser, run_args

ROOT = Path(__file__).resolve().parent.parent
STEPS = 2000  # the shipped run's (the loss still fell at 500)


def main(argv: list[str]) -> int:
    args = ["--out", str(ROOT / "build" / "train_drafter_default"), "--report-dir", str(ROOT / "docs"), "--install",
            "--steps", str(STEPS), *argv]
    command = " ".join(["python scripts/train_drafter_default.py", *argv])
    return run_args(build_parser().parse_args(args), command)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
