"""lm-evaluation-harness 0.4.13's `local-completions` completes a multiple-choice (`loglikelihood`) task
against `engram-serve serve`, on the built-in model and on a V4.1 directory in the official layout
(scripts/lm_eval_check.py; prompt logprobs through echo + logprobs, the tokenizer through the server's
/tokenize and /tokenizer_info). Skips with the install line without lm-eval."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="pip install 'lm-eval[api]==0.4.13' (or pip install -e '.[test]')")


def _run(model=None) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    from lm_eval_check import run
    return run(None if model is None else str(model))


def test_multiple_choice_task_completes_on_the_built_in_model():
    res = _run()["engram_mc"]
    assert res["sample_len"] == 6 and 0.0 <= res["acc,none"] <= 1.0


def test_multiple_choice_task_completes_on_an_official_layout_directory(tmp_path):
    from engram_serve.model.writer import random_v41_checkpoint
    res = _run(random_v41_checkpoint(tmp_path / "v41", seed=4))["engram_mc"]
    assert res["sample_len"] == 6
