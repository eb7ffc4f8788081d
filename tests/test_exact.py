"""Bit-exactness (docs/contract.md §9): a request's logits and tokens are bit-identical whether it runs alone or
beside 0 to 31 other requests, whole or cut into 2 or 3 microbatches at forced cuts, in prefill chunks
of 1, 3, 17 tokens or unlimited, padded into static (graph) buffers, recomputed after preemption, or
on a reused prefix. The negative control turns the batch-invariance rules off (matmul rows padded to
a fixed tile, vectorised elementwise tails) and the same comparison goes red. The same holds for the
torch forms alone (the C kernels switched off), with the same negative control.

The same sweep on random DeepSeek-V4.1 configs (tests/support/v41_fixtures.py: layer roles, ratios 0/1/2, windows,
top-k, candidate blocks, experts, hc_mult, one or more Engram layers; random weights written in the official
layout):
cut offsets anywhere (inside ratio-2 pairs too), chunk sizes, batch mates (one sharing the target's prefix),
block sizes odd and even, preemption and prefix reuse. There the target's logits also equal, bit for bit,
`forward_dense` over its whole sequence: the function tests/reference/test_model_vs_reference.py holds against the
float64 reference."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.config import ModelConfig
from engram_serve.engram.tables import EngramTables
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import exactness, layers, products
from engram_serve.model.deepseek_v41 import DeepseekV41
from engram_serve.model.loader import load_model, model_state_from_official
from engram_serve.model.writer import Quant, make_random_checkpoint, save_v41_checkpoint
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from engram_serve.verify import Workload, run_case
from v41_fixtures import TINY_TOKENIZER, engram_hash_ids, random_v41_weights, v41_configs

GEN = 5


@pytest.fixture(scope="module", params=["built-in", "random"])
def loaded(request, tmp_path_factory):
    if request.param == "built-in":
        return load_model()
    return load_model(make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=4))


def workload(seed: int, mates: int, vocab: int) -> Workload:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 71, size=mates + 1)
    return Workload([rng.integers(6, vocab, size=int(n)).tolist() for n in lens], GEN)


def target_logits(rec) -> tuple[torch.Tensor, list[int]]:
    """Request 0's sampled logits in position order, and its tokens."""
    sel = rec.logit_keys[:, 0] == 0
    order = np.argsort(rec.logit_keys[sel, 1], kind="stable")
    return rec.logits[torch.from_numpy(np.flatnonzero(sel)[order])], rec.tokens[0]


def run(loaded, work: Workload, *, microbatches=1, policy="tokens", chunk=None, graph=False, small_pool=False,
        reuse=False, exact=True):
    n = len(work.prompts)
    chunk = chunk or 2048
    budget = max(chunk, n)
    cfg = RunnerConfig(max_num_seqs=n, max_model_len=96, max_num_batched_tokens=budget,
                       num_blocks=(96 // 16 + 2) if small_pool else 16 * n + 16, block_size=16,
                       microbatch=MicrobatchConfig(microbatches, policy, 0, 0, when="always"), exact=exact,
                       graph_sizes=tuple(s for s in (8, 32, 128, 512) if s < budget) + (budget,) if graph else ())
    return target_logits(run_case(loaded, work, cfg, reuse_prefix=reuse))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10**6), mates=st.sampled_from([0, 1, 3, 7, 31]), microbatches=st.integers(1, 3),
       policy=st.sampled_from(["tokens", "requests"]), chunk=st.sampled_from([None, 1, 3, 17]),
       graph=st.booleans(), small_pool=st.booleans(), reuse=st.booleans())
def test_a_request_is_bit_identical_alone_and_in_any_batch(loaded, seed, mates, microbatches, policy, chunk, graph,
                                                          small_pool, reuse):
    work = workload(seed, mates, loaded.config.vocab_size)
    alone_logits, alone_tokens = run(loaded, Workload(work.prompts[:1], GEN))
    logits, tokens = run(loaded, work, microbatches=microbatches, policy=policy, chunk=chunk, graph=graph,
                         small_pool=small_pool and mates > 0, reuse=reuse)
    assert tokens == alone_tokens
    assert torch.equal(logits, alone_logits), float((logits - alone_logits).abs().max())


