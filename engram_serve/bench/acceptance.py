"""Draft acceptance on held-out code: mean acceptance length and the rate per draft position.

For held-out stdlib files (engram_serve/train.py's split: the drafter never saw them, nor the target), a prompt of
`--prompt-tokens` from the middle of each file; the engine generates `--tokens` tokens (greedy, or sampled at
`--temperature` with seed `--seed` + i for prompt i; EOS ignored). One `forward_dense(features=True)` over prompt +
completion gives the target's logits and the drafter's features at every position (a position's depend on tokens
0 .. p alone); the target's pick at each position is `Sampler.sample` of those logits (for a sampled run with the
counter of that output position: the engine's own rule, checked equal to the engine's tokens).

Then speculative decoding is replayed: from n = the first completion token, the drafter drafts k tokens after the
committed context 0 .. n (`write_context` of positions < n, `draft` at n); its pick at draft position j is the
same `Sampler.sample` with the counter of the position it guesses (coupled drafting: the draft token is the
sampler's token for the draft's logits with the Gumbel noise the target will use there). The verify step accepts
the longest run of draft tokens equal to the target's picks, plus the target's own next token: n advances by
accepted + 1 (vLLM's acceptance length, tokens emitted per verify step). Steps run while a whole block and its
bonus token fit in the completion.

Reported per temperature: `mean_len` (mean of accepted + 1), `rate@j` (the fraction of verify steps whose first j
drafts were all accepted: vLLM's per-position acceptance rate), steps, prompts; and what a draft costs beside a
decode step (`step_costs`: `draft_ms`, one row's draft over a written context, greedy, replayed from a CPU graph
(runner/draft_graphs.py); `decode_ms`, a greedy B = 1 engine step).
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from . import common

DraftFn = Callable[..., "object"]  # (lm, features [L, F], ids [L], positions [R], picks) -> tokens [R, k]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint with a drafter (default: the built-in model)")
    parser.add_argument("--prompts", type=common.positive_int, default=20, help="held-out files (default 20)")
    parser.add_argument("--prompt-tokens", type=common.positive_int, default=64)
    parser.add_argument("--tokens", type=common.positive_int, default=256, help="completion tokens (default 256)")
    parser.add_argument("--temperatures", type=common.temperature_list, default=[0.0, 0.7],
                        help="comma-separated (default 0,0.7; 0 = greedy)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of prompt 0 (prompt i: seed + i)")


def heldout_prompts(tok, seed: int = 0, pct: float = 5.0, max_files: int | None = None, count: int = 20,
                    length: int = 64) -> list[list[int]]:
    """`length` token ids from the middle of each of `count` held-out files, spread evenly over the sorted list
    (files shorter than 2 * length skipped)."""
    from ..train import source_files, split_files, stdlib_root, tokenize_files
    root = stdlib_root()
    held = split_files(source_files(root)[:max_files], seed, pct)[1]
    docs = [d for d in tokenize_files(tok, root, held) if len(d) >= 2 * length]
    pick = np.linspace(0, len(docs) - 1, min(count, len(docs))).round().astype(int)
    return [docs[i][(len(docs[i]) - length) // 2:][:length].tolist() for i in pick]


@dataclass
class Walk:
    """Accepted drafts per verify step of one sequence."""

    accepted: list[int]


def walk(drafts: np.ndarray, picks: np.ndarray, start: int, k: int) -> Walk:
    """Replay verify steps: drafts [L, k] (row n: the drafts after committed context 0 .. n), picks [L] (the target's
    token for position p + 1, from its logits at p); from n = start while n + k + 1 < L."""
    out, n, length = [], start, picks.shape[0]
    while n + k + 1 <= length:
        a = 0
        while a < k and drafts[n, a] == picks[n + a]:
            a += 1
        out.append(a)
        n += a + 1
    return Walk(out)


def summarize(walks: list[Walk], k: int) -> dict:
    acc = np.array([a for w in walks for a in w.accepted])
    row = {"steps": int(acc.size), "mean_len": float(1 + acc.mean()) if acc.size else float("nan")}
    for j in range(1, k + 1):
        row[f"rate@{j}"] = float((acc >= j).mean()) if acc.size else float("nan")
    return row


def sampler_picks(temperature: float, seed: int):
    """pick(logits [R, V], counters [R]) -> tokens [R]: the engine's sampler (greedy at temperature 0)."""
    from ..runner.sampler import Sampler, SamplingBatch
    sampler = Sampler()

    def pick(logits, counters):
        r = logits.shape[0]
        b = SamplingBatch.build(logits.shape[1], [temperature] * r, [0] * r, [1.0] * r, [seed] * r,
                                counters.tolist())
        return sampler.sample(logits, b).tokens
    return pick


def target_pass(lm, ids: list[int]):
    """(logits [L, V], features [L, nL D]) of the sequence through the target."""
    import torch
    from ..train import loaded_hasher, staged_rows
    x = torch.tensor([ids], dtype=torch.int64)
    with torch.no_grad():
        logits, feats = lm.model.forward_dense(x, staged_rows(lm, loaded_hasher(lm), x), features=True)
    return logits[0], feats[0]


