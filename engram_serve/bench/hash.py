"""Engram hash throughput: production `hash_step` vs the plain-loop `reference_hash`, side by side.

Layout: the DeepSeek-V4.1 golden one (Engram layers [1, 14], N=4, H=8, vocab 16,000,000,
V'=129,280). One request whose sequence starts at position 0 (history all -1), random raw ids,
identity compressed map. `prod_backend` says which production path ran: `kernel` (the C hash
kernel, the default on CPU when it was built) or `torch` (`ENGRAM_SERVE_KERNELS=-hash`, or no
kernel). The reference is a Python loop (about 7 us per token here), so for
sizes above `--ref-cap` it is timed on the first `--ref-cap` tokens only and the row says so;
throughput (tokens/s) is what is compared, and the reference's cost is linear in tokens.
"""
from __future__ import annotations

import argparse

from . import common

NAME = "hash"
GOLDEN = dict(engram_layer_ids=[1, 14], engram_num_embeddings=[384006168, 384016682], engram_max_ngram_size=4,
              engram_n_heads=8, engram_head_dim=32, engram_vocab_size=16000000,
              engram_compressed_vocab_size=129280, engram_pad_token_id=2)


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=common.positive_int_list, default=[1, 64, 8192, 65536], metavar="N,N,...",
                        help="tokens per step (default 1,64,8192,65536)")
    parser.add_argument("--ref-cap", type=common.positive_int, default=2048, metavar="N",
                        help="time the reference on at most this many tokens (default 2048)")


def _inputs(tokens: int):
    import torch

    from ..config import EngramConfig
    from ..engram.layout import build_layout
    cfg = EngramConfig(**GOLDEN)
    layout = build_layout(cfg)
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, cfg.engram_compressed_vocab_size, (tokens,), generator=gen)  # [T] int64
    tmap = torch.arange(cfg.engram_compressed_vocab_size)  # identity compressed map [V'] int64
    return cfg, layout, ids, tmap


def setup_production(tokens: int):
    """The callable timed for the production path (runs in the measuring child)."""
    import torch

    from ..engram.hashing import hash_step
    cfg, layout, ids, tmap = _inputs(tokens)
    qsl = torch.tensor([0, tokens])
    hist = torch.full((1, cfg.history_len), -1, dtype=torch.int64)  # [1, D]: sequence starts at 0
    pad = int(tmap[cfg.engram_pad_token_id])
    return lambda: hash_step(ids, qsl, hist, layout, tmap, pad)


def setup_reference(tokens: int):
    """The callable timed for the reference (runs in the measuring child)."""
    from ..engram.hashing import reference_hash
    cfg, layout, ids, tmap = _inputs(tokens)
    seq, dead, tlist = ids.tolist(), [False] * tokens, tmap.tolist()
    pad = tlist[cfg.engram_pad_token_id]
    return lambda: reference_hash(seq, dead, layout, tlist, pad)


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from ..engram.hashing import hash_backend
    backend = hash_backend(torch.zeros(0, dtype=torch.int64))  # the measuring children inherit this environment
    cap = args.ref_cap
    timing = common.timing_kwargs(args)
    rows = []
    for size in args.sizes:
        prod = common.measure(setup_production, {"tokens": size}, **timing)
        ref_tokens = min(size, cap)
        ref = common.measure(setup_reference, {"tokens": ref_tokens}, **timing)
        prod_tps = size / (prod["median_ms"] / 1e3)
        ref_tps = ref_tokens / (ref["median_ms"] / 1e3)
        rows.append({
            "tokens": size, "layers": len(GOLDEN["engram_layer_ids"]), "n": GOLDEN["engram_max_ngram_size"],
            "heads": GOLDEN["engram_n_heads"], "prod_backend": backend,
            "prod_median_ms": prod["median_ms"], "prod_p90_ms": prod["p90_ms"], "prod_tok_s": prod_tps,
            "prod_peak_mib": prod["peak_mib"],
            "ref_tokens": ref_tokens, "ref_median_ms": ref["median_ms"], "ref_p90_ms": ref["p90_ms"],
            "ref_tok_s": ref_tps, "ref_peak_mib": ref["peak_mib"],
            "speedup": prod_tps / ref_tps,
            "threads": args.threads, "mem_method": prod["mem_method"],
            "note": f"reference timed on the first {ref_tokens} tokens" if ref_tokens < size else "",
        })
    return rows