@pytest.mark.parametrize("off", ["fixed matmul tile only", "matmul kernel in another order for few rows",
                                 "float kernel for few rows of bfloat16 weights", "every rule (exact=False)"])
def test_negative_control_without_the_batch_invariance_rules_logits_differ(loaded, monkeypatch, off):
    """Alone, the target's decode steps hold one row; in a batch they hold many. Without the C matmul
    kernel and the fixed-tile rule (MKL's 1-row kernel), or with a kernel that sums a call of few rows
    in other blocks than a bigger call (as BLAS small-call kernels do), or with the bfloat16 weights' tiles
    left to a float matmul for few rows, the bits differ. (The first two turn the tiles off: they hold the
    float kernel's rules.)"""
    work = workload(1, 7, loaded.config.vocab_size)
    alone, _ = run(loaded, Workload(work.prompts[:1], GEN))  # with the rules on, the case passes
    assert torch.equal(alone, run(loaded, work, microbatches=2)[0])
    exact = True
    monkeypatch.setattr(products, "_plans", {})  # the rules below are consulted afresh
    if not off.startswith("float kernel"):
        monkeypatch.setattr(exactness, "amx_supported", lambda kernel: False)
    if off.startswith("float kernel"):
        if not products.plan(loaded.model.head.weight).is_tiles:
            pytest.skip("no bfloat16 tiles: a float32 model, or no AMX here (exactness.amx_supported)")
        tiles = exactness.matmul_bf16

        def few_rows_in_float(x, t, n):
            w = t.permute(1, 3, 0, 2).reshape(-1, t.shape[0] * t.shape[2]).view(torch.bfloat16).float()
            return tiles(x, t, n) if x.shape[0] > 3 else x @ w[:x.shape[1], :n]
        monkeypatch.setattr(exactness, "matmul_bf16", few_rows_in_float)
    elif off.startswith("fixed"):
        monkeypatch.setattr(exactness, "min_rows", lambda weight: 1)
        monkeypatch.setattr(exactness, "small_call_kc", lambda weight: None)
    elif off.startswith("matmul kernel"):
        if products.pad_rows(layers.matmul_weights(loaded.model)) != 1:
            pytest.skip("the C matmul kernel does not serve this model's matmuls here")
        kernel = exactness.matmul_kernel
        monkeypatch.setattr(exactness, "matmul_kernel", lambda x, panels, n, kc, *args, **kw: kernel(
            x, panels, n, kc if x.shape[0] > 3 else kc // 2 + 1, *args, **kw))
    else:
        exact = False
    alone, _ = run(loaded, Workload(work.prompts[:1], GEN), exact=exact)
    batched, _ = run(loaded, work, microbatches=2, exact=exact)
    assert not torch.equal(alone, batched)


@pytest.mark.parametrize("spec", ["none", "-linear"])
def test_the_torch_forms_keep_the_rules_and_their_negative_control_fails(loaded, spec):
    """With the C kernels switched off (engram_serve/kernels.py), the torch forms run (padded matmul calls,
    `pointwise`, attention and indexer in fixed chunks) and keep the bit-exact claim on their own; with every
    rule off (exact=False) they do not."""
    work = workload(2, 7, loaded.config.vocab_size)
    with kernels.override(spec):
        alone, _ = run(loaded, Workload(work.prompts[:1], GEN))
        assert torch.equal(alone, run(loaded, work, microbatches=2)[0])
        alone, _ = run(loaded, Workload(work.prompts[:1], GEN), exact=False)
        assert not torch.equal(alone, run(loaded, work, microbatches=2, exact=False)[0])


# ---- random DeepSeek-V4.1 configs ----------------------------------------------------------------------

def write_v41_checkpoint(path, config: dict, seed: int):
    """`config`'s model with tests/support/v41_fixtures.py's random weights (activations O(1)), in the official
    layout, float32; returns (directory, weights by official name)."""
    weights = random_v41_weights(config, seed)
    cfg = ModelConfig.from_dict(config)
    model = DeepseekV41(cfg)
    model.load_state_dict(model_state_from_official(model, weights))
    ids = cfg.engram.engram_layer_ids
    tables = EngramTables(ids, [weights[f"layers.{lid}.engram.embed.weight"] for lid in ids], pin=False) if ids else None
    return save_v41_checkpoint(path, config, model, tables, TINY_TOKENIZER, Quant(False, None, False)), weights


class CutAt(ModelRunner):
    """Cuts every step with more than one token at the fractions `at` of its tokens (a test's choice of
    where microbatch boundaries fall; the protections are all on)."""

    at: tuple[float, ...] = (0.5,)

    def plan(self, batch, microbatch=None):
        t, n = batch.num_tokens, self.cfg.microbatch.num_microbatches
        inner = sorted({min(t - 1, max(1, round(f * t))) for f in self.at[:n - 1]}) if t > 1 else []
        return [0, *inner, t]


def dense_logits(loaded, config: dict, weights: dict, tokens: list[int]) -> torch.Tensor:
    """[S, V] logits of the whole sequence through forward_dense, with its Engram rows."""
    hashes = engram_hash_ids(config, tokens, token_map=loaded.token_map)
    rows = [weights[f"layers.{lid}.engram.embed.weight"][hashes[lid]][None] for lid in config["engram_layer_ids"]]
    with torch.no_grad():
        return loaded.model.forward_dense(torch.tensor([tokens]), rows or None)[0]


@settings(max_examples=10, deadline=None)
@given(config=v41_configs(tiny_tokenizer=True).filter(lambda c: c["engram_layer_ids"]), seed=st.integers(0, 2**16), mates=st.sampled_from([0, 1, 3, 5]),
       microbatches=st.integers(1, 3), at=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=2),
       chunk=st.sampled_from([None, 1, 3, 5, 17]), block=st.sampled_from([3, 4, 5, 16]), graph=st.booleans(),
       small_pool=st.booleans(), reuse=st.booleans(), shared_prefix=st.integers(0, 12))
def test_a_row_alone_equals_the_same_row_in_a_busy_batch_on_random_v41_configs(
        tmp_path_factory, config, seed, mates, microbatches, at, chunk, block, graph, small_pool, reuse, shared_prefix):
    path, weights = write_v41_checkpoint(tmp_path_factory.mktemp("v41"), config, seed)
    loaded = load_model(path)
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 31, size=mates + 1)
    prompts = [rng.integers(6, 4096, size=int(n)).tolist() for n in lens]
    if mates and shared_prefix:  # a mate that starts with the target's first tokens (a prefix-cache hit)
        prompts[1] = prompts[0][:shared_prefix] + prompts[1]
    work = Workload(prompts, GEN)
    n = len(prompts)
    longest = max(map(len, prompts)) + GEN
    budget = max(chunk or 256, n)

    def runner_config(microbatches: int, **kw) -> RunnerConfig:
        return RunnerConfig(max_num_seqs=n, max_model_len=longest, max_num_batched_tokens=budget, block_size=block,
                            num_blocks=n * (longest // block + 1), microbatch=MicrobatchConfig(
                                microbatches, "tokens", 0, 0, when="always"), **kw)
    alone = run_case(loaded, Workload(prompts[:1], GEN), runner_config(1))
    cut = type("Cut", (CutAt,), {"at": tuple(at)})
    busy_cfg = runner_config(microbatches, graph_sizes=tuple(s for s in (8, 32) if s < budget) + (budget,) if graph else ())
    if small_pool and mates:  # room for the longest request and a little more: the others get preempted
        busy_cfg = RunnerConfig(**{**busy_cfg.__dict__, "num_blocks": longest // block + 2})
    busy = run_case(loaded, work, busy_cfg, reuse_prefix=reuse, runner_cls=cut)
    want, want_tokens = target_logits(alone)
    got, tokens = target_logits(busy)
    assert tokens == want_tokens
    assert torch.equal(got, want), float((got - want).abs().max())
    dense = dense_logits(loaded, config, weights, prompts[0] + want_tokens)  # the sampled positions' logits
    assert torch.equal(dense[len(prompts[0]) - 1:len(prompts[0]) - 1 + GEN], want)
