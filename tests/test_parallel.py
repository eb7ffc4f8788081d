"""Tensor parallelism, 2 ranks, gloo on CPU: verify at TP=2, the in-flight ownership negative control,
the order rule of the cross-rank sum, and the row-sharded tables. (The server with 2 ranks and a
worker killed mid-stream: tests/test_parallel_serve.py.)"""
import dataclasses
import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engram_serve.engram.tables import EngramTables
from engram_serve.errors import OwnershipError
from engram_serve.microbatch.plan import MicrobatchConfig
from engram_serve.model import ops
from engram_serve.model.loader import load_model
from engram_serve.model.deepseek_v41 import run_stages
from engram_serve.parallel.collectives import COMM, rank_ordered_sum
from engram_serve.parallel.launch import TPCluster, bind_cpus
from engram_serve.parallel.runner import ParallelModelRunner
from engram_serve.parallel.tables import ShardedEngramTables
from engram_serve.runner.model_runner import ModelRunner, RunnerConfig
from engram_serve.verify import Workload, run_case, verify


class SharedCommRunner(ParallelModelRunner):
    """NEGATIVE CONTROL (tests only): one communication buffer shared by every microbatch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for b in self.bufs[1:]:
            b.scratch[COMM] = self.bufs[0].scratch[COMM]


@pytest.fixture(scope="module")
def cluster():
    c = TPCluster(None, 2, timeout_s=30)
    yield c
    c.close()
    assert all(not p.is_alive() for p in c.procs)


@pytest.fixture(scope="module")
def reference():
    return load_model()


def test_verify_tp2_across_cuts_and_against_one_process(cluster, reference):
    res = verify(cluster.loaded, seed=1, num_requests=4, gen_tokens=6, make_runner=cluster.make_runner,
                 reference=reference, only=("2 microbatches, tokens", "3 microbatches, requests", "chunk 17",
                                            "graph mode", "first step cut at token 1", "cut at token 2"))
    assert len(res["cases"]) >= 6
    assert res["straddling_rows"] > 0
    assert res["hash_mismatches"] == 0 and res["row_mismatches"] == 0  # staged (sharded) rows bit for bit
    assert res["greedy_mismatches"] == 0 and res["passed"], res
    one = res["vs_single_process"]  # across parallel sizes: same greedy tokens, logits to the last bits
    assert one["greedy_mismatches"] == 0 and one["hash_mismatches"] == 0
    assert one["max_abs_logit_diff"] < 1e-4
    print("TP=2 vs one process: max |logit diff|", one["max_abs_logit_diff"])


def test_a_step_scoring_every_token_runs_whole_on_every_rank(cluster, reference):
    """Prompt logprobs: the step's last layer runs on every token, on the workers too (they get the scored rows
    with the step, else their collectives would not match rank 0's); then a step reading the last tokens alone."""
    cfg = RunnerConfig(max_num_seqs=2, max_model_len=128, max_num_batched_tokens=64, num_blocks=16)
    got = []
    for r in (cluster.make_runner(cfg), ModelRunner(reference, cfg)):
        rng = np.random.default_rng(3)
        slots = np.array([r.store.add(rng.integers(6, 4096, n).tolist()) for n in (20, 9)])
        b = r.build(slots, np.zeros(2, int), np.array([20, 9]), np.arange(16).reshape(2, 8), np.ones(2, bool))
        scored = r.execute(b, score_rows=[0])
        got.append((scored.scored, scored.logits, r.execute(b).logits))
    for tp, one in zip(*got):
        assert tp.shape == one.shape and torch.equal(tp.argmax(-1), one.argmax(-1))
        assert (tp - one).abs().max() < 1e-4
    assert got[0][0].shape[0] == 20 and torch.equal(got[0][1], got[0][2])


def _cfg(work, **kw):
    total = sum(map(len, work.prompts))
    return RunnerConfig(max_num_seqs=len(work.prompts), max_model_len=128, max_num_batched_tokens=total,
                        num_blocks=64, microbatch=MicrobatchConfig(2, "tokens", 0, 0), **kw)


