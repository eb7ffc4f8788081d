"""`bench step --tensor-parallel-size N`: one engine step at N ranks (gloo, CPU), DBO on against off.

Candidates, interleaved call by call in one run (so machine noise hits them alike):
  off       1 microbatch: every cross-rank sum is awaited right after its launch;
  dbo-sync  2 microbatches, each sum awaited at its launch (the same collectives, nothing hidden);
  dbo       2 microbatches, each sum launched at a stage boundary and awaited after the other
            microbatch's next stage (parallel/collectives.py).
Links: the real gloo link on loopback, and a SIMULATED inter-node link (each sum completes
`latency + bytes / bandwidth` after its launch; the wait sleeps only for what is left).

Reported per workload and link: median step time of each candidate, the communication time exposed
on the critical path (seconds blocked in waits, per step), its share of the off step, the fraction of
communication hidden by DBO = 1 - exposed(dbo) / exposed(dbo-sync), and the speedup off / dbo. Also
the Engram table bytes each rank holds (against one process) and each rank's resident set size, and
the cost of the order rule (all-gather + rank-ordered sum against gloo's all-reduce).
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from ..inputs.ubatch import SplitConfig
from ..parallel.group import LinkDelay, ParallelGroup, configure_link

CANDIDATES = (("off", 1, True), ("dbo-sync", 2, False), ("dbo", 2, True))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def sum_cost(group: ParallelGroup, tokens: int, hidden: int, repeats: int) -> dict:
    """Median ms of the rank-ordered sum (all-gather + ordered adds) and of gloo's all-reduce, [tokens, hidden]."""
    from ..parallel.collectives import sum_now
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(group.rank))
    out = {}
    for name in ("ordered", "allreduce") * 2:  # warm-up round, then the measured one
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            if name == "ordered":
                sum_now(group, x, "bench")
            else:
                y = x.clone()
                group.wait(group.pg.allreduce([y]), "bench allreduce")
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    return out


def _prepare(cluster, workload: tuple[int, int, int], ubatches: int):
    from ..runner.model_runner import RunnerConfig
    reqs, new, ctx = workload
    block = 16
    max_len = -(-(ctx + new) // block) * block
    cfg = RunnerConfig(max_num_seqs=reqs, max_model_len=max_len, max_num_batched_tokens=reqs * new,
                       block_size=block, num_blocks=reqs * max_len // block,
                       split=SplitConfig(ubatches, "tokens", 0, 0))
    runner = cluster.make_runner(cfg)
    rng = np.random.default_rng(0)
    vocab = cluster.loaded.config.vocab_size
    slots = np.array([runner.store.add(rng.integers(6, vocab, ctx + new).tolist()) for _ in range(reqs)])
    per = max_len // block
    tables = np.arange(reqs * per).reshape(reqs, per)
    return runner, runner.build(slots, np.full(reqs, ctx), np.full(reqs, new), tables, np.ones(reqs, bool))


def run_tp(args, workloads: dict) -> list[dict]:
    from ..model.loader import load_model
    from ..parallel.launch import TPCluster
    world = args.tensor_parallel_size
    torch.set_num_threads(args.threads)
    cluster = TPCluster(args.model, world)
    rows = []
    try:
        links = [("gloo loopback (real)", None)] + [
            (f"SIMULATED {us:g} us + {args.sim_gbps:g} GB/s", LinkDelay(us * 1e-6, args.sim_gbps * 1e9))
            for us in args.sim_latency_us]
        for wl in args.workloads.split(","):
            if wl not in workloads:
                raise ValueError(f"--workloads: unknown workload {wl!r}; choose from {sorted(workloads)}")
            for link_name, delay in links:
                runners = {name: _prepare(cluster, workloads[wl], n) for name, n, _ in CANDIDATES}
                times = {name: [] for name, _, _ in CANDIDATES}
                exposed = {name: [] for name, _, _ in CANDIDATES}
                spent, rounds = 0.0, 0
                while rounds < 5 or (rounds < 200 and spent < args.budget_s * len(CANDIDATES)):
                    for name, _, overlap in CANDIDATES:
                        runner, batch = runners[name]
                        cluster.call_all(configure_link, delay, overlap)
                        st = cluster.group.stats
                        w0 = st.wait_s
                        t0 = time.perf_counter()
                        runner.execute(batch)
                        dt = time.perf_counter() - t0
                        if rounds > 0:  # round 0 is the warm-up
                            times[name].append(dt * 1e3)
                            exposed[name].append((st.wait_s - w0) * 1e3)
                            spent += dt
                    rounds += 1
                med = {k: statistics.median(v) for k, v in times.items()}
                exp = {k: statistics.median(v) for k, v in exposed.items()}
                tokens = runners["off"][1].num_tokens
                for runner, _ in runners.values():
                    runner.close()
                rows.append({
                    "workload": wl, "tokens": tokens, "link": link_name, "repeats": rounds - 1,
                    "off_ms": med["off"], "dbo_sync_ms": med["dbo-sync"], "dbo_ms": med["dbo"],
                    "off_ms_p90": sorted(times["off"])[int(0.9 * (len(times["off"]) - 1))],
                    "dbo_ms_p90": sorted(times["dbo"])[int(0.9 * (len(times["dbo"]) - 1))],
                    "comm_exposed_off_ms": exp["off"], "comm_exposed_dbo_sync_ms": exp["dbo-sync"],
                    "comm_exposed_dbo_ms": exp["dbo"],
                    "comm_share_of_off_step": exp["off"] / med["off"],
                    "comm_hidden_by_dbo": 1 - exp["dbo"] / exp["dbo-sync"] if exp["dbo-sync"] > 0 else float("nan"),
                    "dbo_speedup_over_off": med["off"] / med["dbo"],
                    "threads": args.threads,
                })
        cluster.call_all(configure_link, None, True)
        cost = {t: cluster.call_all(sum_cost, t, cluster.loaded.config.hidden_size, 50) for t in (64, 1024)}
        full = load_model(args.model)
        rss = [_rss_mib(os.getpid())] + [_rss_mib(p) for p in cluster.pids]
        for t, c in cost.items():
            rows.append({"order_rule_cost": f"[{t}, {cluster.loaded.config.hidden_size}] float32",
                         "rank_ordered_sum_ms": c["ordered"], "gloo_allreduce_ms": c["allreduce"],
                         "ratio": c["ordered"] / c["allreduce"]})
        rows.append({"table_memory": f"TP={world}",
                     "tables_mib_per_rank": cluster.loaded.tables.nbytes / 2**20,
                     "tables_mib_one_process": full.tables.nbytes / 2**20,
                     "ratio": cluster.loaded.tables.nbytes / full.tables.nbytes,
                     "rss_mib_per_rank": [round(r, 1) for r in rss]})
    finally:
        cluster.close()
    return rows
