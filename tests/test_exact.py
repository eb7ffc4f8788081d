"""Bit-exactness (docs/contract.md §9): a request's logits and tokens are bit-identical whether it runs alone or
beside 0 to 31 other requests, whole or cut into 2 or 3 microbatches at forced cuts, in prefill chunks
of 1, 3, 17 tokens or unlimited, padded into static (graph) buffers, recomputed after preemption, or
on a reused prefix. The negative control turns the batch-invariance rules off (matmul rows padded to
a fixed tile, vectorised elementwise tails) and the same comparison goes red. The same holds for the
torch forms alone (the C kernels switched off), with the same negative control."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import exactness, layers
from engram_serve.model.loader import load_model, make_random_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.verify import Workload, run_case

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
                                 "every rule (exact=False)"])
def test_negative_control_without_the_batch_invariance_rules_logits_differ(loaded, monkeypatch, off):
    """Alone, the target's decode steps hold one row; in a batch they hold many. Without the C matmul
    kernel and the fixed-tile rule (MKL's 1-row kernel), or with a kernel that sums a call of few rows
    in other blocks than a bigger call (as BLAS small-call kernels do), the bits differ."""
    work = workload(1, 7, loaded.config.vocab_size)
    alone, _ = run(loaded, Workload(work.prompts[:1], GEN))  # with the rules on, the case passes
    assert torch.equal(alone, run(loaded, work, microbatches=2)[0])
    exact = True
    monkeypatch.setattr(exactness, "_plans", {})  # the rules below are consulted afresh
    if off.startswith("fixed"):
        monkeypatch.setattr(exactness, "min_rows", lambda weight: 1)
        monkeypatch.setattr(exactness, "small_call_kc", lambda weight: None)
    elif off.startswith("matmul kernel"):
        if exactness.pad_rows(layers.matmul_weights(loaded.model)) != 1:
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
    `pointwise`, the chunked attention kernels) and keep the bit-exact claim on their own; with every
    rule off (exact=False) they do not."""
    work = workload(2, 7, loaded.config.vocab_size)
    with kernels.override(spec):
        alone, _ = run(loaded, Workload(work.prompts[:1], GEN))
        assert torch.equal(alone, run(loaded, work, microbatches=2)[0])
        alone, _ = run(loaded, Workload(work.prompts[:1], GEN), exact=False)
        assert not torch.equal(alone, run(loaded, work, microbatches=2, exact=False)[0])
