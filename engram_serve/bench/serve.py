"""Serving throughput and latency: microbatching on against off, or the default kernel threads against one.

Two servers run in this process on loopback (127.0.0.1, free ports), one per setting, over the
same loaded model (one model user at a time: the other engine thread sleeps on its command
queue). For each client count, waves of that many concurrent streaming completions (ignore_eos,
exactly --max-tokens each, the same prompts for both settings) alternate between the microbatching-off
and the microbatching-on server, the order flipping every wave, until --budget-s of timed waves per setting (at
least one, at most --max-waves). Reported per setting: tokens/s (all clients' tokens / wall time of
the waves), p50/p99 time to first token and inter-token latency (nearest rank, over every token of
every client), and the share of engine steps cut into microbatches; and the on/off ratio of each pair of
waves run back to back (median, min, max). The clients run in a process of their own (`_clients`, spawned), as
a server's clients would: they do not share the servers' interpreter lock, only the machine's cores.
Steps are cut only above the MicrobatchConfig thresholds (32 decode tokens, 128 with prefill), so
below ~32 clients both settings run the same whole steps.

`--compare threads` duels the kernels' thread pool instead (default clients 1,16): `default`, the server as `serve`
runs it without --threads (the pool at $ENGRAM_SERVE_THREADS, else the cores of the affinity mask, engine/threads.py
`default_threads`), against `t1`, the same server at --threads 1; both microbatch as `serve` does (2). The pool is
one per process, so before each wave the client process asks the bench to set it to that wave's server's size
(`_set_pool`; the other server's engine thread sleeps on its command queue, and a wave ends only after its last
step). Each row gives both sizes and `*_pool_threads`, the size the engine's own snapshot saw at its last step
(AsyncLLMEngine.metrics `kernel_threads`); the ratios are default over t1.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import multiprocessing
import os
import random
import resource
import time

from . import common

NAME = "serve"
COMPARE = {"microbatch": ("off", "on"), "threads": ("t1", "default")}  # (baseline, candidate) per --compare
WORDS = "the a of river stone light quick slow green idea number seven over under house blue".split()


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compare", choices=sorted(COMPARE), default="microbatch",
                        help="microbatch: microbatching off against on (default); threads: the default kernel "
                             "threads (the affinity mask's cores) against --threads 1")
    parser.add_argument("--clients", type=common.positive_int_list, default=None, metavar="N,N,...",
                        help="concurrent streaming clients (default 1,8,32; --compare threads 1,16)")
    parser.add_argument("--max-tokens", type=common.positive_int, default=32, metavar="N",
                        help="tokens per request (default 32)")
    parser.add_argument("--prompt-words", type=common.positive_int, default=12, metavar="N",
                        help="words per prompt (default 12)")
    parser.add_argument("--max-waves", type=common.positive_int, default=8, metavar="N",
                        help="most waves per client count and setting (default 8)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="checkpoint directory (default: the built-in tiny model)")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def _client(http, base_url: str, body: dict, ttft: list, itl: list) -> int:
    t0 = time.perf_counter()
    last, n = None, 0
    async with http.stream("POST", base_url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"bench request failed: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            k = len(chunk["choices"][0]["token_ids"]) if chunk["choices"] else 0
            if k:
                now = time.perf_counter()
                (ttft if last is None else itl).append(now - (t0 if last is None else last))
                last, n = now, n + k
    return n


def _bodies(rng: random.Random, clients: int, args) -> list[dict]:
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(args.prompt_words)),
             "max_tokens": args.max_tokens, "temperature": 0.8, "seed": rng.randrange(2**31),
             "ignore_eos": True, "stream": True, "return_token_ids": True} for _ in range(clients)]


async def _duel(urls: dict[str, str], clients: int, args, seed: int, max_waves: int | None = None,
                before=None) -> dict:
    """Waves of `clients` concurrent streams, one wave per setting in turn (the order flips every wave,
    so a change in machine load hits both settings alike), until every setting has run --budget-s of
    timed waves (at least one, at most --max-waves). Both settings get the same prompts, wave by wave.
    `before(name)`, if given, runs before each of that setting's waves (untimed)."""
    import httpx
    rng = random.Random(seed)
    names = list(urls)
    stats = {n: {"ttft": [], "itl": [], "tokens": 0, "spent": 0.0, "waves": 0, "wave_tok_s": []} for n in names}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    most = max_waves or args.max_waves
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        w = 0
        while w < 1 or (w < most and min(st["spent"] for st in stats.values()) < args.budget_s):
            bodies = _bodies(rng, clients, args)
            for name in (names if w % 2 == 0 else names[::-1]):
                st = stats[name]
                if before is not None:
                    before(name)
                t0 = time.perf_counter()
                counts = await asyncio.gather(*[_client(http, urls[name], b, st["ttft"], st["itl"]) for b in bodies])
                dt = time.perf_counter() - t0
                st["spent"] += dt
                st["tokens"] += sum(counts)
                st["waves"] += 1
                st["wave_tok_s"].append(sum(counts) / dt)
            w += 1
    return {n: {"waves": st["waves"], "requests": st["waves"] * clients, "tokens": st["tokens"], "wall_s": st["spent"],
                "tok_s": st["tokens"] / st["spent"], "wave_tok_s": st["wave_tok_s"],
                "ttft_p50_ms": _pct(st["ttft"], 0.5) * 1e3, "ttft_p99_ms": _pct(st["ttft"], 0.99) * 1e3,
                "itl_p50_ms": _pct(st["itl"], 0.5) * 1e3, "itl_p99_ms": _pct(st["itl"], 0.99) * 1e3}
            for n, st in stats.items()}


