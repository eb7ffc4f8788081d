"""Sampler cost at DeepSeek's vocabulary (129,280) for 1 to 256 rows, against one argmax.

Times: in one fresh process per (shape, rows), every candidate call follows an argmax over the same
logits, and the per-pair ratio is reported (median and p10-p90): a ratio measured this way holds on
a loaded machine, where absolute times drift. Peak memory: top_p and the full sort, each in its own
fresh process (`common.measure`). Candidates, on the same logits:
- `argmax`: `logits.argmax(dim=1)`, the yardstick;
- `greedy`: `Sampler.sample` with every row greedy (finite check + one argmax);
- `top_p`: temperature 1, top_p 0.9, on candidates (`topk` of 64) with the exact fallback;
- `top_p_full_sort`: the same rows through the full-vocabulary sort path (the previous algorithm,
  kept as the fallback): the baseline the candidate path replaces;
- `top_k`: temperature 1, top_k 50;
- `sample`: temperature 1, no filter: Gumbel noise over the whole vocabulary.

Logits: `peaked` = a Zipf-like language-model shape (logit = -2 ln(1 + rank) + N(0, 0.5), ranks in
a random order per row); `flat` = N(0, 1) per token, where top_p 0.9 keeps most of the vocabulary
and every row takes the fallback. `fallback_rows` says how many rows fell back.
"""
from __future__ import annotations

import argparse

from ..errors import UsageError
from . import common

VOCAB = 129280


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=common.positive_int_list, default=[1, 16, 64, 256], metavar="N,N,...",
                        help="rows per step (default 1,16,64,256)")
    parser.add_argument("--vocab", type=common.positive_int, default=VOCAB, metavar="V",
                        help=f"vocabulary size (default {VOCAB}, DeepSeek-V4's)")
    parser.add_argument("--shapes", default="peaked,flat", help="logit shapes: peaked, flat (default both)")


def make_logits(rows: int, vocab: int, shape: str):
    import torch
    g = torch.Generator().manual_seed(rows)
    if shape == "flat":
        return torch.randn(rows, vocab, generator=g)
    rank = torch.argsort(torch.rand(rows, vocab, generator=g), dim=1).float()  # a random rank per token
    return -2.0 * torch.log1p(rank) + 0.5 * torch.randn(rows, vocab, generator=g)


def _batch(rows: int, vocab: int, kind: str):
    from ..runner.sampler import SamplingBatch
    t, k, p = {"greedy": (0.0, 0, 1.0), "top_p": (1.0, 0, 0.9), "top_p_full_sort": (1.0, 0, 0.9),
               "top_k": (1.0, 50, 1.0), "sample": (1.0, 0, 1.0)}[kind]
    return SamplingBatch.build(vocab, [t] * rows, [k] * rows, [p] * rows, list(range(rows)), [7] * rows)


def setup(rows: int, vocab: int, shape: str, kind: str):
    """The timed callable (runs in the measuring child)."""
    from ..runner.sampler import Sampler
    logits = make_logits(rows, vocab, shape)
    if kind == "argmax":
        return lambda: logits.argmax(dim=1)
    b, s = _batch(rows, vocab, kind), Sampler()
    if kind == "top_p_full_sort":
        return lambda: s._draw_full(logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.counters)
    return lambda: s.sample(logits, b)


def fallback_rows(rows: int, vocab: int, shape: str) -> int:
    from ..runner.sampler import Sampler

    class Count(Sampler):
        n = 0

        def _draw_full(self, z, *a):
            Count.n += z.shape[0]
            return super()._draw_full(z, *a)
    Count().sample(make_logits(rows, vocab, shape), _batch(rows, vocab, "top_p"))
    return Count.n


KINDS = ("greedy", "top_p", "top_p_full_sort", "top_k", "sample")


def paired(rows: int, vocab: int, shape: str, threads: int, budget_s: float) -> dict:
    """In one fresh process: each candidate call is timed right after an argmax over the same logits,
    so the ratio of the pair is immune to the machine's load drifting between runs. Per kind: the
    median time, and the median and p10-p90 spread of the per-pair ratio."""
    import statistics
    import time

    import torch
    torch.set_num_threads(threads)
    logits = make_logits(rows, vocab, shape)
    out = {}
    for kind in KINDS:
        fn = setup(rows, vocab, shape, kind)
        fn()
        logits.argmax(dim=1)
        ratios, times, bases, spent = [], [], [], 0.0
        while len(ratios) < 3 or (spent < budget_s and len(ratios) < 50):
            t0 = time.perf_counter()
            logits.argmax(dim=1)
            t1 = time.perf_counter()
            fn()
            t2 = time.perf_counter()
            bases.append(t1 - t0)
            times.append(t2 - t1)
            ratios.append((t2 - t1) / (t1 - t0))
            spent += t2 - t0
        ratios.sort()
        out[kind] = {"ms": statistics.median(times) * 1e3, "argmax_ms": statistics.median(bases) * 1e3,
                     "x": statistics.median(ratios), "x_p10": ratios[int(0.1 * (len(ratios) - 1))],
                     "x_p90": ratios[int(0.9 * (len(ratios) - 1) + 0.999)], "pairs": len(ratios)}
    return out


def run(args: argparse.Namespace) -> list[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    out = []
    ctx = multiprocessing.get_context("spawn")
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if shape not in ("peaked", "flat"):
            raise UsageError(f"--shapes: unknown shape {shape!r} (peaked, flat)")
        for rows in args.rows:
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                res = pool.submit(paired, rows, args.vocab, shape, args.threads, args.budget_s).result()
            row = {"shape": shape, "rows": rows, "vocab": args.vocab, "argmax_ms": res["greedy"]["argmax_ms"]}
            for kind in KINDS:
                r = res[kind]
                row[f"{kind}_ms"] = r["ms"]
                row[f"{kind}_x_argmax"] = r["x"]
                row[f"{kind}_x_spread"] = f"{r['x_p10']:.2f}-{r['x_p90']:.2f}"
            row["top_p_fallback_rows"] = fallback_rows(rows, args.vocab, shape)
            for kind in ("top_p", "top_p_full_sort"):  # peak memory: each in its own fresh process
                once = {**common.timing_kwargs(args), "budget_s": 0.0, "min_repeats": 1, "max_repeats": 1}
                m = common.measure(setup, {"rows": rows, "vocab": args.vocab, "shape": shape, "kind": kind}, **once)
                row[f"{kind}_peak_mib"] = m["peak_mib"]
            row["threads"] = args.threads
            out.append(row)
    return out
