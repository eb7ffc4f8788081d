"""What a DSpark draft costs beside a target decode step, per row count, in one run.

For R rows (each with `--context` committed tokens, written by `write_context`), timed side by side: the target's
decode step of R rows (`ModelRunner.execute` on a prepared step, CPU graphs as served; bench/step_workloads.py), the
eager `DSpark.draft` (greedy), the replayed one (runner/draft_graphs.py: greedy, and with a pick of the caller's,
the Markov chain then eager), and `write_context` of the R tokens a decode step commits (eager and replayed).
Medians of wall time and of the process's CPU time (less hit by other jobs' load). `same_bits`: the replayed
draft's tokens, logits and confidence equal the eager one's.
"""
from __future__ import annotations

import argparse

from ..errors import UsageError
from . import common

NAME = "draft"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint with a drafter (default: the built-in model)")
    parser.add_argument("--rows", type=common.positive_int_list, default=[1, 8, 32], metavar="R,R",
                        help="rows per draft call (default 1,8,32)")
    parser.add_argument("--context", type=common.positive_int, default=256, help="committed tokens a row (default 256)")


def _time(fn, args) -> common.Timing:
    return common.time_callable(fn, warmup=3, max_repeats=1000, budget_s=args.budget_s)  # (eager, capture, replays)


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from ..model.dspark import DSparkState
    from ..model.loader import load_model
    from ..runner.draft_graphs import DraftGraphs
    from ..runner.model_runner import ModelRunner
    from .step_workloads import BLOCK, prepare
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, pin_tables=False)
    d, cfg = lm.drafter, lm.config
    if d is None:
        raise UsageError(f"--model {lm.path}: the checkpoint has no drafter (bench draft needs one)")
    graphs, rows = DraftGraphs(d, lm.model), []
    gen = torch.Generator().manual_seed(0)
    for r in args.rows:
        runner, batch = prepare(lambda c: ModelRunner(lm, c), cfg.vocab_size, (r, 1, args.context), 1)
        step = _time(lambda: runner.execute(batch), args)
        runner.close()
        per = -(-(args.context + d.block) // BLOCK)  # blocks a row
        state = DSparkState(cfg, r * per, BLOCK, max_rows=r)
        tables = torch.arange(r * per).view(r, per)
        ctx = torch.arange(args.context)
        feats = torch.randn(args.context, len(cfg.dspark.dspark_target_layer_ids) * cfg.hidden_size, generator=gen)
        last = torch.randint(6, cfg.vocab_size, (r,), generator=gen)
        n = torch.full((r,), args.context)
        new = torch.randn(r, feats.shape[1], generator=gen)
        with torch.no_grad():
            for i in range(r):
                d.write_context(state, feats, ctx, tables[i, ctx // BLOCK] * BLOCK + ctx % BLOCK)
            eager = d.draft(lm.model, state, last, n, tables, BLOCK)
            t_eager = _time(lambda: d.draft(lm.model, state, last, n, tables, BLOCK), args)
            t_graph = _time(lambda: graphs.draft(state, last, n, tables, BLOCK), args)
            same = all(torch.equal(a, b) for a, b in zip(eager, graphs.draft(state, last, n, tables, BLOCK)))
            t_pick = _time(lambda: graphs.draft(state, last, n, tables, BLOCK, pick=lambda j, z: z.argmax(1)), args)
            # a decode step's context: one token a row, at position n (never read by these drafts)
            slots = tables[torch.arange(r), n // BLOCK] * BLOCK + n % BLOCK  # [R]
            t_ctx = _time(lambda: d.write_context(state, new, n, slots), args)
            t_ctx_graph = _time(lambda: graphs.write_context(state, new, n, slots), args)
        rows.append({"rows": r, "step_ms": step.median_ms, "step_cpu_ms": step.cpu_median_ms,
                     "eager_ms": t_eager.median_ms, "eager_cpu_ms": t_eager.cpu_median_ms,
                     "graph_ms": t_graph.median_ms, "graph_cpu_ms": t_graph.cpu_median_ms,
                     "graph_pick_ms": t_pick.median_ms,
                     "write_context_ms": t_ctx.median_ms, "write_context_graph_ms": t_ctx_graph.median_ms,
                     "graph_over_step": t_graph.median_ms / step.median_ms,
                     "eager_over_graph": t_eager.median_ms / t_graph.median_ms, "same_bits": same,
                     "replays": graphs.replays})
    return rows
