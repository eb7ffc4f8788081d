"""`bench step --tensor-parallel-size N`: one engine step at N ranks (gloo, CPU), microbatching on against off.

Candidates, interleaved call by call in one run, their order rotated every round (so machine noise
hits them alike):
  off       1 microbatch: every cross-rank sum is awaited right after its launch;
  sync      2 microbatches, each sum awaited at its launch (the same collectives as overlap, nothing hidden);
  overlap   2 microbatches (dual-batch overlap), each sum launched at a stage boundary and awaited after
            the other microbatch's next stage (parallel/collectives.py);
  planner   DBO on as served: the default `MicrobatchConfig` (when="overlap") with the planner choosing
            each step's form from its cost model (microbatch/plan.py, `StepCosts`), after its warm-up
            (2 x StepCosts.WARMUP untimed steps under the same link); its timed steps keep the planner's
            exploration (one decision in EXPLORE_EVERY takes the other form), and its planning is timed
            with its step, as in serving. Reported: its ratio to off,
            the share of its timed steps it cut, and the median |predicted - actual| / actual of its
            step times (the cost model's prediction against what the step then took).
Links: the real gloo link on loopback, and SIMULATED inter-node links: each sum completes
`latency + bytes / bandwidth` after its launch (or when gloo completes it, if later); the wait sleeps
only for what is left of that time, so the delay elapses while the other microbatch computes.

Every rank is pinned to its own share of the cores (`--cpu-bind rank`, default; `none` leaves it to
the OS scheduler). Reported per workload and link: median step time of each candidate with its
p10-p90 spread, the median of the per-round ratio off / overlap with its spread, the communication time
exposed on rank 0's critical path (seconds blocked in waits: link time plus waiting for the other
rank), its share of the off step, and the fraction of communication hidden by the overlap,
    hidden = (exposed(off) - exposed(overlap)) / exposed(off),
beside the fraction of its own (twice as many) collectives it hides, 1 - exposed(overlap) / exposed(sync).
And the ceiling of perfect overlap, from the same run: the cut step computes for C2 = sync - exposed(sync)
and communicates for E2 = exposed(sync), so no schedule of its two microbatches beats max(C2, E2):
    ideal speedup = off / max(C2, E2),  ideal hidden = 1 - max(0, E2 - C2) / exposed(off).
Where the sums are latency-bound (a cut doubles their number without shortening them) and E2 > C2,
that ceiling is below 1.15x whatever the overlap.
Also the Engram table bytes each rank holds (against one process), each rank's resident and peak
resident set, the cost of the order rule (all-gather + rank-ordered sum against gloo's all-reduce), and
per workload the attention work every rank repeats whole (the MQA latent, the compressor, the indexer)
against one process's step on the same cores (`replicated_attention_cost`).
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from ..errors import UsageError
from ..parallel.group import ParallelGroup
from .link import LinkDelay, configure_link
from .step_workloads import TP_WORKLOADS, prepare

CANDIDATES = (("off", 1, True), ("sync", 2, False), ("overlap", 2, True), ("planner", 2, True))


def _status_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[round(q * (len(v) - 1))]


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


def _prepare(make_runner, vocab: int, workload: tuple[int, int, int], microbatches: int, planned: bool = False):
    """(runner, the workload's step, its bounds) for a runner made by `make_runner(RunnerConfig)`; with
    `planned`, the served configuration and bounds None (the planner chooses at every call)."""
    runner, batch = prepare(make_runner, vocab, workload, microbatches, planned=planned)
    if planned:
        return runner, batch, None
    bounds = runner.plan(batch)  # fixed for every timed call: the candidate's cut, never the planner's choice
    if len(bounds) - 1 != microbatches:
        reqs, new, _ = workload
        raise ValueError(f"bench step: the {reqs * new}-token step was cut into {len(bounds) - 1} microbatches; "
                         f"the candidate needs {microbatches}")
    return runner, batch, bounds


def _measure(cluster, workload: tuple[int, int, int], delay: LinkDelay | None, budget_s: float) -> dict:
    """Step times and exposed communication (ms, rank 0) of each candidate, interleaved call by call."""
    from ..microbatch.plan import StepCosts
    vocab = cluster.loaded.config.vocab_size
    runners = {name: _prepare(cluster.make_runner, vocab, workload, n, name == "planner") for name, n, _ in CANDIDATES}
    times = {name: [] for name, _, _ in CANDIDATES}
    exposed = {name: [] for name, _, _ in CANDIDATES}
    microbatched = []  # the planner's timed steps: microbatched or not
    spent, rounds = 0.0, 0
    try:
        runner, batch, _ = runners["planner"]
        cluster.call_all(configure_link, delay, True)
        for _ in range(2 * StepCosts.WARMUP):  # the cost model's warm-up: both forms measured
            runner.execute(batch)
        while rounds < 6 or (rounds < 300 and spent < budget_s * len(CANDIDATES)):
            shift = rounds % len(CANDIDATES)
            for name, _, overlap in CANDIDATES[shift:] + CANDIDATES[:shift]:
                runner, batch, bounds = runners[name]
                cluster.call_all(configure_link, delay, overlap)
                st = cluster.group.stats
                w0 = st.wait_s
                t0 = time.perf_counter()
                step_bounds = runner.plan(batch) if bounds is None else bounds
                runner.execute(batch, step_bounds)
                dt = time.perf_counter() - t0
                if rounds > 0:  # round 0 is the warm-up
                    times[name].append(dt * 1e3)
                    exposed[name].append((st.wait_s - w0) * 1e3)
                    spent += dt
                    if bounds is None:
                        microbatched.append(len(step_bounds) > 2)
            rounds += 1
        error = runners["planner"][0].planner.prediction_error()
    finally:
        for runner, _, _ in runners.values():
            runner.close()
    return {"tokens": runners["off"][1].num_tokens, "times": times, "exposed": exposed,
            "planner_microbatched": microbatched, "planner_prediction_error": error}


def _replicated_pieces(model, workload: tuple[int, int, int]):
    """A function timing, over one step of `workload` in one process, the attention work every rank
    repeats whole under tensor parallelism: each layer's MQA latent (wq_a, q_norm, wkv, kv_norm, rope),
    its compressor and its indexer, run piece by piece on the step's shapes over a fresh paged state
    (sequence b owns slots b*S .. b*S + S - 1, as in `forward_dense`). Their cost depends on the shapes
    (tokens, visible entries), not on the values. Returns {piece: seconds}."""
    from ..model.layers import linear
    from ..model.paged_state import PagedState
    cfg, (reqs, new, ctx) = model.config, workload
    s = ctx + new
    cache = PagedState(cfg, reqs, s)
    pos = torch.arange(ctx, s).repeat(reqs)  # [T] absolute positions
    rows = torch.arange(reqs).repeat_interleave(new)  # [T]
    step = model.make_step(cache, pos, rows, torch.arange(reqs)[:, None], s, rows * s + pos)
    lookups = model.rotary(pos)
    plain, comp = lookups["plain"], lookups["comp"]
    entry_cs = {r: lookups.get(r, comp) for r in cfg.ratios if r}
    x = torch.randn(pos.shape[0], cfg.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, D]

    def run() -> dict[str, float]:
        spent = dict.fromkeys(("latent", "compressor", "indexer"), 0.0)
        for blk in model.layers:
            a, r = blk.attn, blk.role.ratio
            cs = comp if r else plain
            t0 = time.perf_counter()
            qr = a.q_norm(linear(x, a.wq_a.weight), step.ops)  # [T, ql]
            step.ops.rope(a.kv_norm(linear(x, a.wkv.weight), step.ops), *cs, inverse=False)  # [T, hd]
            t1 = time.perf_counter()
            if a.compressor is not None:
                a._compress(x, step, entry_cs[r])
            t2 = time.perf_counter()
            if a.indexer is not None:
                t = x.shape[0]
                a._select(x, qr, step, step.plan, cs, step.topk[:t], step.candidates[:t])
            spent["latent"] += t1 - t0
            spent["compressor"] += t2 - t1
            spent["indexer"] += time.perf_counter() - t2
        return spent
    return run


def replicated_attention_cost(loaded, workload: tuple[int, int, int], world: int, rounds: int = 5) -> dict:
    """The replicated attention work (`_replicated_pieces`) against one process's whole step of the same
    workload, interleaved call by call, medians of `rounds` (after one warm-up): its share r of the
    one-process step, and what it makes of a rank's step if everything else splits `world` ways,
    r / (r + (1 - r) / world), with the compute speedup that leaves, 1 / (r + (1 - r) / world)."""
    from ..model.exactness import batch_invariant
    from ..runner.model_runner import ModelRunner
    runner, batch, bounds = _prepare(lambda c: ModelRunner(loaded, c), loaded.config.vocab_size, workload, 1)
    pieces = _replicated_pieces(loaded.model, workload)
    steps, parts = [], []
    try:
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            runner.execute(batch, bounds)
            dt = time.perf_counter() - t0
            with torch.no_grad(), batch_invariant(runner.cfg.exact):
                p = pieces()
            if i:
                steps.append(dt * 1e3)
                parts.append({k: v * 1e3 for k, v in p.items()})
    finally:
        runner.close()
    step_ms = statistics.median(steps)
    ms = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    r = sum(ms.values()) / step_ms
    return {"one_process_step_ms": step_ms, **{f"{k}_ms": v for k, v in ms.items()},
            "replicated_ms": sum(ms.values()), "share_of_one_process_step": r,
            "share_of_rank_step": r / (r + (1 - r) / world), "compute_speedup_cap": 1 / (r + (1 - r) / world)}


def _row(m: dict) -> dict:
    t, e = m["times"], m["exposed"]
    med = {k: statistics.median(v) for k, v in t.items()}
    exp = {k: statistics.median(v) for k, v in e.items()}
    paired = [a / b for a, b in zip(t["off"], t["overlap"])]  # the same round: the same machine load
    planned = [a / b for a, b in zip(t["off"], t["planner"])]
    c2, e2 = med["sync"] - exp["sync"], exp["sync"]  # the cut step's compute and communication
    return {
        "tokens": m["tokens"], "rounds": len(t["off"]),
        "off_ms": med["off"], "sync_ms": med["sync"], "overlap_ms": med["overlap"],
        "off_ms_p10_p90": f"{_pct(t['off'], 0.1):.1f}-{_pct(t['off'], 0.9):.1f}",
        "overlap_ms_p10_p90": f"{_pct(t['overlap'], 0.1):.1f}-{_pct(t['overlap'], 0.9):.1f}",
        "comm_exposed_off_ms": exp["off"], "comm_exposed_sync_ms": exp["sync"],
        "comm_exposed_overlap_ms": exp["overlap"],
        "comm_share_of_off_step": exp["off"] / med["off"],
        "comm_hidden_by_overlap": (exp["off"] - exp["overlap"]) / exp["off"] if exp["off"] > 0 else float("nan"),
        "overlap_comm_hidden": 1 - exp["overlap"] / exp["sync"] if exp["sync"] > 0 else float("nan"),
        "overlap_speedup_over_off": med["off"] / med["overlap"],
        "paired_speedup_median": statistics.median(paired),
        "paired_speedup_p10_p90": f"{_pct(paired, 0.1):.2f}-{_pct(paired, 0.9):.2f}",
        "ideal_overlap_speedup": med["off"] / max(c2, e2),
        "ideal_comm_hidden": 1 - max(0.0, e2 - c2) / exp["off"] if exp["off"] > 0 else float("nan"),
        "planner_ms": med["planner"],
        "planner_speedup_median": statistics.median(planned),
        "planner_speedup_p10_p90": f"{_pct(planned, 0.1):.2f}-{_pct(planned, 0.9):.2f}",
        "planner_microbatched_share": sum(m["planner_microbatched"]) / len(m["planner_microbatched"]),
        "planner_prediction_error": m["planner_prediction_error"],
    }


def table_memory(world: int, per_rank_bytes: int, one_process_bytes: int, rss_mib: list[float],
                 peak_rss_mib: list[float]) -> dict:
    """The table-memory row: the Engram table bytes rank 0 holds against one process's, with every rank's
    resident and peak resident set. A model without Engram tables has no ratio to report: its row says
    so ("no Engram tables") and its ratio is None."""
    ratio = per_rank_bytes / one_process_bytes if one_process_bytes else None
    return {"table_memory": f"TP={world}" if one_process_bytes else f"TP={world}, no Engram tables",
            "tables_mib_per_rank": per_rank_bytes / 2**20, "rss_mib_per_rank": rss_mib,
            "peak_rss_mib_per_rank": peak_rss_mib, "tables_mib_one_process": one_process_bytes / 2**20,
            "ratio": ratio}


def run_tp(args) -> list[dict]:
    from ..model.loader import load_model
    from ..parallel.launch import TPCluster, bind_cpus
    world = args.tensor_parallel_size
    torch.set_num_threads(args.threads)
    names = args.workloads.split(",") if args.workloads else list(TP_WORKLOADS)
    for wl in names:
        if wl not in TP_WORKLOADS:
            raise UsageError(f"--workloads: unknown workload {wl!r}; choose from {sorted(TP_WORKLOADS)}")
    cores = sorted(os.sched_getaffinity(0))
    bind = args.cpu_bind == "rank"
    if bind and len(cores) < world:
        raise UsageError(f"--cpu-bind rank: {len(cores)} cores for {world} ranks; use --cpu-bind none")
    cluster = TPCluster(args.model, world)
    rows = []
    try:
        cluster.call_all(bind_cpus, cores, bind)
        links = [("gloo loopback (real)", None)] + [
            (f"SIMULATED {us:g} us + {args.sim_gbps:g} GB/s", LinkDelay(us * 1e-6, args.sim_gbps * 1e9))
            for us in args.sim_latency_us]
        for wl in names:
            for link_name, delay in links:
                row = _row(_measure(cluster, TP_WORKLOADS[wl], delay, args.budget_s))
                rows.append({"workload": wl, "link": link_name, **row, "threads": args.threads,
                             "cpu_bind": args.cpu_bind})
        cluster.call_all(configure_link, None, True)
        cost = {t: cluster.call_all(sum_cost, t, cluster.loaded.config.hidden_size, 50) for t in (64, 1024)}
        for t, c in cost.items():
            rows.append({"order_rule_cost": f"[{t}, {cluster.loaded.config.hidden_size}] float32",
                         "rank_ordered_sum_ms": c["ordered"], "gloo_allreduce_ms": c["allreduce"],
                         "ratio": c["ordered"] / c["allreduce"]})
        pids = [os.getpid()] + cluster.pids
        per_rank = cluster.loaded.tables.nbytes
        rss = [round(_status_mib(p), 1) for p in pids]
        peak = [round(_status_mib(p, "VmHWM"), 1) for p in pids]
    finally:
        cluster.close()
    full = load_model(args.model)  # one process, after the ranks are gone (on rank 0's cores)
    rows.append(table_memory(world, per_rank, full.tables.nbytes, rss, peak))
    for wl in names:
        rows.append({"replicated_attention": wl, **replicated_attention_cost(full, TP_WORKLOADS[wl], world)})
    return rows
