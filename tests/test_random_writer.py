"""The fast random checkpoint (model/random_writer.py): the slow writer's names, dtypes, shapes and shards; the
same bytes for the same seed; no NaN code; it loads, and its logits are finite and vary with the input."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engram_serve.model import random_writer
from engram_serve.model.loader import load_model
from engram_serve.model.random_writer import fast_v41_checkpoint
from engram_serve.model.writer import Quant, random_v41_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SHARD = 256 << 10


def headers(d: Path) -> tuple[dict, dict]:
    """({name: (dtype, shape, shard file)}, the index metadata) read from the safetensors headers."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for name, f in index["weight_map"].items():
        with safe_open(str(d / f), framework="pt") as h:
            s = h.get_slice(name)
            out[name] = (s.get_dtype(), s.get_shape(), f)
    return out, index["metadata"]


def tensors(d: Path) -> dict[str, bytes]:
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, f in index.items():
        with safe_open(str(d / f), framework="pt") as h:
            out[name] = h.get_tensor(name).view(-1).view(torch.uint8).numpy().tobytes()
    return out


@pytest.fixture(scope="module")
def fast(tmp_path_factory) -> Path:
    return fast_v41_checkpoint(tmp_path_factory.mktemp("fast") / "ckpt", seed=5, quant=Quant(bf16=True),
                               shard_bytes=SHARD)


@pytest.mark.parametrize("quant", [Quant(bf16=True), Quant(), Quant(experts="fp8", tables=False),
                                   Quant(linears=False, experts=None, bf16=True)], ids=str)
def test_headers_equal_the_slow_writers(tmp_path, quant):
    slow = random_v41_checkpoint(tmp_path / "slow", quant=quant, shard_bytes=SHARD)
    quick = fast_v41_checkpoint(tmp_path / "fast", quant=quant, shard_bytes=SHARD)
    (a, meta_a), (b, meta_b) = headers(slow), headers(quick)
    assert len(a) > 250 and len({f for _, _, f in a.values()}) > 3
    assert a == b and meta_a == meta_b
    assert (slow / "config.json").read_text() == (quick / "config.json").read_text()


def test_same_seed_same_bytes_at_any_shard_size_and_the_script_flag(fast, tmp_path):
    again = fast_v41_checkpoint(tmp_path / "again", seed=5, quant=Quant(bf16=True), shard_bytes=SHARD)
    files = sorted(p.name for p in fast.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert all((fast / f).read_bytes() == (again / f).read_bytes() for f in files)
    one = fast_v41_checkpoint(tmp_path / "one", seed=5, quant=Quant(bf16=True), shard_bytes=1 << 30)
    assert len(list(one.glob("*.safetensors"))) == 1 and tensors(one) == tensors(fast)
    other = tensors(fast_v41_checkpoint(tmp_path / "other", seed=6, quant=Quant(bf16=True), shard_bytes=1 << 30))
    name = "layers.2.ffn.experts.0.w1.weight"
    assert other[name] != tensors(one)[name]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_official_checkpoint.py"), "--out", str(tmp_path / "s"),
                    "--fast", "--bf16", "--seed", "5", "--shard-mib", "1024"], check=True, cwd=ROOT,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (tmp_path / "s" / "model-00001-of-00001.safetensors").read_bytes() == \
        (one / "model-00001-of-00001.safetensors").read_bytes()


def test_codes_are_valid_and_random(fast):
    index = json.loads((fast / "model.safetensors.index.json").read_text())["weight_map"]
    seen = {"F8_E4M3": set(), "F8_E8M0": set(), "I8": set()}
    for name, f in index.items():
        with safe_open(str(fast / f), framework="pt") as h:
            t = h.get_tensor(name)
        dtype = headers_dtype(t)
        if dtype in seen:
            seen[dtype] |= set(t.view(torch.uint8).unique().tolist())
    assert not {0x7F, 0xFF} & seen["F8_E4M3"] and len(seen["F8_E4M3"]) == 254  # every code but NaN
    assert 0xFF not in seen["F8_E8M0"] and len(seen["F8_E8M0"]) >= 3
    assert seen["I8"] == set(range(256))  # both E2M1 nibbles take every value


def headers_dtype(t: torch.Tensor) -> str:
    return {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8"}.get(t.dtype, "")


def logits(d: Path, texts: list[str]) -> torch.Tensor:
    m = load_model(d, pin_tables=False)
    out = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([m.tokenizer.encode(text).ids[:6]])
            out.append(m.model.forward_dense(ids, None)[0])
    return torch.stack(out)  # [texts, 6, V]


TEXTS = ["def fibonacci(n): return n", "import os, sys\nprint(os.path)", "the quick brown fox jumps over"]


def test_loads_and_logits_are_finite_and_vary_with_the_input(fast):
    lg = logits(fast, TEXTS)
    assert torch.isfinite(lg).all()
    greedy = lg.argmax(-1)
    assert len(set(greedy.flatten().tolist())) > 8  # not one token everywhere
    assert 0.1 < lg.std(-1).mean() < 100
    from engram_serve.llm import LLM
    from engram_serve.sampling_params import SamplingParams
    out = LLM(str(fast), max_model_len=64).generate(TEXTS, SamplingParams(max_tokens=6, temperature=0.0))
    assert all(len(o.token_ids) == 6 for o in out) and len({tuple(o.token_ids) for o in out}) == 3


def test_control_weights_too_large_give_non_finite_logits(tmp_path, monkeypatch):
    """Negative control: with every scale 2^40 times too large the same check fails."""
    monkeypatch.setattr(random_writer, "std_of", lambda name, logical: 2.0 ** 40)
    d = fast_v41_checkpoint(tmp_path / "big", seed=5, quant=Quant(bf16=True), shard_bytes=SHARD)
    assert not torch.isfinite(logits(d, TEXTS[:1])).all()
