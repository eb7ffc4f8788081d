"""Sampler cost at DeepSeek's vocabulary (129,280) for 1 to 256 rows, against one argmax.

Candidates, each in its own fresh process (`common.measure`), on the same logits:
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


def run(args: argparse.Namespace) -> list[dict]:
    timing = common.timing_kwargs(args)
    out = []
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if shape not in ("peaked", "flat"):
            raise SystemExit(f"--shapes: unknown shape {shape!r} (peaked, flat)")
        for rows in args.rows:
            res = {kind: common.measure(setup, {"rows": rows, "vocab": args.vocab, "shape": shape, "kind": kind},
                                        **timing)
                   for kind in ("argmax", "greedy", "top_p", "top_p_full_sort", "top_k", "sample")}
            base = res["argmax"]["median_ms"]
            row = {"shape": shape, "rows": rows, "vocab": args.vocab, "argmax_ms": base}
            for kind in ("greedy", "top_p", "top_p_full_sort", "top_k", "sample"):
                row[f"{kind}_ms"] = res[kind]["median_ms"]
                row[f"{kind}_x_argmax"] = res[kind]["median_ms"] / base
            row["top_p_fallback_rows"] = fallback_rows(rows, args.vocab, shape)
            row["top_p_peak_mib"] = res["top_p"]["peak_mib"]
            row["full_sort_peak_mib"] = res["top_p_full_sort"]["peak_mib"]
            row["threads"] = args.threads
            out.append(row)
    return out
