"""An official-layout DeepSeek-V4.1 directory (FP8 block-scaled linears, MXFP4 experts, FP8 Engram tables,
sharded) served by `serve` and used through the official `openai` client and `generate`: prompt logprobs
(echo + logprobs) and the logprobs of decoded tokens equal the float64 reference's full-sequence pass on
the dequantized weights within 1e-4, and greedy tokens agree (positions after a near tie excepted)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from openai import OpenAI

from engram_serve.engine.async_engine import AsyncLLMEngine
from engram_serve.engram.quantized import Fp8Table, dequantize_rows
from engram_serve.llm import build_engine
from engram_serve.model.loader import load_model
from engram_serve.model.writer import SMALL_TEXT_CONFIG, Quant, official_tensors, random_v41_checkpoint, with_engram_rows
from engram_serve.server.api import build_app
from engram_serve.server.run import BackgroundServer
from reference_v41 import reference_forward
from v41_fixtures import engram_hash_ids, tiny_token_map

TOL = 1e-4
PROMPT = [(7 * i + 3) % 4000 + 10 for i in range(23)]  # longer than the window (8) and than top-k x ratio (8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return random_v41_checkpoint(tmp_path_factory.mktemp("v41"), seed=11, quant=Quant(), shard_bytes=256 << 10)


@pytest.fixture(scope="module")
def reference_weights(ckpt):
    """The checkpoint's tensors as the model computes with them (dequantized once), under official names."""
    lm = load_model(ckpt)
    w = official_tensors(lm.model, None, Quant(linears=False, experts=None, tables=False))
    for lid, t in zip(lm.tables.layer_ids, lm.tables.tables):
        w[f"layers.{lid}.engram.embed.weight"] = (dequantize_rows(t.weight, t.scale, torch.empty(t.weight.shape))
                                                  if isinstance(t, Fp8Table) else t.float())
    return w


def reference(weights: dict, ids: list[int]):
    cfg = with_engram_rows(dict(SMALL_TEXT_CONFIG))
    return reference_forward(cfg, weights, ids, engram_hash_ids(cfg, ids, token_map=tiny_token_map()))


@pytest.fixture(scope="module")
def client(ckpt):
    engine = AsyncLLMEngine(build_engine(ckpt, max_model_len=256, num_blocks=64, max_num_seqs=4))
    server = BackgroundServer(build_app(engine, "v41")).start()
    yield OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    server.stop()
    engine.shutdown()


def test_prompt_logprobs_equal_the_float64_reference(client, reference_weights):
    ref = reference(reference_weights, PROMPT)
    lp = client.completions.create(model="v41", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0).choices[0].logprobs
    assert lp.token_logprobs[0] is None
    clean = [p for p in range(1, len(PROMPT)) if not ref.tainted(p - 1)]
    diff = max(abs(lp.token_logprobs[p] - float(ref.logprobs[p - 1, PROMPT[p]])) for p in clean)
    assert len(clean) > len(PROMPT) // 2 and diff <= TOL, diff


def test_decoded_tokens_and_logprobs_equal_a_full_sequence_reference_pass(client, reference_weights):
    out = client.completions.create(model="v41", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                    extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    gen = out.model_extra["token_ids"]
    ref = reference(reference_weights, PROMPT + gen)
    for j, tok in enumerate(gen):
        p = len(PROMPT) - 1 + j  # the position whose logits chose token j
        if ref.tainted(p):
            break
        assert int(ref.logprobs[p].argmax()) == tok
        assert abs(out.logprobs.token_logprobs[j] - float(ref.logprobs[p, tok])) <= TOL


def test_generate_runs_on_the_directory(ckpt):
    r = subprocess.run([sys.executable, "-m", "engram_serve.cli", "generate", "def f(x):", "--model", str(ckpt),
                        "--max-tokens", "8", "--seed", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "tokens identical to the unsplit run: yes" in r.stderr
