"""The serving path against the independent reference model (tests/reference_model.py), over random
configs, workloads, prefill chunks and microbatch cuts. Negative controls break the Engram gate on
purpose (drop the sign, divide by hidden instead of sqrt(hidden)) and the comparison goes red."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve.config import ModelConfig, read_json
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import fused
from engram_serve.model.layers import pointwise
from engram_serve.model.loader import TINY_DIR, load_model, make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.verify import Workload, run_case
from reference_model import ReferenceModel

TOL = 2e-5  # float32 serving vs float64 reference, relative to the largest logit (seen: <= 3e-6)

VARIANTS = {
    "everything": dict(index_topk=5),  # hc_mult 2, MoE, Engram on 2 layers, index sharing with a top-k that bites
    "plain": dict(hc_mult=1, moe_layer_ids=(), n_routed_experts=0, index_layer_ids=(), index_topk=0),
    "wide-hc": dict(hc_mult=3, index_topk=3, num_experts_per_tok=1),
}


def small_config(**over) -> ModelConfig:
    cfg = ModelConfig.from_dict(read_json(TINY_DIR / "config.json"))
    over = {"hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24, "head_dim": 8,
            "num_attention_heads": 4, "num_key_value_heads": 2, **over}
    hc = over.pop("hc_mult", cfg.hc_mult)
    engram = dataclasses.replace(cfg.engram, hidden_size=over["hidden_size"], hc_mult=hc)
    return dataclasses.replace(cfg, engram=engram, hc_mult=hc, **over)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    out = {}
    for name, over in VARIANTS.items():
        lm = load_model(make_random_checkpoint(tmp_path_factory.mktemp(name), seed=11, config=small_config(**over)))
        # larger weights than the init's 0.02, so every term (gate, MoE routing, selection) matters
        with torch.no_grad():
            for n, prm in lm.model.named_parameters():
                if not (n.endswith("norm.weight") or n.endswith(".q_w") or n.endswith(".k_w")):
                    prm.mul_(8.0)
        ref = ReferenceModel(lm.config, lm.model.state_dict(), lm.tables.tables, lm.layout, lm.token_map,
                             int(lm.token_map[lm.config.engram.engram_pad_token_id]))
        out[name] = (lm, ref)
    return out


def serve_and_compare(lm, ref, seed: int, num_requests: int, chunk: int, cut_at: int | None) -> float:
    """Largest |serving - reference| logit difference over every sampled position, relative to the
    largest reference logit."""
    work = Workload.seeded(seed, num_requests, lm.config.vocab_size, gen_tokens=3)
    work.prompts = [p[:24] for p in work.prompts]
    total = sum(map(len, work.prompts))
    cfg = RunnerConfig(max_num_seqs=num_requests, max_model_len=32, max_num_batched_tokens=max(chunk, num_requests),
                       num_blocks=64, block_size=4, microbatch=MicrobatchConfig(2 if cut_at else 1, "tokens", 0, 0, when="always"))
    first = [0, min(cut_at, total - 1), min(total, cfg.max_num_batched_tokens)] if cut_at else None
    if first and not first[0] < first[1] < first[2]:
        first = None
    rec = run_case(lm, work, cfg, first)
    worst = 0.0
    for r, prompt in enumerate(work.prompts):
        full = prompt + rec.tokens[r]
        want = ref.logits(full)
        sel = rec.logit_keys[:, 0] == r
        for (_, pos), got in zip(rec.logit_keys[sel], rec.logits[torch.from_numpy(sel)]):
            worst = max(worst, float((got.double() - want[pos]).abs().max() / want[pos].abs().max()))
    return worst


@settings(max_examples=6, deadline=None)
@given(variant=st.sampled_from(list(VARIANTS)), seed=st.integers(0, 10**6), num_requests=st.integers(1, 3),
       chunk=st.sampled_from([1, 3, 7, 64]), cut_at=st.one_of(st.none(), st.integers(1, 40)))
def test_serving_path_matches_the_independent_reference(worlds, variant, seed, num_requests, chunk, cut_at):
    lm, ref = worlds[variant]
    assert serve_and_compare(lm, ref, seed, num_requests, chunk, cut_at) < TOL


def broken_gate(kind: str):
    """The Engram gate of model/fused.py with one mistake (the sign dropped, or the dot scaled by hidden)."""
    def engram_gate(h, kv, q_w, k_w, dead, eps):
        t, hc, hidden = h.shape
        keys, value = kv[:, :hc * hidden].view(t, hc, hidden), kv[:, hc * hidden:]
        from engram_serve.model.layers import rms_norm
        dot = (rms_norm(h, eps) * q_w * rms_norm(keys, eps) * k_w).sum(-1)
        dot = dot / (hidden if kind == "scale" else math.sqrt(hidden))
        pre = torch.sqrt(dot.abs().clamp(min=1e-6))
        g = pointwise(torch.sigmoid, pre if kind == "sign" else torch.sign(dot) * pre)
        g = g.masked_fill(dead[:, None], 0.0) if dead is not None else g
        return h + g[..., None] * value[:, None, :]
    return engram_gate


@pytest.mark.parametrize("kind", ["sign", "scale"])
def test_negative_control_a_broken_gate_is_caught(worlds, monkeypatch, kind):
    lm, ref = worlds["everything"]
    assert serve_and_compare(lm, ref, 5, 2, 64, None) < TOL  # the comparison passes with the real gate...
    monkeypatch.setattr(fused, "engram_gate", broken_gate(kind))  # what the serving forward calls
    assert serve_and_compare(lm, ref, 5, 2, 64, None) > 10 * TOL  # ...and fails with the broken one
