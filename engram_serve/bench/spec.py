"""Speculative decoding with the checkpoint's DSpark drafter against plain decoding: tokens/s side by side.

For held-out code prompts (bench/acceptance.py's: files neither the target nor the drafter saw), the engine
generates `--tokens` tokens per prompt (EOS ignored; greedy, or sampled at each `--temperatures` value with seed
i for prompt i) at each batch size of `--batch` (B = 1: one prompt at a time; B > 1: B requests at once, the
prompts repeated). Three engines over the same model, built once per batch size and run in turn within each of
`--rounds` rounds (so that the machine's load hits them alike): "plain", "always" (`--speculative-config` dspark,
N = `--k`, drafting in every decode step) and "pays" (the same, the planner's default: drafting only where decode
steps measured cheaper per token). Each run's tokens must equal the plain run's, or the benchmark raises.

Per row: the medians over rounds of the process CPU time and the wall time per run, tokens/s (from the CPU
time: less hit by other jobs), each speculative form's ratio to plain (the median over rounds of the round's
ratio of CPU times: runs side by side, so that the machine's drift cancels), and the "always" engine's mean acceptance
length (tokens a verify row emits: 1 + accepted drafts per verify row) and acceptance rate per draft position.
"""
from __future__ import annotations

import argparse
import statistics
import time

from ..errors import UsageError
from . import common


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint with a drafter (default: the built-in model)")
    parser.add_argument("--prompts", type=common.positive_int, default=10, help="held-out files (default 10)")
    parser.add_argument("--prompt-tokens", type=common.positive_int, default=64)
    parser.add_argument("--tokens", type=common.positive_int, default=256, help="completion tokens (default 256)")
    parser.add_argument("--k", type=common.positive_int, default=None,
                        help="num_speculative_tokens (default: the drafter's block size)")
    parser.add_argument("--temperatures", type=common.temperature_list, default=[0.0, 0.7],
                        help="comma-separated (default 0,0.7; 0 = greedy)")
    parser.add_argument("--batch", type=common.positive_int_list, default=[1, 32], help="batch sizes (default 1,32)")
    parser.add_argument("--rounds", type=common.positive_int, default=3, help="alternating rounds (default 3)")


def generate(engine, prompts: list[list[int]], params: list, batch: int) -> list[list[int]]:
    """Every prompt's tokens, `batch` requests at a time."""
    out = [[] for _ in prompts]
    for first in range(0, len(prompts), batch):
        for i in range(first, min(first + batch, len(prompts))):
            engine.add_request(str(i), prompts[i], params[i])
        while engine.has_unfinished():
            for ev in engine.step().events:
                if ev.token is not None:
                    out[int(ev.request_id)].append(ev.token)
    return out


def run(args: argparse.Namespace) -> list[dict]:
    import torch
    from ..engine.llm_engine import EngineStats, LLMEngine
    from ..model.loader import load_model
    from ..runner.model_runner import RunnerConfig
    from ..sampling_params import SamplingParams
    from .acceptance import heldout_prompts
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, pin_tables=False)
    if lm.drafter is None:
        raise UsageError(f"--model {lm.path}: the checkpoint has no drafter (bench spec needs one)")
    k = args.k or lm.config.dspark.dspark_block_size
    held = heldout_prompts(lm.tokenizer, count=args.prompts, length=args.prompt_tokens)
    rows = []
    for batch in args.batch:
        prompts = [held[i % len(held)] for i in range(max(len(held), batch))]
        cfg = RunnerConfig(max_num_seqs=batch, max_model_len=args.prompt_tokens + args.tokens + 16,
                           num_blocks=batch * ((args.prompt_tokens + args.tokens) // 16 + 3) + 8)
        spec = {"method": "dspark", "num_speculative_tokens": k}
        engines = {"plain": LLMEngine(lm, cfg, threads=args.threads),
                   "always": LLMEngine(lm, cfg, threads=args.threads, speculative={**spec, "when": "always"}),
                   "pays": LLMEngine(lm, cfg, threads=args.threads, speculative=spec)}
        try:
            for t in args.temperatures:
                params = [SamplingParams(max_tokens=args.tokens, temperature=t, seed=i, ignore_eos=True)
                          for i in range(len(prompts))]
                cpu = {m: [] for m in engines}
                wall = {m: [] for m in engines}
                engines["always"].stats = EngineStats()
                engines["always"].stats.spec_accepted_per_position = [0] * k
                want = None
                for _ in range(args.rounds):
                    for mode, engine in engines.items():
                        c0, w0 = time.process_time(), time.perf_counter()
                        got = generate(engine, prompts, params, batch)
                        cpu[mode].append(time.process_time() - c0)
                        wall[mode].append(time.perf_counter() - w0)
                        want = got if want is None else want
                        if got != want:
                            raise RuntimeError(f"bench spec: {mode} at B={batch}, T={t} gave other tokens than plain")
                st = engines["always"].stats
                n = len(prompts) * args.tokens
                row = {"batch": batch, "temperature": t, "prompts": len(prompts), "tokens": args.tokens, "k": k,
                       "mean_len": 1 + st.spec_accepted_tokens / max(st.spec_drafts, 1),
                       **{f"rate@{j + 1}": c / max(st.spec_drafts, 1) for j, c in
                          enumerate(st.spec_accepted_per_position)}}
                for mode in engines:
                    row[f"{mode}_cpu_s"] = statistics.median(cpu[mode])
                    row[f"{mode}_wall_s"] = statistics.median(wall[mode])
                    row[f"{mode}_tok_s"] = n / row[f"{mode}_cpu_s"]
                for mode in ("always", "pays"):  # each round's runs side by side: the machine's drift cancels
                    row[f"{mode}_ratio"] = statistics.median(p / c for p, c in zip(cpu["plain"], cpu[mode]))
                rows.append(row)
        finally:
            for e in engines.values():
                e.close()
    return rows
