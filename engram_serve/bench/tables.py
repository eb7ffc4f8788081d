"""Engram tables larger than RAM: the staging gather from a memory-mapped FP8 table, cold and warm.

Creates one safetensors file in the official layout (two Engram layers, N = 4, H = 8, head_dim 256,
F8_E4M3 rows + F8_E8M0 scales) larger than this machine's RAM, written sparse: the header, the
scales (dense, 8 bytes per row) and only the rows the stream below touches (random bytes); the
rest of the file is a hole, so the disk is not filled with zeros. The file is deleted at the end.

The stream: real text (the Python standard library's sources) through the built-in tokenizer, cut
into `requests` sequences that decode side by side, one token per request per step; their hash ids
(production `hash_step`) are Zipfian like the text. Each step stages its rows with the production
gather (`EngramTables.gather`, float32 staging, opened through the production loader path), under
five settings: the torch path (the baseline) plain and with dedup, the fused C kernel
(`engram.staging`) plain and with dedup, and the kernel with dedup behind the hot-row cache. Warm:
the written rows are in the page cache; a first pass per setting maps them and fills the cache, then
--rounds rounds time every setting in turn over the whole stream (alternating, so that all see the
same load). Cold: page cache dropped with posix_fadvise DONTNEED, the file re-opened, the first
--cold-steps steps timed, one setting after another (the page cache is the variable; cold is last,
since it undoes the warm-up). Torch threads are set by --threads.

Reported per row: median and p90 ms per step; at the median step, staged rows/s and staged bytes/s
(float32 rows written into staging, duplicates included: the effective staging rate) and stored
bytes/s read from the table (distinct rows x 264 bytes); the cache hit rate and the process's peak RSS.
Warm rows also give x_memcpy: each round ends with this machine's memcpy rate (torch copy_ of 512 MiB,
DRAM to DRAM), so the baseline is measured under the same load as the round's gathers; x_memcpy is the
median over rounds of (the round's staged bytes/s at its median step) / (that round's memcpy), with
its range. Extra rows:
the gather's share of a decode step, in the engine: the built-in backbone (its config, random weights)
with this geometry as its Engram layers 1 and 2, reading the table file, 64 requests decoding their
slices of the 64-request stream (`ModelRunner.execute`); the runner's gather on its worker, overlapped
with layer 0, against the gather inline, step by step; the share = time the step blocked waiting for its
rows / step time (and, inline, the gather's time / step time). And the memcpy rates (of 512 MiB: the median
of the rounds' figures; and of a 64-request step's staging size, which stays in the CPU caches as the
staging buffer does).
"""
from __future__ import annotations

import argparse
import gc
import contextlib
import json
import math
import os
import resource
import shutil
import statistics
import struct
import sys
import sysconfig
import time
from pathlib import Path

from ..errors import UsageError
from . import common

