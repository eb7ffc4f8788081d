"""Bits independent of the thread count (docs/exactness.md, "Threads"): the C kernels' pool partitions each call's
independent outputs (output panels, (expert, panel) pairs, tokens, (token, head group) items, rows, columns) in
contiguous ranges, never the terms of a sum, so a model's logits are the same bits on 1, 2, 3 or 4 threads (more
threads than this machine's cores too). With `pool_always` every job of 2 or more items is split, so these small
models run the partitions of a big one. The negative control splits one dot product's inputs across two threads
(`k_halves`) and the same comparison goes red through the real forward. Tensor-parallel ranks share the cores."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engram_serve import kernels, thread_pool
from engram_serve.engine import threads as engine_threads
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import exactness, ops_c
from engram_serve.model.loader import load_model
from engram_serve.model.writer import Quant, random_v41_checkpoint
from engram_serve.runner.model_runner import RunnerConfig
from engram_serve.verify import Workload, run_case, verify
from fp8_tables import fp8_weight
from kernel_hooks import k_halves, pool_always, shared_jobs
from test_exact import write_v41_checkpoint
from v41_fixtures import v41_configs

pytestmark = pytest.mark.skipif(not kernels.loaded("linear", "token") or not thread_pool.built(),
                                reason="needs the linear and token kernels and the kernels' thread pool")

THREADS = (1, 2, 3, 4)
GEN = 3


@pytest.fixture(autouse=True)
def one_thread_after():
    engine_threads.set_torch_threads()  # the engine's count chosen now: an engine built below keeps the pool's size
    yield
    thread_pool.set_threads(1)


def logits_on(loaded, prompts: list[list[int]], threads: int, microbatches: int = 1) -> tuple[torch.Tensor, list]:
    """Every sampled logit row of the workload (in (request, position) order) and the greedy tokens, with the kernels'
    pool at `threads` and every job split."""
    longest = max(map(len, prompts)) + GEN
    cfg = RunnerConfig(max_num_seqs=len(prompts), max_model_len=longest, max_num_batched_tokens=256, block_size=4,
                       num_blocks=len(prompts) * (longest // 4 + 2),
                       microbatch=MicrobatchConfig(microbatches, "tokens", 0, 0, when="always"))
    with thread_pool.threads_set(threads), pool_always():
        assert thread_pool.threads() == threads
        before = shared_jobs()
        rec = run_case(loaded, Workload(prompts, GEN), cfg)
        assert (shared_jobs() > before) == (threads > 1)  # the jobs really ran on several threads
    order = np.lexsort((rec.logit_keys[:, 1], rec.logit_keys[:, 0]))
    return rec.logits[torch.from_numpy(order)], rec.tokens


def prompts_of(seed: int, count: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(6, vocab, size=int(n)).tolist() for n in rng.integers(1, 24, size=count)]


def assert_same_on_every_count(loaded, prompts, microbatches: int = 1) -> None:
    want, want_tokens = logits_on(loaded, prompts, 1, microbatches)
    for n in THREADS[1:]:
        got, tokens = logits_on(loaded, prompts, n, microbatches)
        assert tokens == want_tokens, n
        assert torch.equal(got, want), (n, float((got - want).abs().max()))


def mid_size_calls(seed: int) -> list[torch.Tensor]:
    """The kernels at the mid-size model's shapes, where their jobs split at the default costs: attention of 5
    tokens x 16 heads of 128 over a window with masked keys and picks; the indexer's scores of 3 tokens over 700
    entries (three items of entries a token) with candidate blocks; products of one row (many panels), of 70 rows
    of a 24-column weight (2 panels: rows chunked too), FP8 panels of one row, MXFP4 and FP8 as stored of 16 and 3 rows
    (and on the tiles, 64 and 5 rows); a 64-token prompt's embedding (4 copies), router and column concatenation."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    out = []
    window, entries = r(64, 128), r(40, 128)
    wslots, wok = torch.randint(0, 64, (5, 32), generator=g), torch.rand(5, 32, generator=g) > 0.2
    eslots = torch.randint(0, 40, (5, 20), generator=g)
    topk = torch.randint(-1, 20, (5, 12), generator=g)
    out.append(ops_c.attend_paged(r(5, 16, 128), window, wslots, wok, entries, eslots, topk, 0, r(16), 0.08))
    pool, slots = r(800, 64), torch.randint(0, 800, (3, 700), generator=g)
    count, cands = torch.tensor([700, 350, 1]), torch.randint(-1, 70, (3, 16), generator=g)
    out.append(ops_c.index_scores(r(3, 16, 64), r(3, 16), 0.25, pool, slots, count, 700, 0, cands, 10))
    for m, k, n in ((1, 1024, 520), (70, 512, 24)):
        out.append(exactness.matmul_kernel(r(m, k), exactness.pack_panels(r(n, k).t().contiguous()), n, 256))
    if kernels.get("linear").fp8_supported():
        w = fp8_weight(300, 256, 64, seed)
        out.append(exactness.matmul_fp8(r(1, 256), exactness.pack_fp8(w.t().contiguous()), 300, 256))
    codes = torch.randint(0, 256, (96, 512), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 130, (96, 32), generator=g, dtype=torch.uint8)
    out.append(exactness.matmul_stored(r(16, 1024), exactness.STORED_MXFP4, codes, scales, 96, 256))
    fp8 = torch.randint(0, 120, (96, 1024), generator=g, dtype=torch.uint8)
    out.append(exactness.matmul_stored(r(3, 1024), exactness.STORED_FP8, fp8, scales[:, :8], 96, 256, block=128))
    if exactness.amx_supported(kernels.get("linear")):  # the tiles: 64 rows (their pairs decoded once), 5 rows
        for m in (64, 5):
            out.append(exactness.matmul_stored(r(m, 1024), exactness.STORED_MXFP4 | exactness.AMX, codes, scales, 96, 8))
    out.append(ops_c.gather_rows(r(512, 1024), torch.randint(0, 512, (64,), generator=g), 4))
    ids, w = ops_c.moe_route(r(64, 256), r(256), 8, True, 2.5)
    out.append(torch.cat([ids.view(torch.float32), w], 1))  # one job: the bits of its ids and weights
    out.append(ops_c.cat_cols([r(64, 1024), r(64, 512)]))
    return out


