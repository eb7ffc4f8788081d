"""Engram hash throughput, production vs reference: the same as `engram-serve bench hash`.

    python benchmarks/bench_hash.py [--json] [--sizes 1,64,8192,65536] [--ref-cap 2048] [--threads 1]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engram_serve.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "hash", *sys.argv[1:]]))