NAME = "tables"
HEAD_DIM, N, H, LAYERS = 256, 4, 8, (1, 2)  # V4.1's Engram geometry; layers 1 and 2 of the built-in backbone
ROW_BYTES = HEAD_DIM + HEAD_DIM // 32  # E4M3 row + its E8M0 scales
MEMCPY_BYTES = 512 * 2**20  # the memcpy baseline: DRAM to DRAM


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-gib", type=common.positive_float, default=None, metavar="GiB",
                        help="table file size (default: 1.5 x RAM, at least 32, leaving >= 2 GiB of disk free)")
    parser.add_argument("--dir", type=Path, default=None, help="where to create the file (default: the current dir)")
    parser.add_argument("--requests", type=common.positive_int_list, default=[64, 512], metavar="R,R",
                        help="requests decoding side by side = tokens per step (default 64,512)")
    parser.add_argument("--stream-tokens", type=common.positive_int, default=16384, metavar="T",
                        help="tokens of text in the stream (default 16384)")
    parser.add_argument("--cache-mib", type=common.positive_int, default=256, metavar="MiB",
                        help="hot-row cache size (default 256)")
    parser.add_argument("--cold-steps", type=common.positive_int, default=2, metavar="S",
                        help="steps timed cold per stream and setting (default 2: cold reads are disk-bound)")
    parser.add_argument("--rounds", type=common.positive_int, default=3, metavar="K",
                        help="warm rounds, each timing every setting in turn over the whole stream (default 3)")
    parser.add_argument("--share-steps", type=common.positive_int, default=16, metavar="S",
                        help="steps of the 64-request stream timed beside the decode step, per round (default 16)")
    parser.add_argument("--keep", action="store_true", help="keep the table file (default: delete it)")


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _config(total_bytes: int):
    """(the Engram fields, their EngramConfig, its layout) of the V4.1 geometry whose two tables hold about
    total_bytes."""
    from ..config import EngramConfig
    from ..engram.layout import build_layout
    rows_per_layer = total_bytes // (len(LAYERS) * ROW_BYTES)
    vocab = rows_per_layer // ((N - 1) * H)
    d = dict(engram_layer_ids=list(LAYERS), engram_num_embeddings=[0, 0], engram_max_ngram_size=N, engram_n_heads=H,
             engram_head_dim=HEAD_DIM, engram_vocab_size=vocab, engram_compressed_vocab_size=2726,
             engram_pad_token_id=1)
    d["engram_num_embeddings"] = build_layout(EngramConfig(**d), check_rows=False).table_rows
    cfg = EngramConfig(**d)
    return d, cfg, build_layout(cfg)


def _stream(tokens: int):
    """Token ids of real text: the standard library's .py sources, in path order, through the built-in tokenizer."""
    from ..engram.token_map import build_token_map, load_tokenizer
    from ..model.loader import TINY_DIR
    tok = load_tokenizer(TINY_DIR / "tokenizer.json")
    ids: list[int] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts:
            continue
        try:
            ids += tok.encode(path.read_text(encoding="utf-8")).ids
        except (OSError, UnicodeDecodeError):
            continue
        if len(ids) >= tokens:
            break
    return ids[:tokens], build_token_map(tok, 2726)


def _hash_stream(ids: list[int], requests: int, layout, tmap):
    """hash ids [steps, requests, L, C]: request r decodes text[r*steps : (r+1)*steps], one token per step."""
    import torch

    from ..engram.hashing import hash_step
    steps = len(ids) // requests
    x = torch.tensor(ids[: steps * requests])  # [R*S]
    qsl = torch.arange(requests + 1) * steps
    hist = torch.full((requests, N - 1), -1, dtype=torch.int64)
    h = hash_step(x, qsl, hist, layout, tmap, int(tmap[1]))  # [R*S, L, C]
    return h.view(requests, steps, len(LAYERS), -1).transpose(0, 1).contiguous()  # [S, R, L, C]


