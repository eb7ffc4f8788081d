"""Step preparation as the engine does it: row arrays, block tables, batch, cut, history and hash ids.

Candidate `engine`: the persistent step state (block tables on the device, updated incrementally:
each step appends only the blocks the rows gained) and one packed copy of the row fields. Baseline
`rebuild`: what the engine did before, the block tables rebuilt every step as rows x max_blocks
Python lists, then turned into an array. Both then build the same batch from the token store, cut
it in two, rebuild each microbatch's history and compute its hash ids into persistent buffers, and
both are checked to give identical hash ids and block tables before timing.

Each step mixes decodes (half the requests, 1 token each) and prefill chunks (the other half share
the remaining tokens); every request already has `context` tokens computed, so history comes from
deep in the token store and each block table holds context/16 blocks. The prefill rows gain their
chunk's blocks every step, as in serving. Sizes with fewer tokens than requests are skipped.
"""
from __future__ import annotations

import argparse

from . import common

NAME = "prep"
BLOCK = 16
MAX_CALLS = 200  # the block lists have room to grow for this many timed steps


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=common.positive_int_list, default=[256], metavar="N,...")
    parser.add_argument("--tokens", type=common.positive_int_list, default=[256, 2048], metavar="N,...")
    parser.add_argument("--contexts", type=common.positive_int_list, default=[512, 32768, 131072], metavar="N,...")


class _Row:
    """What the engine reads from a scheduled row: its slot and its (growing) block list."""

    def __init__(self, slot: int, block_ids: list[int]):
        self.slot, self.block_ids = slot, block_ids


def _workload(requests: int, tokens: int, context: int):
    import numpy as np
    import torch

    from ..config import EngramConfig
    from ..engram.layout import build_layout
    from ..inputs.step_state import StepState
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
    computed = np.full(requests, context, dtype=np.int64)
    grow = np.zeros(requests, dtype=np.int64)
    grow[prefill] = -(-(new[prefill]) // BLOCK)  # blocks a prefill row gains per step
    max_blocks = -(-max_len // BLOCK) + MAX_CALLS * int(grow.max())
    per_row = -(-max_len // BLOCK)
    rows = [_Row(r, list(range(r * max_blocks, r * max_blocks + per_row))) for r in range(requests)]
    state = StepState(requests, max_blocks)
    for row in rows:
        state.sync(row.slot, row.block_ids)
    state.flush()
    tmap = torch.arange(129280)
    hash_buffers = [torch.empty(tokens, cfg.num_layers, cfg.num_columns, dtype=torch.int64) for _ in range(2)]
    return dict(cfg=cfg, layout=layout, store=store, rows=rows, computed=computed, new=new, grow=grow,
                max_blocks=max_blocks, state=state, tmap=tmap, hash_buffers=hash_buffers, calls=[0])


def _advance(w) -> None:
    """One step later: each prefill row has gained its chunk's blocks (no-op past MAX_CALLS)."""
    if w["calls"][0] >= MAX_CALLS:
        return
    w["calls"][0] += 1
    for row, g in zip(w["rows"], w["grow"].tolist()):
        if g:
            last = row.block_ids[-1]
            row.block_ids.extend(range(last + 1, last + 1 + g))


def _slice_and_hash(w, batch):
    from ..engram.hashing import hash_step
    from ..microbatch.plan import MicrobatchConfig, plan_microbatches
    from ..microbatch.slicing import slice_microbatches
    bounds = plan_microbatches(batch.qsl_host, MicrobatchConfig(2, "tokens", 0, 0, when="always"), is_decode_only=False)
    return [hash_step(u.input_ids, u.qsl, u.history, w["layout"], w["tmap"], 2, dead=u.dead,
                      out=buf[: u.num_tokens]) for u, buf in zip(slice_microbatches(batch, bounds), w["hash_buffers"])]


def engine(w):
    """The engine's preparation: sync the persistent tables (O(new blocks)), one packed copy, build."""
    import numpy as np

    from ..inputs.step import build_step
    _advance(w)
    rows, state, n = w["rows"], w["state"], len(w["rows"])
    for row in rows:
        state.sync(row.slot, row.block_ids)
    batch = build_step(w["store"], np.fromiter((r.slot for r in rows), np.int64, n), w["computed"], w["new"],
                       state, BLOCK, w["cfg"].history_len)
    return batch, _slice_and_hash(w, batch)


def rebuild(w):
    """The baseline: block tables rebuilt from Python lists every step (rows x max_blocks), then built."""
    import numpy as np

    from ..inputs.step import build_step
    _advance(w)
    rows, mb = w["rows"], w["max_blocks"]
    tables = np.array([r.block_ids + [-1] * (mb - len(r.block_ids)) for r in rows])
    batch = build_step(w["store"], np.array([r.slot for r in rows]), w["computed"], w["new"], tables, BLOCK,
                       w["cfg"].history_len)
    return batch, _slice_and_hash(w, batch)


def setup(candidate: str, requests: int, tokens: int, context: int):
    w = _workload(requests, tokens, context)
    fn = engine if candidate == "engine" else rebuild
    return lambda: fn(w)


def check_equal(requests: int, tokens: int, context: int) -> None:
    import torch
    a_w, b_w = _workload(requests, tokens, context), _workload(requests, tokens, context)
    for _ in range(3):  # a few steps, so that the incremental appends are compared too
        (a, ha), (b, hb) = engine(a_w), rebuild(b_w)
        same = torch.equal(a.block_tables, b.block_tables[:, :a.block_tables.shape[1]])  # the columns a step reads
        if not same or not all(torch.equal(x, y) for x, y in zip(ha, hb)) or not torch.equal(a.slot_mapping,
                                                                                             b.slot_mapping):
            raise RuntimeError(f"candidates disagree at requests={requests} tokens={tokens} context={context}")


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    check_equal(8, 64, 128)
    for ctx in args.contexts:
        for req in args.requests:
            for tok in args.tokens:
                if tok < req:
                    continue
                res = {c: common.measure(setup, dict(candidate=c, requests=req, tokens=tok, context=ctx),
                                         **common.timing_kwargs(args))
                       for c in ("engine", "rebuild")}
                e, r = res["engine"], res["rebuild"]
                rows.append({"requests": req, "tokens": tok, "context": ctx,
                             "engine_ms": e["median_ms"], "engine_p90_ms": e["p90_ms"],
                             "rebuild_ms": r["median_ms"], "speedup": r["median_ms"] / e["median_ms"],
                             "engine_peak_mib": e["peak_mib"], "rebuild_peak_mib": r["peak_mib"],
                             "threads": args.threads})
    return rows
