"""The `engram-serve` command line.

Each subcommand is registered by one `add_<name>(subparsers)` function listed in `COMMANDS`; it
builds its parser and sets `run=<function(args) -> int>`. Benchmarks are the modules of
`engram_serve.bench.registry()`, each becoming `engram-serve bench <name>`.

Errors: every `EngramServeError`, every bad argument, a wrongly typed config value (a TypeError /
ValueError while loading a checkpoint) and a closed output pipe (`... | head`) end the command with
ONE line `engram-serve: error: <message>` on stderr and exit code 2, never a traceback. Other
exceptions are bugs and keep their traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from .errors import ConfigError, EngramServeError, InvalidRequest, UsageError

PROG = "engram-serve"
DATA_DIR = Path(__file__).resolve().parent / "data" / "tiny"
DEFAULT_CONFIG = DATA_DIR / "config.json"
DEFAULT_TOKENIZER = DATA_DIR / "tokenizer.json"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; main prints one line
        if message.endswith("expected one argument"):
            message += " (attach a value that starts with '-', e.g. --token-ids=-1,2)"
        raise UsageError(message)


# ---- shared argument types and loaders ----

def id_list(text: str) -> list[int]:
    """argparse type: a non-empty comma-separated list of integers >= 0 (`1,2,3`)."""
    from .bench.common import int_list
    return int_list(text, 0)


def load_engram(config: Path, tokenizer: Path | None):
    """(EngramConfig, EngramLayout, token map [V] int64, tokenizer path) from the CLI's paths.

    The tokenizer defaults to `tokenizer.json` beside the config, else the bundled one. Every
    failure is an EngramServeError naming the option and the file."""
    from .config import EngramConfig, read_json
    from .engram.layout import build_layout
    from .engram.token_map import build_token_map, load_tokenizer

    try:
        raw = read_json(config)
    except ConfigError as e:
        raise ConfigError(f"--config: {e}") from None
    try:
        cfg = EngramConfig.from_dict(raw)
        layout = build_layout(cfg)
    except (EngramServeError, TypeError, ValueError) as e:  # wrong-typed fields surface as Type/ValueError
        raise ConfigError(f"--config {config}: {e}") from None
    if tokenizer is None:
        beside = config.parent / "tokenizer.json"
        tokenizer = beside if beside.is_file() else DEFAULT_TOKENIZER
    try:
        tok = load_tokenizer(tokenizer)
        tmap = build_token_map(tok, cfg.engram_compressed_vocab_size)  # [V] int64
    except EngramServeError as e:
        raise type(e)(f"--tokenizer {tokenizer}: {e}") from None
    if cfg.engram_pad_token_id >= len(tmap):
        raise ConfigError(f"--config {config}: engram_pad_token_id={cfg.engram_pad_token_id} is outside "
                          f"the vocabulary [0, {len(tmap)}) of --tokenizer {tokenizer}")
    return cfg, layout, tmap, tokenizer


# ---- hash ----

def add_hash(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hash", help="print the Engram hash ids of a token sequence",
                       description="Print {\"hash_ids\": [...]} of shape [tokens, engram_layers, (N-1)*H] for "
                                   "one sequence starting at position 0, computed by the production hash.")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, metavar="CONFIG.json",
                   help="model config.json (default: the bundled tiny model's)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="tokenizer.json",
                   help="default: tokenizer.json beside the config if present, else the bundled one")
    p.add_argument("--token-ids", type=id_list, metavar="1,2,3",
                   help="raw token ids, mapped through the tokenizer's compressed map")
    p.add_argument("--compressed-ids", type=id_list, metavar="1,2,3",
                   help="compressed ids in [0, engram_compressed_vocab_size), used as they are")
    p.set_defaults(run=run_hash)


def run_hash(args: argparse.Namespace) -> int:
    if (args.token_ids is None) == (args.compressed_ids is None):
        got = "neither" if args.token_ids is None else (
            f"both (--token-ids {_ids_text(args.token_ids)}, --compressed-ids {_ids_text(args.compressed_ids)})")
        raise UsageError(f"give exactly one of --token-ids or --compressed-ids, got {got}")
    import torch

    from .engram.hashing import hash_step
    cfg, layout, tmap, tok_path = load_engram(args.config, args.tokenizer)
    pad_id = int(tmap[cfg.engram_pad_token_id])  # docs/contract.md §2: pad_id = map[engram_pad_token_id]
    if args.token_ids is not None:
        ids, limit, option, where = args.token_ids, len(tmap), "--token-ids", f"the vocabulary of {tok_path}"
    else:
        ids, limit, option = args.compressed_ids, cfg.engram_compressed_vocab_size, "--compressed-ids"
        where = "the compressed vocabulary (engram_compressed_vocab_size)"
        tmap = torch.arange(limit)  # identity map [V'] int64
    for i, v in enumerate(ids, 1):
        if v >= limit:
            raise InvalidRequest(f"{option} {_ids_text(ids)}: item {i} ({v}) is outside {where} [0, {limit})")
    history = torch.full((1, cfg.history_len), -1, dtype=torch.int64)  # [1, D]: starts at position 0
    out = hash_step(torch.tensor(ids), torch.tensor([0, len(ids)]), history, layout, tmap, pad_id)  # [T, L, C]
    print(json.dumps({"hash_ids": out.tolist()}))
    return 0


def _ids_text(ids: list[int]) -> str:
    text = ",".join(map(str, ids))
    return text if len(text) <= 60 else text[:57] + "..."


# ---- lookup ----

def add_lookup(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lookup", help="print each token's Engram hash ids and staged rows, from a checkpoint "
                                      "directory (no backbone loaded)",
                       description="Read only the config, the tokenizer and the Engram tables (of the shards "
                                   "that hold them); tokenize TEXT, hash it from position 0 and stage its rows "
                                   "as a serving step does. Prints, per token and Engram layer, the hash ids and "
                                   "a sha256 digest of the staged rows; with --json one object with token_ids, "
                                   "hash_ids [tokens][engram_layers][(N-1)*H] and rows "
                                   "[engram_layers][tokens][(N-1)*H][engram_head_dim] (float32, printed exactly).")
    p.add_argument("text", help="the text to tokenize")
    p.add_argument("--model", type=Path, default=DATA_DIR, metavar="DIR",
                   help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the rows in full")
    p.set_defaults(run=run_lookup)


def run_lookup(args: argparse.Namespace) -> int:
    from .engram.lookup import EngramReader
    try:
        reader = EngramReader.open(args.model)
    except EngramServeError as e:
        raise type(e)(f"--model {args.model}: {e}") from None
    res = reader.lookup(args.text)
    if args.json:
        print(json.dumps(res.to_json()))
        return 0
    e = reader.config
    print(f"{len(res.token_ids)} tokens, Engram layers {list(res.layer_ids)}, {e.num_columns} hash columns of "
          f"width {e.engram_head_dim}; shards read: {', '.join(p.name for p in reader.shards)}")
    for t, tid in enumerate(res.token_ids):
        piece = reader.tokenizer.decode([tid], skip_special_tokens=False)
        for layer, lid in enumerate(res.layer_ids):
            ids = ",".join(map(str, res.hash_ids[t, layer].tolist()))
            print(f"{t:>4} {tid:>7} {piece!r:<14} layer {lid}: rows sha256 {res.digest(layer, t)}  hash ids {ids}")
    return 0


# ---- bench ----

def add_bench(sub: argparse._SubParsersAction) -> None:
    from . import bench
    from .bench import common
    p = sub.add_parser("bench", help="run a benchmark (candidate and baseline side by side)")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, module in bench.registry().items():
        bp = bsub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__)
        common.add_common_args(bp)
        module.add_args(bp)
        bp.set_defaults(run=_bench_runner(module.run))


def _bench_runner(run: Callable[[argparse.Namespace], list[dict]]) -> Callable[[argparse.Namespace], int]:
    def go(args: argparse.Namespace) -> int:
        from .bench.common import print_rows
        print_rows(run(args), args.json)
        return 0
    return go


# ---- verify ----

def add_verify(sub: argparse._SubParsersAction) -> None:
    from .bench.common import positive_int_list
    p = sub.add_parser("verify", help="check that a seeded workload's results never depend on how steps are cut",
                       description="Run one seeded workload (one prompt past the model's window, top-k and "
                                   "candidate blocks) with whole steps, then with 2 and 3 microbatches "
                                   "under both policies, a boundary swept across every offset of a straddling request, "
                                   "prefill chunks 1, 3, 17 and unlimited, graph mode with padding, preemption and "
                                   "prefix reuse (an odd block size: hits inside ratio-2 pairs); compare "
                                   "hash ids, staged rows and logits bit for bit, and greedy tokens, and count the "
                                   "DeepSeek-V4.1 hard places each case met. Exit 0 only if everything matches.")
    p.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=lambda t: positive_int_list(t)[0], default=6, metavar="N")
    p.add_argument("--gen-tokens", type=lambda t: positive_int_list(t)[0], default=16, metavar="N",
                   help="greedy tokens generated per request (default 16)")
    p.add_argument("--debug-ownership", action="store_true",
                   help="also check at run time that no buffer is touched by two microbatches")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--speculative", type=lambda t: positive_int_list(t)[0], nargs="?", const=3, default=None,
                   metavar="N", help="every case decodes speculatively, N drafts a request (default 3) from the "
                                     "baseline's tokens with 30%% replaced at random, against the plain baseline")
    p.add_argument("--drafter", choices=("oracle", "dspark"), default="oracle",
                   help="with --speculative: the drafter (oracle: the baseline's tokens with errors, as above; dspark: "
                        "the checkpoint's DSpark drafter)")
    p.add_argument("--threads", type=lambda t: positive_int_list(t)[0], default=None, metavar="N",
                   help="threads of the C kernels' pool the cases run on (the whole-step baseline runs on one; "
                        "default: the cores in this process's affinity mask)")
    add_parallel_args(p)
    p.set_defaults(run=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .bench.common import format_table
    from .engine.threads import set_torch_threads
    from .model.loader import load_model
    from .verify import verify
    set_torch_threads(args.threads)
    overrides = {"debug_ownership": True} if args.debug_ownership else None
    with tqdm(total=1, desc="verify", unit="case", file=sys.stderr, leave=False, mininterval=0.5) as bar:
        def progress(done: int, total: int) -> None:
            if bar.total != total:
                bar.reset(total=total)
            bar.n = done
            bar.refresh()
        if args.tensor_parallel_size > 1 or args.dist_init is not None:
            res = _verify_parallel(args, overrides)
        else:
            res = verify(load_model(args.model, device=args.device), args.seed, args.num_requests,
                         args.gen_tokens, overrides=overrides, device=args.device, progress=progress,
                         speculative=args.speculative, drafter="dspark" if args.drafter == "dspark" else None)
    if args.json:
        print(json.dumps(res))
    else:
        print(format_table(res["cases"]))
        c = res["coverage"]
        print(f"\nDeepSeek-V4.1 state exercised (longest prompt {res['longest_prompt']} tokens): {c['pair_bounds']} "
              f"microbatch cuts and {c['pair_chunks']} prefill chunks inside a ratio-2 pair, {c['prefix_hits']} "
              f"prefix-cache hits ({c['pair_prefix_hits']} inside a pair), {c['preemptions']} preemptions; tokens past "
              f"the window {c['past_window']}, with a selecting top-k {c['selecting']}, restricted by candidate "
              f"blocks {c['restricted']}")
        print(f"{len(res['cases'])} cases on {res['threads']} kernel thread(s) against the whole-step run on 1, "
              f"{res['straddling_rows']} rows straddled a cut; hash mismatches "
              f"{res['hash_mismatches']}, staged-row mismatches {res['row_mismatches']}, max |logit diff| "
              f"{res['max_abs_logit_diff']:.3g} ({res['logit_mismatches']} sampled rows not bit-identical), greedy "
              f"mismatches {res['greedy_mismatches']}: {'PASS' if res['passed'] else 'FAIL'}")
        if "vs_single_process" in res:
            v = res["vs_single_process"]
            print(f"tensor-parallel size {args.tensor_parallel_size} (whole steps) against one process: "
                  f"{v['compared_tokens']} tokens, hash mismatches {v['hash_mismatches']}, greedy mismatches "
                  f"{v['greedy_mismatches']}, max |logit diff| {v['max_abs_logit_diff']:.3g}")
        if "speculative" in res:
            s = res["speculative"]
            print(f"speculative decoding: {s['drafts']} verify rows, {s['draft_tokens']} drafts, "
                  f"{s['accepted_tokens']} accepted, {s['draft_bounds']} microbatch cuts inside a draft block")
    return 0 if res["passed"] else 1


# ---- parallelism options (--tensor-parallel-size, --device, --dist-init) ----

def add_parallel_args(p: argparse.ArgumentParser) -> None:
    from .parallel.options import add_parallel_args as add
    add(p)


def _verify_parallel(args: argparse.Namespace, overrides: dict | None) -> dict:
    """verify on every rank of a tensor-parallel group; the unsharded model is the single-process reference."""
    import os

    from .model.loader import load_model
    from .parallel.launch import TPCluster, local_device, set_kernel_threads
    from .verify import verify
    world = args.tensor_parallel_size
    if args.dist_init is not None and int(os.environ.get("WORLD_SIZE", world)) != world:
        raise ConfigError(f"--tensor-parallel-size {world} but WORLD_SIZE={os.environ.get('WORLD_SIZE')}")
    device = local_device(args.device)
    cluster = TPCluster(args.model, world, device, init_method=args.dist_init)
    try:
        return verify(cluster.loaded, args.seed, args.num_requests, args.gen_tokens, overrides=overrides,
                      make_runner=cluster.make_runner, reference=load_model(args.model, device=device),
                      speculative=args.speculative,
                      device=device, set_threads=lambda n: cluster.call_all(set_kernel_threads, n))
    finally:
        cluster.close()


# ---- generate, serve, train (their options live beside their code) ----

def add_generate(sub: argparse._SubParsersAction) -> None:
    from .bench.common import positive_int
    p = sub.add_parser("generate", help="generate text from a prompt with the built-in (or --model) model",
                       description="Generate with microbatching on (dual-batch overlap), then (unless --no-check) "
                                   "re-run with whole steps and print a one-line microbatching summary on stderr "
                                   "(steps cut into microbatches, rows that straddled a boundary, match).")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-tokens", type=positive_int, default=32, metavar="N", help="tokens to generate (32)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy (default 1.0)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: random)")
    p.add_argument("--model", type=Path, default=None, metavar="PATH",
                   help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--microbatches", "--ubatches", dest="microbatches", type=positive_int, default=2, metavar="N",
                   help="microbatches per step (default 2: dual-batch overlap)")
    p.add_argument("--microbatch-threshold", "--split-threshold", dest="microbatch_threshold", type=positive_int,
                   default=2, metavar="TOKENS",
                   help="steps with fewer tokens stay whole (default 2, so that a one-prompt run is cut "
                        "at all; the serving defaults are 32 for decode and 128 for prefill steps)")
    p.add_argument("--no-check", action="store_true", help="skip the second, whole-step run and its comparison")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="threads of the C kernels (and of torch where not exact; default: the cores of this "
                        "process's affinity mask)")
    p.add_argument("--json", action="store_true",
                   help='print {"text", "token_ids", "finish_reason", "microbatch": {...}} as JSON')
    from .spec.config import add_speculative_arg
    add_speculative_arg(p)
    add_parallel_args(p)
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Generate once with microbatching, again with whole steps (unless --no-check); the text on stdout,
    the microbatching line on stderr."""
    import random

    from .llm import LLM
    from .microbatch.plan import MicrobatchConfig
    from .model.loader import load_model
    from .sampling_params import SamplingParams
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
    from .parallel.options import engine_options
    opts = engine_options(args)
    cluster = None
    if opts["tensor_parallel_size"] > 1 or "dist_init" in opts:  # one group of ranks for both runs
        from .parallel.launch import TPCluster, local_device
        opts = {"device": local_device(args.device)}
        cluster = TPCluster(args.model, args.tensor_parallel_size, opts["device"], init_method=args.dist_init)
        opts["cluster"] = cluster
    same = None
    try:
        loaded = load_model(args.model, progress=True, device=args.device) if cluster is None else args.model
        microbatch = MicrobatchConfig(num_microbatches=args.microbatches, decode_threshold=args.microbatch_threshold,
                                      prefill_threshold=args.microbatch_threshold, when="always")  # a demonstration
        llm = LLM(loaded, microbatch=microbatch, threads=args.threads, speculative_config=args.speculative_config,
                  **opts)
        out = llm.generate(args.prompt, params)[0]
        stats = dataclasses.replace(llm.stats)
        llm.close()
        if not args.no_check:
            whole = LLM(loaded, microbatch=MicrobatchConfig(num_microbatches=1), **opts)
            ref = whole.generate(args.prompt, params)[0]
            whole.close()
            same = ref.token_ids == out.token_ids
    finally:
        if cluster is not None:
            cluster.close()
    micro = {"steps": stats.steps, "microbatched_steps": stats.microbatched_steps,
             "straddling_rows": stats.straddling_rows, "num_microbatches": args.microbatches, "seed": seed,
             "identical_to_whole": same}
    if args.speculative_config is not None:
        micro["speculative"] = {"drafts": stats.spec_drafts, "draft_tokens": stats.spec_draft_tokens,
                                "accepted_tokens": stats.spec_accepted_tokens}
    if out.finish_reason == "error":
        print(f"error: {out.error}", file=sys.stderr)
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "microbatch": micro}))
    else:
        print(out.text)
        check = "not checked (--no-check)" if same is None else ("yes" if same else "NO")
        spec = "" if args.speculative_config is None else (
            f" ({stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafts accepted; the unsplit run does not "
            f"speculate)")
        print(f"microbatching: {stats.microbatched_steps}/{stats.steps} steps split, {stats.straddling_rows} rows "
              f"straddled a cut, tokens identical to the unsplit run{spec}: {check}", file=sys.stderr)
    return 0 if same is not False and out.finish_reason != "error" else 1