def _write_file(path: Path, cfg, touched: list, seed: int = 0) -> int:
    """Sparse safetensors file: header, dense scales, random bytes in the touched rows only."""
    import numpy as np
    header, off, spans = {}, 0, []
    for lid, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        for suffix, dtype, width in (("weight", "F8_E4M3", HEAD_DIM), ("scale", "F8_E8M0", HEAD_DIM // 32)):
            header[f"layers.{lid}.engram.embed.{suffix}"] = {"dtype": dtype, "shape": [rows, width],
                                                             "data_offsets": [off, off + rows * width]}
            spans.append((off, rows, width))
            off += rows * width
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    base = 8 + len(h)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(base + off)
    rng = np.random.default_rng(seed)
    for layer in range(len(LAYERS)):
        (w_off, rows, _), (s_off, _, sw) = spans[2 * layer], spans[2 * layer + 1]
        scales = np.memmap(path, dtype=np.uint8, mode="r+", offset=base + s_off, shape=(rows, sw))
        for a in range(0, rows, 1 << 22):  # dense scales, in 4M-row chunks: codes 2^-9 .. 2^-1
            scales[a:a + (1 << 22)] = rng.integers(118, 127, (min(1 << 22, rows - a), sw), dtype=np.uint8)
        scales.flush()
        del scales
        rows_w = np.memmap(path, dtype=np.uint8, mode="r+", offset=base + w_off, shape=(rows, HEAD_DIM))
        ids = np.asarray(touched[layer], dtype=np.int64)
        data = rng.integers(0, 256, (len(ids), HEAD_DIM), dtype=np.uint8)
        data[(data & 0x7F) == 0x7F] = 0x3C  # no NaN codes
        rows_w[ids] = data
        rows_w.flush()
        del rows_w
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return base + off


def _drop_cache(path: Path) -> None:
    """Evict the file from the page cache (its pages must not be mapped by anyone: callers drop their tables)."""
    gc.collect()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _open_tables(root: Path, cfg, dedup: bool, cache_bytes: int):
    from ..model.checkpoint import CheckpointFiles
    from ..model.loader import read_tables
    return read_tables(CheckpointFiles.open(root), cfg, pin=False, dedup=dedup, cache_bytes=cache_bytes)


def _pass(tables, hashes, staging, backend: str = "kernel") -> list[float]:
    """Gather every step of `hashes`; backend "torch" switches the gather kernel off for the pass."""
    from .. import kernels
    times = []
    with kernels.override("-gather") if backend == "torch" else contextlib.nullcontext():
        for s in range(hashes.shape[0]):
            t0 = time.perf_counter()
            tables.gather(hashes[s], staging)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


# (name, gather backend, dedup, cache on): the fused C kernel beside the torch path it replaces (the
# baseline); with the cache (the kernel's HotRowCache), hits are copied out of it inside the same kernel call
SETTINGS = (("torch plain", "torch", False, 0), ("torch dedup", "torch", True, 0), ("kernel plain", "kernel", False, 0),
            ("kernel dedup", "kernel", True, 0), ("kernel dedup+cache", "kernel", True, 1))


def _staging(requests: int):
    import torch
    return torch.empty(len(LAYERS), requests, (N - 1) * H, HEAD_DIM)  # [L, T, C, hd] float32


def _p90(times: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    return sorted(times)[max(0, math.ceil(0.9 * len(times)) - 1)]


def _row(tables, hashes, times: list[float], r: int, name: str, state: str, dedup: bool,
         memcpy: list[float] | None = None) -> dict:
    """A gather row; with memcpy (GB/s, one per warm round, each round's steps in turn in times), the
    per-round ratios to it."""
    import torch
    steps, per_step = hashes.shape[0], r * len(LAYERS) * hashes.shape[-1]
    distinct = sum(int(torch.unique(hashes[s, :, layer]).numel()) for s in range(steps) for layer in range(len(LAYERS)))
    caches = [c for c in tables.caches if c is not None]
    hit_rate = (sum(c.hits for c in caches) / max(1, sum(c.lookups for c in caches))) if caches else None
    for c in caches:
        c.hits = c.lookups = 0
    med_s = statistics.median(times) / 1e3  # rates from the median step: one slow step (a shared machine) is noise
    staged = per_step * HEAD_DIM * 4 / 1e9  # GB a step
    ratios = [staged / (statistics.median(times[k * steps:(k + 1) * steps]) / 1e3) / gbs
              for k, gbs in enumerate(memcpy or [])]
    vs = {"x_memcpy": statistics.median(ratios), "x_memcpy_min": min(ratios), "x_memcpy_max": max(ratios)} \
        if ratios else {}
    return {**vs, "what": "gather", "requests": r, "setting": name, "state": state, "steps": steps,
            "rows_per_step": per_step, "distinct_per_step": distinct / steps, "median_ms": statistics.median(times),
            "p90_ms": _p90(times), "rows_s": per_step / med_s, "staged_gb_s": staged / med_s,
            "stored_mb_s": (distinct / steps if dedup else per_step) * ROW_BYTES / med_s / 1e6,
            "cache_hit_rate": hit_rate, "peak_rss_mib": _peak_rss_mib()}


def _memcpy_gbs(src, repeats: int) -> float:
    """torch copy_ of the float32 tensor src: median GB/s (copied bytes per second)."""
    dst = src.new_empty(src.shape)
    dst.copy_(src)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return src.numel() * 4 / statistics.median(ts) / 1e9


def _share_model(engram: dict, tables, tmap):
    """The built-in backbone (its config, random weights) with this file's Engram geometry, reading `tables`."""
    from ..config import ModelConfig, flatten_config, read_json
    from ..engram.layout import build_layout
    from ..engram.token_map import load_tokenizer
    from ..model.deepseek_v41 import DeepseekV41, init_weights
    from ..model.layers import layout_weights_
    from ..model.loader import TINY_DIR, LoadedModel
    cfg = ModelConfig.from_dict({**flatten_config(read_json(TINY_DIR / "config.json")), **engram})
    model = layout_weights_(init_weights(DeepseekV41(cfg), 0)).requires_grad_(False).eval()
    return LoadedModel(cfg, model, tables, build_layout(cfg.engram), load_tokenizer(TINY_DIR / "tokenizer.json"),
                       tmap, TINY_DIR)


def _share_rows(engram: dict, tables: dict, ids: list[int], tmap, steps: int, rounds: int) -> list[dict]:
    """The engine's decode step (`ModelRunner.execute`, 64 requests) of a model whose Engram layers read
    the table file: request r holds its slice of the 64-request stream and decodes its last `steps`
    tokens, one per step (the stream's own hash ids, so only written rows are read). The gather on the
    runner's worker, overlapped with layer 0 (the default), against the gather inline (MicrobatchPlanner.PREFETCH_MIN_MS
    infinite), alternating step by step. Exposed = the time the step blocked waiting for its rows."""
    import numpy as np

    from ..microbatch.plan import MicrobatchConfig, MicrobatchPlanner
    from ..runner.model_runner import ModelRunner, RunnerConfig
    requests, block = 64, 16
    length = len(ids) // requests // block * block
    ctx = length - steps
    text = np.asarray(ids[: requests * (len(ids) // requests)], dtype=np.int64).reshape(requests, -1)[:, :length]
    staging = _staging(requests)
    out = []
    for name in ("kernel dedup", "kernel dedup+cache"):
        runner = ModelRunner(_share_model(engram, tables[name], tmap), RunnerConfig(
            max_num_seqs=requests, max_model_len=length, max_num_batched_tokens=requests, block_size=block,
            num_blocks=requests * length // block, microbatch=MicrobatchConfig(1)))
        slots = np.array([runner.store.add(row.tolist()) for row in text])
        bt = np.arange(requests * (length // block)).reshape(requests, -1)
        batches = [runner.build(slots, np.full(requests, ctx + s), np.ones(requests, np.int64), bt, np.ones(requests, bool))
                   for s in range(steps)]
        for b in batches:  # warm-up: maps the rows, fills the cache, feeds the runner's gather estimate
            runner.execute(b)
        ms = {"overlapped": [], "inline": [], "exposed": [], "gather": []}
        for _ in range(rounds):
            for b in batches:
                for mode, min_ms in (("overlapped", MicrobatchPlanner.PREFETCH_MIN_MS), ("inline", math.inf)):
                    runner.planner.PREFETCH_MIN_MS = min_ms
                    t0 = time.perf_counter()
                    runner.execute(b)
                    ms[mode].append((time.perf_counter() - t0) * 1e3)
                    if mode == "overlapped":
                        ms["exposed"].append(runner.gather_wait_ms)
                ms["gather"] += _pass(tables[name], runner.bufs[0].hash_ids[None, :requests], staging)  # timed alone
        runner.close()
        med = {k: statistics.median(v) for k, v in ms.items()}
        out.append({"what": "decode step share", "setting": name, "requests": requests, "context": f"{ctx}-{length - 1}",
                    "step_overlapped_ms": med["overlapped"], "step_overlapped_p90_ms": _p90(ms["overlapped"]),
                    "step_inline_ms": med["inline"], "step_inline_p90_ms": _p90(ms["inline"]),
                    "gather_ms": med["gather"], "exposed_ms": med["exposed"], "exposed_p90_ms": _p90(ms["exposed"]),
                    "share_overlapped": med["exposed"] / med["overlapped"],
                    "share_inline": med["gather"] / med["inline"],
                    "inline_over_overlapped": med["inline"] / med["overlapped"]})
    return out


def run(args: argparse.Namespace) -> list[dict]:
    import torch
    torch.set_num_threads(args.threads)
    where = (args.dir or Path.cwd()).resolve()
    free = shutil.disk_usage(where).free
    ram = _ram_bytes()
    size = int(args.size_gib * 2**30) if args.size_gib else max(int(1.5 * ram), 32 * 2**30)
    if free - size < 2 * 2**30:
        raise UsageError(f"--size-gib {size / 2**30:.1f}: {where} has {free / 2**30:.1f} GiB free; the file's size "
                         f"and 2 GiB more must be free (the file is sparse, but its apparent size is reserved here "
                         f"to be safe)")
    engram, cfg, layout = _config(size)
    ids, tmap = _stream(args.stream_tokens)
    streams = {r: _hash_stream(ids, r, layout, tmap) for r in args.requests}
    touched = [torch.unique(torch.cat([h[:, :, layer].reshape(-1) for h in streams.values()])).numpy()
               for layer in range(len(LAYERS))]
    root = where / "engram-bench-tables"
    root.mkdir(exist_ok=True)
    path = root / "model.safetensors"
    rows, memcpy, memcpy_src = [], [], torch.ones(MEMCPY_BYTES // 4)
    try:
        t0 = time.perf_counter()
        file_bytes = _write_file(path, cfg, touched)
        allocated = os.stat(path).st_blocks * 512
        rows.append({"what": "table file", "file_gib": file_bytes / 2**30, "ram_gib": ram / 2**30,
                     "on_disk_gib": allocated / 2**30, "table_rows": sum(cfg.engram_num_embeddings),
                     "stream_tokens": len(ids), "distinct_rows": int(sum(len(t) for t in touched)),
                     "write_s": time.perf_counter() - t0})
        # warm first: the rows just written are in the page cache; a first pass maps them (and fills the
        # caches), then --rounds rounds time every setting in turn, one pass over the stream each
        for r, hashes in streams.items():
            tables = {name: _open_tables(root, cfg, dedup, cache * args.cache_mib * 2**20)
                      for name, _, dedup, cache in SETTINGS}
            times: dict[str, list[float]] = {name: [] for name in tables}
            for name, backend, _, _ in SETTINGS:
                _pass(tables[name], hashes, _staging(r), backend)
                for c in tables[name].caches:  # count the timed passes only
                    if c is not None:
                        c.hits = c.lookups = 0
            for _ in range(args.rounds):
                for name, backend, _, _ in SETTINGS:
                    times[name] += _pass(tables[name], hashes, _staging(r), backend)
                memcpy.append(_memcpy_gbs(memcpy_src, 5))  # the baseline, under this round's load
            for name, _, dedup, _ in SETTINGS:
                rows.append(_row(tables[name], hashes, times[name], r, name, "warm", dedup, memcpy[-args.rounds:]))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
            if r == 64:
                rows += _share_rows(engram, tables, ids, tmap, args.share_steps, args.rounds)
            del tables
        # cold last (dropping the page cache undoes the warm-up): the first --cold-steps steps of each stream
        for r, hashes in streams.items():
            cold = hashes[: args.cold_steps]
            for name, backend, dedup, cache in SETTINGS:
                _drop_cache(path)
                tables = _open_tables(root, cfg, dedup, cache * args.cache_mib * 2**20)
                rows.append(_row(tables, cold, _pass(tables, cold, _staging(r), backend), r, name, "cold", dedup))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
                del tables
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    staging_bytes = 64 * len(LAYERS) * (N - 1) * H * HEAD_DIM * 4  # a 64-request step's float32 staging
    rows.append({"what": "memcpy", "bytes": "512 MiB (median of the warm rounds)", "gb_s": statistics.median(memcpy),
                 "min_gb_s": min(memcpy), "max_gb_s": max(memcpy), "threads": args.threads})
    rows.append({"what": "memcpy", "bytes": f"{staging_bytes / 2**20:.0f} MiB (staging size)",
                 "gb_s": _memcpy_gbs(torch.ones(staging_bytes // 4), 50), "threads": args.threads})
    return rows
