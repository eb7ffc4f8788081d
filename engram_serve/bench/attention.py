"""Varlen attention: mixed steps against their parts, decode cost against context, the cost of exactness.

Timed: `ModelRunner.execute` of one whole (uncut) step on the built-in model: hash, staging gather,
forward and logits, each candidate in its own fresh process (see common.py).
  * mixed: 63 decodes with 512 tokens of context plus one 448-token prefill chunk in one step,
    against the decodes alone and the prefill alone; target mixed <= 1.15 x (decode + prefill).
  * context: a decode step of 8 rows at 512, 4,096 and 32,768 tokens of context, under one
    max_model_len (32,784): the time follows the rows' real context, not max_model_len.
  * exactness: the bit-exact path (batch-invariance rules on) against the fastest non-exact
    configuration we have (the rules off: no row padding of matmuls, no padding of elementwise tails;
    the same varlen attention, which is also our fastest), at 1, 32 and 128 concurrent decodes with
    256 tokens of context, both in one process and timed alternately; target overhead <= 5%.
"""
from __future__ import annotations

import argparse

from ..errors import UsageError
from . import common

NAME = "attention"
BLOCK = 16
MIXED = {"decode 63 x 512": [(63, 1, 512)], "prefill 448": [(1, 448, 0)],
         "mixed": [(63, 1, 512), (1, 448, 0)]}
CONTEXTS = (512, 4096, 32768)
DECODES = (1, 32, 128)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="mixed,context,exactness",
                        help="comma-separated: mixed, context, exactness (default: all)")
    parser.add_argument("--rounds", type=common.positive_int, default=21, metavar="N",
                        help="exactness: alternating timed rounds of the exact and the fast step (default 21)")


def setup(groups: list[tuple[int, int, int]], max_model_len: int = 1024, exact: bool = True):
    """A runner and one step of `groups` (rows, new tokens per row, context per row); returns the step."""
    import numpy as np

    from ..microbatch.plan import MicrobatchConfig
    from ..model.loader import load_model
    from ..runner.model_runner import ModelRunner, RunnerConfig

    loaded = load_model()
    rows = [(new, ctx) for n, new, ctx in groups for _ in range(n)]
    per = -(-max_model_len // BLOCK)
    need = [-(-(new + ctx) // BLOCK) for new, ctx in rows]
    tokens = sum(new for new, _ in rows)
    cfg = RunnerConfig(max_num_seqs=len(rows), max_model_len=per * BLOCK, max_num_batched_tokens=tokens,
                       block_size=BLOCK, num_blocks=sum(need) + 1, microbatch=MicrobatchConfig(1), exact=exact)
    runner = ModelRunner(loaded, cfg)
    rng = np.random.default_rng(0)
    slots = np.array([runner.store.add(rng.integers(6, loaded.config.vocab_size, new + ctx).tolist())
                      for new, ctx in rows])
    tables = np.full((len(rows), max(need)), -1)
    first = np.cumsum([0] + need[:-1])
    for i, n in enumerate(need):  # the rows' own blocks; their context's KV is whatever the pool holds
        tables[i, :n] = np.arange(first[i], first[i] + n)
    batch = runner.build(slots, np.array([c for _, c in rows]), np.array([n for n, _ in rows]), tables,
                         np.ones(len(rows), bool))
    return lambda: runner.execute(batch, [0, batch.num_tokens])


def run(args: argparse.Namespace) -> list[dict]:
    parts = args.parts.split(",")
    bad = [p for p in parts if p not in ("mixed", "context", "exactness")]
    if bad:
        raise UsageError(f"--parts: unknown part(s) {bad}; choose from mixed, context, exactness")
    timing = common.timing_kwargs(args)
    rows = []
    if "mixed" in parts:
        ms = {name: common.measure(setup, dict(groups=g), **timing) for name, g in MIXED.items()}
        apart = {k: ms["decode 63 x 512"][k] + ms["prefill 448"][k] for k in ("median_ms", "cpu_median_ms")}
        for name, m in ms.items():
            mixed = name == "mixed"
            rows.append({"part": "mixed", "step": name, "median_ms": m["median_ms"], "p90_ms": m["p90_ms"],
                         "cpu_ms": m["cpu_median_ms"], "peak_mib": m["peak_mib"],
                         "vs_apart": m["median_ms"] / apart["median_ms"] if mixed else None,
                         "cpu_vs_apart": m["cpu_median_ms"] / apart["cpu_median_ms"] if mixed else None})
    if "context" in parts:
        for ctx in CONTEXTS:
            m = common.measure(setup, dict(groups=[(8, 1, ctx)], max_model_len=max(CONTEXTS) + BLOCK), **timing)
            rows.append({"part": "context", "step": f"decode 8 x {ctx}", "median_ms": m["median_ms"],
                         "p90_ms": m["p90_ms"], "cpu_ms": m["cpu_median_ms"], "peak_mib": m["peak_mib"]})
    if "exactness" in parts:
        import torch
        torch.set_num_threads(args.threads)
        for n in DECODES:
            rows.append({"part": "exactness", "step": f"decode {n} x 256", **duel([(n, 1, 256)], args.rounds)})
    return rows


def duel(groups, rounds: int) -> dict:
    """The exact and the fast step in this process, timed alternately (the order swapped every round)
    after one warm-up call each, so that load changes hit both alike: medians, and the spread of the
    per-round ratio exact / fast."""
    import statistics
    import time

    fns = {"exact": setup(groups), "fast": setup(groups, exact=False)}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    for r in range(rounds):
        for name in (("exact", "fast") if r % 2 else ("fast", "exact")):
            t, c = time.perf_counter(), time.process_time()
            fns[name]()
            wall[name].append((time.perf_counter() - t) * 1e3)
            cpu[name].append((time.process_time() - c) * 1e3)
    med = {f"{n}_{kind}": statistics.median(v) for kind, d in (("ms", wall), ("cpu_ms", cpu)) for n, v in d.items()}
    ratios = sorted(a / b for a, b in zip(wall["exact"], wall["fast"]))
    return {**med, "exact_overhead": med["exact_ms"] / med["fast_ms"] - 1,
            "cpu_exact_overhead": med["exact_cpu_ms"] / med["fast_cpu_ms"] - 1,
            "round_ratio_min": ratios[0], "round_ratio_max": ratios[-1]}