def test_shared_comm_buffer_corrupts_logits_and_the_checker_names_it(cluster):
    work = Workload.seeded(3, 3, cluster.loaded.config.vocab_size, gen_tokens=1)
    cfg = _cfg(work)
    good = run_case(cluster.loaded, work, cfg, max_steps=1, make_runner=cluster.make_runner)
    shared = run_case(cluster.loaded, work, cfg, max_steps=1,
                      make_runner=lambda c: cluster.make_runner(c, SharedCommRunner))
    assert np.array_equal(good.logit_keys, shared.logit_keys)
    bad = ~torch.isfinite(shared.logits).all(1) | (shared.logits != good.logits).any(1)
    assert bad.any(), "a communication buffer shared by both microbatches left the logits intact"
    print(f"shared buffer: {int(bad.sum())}/{len(bad)} sampled rows wrong, max |diff| "
          f"{float((shared.logits - good.logits).abs().nan_to_num(float('inf')).max()):.3g}")
    with pytest.raises(OwnershipError, match=r"'comm'.*in flight.*microbatch 0.*microbatch 1"):
        run_case(cluster.loaded, work, dataclasses.replace(cfg, debug_ownership=True), max_steps=1,
                 make_runner=lambda c: cluster.make_runner(c, SharedCommRunner))
    # positive control: the same check with per-microbatch buffers passes, and the group still works
    ok = run_case(cluster.loaded, work, dataclasses.replace(cfg, debug_ownership=True), max_steps=1,
                  make_runner=cluster.make_runner)
    assert torch.equal(ok.logits, good.logits)


@given(st.integers(1, 40), st.integers(2, 4), st.integers(0, 2**31 - 1))
def test_rank_ordered_sum_is_independent_of_the_token_count(n, world, seed):
    """Each token's sum is the same chain of additions whether it is summed alone or among n tokens."""
    g = torch.randn(world, n, 33, generator=torch.Generator().manual_seed(seed)) * 1e3
    whole = rank_ordered_sum(g)
    for t in range(n):
        assert torch.equal(rank_ordered_sum(g[:, t:t + 1].contiguous())[0], whole[t])
    plain = g[0].clone()
    for r in range(1, world):  # the plain loop: ((g0 + g1) + g2) ...
        plain = plain + g[r]
    assert torch.equal(plain, whole)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=3), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_sharded_tables_partition_rows_and_sum_to_the_full_gather(rows, world, seed):
    g = torch.Generator().manual_seed(seed)
    full = EngramTables(list(range(len(rows))), [torch.randn(r, 4, generator=g) for r in rows], pin=False)
    shards = [ShardedEngramTables(full, r, world, pin=False) for r in range(world)]
    for layer, t in enumerate(full.tables):
        assert sum(s.tables[layer].shape[0] - 1 for s in shards) == t.shape[0]  # rows partitioned (+ a zero row)
        assert all(s.tables[layer].shape[0] - 1 <= -(-t.shape[0] // world) for s in shards)  # no rank holds it all
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.stack([rng.integers(0, r, size=(7, 5)) for r in rows], axis=1))  # [T, L, C]
    want = full.gather(ids, torch.empty(len(rows), 7, 5, 4))
    parts = [s.gather(ids, torch.full_like(want, float("nan"))) for s in shards]
    assert torch.equal(rank_ordered_sum(torch.stack(parts)), want)  # exactly one rank holds each row
    owned = torch.stack([(p != 0).any(-1) for p in parts]).sum(0)  # [L, T, C] ranks with a nonzero row
    assert (owned <= 1).all()


def test_in_flight_buffer_belongs_to_its_microbatch_until_waited():
    from engram_serve.runner.ownership import OwnershipTracker
    buf, other = torch.zeros(8), torch.zeros(8)
    t = OwnershipTracker()
    t.launch("comm", buf[:4], 0)
    with pytest.raises(OwnershipError, match=r"'comm' has a collective in flight.*microbatch 0.*microbatch 1"):
        t.touch("comm", buf[4:], 1)  # another microbatch, another view of the same storage
    with pytest.raises(OwnershipError, match=r"in flight.*microbatch 0.*touched by microbatch 0"):
        t.launch("comm", buf, 0)  # the owner's own next launch before its wait
    with pytest.raises(OwnershipError, match="does not own"):
        t.land("comm", buf, 1)
    t.land("comm", buf, 0)
    t.touch("comm", buf, 0)  # landed: the owner may read it
    t.launch("comm", other, 1)
    with pytest.raises(OwnershipError, match=r"owned by microbatch 0.*touched by microbatch 1"):
        t.touch("comm", buf, 1)


def _sums_under_a_simulated_link(group, seconds: float):
    """On every rank: a sum launched over a SIMULATED link of `seconds`, awaited after `seconds` of compute
    (another microbatch's stage); then one awaited at once. Returns the three durations and the sum."""
    from engram_serve.parallel.collectives import launch_sum, sum_now
    from engram_serve.bench.link import LinkDelay, configure_link
    sum_now(group, torch.zeros(1), "align")  # both ranks here (a worker imports this module first)
    configure_link(group, LinkDelay(seconds), True)
    try:
        x = torch.full((4, 8), float(group.rank + 1))
        t0 = time.perf_counter()
        pending = launch_sum(group, x, None, "test")
        launch_s = time.perf_counter() - t0
        a = torch.randn(64, 64)
        while time.perf_counter() - t0 < seconds:  # compute while the sum is in flight
            a = torch.tanh(a @ a)
        t1 = time.perf_counter()
        out = pending.wait()
        overlapped_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        launch_sum(group, x, None, "test").wait()
        direct_s = time.perf_counter() - t2
    finally:
        configure_link(group, None, True)
    return launch_s, overlapped_s, direct_s, out


def test_simulated_link_delay_elapses_while_the_launcher_computes(cluster):
    """The simulated link delays the completion, not the launch: compute after the launch hides it."""
    d = 0.3
    launch_s, overlapped_s, direct_s, out = cluster.call_all(_sums_under_a_simulated_link, d)
    assert torch.equal(out, torch.full((4, 8), 3.0))
    assert launch_s < d / 3, f"the launch blocked for {launch_s:.3f} s"
    assert overlapped_s < d / 3, f"{overlapped_s:.3f} s left to wait after {d} s of compute"
    assert direct_s >= d * 0.95, f"a sum awaited at once took {direct_s:.3f} s over a {d} s link"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_bind_cpus_gives_every_thread_of_each_rank_its_own_cores(cluster):
    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2

    def threads(pid):
        return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}
    try:
        assert cluster.call_all(bind_cpus, cores, True) == cores[:half]
        assert set(map(tuple, threads(os.getpid()).values())) == {tuple(cores[:half])}
        assert set(map(tuple, threads(cluster.pids[0]).values())) == {tuple(cores[half:2 * half])}
    finally:
        cluster.call_all(bind_cpus, cores, False)
    assert sorted(os.sched_getaffinity(0)) == cores
    assert set(map(tuple, threads(cluster.pids[0]).values())) == {tuple(cores)}