@pytest.mark.parametrize("threads", [2, 3])
def test_the_kernels_at_mid_size_shapes_give_the_same_bits_on_several_threads(threads):
    want = mid_size_calls(threads)
    with thread_pool.threads_set(threads):
        before = shared_jobs()
        got = mid_size_calls(threads)  # the default costs: these calls are big enough to split
        assert shared_jobs() - before >= len(want)
        with pool_always():
            split = mid_size_calls(threads)
    for w, a, b in zip(want, got, split):
        assert torch.equal(w.view(torch.int32), a.view(torch.int32)) and torch.equal(w.view(torch.int32),
                                                                                    b.view(torch.int32))


@settings(max_examples=10, deadline=None)
@given(config=v41_configs(tiny_tokenizer=True), seed=st.integers(0, 2**16), requests=st.integers(1, 3),
       microbatches=st.integers(1, 2))
def test_logits_are_the_same_bits_on_1_2_3_and_4_threads_on_random_v41_configs(tmp_path_factory, config, seed,
                                                                              requests, microbatches):
    path, _ = write_v41_checkpoint(tmp_path_factory.mktemp("v41"), config, seed)
    loaded = load_model(path)
    assert_same_on_every_count(loaded, prompts_of(seed, requests, loaded.config.vocab_size), microbatches)


@pytest.fixture(scope="module", params=["fp8 linears, mxfp4 experts", "fp8 linears and experts, bf16"])
def quantized(request, tmp_path_factory):
    """The small V4.1 checkpoint in the official formats: FP8 block-scaled linears (the FP8 panels of one-row calls)
    and MXFP4 experts kept as stored (the experts' MXFP4 panels), or FP8 experts and BF16 matrices."""
    quant = Quant() if request.param.startswith("fp8 linears, mxfp4") else Quant(experts="fp8", bf16=True)
    return load_model(random_v41_checkpoint(tmp_path_factory.mktemp("q"), seed=3, quant=quant, shard_bytes=1 << 20))


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**16), requests=st.integers(1, 3))
def test_logits_are_the_same_bits_on_every_thread_count_for_fp8_and_mxfp4_checkpoints(quantized, seed, requests):
    assert_same_on_every_count(quantized, prompts_of(seed, requests, quantized.config.vocab_size))


def test_negative_control_a_dot_product_summed_in_halves_on_two_threads_changes_the_logits(quantized):
    """The rule switched off in one place: the linear kernel sums each output's inputs [0, k / 2) and [k / 2, k)
    on two threads and adds them (the k_halves hook). One thread never partitions (the baseline's bits); two do,
    and the logits differ, in their last bits only (the halves decode each weight from its words as the tiles do,
    tiled or not: the same values)."""
    prompts = prompts_of(5, 2, quantized.config.vocab_size)
    want, _ = logits_on(quantized, prompts, 1)
    assert torch.equal(logits_on(quantized, prompts, 2)[0], want)  # the rule on: the same bits
    with k_halves():
        assert torch.equal(logits_on(quantized, prompts, 1)[0], want)  # one thread: no halves
        got, _ = logits_on(quantized, prompts, 2)
    assert not torch.equal(got, want)
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_verify_compares_every_case_on_n_threads_with_the_one_thread_baseline(quantized):
    with thread_pool.threads_set(3), pool_always():
        res = verify(quantized, seed=2, num_requests=2, gen_tokens=4, only=("whole steps", "2 microbatches, tokens"))
    assert res["threads"] == 3 and res["passed"], res
    assert [c["case"] for c in res["cases"]] == ["whole steps, 3 threads", "2 microbatches, tokens policy"]
    with thread_pool.threads_set(2), pool_always(), k_halves():
        res = verify(quantized, seed=2, num_requests=2, gen_tokens=4, only="whole steps")
    assert not res["passed"] and res["cases"][0]["logit_mismatches"] > 0


def test_the_engine_count_sets_the_pool_and_tensor_parallel_ranks_share_the_cores(monkeypatch):
    monkeypatch.setattr(engine_threads, "_chosen", None)
    monkeypatch.setattr(engine_threads, "_ranks", 1)
    before = torch.get_num_threads()
    try:
        assert engine_threads.set_torch_threads(2) == 2 == thread_pool.threads()
        assert engine_threads.share_cores(2) == 1 == thread_pool.threads()  # TP=2 on 2 cores: one thread a rank
        assert engine_threads.set_torch_threads() == 1  # a later engine keeps the rank's share
        assert engine_threads.share_cores(1) == 2 == thread_pool.threads()
        assert engine_threads.rank_threads(32, 3) == 10 and engine_threads.rank_threads(2, 4) == 1
    finally:
        torch.set_num_threads(before)