def add_serve(sub: argparse._SubParsersAction) -> None:
    from .server.run import add_serve_args, run_serve
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                       description="/v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /tokenize, "
                                   "/detokenize, /version, /health and /metrics on uvicorn.")
    add_serve_args(p)
    p.set_defaults(run=run_serve)


def add_train(sub: argparse._SubParsersAction) -> None:
    from .train import build_parser, run_args
    p = sub.add_parser("train", help="train the built-in tiny Engram model on the Python standard library",
                       description="Seeded, reproducible training on 2 CPU cores, with the no-Engram ablation.")
    build_parser(p)
    p.set_defaults(run=lambda args: run_args(args, "engram-serve train"))


def add_train_drafter(sub: argparse._SubParsersAction) -> None:
    from .train_drafter import build_parser, run_args
    p = sub.add_parser("train-drafter", help="train the DSpark drafter of a frozen target (default: the built-in model)",
                       description="Seeded training of the drafter (`mtp.*`) on the Python standard library, the "
                                   "target frozen; then its acceptance on held-out code.")
    build_parser(p)
    p.set_defaults(run=lambda args: run_args(args, "engram-serve train-drafter"))


# ---- env ----

def add_env(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("env", help="print the C kernels loaded, the SIMD level, torch's version and the thread count",
                       description="What this process would run with: each C kernel loaded or not and why (not "
                                   "built, or switched off by ENGRAM_SERVE_KERNELS), the matmul kernel's SIMD level, "
                                   "whether CPU graphs can run, torch's version and the thread count the engine sets.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_env)


def run_env(args: argparse.Namespace) -> int:
    from . import __version__, kernels
    env = kernels.environment()
    if args.json:
        print(json.dumps({"engram_serve": __version__, **env}))
        return 0
    print(f"engram-serve {__version__}, torch {env['torch']}")
    print(f"threads: {env['threads']} ({env['threads_source']}); kernels' thread pool: {env['thread_pool']}")
    print(f"{kernels.ENV}: {env['kernels_env'] if env['kernels_env'] is not None else '(unset: all)'}")
    for name, state in env["kernels"].items():
        print(f"kernel {name}: {state}")
    simd, need = env["simd_level"], ", ".join(kernels.CPU_GRAPHS_NEED)
    print("SIMD level: " + ("- (no matmul kernel)" if simd is None else f"{simd} ({env['simd']})"))
    print("CPU graphs: " + ("possible" if env["cpu_graphs_possible"] else f"off (they need {need})"))
    return 0


# ---- plan ----

def add_plan(sub: argparse._SubParsersAction) -> None:
    from .bench.common import positive_int
    p = sub.add_parser("plan", help="print the memory a checkpoint (or a config.json) needs per rank, before loading",
                       description="Per rank: the weights as the engine holds them (by stored format), the Engram "
                       "tables, the per-request state at --max-model-len times --max-num-seqs, the runtime buffers, "
                       "their total and whether it fits in this machine's RAM (MemTotal) or --memory. A checkpoint "
                       "directory is read by its headers only; a config.json alone assumes the published layout.")
    p.add_argument("--model", required=True, type=Path, metavar="DIR|CONFIG",
                   help="a checkpoint directory, or a config.json (then FP8 linears, MXFP4 routed experts, BF16 other "
                        "matrices and FP8 Engram tables are assumed, as published)")
    p.add_argument("--tensor-parallel-size", type=positive_int, default=1, metavar="N", help="ranks (default 1)")
    p.add_argument("--max-model-len", type=positive_int, default=None, metavar="L",
                   help="tokens a request may hold (default: the engine's, 2048 capped by max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, metavar="S", help="requests at once (default 64)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=None, metavar="T",
                   help="tokens a step computes (default 1024)")
    p.add_argument("--memory", type=_byte_count, default=None, metavar="BYTES",
                   help="compare with this instead of MemTotal (bytes, or with a K/M/G/T suffix: 512G)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run_plan)


def _byte_count(text: str) -> int:
    from .memory_plan import parse_bytes
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run_plan(args: argparse.Namespace) -> int:
    from .memory_plan import format_plan, memory_plan
    if not args.model.exists():
        raise ConfigError(f"--model {args.model}: no such file or directory")
    p = memory_plan(args.model, args.tensor_parallel_size, args.max_model_len, args.max_num_seqs,
                    args.max_num_batched_tokens, args.memory)
    if args.json:
        print(json.dumps(p.to_dict()))
    else:
        print("\n".join(format_plan(p)))
    return 0


# ---- entry point ----

COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_generate, add_serve, add_verify, add_hash, add_lookup, add_train, add_train_drafter, add_bench, add_env, add_plan)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = _Parser(prog=PROG, description="Serving runtime for Engram language models.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        from .parallel.options import check_device, maybe_run_worker
        check_device(args)
        code = maybe_run_worker(args)  # a torchrun rank other than 0 serves rank 0's command
        code = code if code is not None else args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the try
        return code
    except EngramServeError as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`... | head`): no traceback, and none at exit when Python flushes
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        print(f"{PROG}: error: standard output was closed before the output was written (broken pipe)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