def test_bench_hidden_fraction_is_exposed_comm_removed_over_the_off_steps():
    from engram_serve.bench.step_tp import _row
    m = {"tokens": 8, "times": {"off": [100.0, 110.0, 90.0], "sync": [120.0] * 3, "overlap": [80.0, 85.0, 90.0],
                                "planner": [100.0, 100.0, 100.0]},
         "exposed": {"off": [20.0] * 3, "sync": [40.0] * 3, "overlap": [5.0] * 3, "planner": [20.0] * 3},
         "planner_microbatched": [False, True, False], "planner_prediction_error": 0.1}
    r = _row(m)
    assert r["planner_speedup_median"] == 1.0 and r["planner_microbatched_share"] == 1 / 3
    assert r["comm_hidden_by_overlap"] == 0.75  # (20 - 5) / 20
    assert r["overlap_comm_hidden"] == 0.875  # 1 - 5 / 40: of the overlap's own collectives
    assert r["comm_share_of_off_step"] == 0.2 and r["overlap_speedup_over_off"] == 100 / 85
    assert r["paired_speedup_median"] == 1.25  # median of the per-round ratios 1.25, 1.294, 1.0
    assert r["ideal_overlap_speedup"] == 100 / 80  # the cut step computes 120 - 40 = 80 ms, communicates 40
    assert r["ideal_comm_hidden"] == 1.0  # its 40 ms fit inside its 80 ms of compute
    m["exposed"]["sync"] = [70.0] * 3  # latency-bound sums, doubled by the cut: more than the compute
    r = _row(m)
    assert r["ideal_overlap_speedup"] == 100 / 70 and r["ideal_comm_hidden"] == 1 - (70 - 50) / 20