def drafter_drafts(lm, feats, ids, positions, pick):
    """tokens [R, k]: the shipped drafter's drafts at `positions` [R] (each after context 0 .. n - 1 and the token at
    n), picking draft token j with pick(z_j, counters = n + 1 + j)."""
    import torch
    from ..model.dspark import DSparkState
    d, seq = lm.drafter, feats.shape[0]
    state = DSparkState(lm.config, 1, seq + d.block, max_rows=positions.shape[0])
    pos = torch.arange(seq)
    with torch.no_grad():
        d.write_context(state, feats, pos, pos)
        out = d.draft(lm.model, state, torch.as_tensor(ids)[positions], positions,
                      torch.zeros(positions.shape[0], 1, dtype=torch.int64), seq + d.block,
                      pick=lambda j, z: pick(z, positions + 1 + j))
    return out.tokens


def measure(lm, prompts: list[list[int]], tokens: int = 256, temperatures=(0.0, 0.7), seed: int = 0,
            drafts: DraftFn = drafter_drafts) -> list[dict]:
    """One row per temperature (module docstring). `drafts` stands in for the drafter in tests."""
    import torch
    from ..llm import LLM
    from ..sampling_params import SamplingParams
    k = lm.config.dspark.dspark_block_size
    llm = LLM(lm, threads=torch.get_num_threads())
    rows = []
    try:
        for t in temperatures:
            params = [SamplingParams(max_tokens=tokens, temperature=t, seed=seed + i, ignore_eos=True)
                      for i in range(len(prompts))]
            walks = []
            for i, (p, res) in enumerate(zip(prompts, llm.generate(prompts, params))):
                ids = list(p) + res.token_ids
                logits, feats = target_pass(lm, ids)
                pick = sampler_picks(t, seed + i)
                picks = pick(logits, torch.arange(1, len(ids) + 1)).numpy()  # [L]: token for p + 1
                if not np.array_equal(picks[len(p) - 1:-1], res.token_ids):
                    raise RuntimeError(f"prompt {i}: the target's picks over the sequence differ from the engine's")
                positions = torch.arange(len(p), len(ids) - k)
                table = np.full((len(ids), k), -1, dtype=np.int64)
                table[len(p):len(ids) - k] = drafts(lm, feats, ids, positions, pick).numpy()
                walks.append(walk(table, picks, len(p), k))
            rows.append({"temperature": t, "prompts": len(prompts), "tokens": tokens, "k": k, **summarize(walks, k)})
    finally:
        llm.close()
    return rows


def step_costs(lm, prompt: list[int], tokens: int = 64, repeats: int = 20) -> dict:
    """{"draft_ms": one row's draft of k tokens (greedy, replayed: runner/draft_graphs.py; median of `repeats`),
    "decode_ms": a greedy B = 1 decode step of the engine (its wall time over `tokens` tokens, prefill included)}:
    what a draft costs against a step."""
    import statistics
    import time

    import torch
    from ..llm import LLM
    from ..sampling_params import SamplingParams
    llm = LLM(lm, threads=torch.get_num_threads())
    try:
        llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        t0 = time.perf_counter()
        ids = list(prompt) + llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0.0,
                                                                   ignore_eos=True))[0].token_ids
        decode = (time.perf_counter() - t0) / tokens
    finally:
        llm.close()
    from ..model.dspark import DSparkState
    from ..runner.draft_graphs import DraftGraphs
    d, seq = lm.drafter, len(ids)
    feats = target_pass(lm, ids)[1]
    state = DSparkState(lm.config, 1, seq + d.block, max_rows=1)
    pos = torch.arange(seq)
    times, graphs = [], DraftGraphs(d, lm.model)
    with torch.no_grad():
        d.write_context(state, feats, pos, pos)
        last, n, table = torch.tensor([ids[-1]]), torch.tensor([seq - 1]), torch.zeros(1, 1, dtype=torch.int64)
        for _ in range(repeats + 2):  # (eager, capture, then replays)
            t0 = time.perf_counter()
            graphs.draft(state, last, n, table, seq + d.block)
            times.append(time.perf_counter() - t0)
    return {"draft_ms": statistics.median(times[2:]) * 1e3, "decode_ms": decode * 1e3}


def format_rows(rows: list[dict]) -> str:
    return common.format_table(rows)


def markdown_table(rows: list[dict]) -> str:
    k = rows[0]["k"]
    lines = ["| temperature | prompts x tokens | verify steps | mean acceptance length | "
             + " | ".join(f"rate@{j}" for j in range(1, k + 1)) + " |", "|---:|---:|---:|---:|" + "---:|" * k]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['prompts']} x {r['tokens']} | {r['steps']} | **{r['mean_len']:.2f}** | "
                     + " | ".join(f"{r[f'rate@{j}']:.3f}" for j in range(1, k + 1)) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict]:
    import torch
    from ..model.loader import load_model
    torch.set_num_threads(args.threads)
    lm = load_model(args.model, pin_tables=False)
    if lm.drafter is None:
        raise UsageError(f"--model {lm.path}: the checkpoint has no drafter (bench acceptance needs one)")
    prompts = heldout_prompts(lm.tokenizer, count=args.prompts, length=args.prompt_tokens)
    costs = step_costs(lm, prompts[0])
    return [{**r, **costs} for r in measure(lm, prompts, args.tokens, args.temperatures, args.seed)]
