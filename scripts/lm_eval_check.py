"""lm-evaluation-harness's `local-completions` model scoring a multiple-choice task against `engram-serve serve`.

Starts `serve` (the built-in model, or --model DIR) on a free loopback port, runs a small local
multiple-choice task (tests/data/lm_eval_task: a YAML and a JSONL of a few Python questions; nothing is
downloaded) through lm-eval's `loglikelihood` requests (echo + logprobs on /v1/completions, the tokenizer
through the server's /tokenize and /tokenizer_info), and prints the task's accuracy as JSON.

    pip install 'lm-eval==0.4.13'
    python scripts/lm_eval_check.py [--model DIR] [--limit N]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "tests" / "data" / "lm_eval_task"


def run(model: str | None = None, limit: int | None = None) -> dict:
    """{task: {metric: value}} of the local multiple-choice task, scored against a fresh `serve`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    sys.path.insert(0, str(ROOT / "tests"))
    from serve_process import start_serve

    with tempfile.TemporaryDirectory() as tmp:
        task_dir = Path(tmp)
        (task_dir / "engram_mc.yaml").write_text((TASK / "engram_mc.yaml").read_text().replace(
            "DATA_FILE", str(TASK / "engram_mc.jsonl")))
        proc, base = start_serve(["--served-model-name", "engram-tiny", *(["--model", model] if model else [])],
                                 timeout_s=180, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            out = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={"model": "engram-tiny", "base_url": base + "/v1/completions", "num_concurrent": 1,
                            "tokenizer_backend": "remote", "tokenized_requests": True, "max_retries": 1},
                tasks=["engram_mc"], task_manager=TaskManager(include_path=str(task_dir)), limit=limit)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {task: {k: v for k, v in r.items() if isinstance(v, (int, float))} for task, r in out["results"].items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args(argv)
    print(json.dumps(run(args.model, args.limit), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
