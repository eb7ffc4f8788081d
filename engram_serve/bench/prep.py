"""Step preparation: vectorised (batch, split, per-microbatch history and hash ids) vs a per-request loop.

Each step mixes decodes (half the requests, 1 token each) and prefill chunks (the other half share
the remaining tokens); every request already has `context` tokens computed, so the step reads
history from deep in the token store. Both candidates produce the same hash ids (checked on a
small step before timing). Rows with fewer tokens than requests are skipped.
"""
from __future__ import annotations

import argparse

from . import common

NAME = "prep"
BLOCK = 16


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=common.positive_int_list, default=[1, 64, 256, 1024], metavar="N,...")
    parser.add_argument("--tokens", type=common.positive_int_list, default=[64, 2048, 8192], metavar="N,...")
    parser.add_argument("--contexts", type=common.positive_int_list, default=[128, 131072], metavar="N,...")


def _workload(requests: int, tokens: int, context: int):
    import numpy as np
    import torch

    from ..config import EngramConfig
    from ..engram.layout import build_layout
    from ..inputs.token_store import TokenStore

    cfg = EngramConfig([1, 14], [0, 0], 4, 8, 32, 16000000, 129280, 2)
    layout = build_layout(cfg, check_rows=False)
    rng = np.random.default_rng(requests * 7 + tokens + context)
    new = np.ones(requests, dtype=np.int64)
    prefill = np.arange(requests // 2, requests)  # the second half prefills the remaining tokens
    extra = tokens - requests
    new[prefill] += extra // len(prefill)
    new[prefill[: extra % len(prefill)]] += 1
    max_len = context + int(new.max())
    store = TokenStore(requests, max_len)
    store.ids.copy_(torch.from_numpy(rng.integers(0, 129280, size=(requests, max_len), dtype=np.int32)))
    store.lengths.fill_(max_len)
    slots = np.arange(requests)
    computed = np.full(requests, context, dtype=np.int64)
    max_blocks = -(-max_len // BLOCK)
    tables = np.arange(requests * max_blocks, dtype=np.int64).reshape(requests, max_blocks)
    tmap = torch.arange(129280)
    hash_buffers = [torch.empty(tokens, cfg.num_layers, cfg.num_columns, dtype=torch.int64) for _ in range(2)]
    return cfg, layout, store, slots, computed, new, tables, tmap, hash_buffers


def vectorised(cfg, layout, store, slots, computed, new, tables, tmap, hash_buffers):
    """What the runner does: the microbatches' hash ids land in their persistent buffers."""
    from ..engram.hashing import hash_step
    from ..inputs.step import build_step
    from ..inputs.ubatch import SplitConfig, plan_split, split_batch

    batch = build_step(store, slots, computed, new, tables, BLOCK, cfg.history_len)
    bounds = plan_split(batch.qsl_host, SplitConfig(2, "tokens", 0, 0), is_decode_only=False)
    return [hash_step(u.input_ids, u.qsl, u.history, layout, tmap, 2, dead=u.dead, out=buf[: u.num_tokens])
            for u, buf in zip(split_batch(batch, bounds), hash_buffers)]


def per_request_loop(cfg, layout, store, slots, computed, new, tables, tmap, hash_buffers=None):
    """The straightforward way: every field, history and hash built request by request."""
    import torch

    from ..engram.hashing import hash_step
    d = cfg.history_len
    total = int(new.sum())
    cut = round(total / 2)
    outs, start, fields = [], 0, []
    rows_of = [[], []]
    for r in range(len(slots)):
        c, n, s = int(computed[r]), int(new[r]), int(slots[r])
        pos = torch.arange(c, c + n)
        ids = store.ids[s, c:c + n].long()
        fields.append((ids, pos, torch.tensor(tables[r])[pos // BLOCK] * BLOCK + pos % BLOCK))
        for k, (a, b) in enumerate(((0, cut), (cut, total))):  # this request's part in each microbatch
            lo, hi = max(a, start) - start, min(b, start + n) - start
            if lo < hi:
                first = c + lo
                hist = torch.tensor([int(store.ids[s, first - 1 - j]) if first - 1 - j >= 0 else -1
                                     for j in range(d)])
                rows_of[k].append((ids[lo:hi], hist))
        start += n
    _ids, _positions, _slot_mapping = (torch.cat(f) for f in zip(*fields))  # the step's token fields
    for rows in rows_of:
        outs.append(torch.cat([hash_step(ids, torch.tensor([0, len(ids)]), hist[None], layout, tmap, 2)
                               for ids, hist in rows]))
    return outs


def setup(candidate: str, requests: int, tokens: int, context: int):
    w = _workload(requests, tokens, context)
    fn = vectorised if candidate == "vectorised" else per_request_loop
    return lambda: fn(*w)


def check_equal(requests: int, tokens: int, context: int) -> None:
    import torch
    w = _workload(requests, min(tokens, 256) if requests <= 256 else tokens, context)
    a, b = vectorised(*w), per_request_loop(*w)
    if not all(torch.equal(x, y) for x, y in zip(a, b)):
        raise RuntimeError(f"candidates disagree at requests={requests} tokens={tokens} context={context}")


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    check_equal(4, 64, 128)
    for ctx in args.contexts:
        for req in args.requests:
            for tok in args.tokens:
                if tok < req:
                    continue
                res = {c: common.measure(setup, dict(candidate=c, requests=req, tokens=tok, context=ctx),
                                         **common.timing_kwargs(args))
                       for c in ("vectorised", "per_request_loop")}
                v, loop = res["vectorised"], res["per_request_loop"]
                rows.append({"requests": req, "tokens": tok, "context": ctx,
                             "vectorised_ms": v["median_ms"], "loop_ms": loop["median_ms"],
                             "speedup": loop["median_ms"] / v["median_ms"],
                             "vectorised_peak_mib": v["peak_mib"], "loop_peak_mib": loop["peak_mib"]})
    return rows