def test_bench_replicated_attention_cost_times_each_replicated_piece():
    """The built-in model has every piece (latent on each layer, compressors, indexers): each is timed, and
    the share at TP=2 follows from the share of the one-process step."""
    from engram_serve.bench.step_tp import replicated_attention_cost
    r = replicated_attention_cost(load_model(), (3, 1, 40), 2, rounds=1)
    assert all(r[f"{k}_ms"] > 0 for k in ("latent", "compressor", "indexer")), r
    share = r["share_of_one_process_step"]
    assert share == r["replicated_ms"] / r["one_process_step_ms"] and 0 < share < 1
    assert r["share_of_rank_step"] == share / (share + (1 - share) / 2)


class _Partial:
    """Stands in for an in-flight sum in single-process tests: `wait` returns this rank's partial."""

    def __init__(self, x):
        self.x = x

    def wait(self):
        return self.x


@given(st.integers(1, 40), st.integers(0, 2**31 - 1))
def test_expert_parallel_moe_partials_sum_to_the_unsharded_moe(n, seed):
    """Each rank's partial holds its experts' weighted outputs and its slice of the shared expert; their
    rank-ordered sum is the unsharded MoE up to float rounding (the shared expert's down projection is
    summed in two halves: the bits may differ across parallel sizes, never across cuts at one size)."""
    import engram_serve.parallel.layers as pl
    from engram_serve.model import deepseek_v41 as v41
    from engram_serve.model.writer import SMALL_TEXT_CONFIG, with_engram_rows
    from engram_serve.config import ModelConfig
    from engram_serve.parallel.group import CommStats
    cfg = ModelConfig.from_dict(with_engram_rows(dict(SMALL_TEXT_CONFIG, n_routed_experts=8, num_experts_per_tok=3)))
    g = torch.Generator().manual_seed(seed)
    full = v41.MoE(cfg)
    with torch.no_grad():
        for p in full.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(n, cfg.hidden_size, generator=g)
    want = run_stages(full.stages(x, ops.choose(x, *full.parameters())))
    parts = []
    orig = pl.launch_sum
    pl.launch_sum = lambda group, y, ctx, what: _Partial(y)
    try:
        for rank in range(2):
            group = type("G", (), {"rank": rank, "world": 2, "stats": CommStats()})()
            shard = pl.ExpertParallelMoE(full, group, "moe")
            parts.append(run_stages(shard.stages(x, ops.choose(x, *shard.parameters()))))
    finally:
        pl.launch_sum = orig
    assert torch.allclose(rank_ordered_sum(torch.stack(parts)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("argv, message", [
    (["verify", "--tensor-parallel-size", "3"], "--tensor-parallel-size 3: num_attention_heads=4 is not divisible by 3"),
    (["serve", "--tensor-parallel-size", "0"], "--tensor-parallel-size: '0' must be >= 1"),
    (["generate", "hi", "--device", "cuda"], "--device cuda: CUDA is not available"),
])
def test_parallel_options_refuse_bad_values_with_one_line(argv, message, capsys):
    from engram_serve.cli import main
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("drafter", [None, "dspark"])
def test_verify_tp2_speculative_decoding_keeps_every_bit(cluster, drafter):
    """Verify steps at TP=2: every rank gets the step's read tokens (every position of a verify row) with the
    step, so the last layer's collectives match; drafts accepted and rejected, cuts inside draft blocks. The
    DSpark drafter runs whole on rank 0, on the features rank 0's forward captures (the residual streams are
    whole on every rank)."""
    res = verify(cluster.loaded, seed=2, num_requests=3, gen_tokens=8, make_runner=cluster.make_runner, speculative=3,
                 drafter=drafter, only=("whole steps", "2 microbatches, tokens", "chunk 17", "preemption"))
    spec = res["speculative"]
    assert res["passed"] and res["logit_mismatches"] == 0 and res["hash_mismatches"] == 0, res
    assert 0 < spec["accepted_tokens"] < spec["draft_tokens"] and spec["draft_bounds"] > 0, spec