def _clients(conn, urls: dict[str, str], args: argparse.Namespace) -> None:
    """The client process: for each ("duel", clients, seed, max_waves) it receives, `_duel` over `urls`, asking
    the server process ("before", name; it answers when done) before each wave, then sends ("done", result)."""
    def before(name: str) -> None:
        conn.send(("before", name))
        conn.recv()
    while (job := conn.recv()) is not None:
        _, clients, seed, max_waves = job
        try:
            conn.send(("done", asyncio.run(_duel(urls, clients, args, seed, max_waves, before))))
        except Exception as e:  # (a failed request): the server process raises it
            conn.send(("failed", f"{type(e).__name__}: {e}"))


def _duel_elsewhere(conn, clients: int, seed: int, max_waves: int | None, before) -> dict:
    """`_duel` in the client process, running `before(name)` here when it asks (EOFError if that process died)."""
    conn.send(("duel", clients, seed, max_waves))
    while (msg := conn.recv())[0] == "before":
        if before is not None:
            before(msg[1])
        conn.send("ok")
    if msg[0] == "failed":
        raise RuntimeError(f"bench serve's clients: {msg[1]}")
    return msg[1]


def _set_pool(sizes: dict[str, int], name: str) -> None:
    """The kernels' pool at `name`'s size: called between waves, while no engine steps."""
    from .. import thread_pool
    if thread_pool.set_threads(sizes[name]) != sizes[name]:
        raise RuntimeError(f"the kernels' pool cannot run {sizes[name]} threads (not built?)")


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from ..engine.async_engine import AsyncLLMEngine
    from ..engine.llm_engine import LLMEngine
    from ..engine.threads import default_threads, set_torch_threads
    from ..errors import ConfigError
    from ..microbatch.plan import MicrobatchConfig
    from ..model.loader import load_model
    from ..runner.model_runner import RunnerConfig
    from ..server.api import build_app
    from ..server.run import BackgroundServer

    base, cand = COMPARE[args.compare]
    clients_list = args.clients or ([1, 16] if args.compare == "threads" else [1, 8, 32])
    if args.compare == "threads":
        n = default_threads()
        if n == 1:
            raise ConfigError("--compare threads: the default is 1 thread (the affinity mask has one core, or "
                              "ENGRAM_SERVE_THREADS=1): nothing to compare; set ENGRAM_SERVE_THREADS=N")
        sizes = {base: 1, cand: n}
        settings = {name: (MicrobatchConfig(num_microbatches=2), sizes[name]) for name in (base, cand)}
        before = functools.partial(_set_pool, sizes)
        set_torch_threads(n)  # loading runs torch ops; each engine below sets its own count (exact: torch on one)
    else:
        settings = {base: (MicrobatchConfig(num_microbatches=1), None),
                    cand: (MicrobatchConfig(num_microbatches=2), None)}
        before = None
        torch.set_num_threads(args.threads)
        os.environ["ENGRAM_SERVE_THREADS"] = str(args.threads)  # engines built below keep it
    loaded = load_model(args.model)
    most = max(clients_list)
    servers, proc = {}, None
    try:
        for name, (microbatch, threads) in settings.items():
            cfg = RunnerConfig(max_num_seqs=most, max_model_len=min(2048, loaded.config.max_position_embeddings),
                               microbatch=microbatch)
            engine = AsyncLLMEngine(LLMEngine(loaded, cfg, threads=threads))
            servers[name] = (engine, BackgroundServer(build_app(engine, "bench")).start())
        urls = {name: server.base_url for name, (_, server) in servers.items()}
        spawn = multiprocessing.get_context("spawn")
        conn, theirs = spawn.Pipe()
        wave = argparse.Namespace(**{k: getattr(args, k) for k in ("budget_s", "max_waves", "max_tokens",
                                                                   "prompt_words")})  # (what _duel reads)
        proc = spawn.Process(target=_clients, args=(theirs, urls, wave), daemon=True)
        proc.start()
        theirs.close()  # (so that recv sees the client process end)
        _duel_elsewhere(conn, 2, 0, 1, before)  # warm-up
        rows = []
        for clients in clients_list:
            before_m = {name: engine.metrics() for name, (engine, _) in servers.items()}
            res = _duel_elsewhere(conn, clients, clients, None, before)
            for name, (engine, _) in servers.items():
                after = engine.metrics()
                steps = after["steps_total"] - before_m[name]["steps_total"]
                res[name]["microbatched_steps_pct"] = 100 * (after["microbatched_steps_total"] -
                                                      before_m[name]["microbatched_steps_total"]) / max(steps, 1)
                res[name]["pool_threads"] = after["kernel_threads"]
            row = {"clients": clients, "max_tokens": args.max_tokens, "requests": res[cand]["requests"]}
            keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "microbatched_steps_pct")
            if before is not None:
                keys += ("pool_threads",)
                row[f"{base}_threads"], row[f"{cand}_threads"] = sizes[base], sizes[cand]
            for key in keys:
                row[f"{base}_{key}"] = res[base][key]
                row[f"{cand}_{key}"] = res[cand][key]
            row[f"tok_s_ratio_{cand}_{base}"] = res[cand]["tok_s"] / res[base]["tok_s"]
            pairs = sorted(c / b for c, b in zip(res[cand]["wave_tok_s"], res[base]["wave_tok_s"]))
            row["wave_ratio_median"], row["wave_ratio_min"], row["wave_ratio_max"] = _pct(pairs, 0.5), pairs[0], pairs[-1]
            if before is None:
                row["threads"] = args.threads
            rows.append(row)
    finally:
        if proc is not None and proc.is_alive():
            conn.send(None)
            proc.join(10)
        for engine, server in servers.values():
            server.stop()
            engine.shutdown()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for row in rows:
        row["process_peak_rss_mib"] = peak
    return rows
