"""`engram-serve verify`: run one seeded workload under many cuts and compare with the whole-step run.

Compared per token, keyed by (request, absolute position): hash ids, staged Engram rows and the
logits of sampled positions bit for bit (tolerance 0; the maximum absolute difference is reported),
and the greedy tokens exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .engine.llm_engine import EngineStats, LLMEngine
from .microbatch.plan import MicrobatchConfig
from .model.loader import LoadedModel
from .runner.model_runner import ModelRunner, RunnerConfig
from .sampling_params import SamplingParams

GRAPH_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class Workload:
    prompts: list[list[int]]
    gen_tokens: int

    @classmethod
    def seeded(cls, seed: int, num_requests: int, vocab: int, gen_tokens: int = 16) -> "Workload":
        """Prompt lengths from 1 to 70 tokens (so rows straddle cuts); ids avoid the first 6 (special) ids."""
        rng = np.random.default_rng(seed)
        lens = rng.integers(1, 71, size=num_requests)
        lens[0] = max(lens[0], 40)  # at least one long prompt to sweep cuts through
        return cls([rng.integers(6, vocab, size=int(n)).tolist() for n in lens], gen_tokens)


@dataclass
class Record:
    """Everything one run computed, keyed by (request index, absolute position)."""

    keys: np.ndarray  # [K, 2]
    hashes: torch.Tensor  # [K, L*C]
    staged: torch.Tensor  # [K, L*C*hd]
    logit_keys: np.ndarray  # [S, 2]
    logits: torch.Tensor  # [S, V]
    tokens: list[list[int]]
    steps: int = 0
    microbatched_steps: int = 0
    straddling_rows: int = 0
    preemptions: int = 0


def run_case(loaded: LoadedModel, work: Workload, cfg: RunnerConfig, first_step_bounds: list[int] | None = None,
             max_steps: int | None = None, reuse_prefix: bool = False,
             runner_cls: type[ModelRunner] = ModelRunner, make_runner=None) -> Record:
    """Run the workload and record it. `reuse_prefix`: run it once unrecorded with prefix caching on,
    then record a second pass whose prompts start from the cached KV blocks of the first.
    `make_runner(cfg)` (tensor parallel): builds the runner instead, e.g. `TPCluster.make_runner`."""
    engine = LLMEngine(loaded, cfg, enable_prefix_caching=reuse_prefix, runner_cls=runner_cls,
                       runner=make_runner(cfg) if make_runner is not None else None)
    params = SamplingParams(max_tokens=work.gen_tokens, temperature=0.0, ignore_eos=True)
    if reuse_prefix:
        for i, p in enumerate(work.prompts):
            engine.add_request(f"warm{i}", p, params)
        while engine.has_unfinished():
            engine.step()
        engine.stats = EngineStats()
    index = {}
    for i, p in enumerate(work.prompts):
        engine.add_request(f"r{i}", p, params)
        index[f"r{i}"] = i
    keys, hashes, staged, lkeys, logits = [], [], [], [], []
    tokens: list[list[int]] = [[] for _ in work.prompts]
    steps = 0
    try:
        while engine.has_unfinished() and (max_steps is None or steps < max_steps):
            res = engine.step(first_step_bounds if steps == 0 else None, record=True)
            steps += 1
            for ev in res.events:
                if ev.token is not None:
                    tokens[index[ev.request_id]].append(ev.token)
            if res.output is None:
                continue
            rows = res.scheduled.rows
            req = np.repeat([index[r] for r in res.req_ids], [r.num_new for r in rows])
            pos = np.concatenate([np.arange(r.num_computed, r.num_computed + r.num_new) for r in rows])
            keys.append(np.stack([req, pos], 1))
            hashes.append(res.output.hash_ids.reshape(len(req), -1))
            staged.append(res.output.staged.permute(1, 0, 2, 3).reshape(len(req), -1))
            sampled = [(index[rid], r.num_computed + r.num_new - 1)
                       for rid, r, flag in zip(res.req_ids, rows, res.sampled) if flag]
            lkeys.append(np.array(sampled, dtype=np.int64).reshape(-1, 2))
            logits.append(res.output.logits)
        st = engine.stats
        return Record(np.concatenate(keys), torch.cat(hashes), torch.cat(staged), np.concatenate(lkeys),
                      torch.cat(logits), tokens, steps, st.microbatched_steps, st.straddling_rows, st.preemptions)
    finally:
        engine.close()


def _by_key(keys: np.ndarray, *values: torch.Tensor):
    """Sort by (request, position), keeping the last occurrence (a recompute after preemption)."""
    order = np.lexsort((np.arange(len(keys)), keys[:, 1], keys[:, 0]))
    k = keys[order]
    last = np.ones(len(k), dtype=bool)
    last[:-1] = (k[1:] != k[:-1]).any(1)
    idx = torch.from_numpy(order[last])
    return (k[last], *(v[idx] for v in values))


def _lookup(base_keys: np.ndarray, keys: np.ndarray) -> torch.Tensor:
    """Index into the sorted base_keys of every (request, position) in keys; raises if one is missing."""
    flat_base, flat = base_keys[:, 0] * (1 << 32) + base_keys[:, 1], keys[:, 0] * (1 << 32) + keys[:, 1]
    idx = np.searchsorted(flat_base, flat).clip(max=len(flat_base) - 1)
    if len(flat) and (flat_base[idx] != flat).any():
        raise RuntimeError("a run computed a (request, position) the whole-step run never computed")
    return torch.from_numpy(idx)


def compare(base: Record, other: Record, work: Workload, tokens: bool = True) -> dict:
    """Every token `other` computed against the same (request, position) of `base`; with `tokens`,
    also the greedy outputs (a one-step run has none to compare)."""
    bk, bh, bs = _by_key(base.keys, base.hashes, base.staged)
    ok, oh, os_ = _by_key(other.keys, other.hashes, other.staged)
    idx = _lookup(bk, ok)
    blk, bl = _by_key(base.logit_keys, base.logits)
    olk, ol = _by_key(other.logit_keys, other.logits)
    lidx = _lookup(blk, olk)
    diff = float((bl[lidx] - ol).abs().max()) if len(olk) else 0.0
    bits = int((bl[lidx] != ol).any(1).sum()) if len(olk) else 0  # NaN != NaN: counted too
    greedy_bad = sum(bt != ot for bt, ot in zip(base.tokens, other.tokens)) if tokens else 0
    return {"compared_tokens": len(ok),
            "hash_mismatches": int((bh[idx] != oh).any(1).sum()),
            "row_mismatches": int((bs[idx] != os_).any(1).sum()),  # exact equality of the float rows
            "logit_mismatches": bits, "max_abs_logit_diff": diff, "greedy_mismatches": greedy_bad}


def cases(base: RunnerConfig, first_qsl: np.ndarray) -> list[tuple[str, RunnerConfig, list | None, bool]]:
    """(name, runner config, forced bounds of the first step, reuse a cached prefix) per comparison."""
    big = base.max_num_batched_tokens
    def microbatched(n, policy, **kw):
        return dataclasses.replace(base, microbatch=MicrobatchConfig(n, policy, 0, 0, when="always"), **kw)
    out = [(f"{n} microbatches, {p} policy", microbatched(n, p), None, False)
           for n in (2, 3) for p in ("tokens", "requests")]
    out += [(f"prefill chunk {c}, 2 microbatches",
             microbatched(2, "tokens", max_num_batched_tokens=c, max_num_seqs=min(c, base.max_num_seqs)), None, False)
            for c in (1, 3, 17)]
    out.append(("prefill chunk unlimited, 2 microbatches", microbatched(2, "tokens", max_num_batched_tokens=big),
                None, False))
    out.append(("graph mode, padded, 2 microbatches",
                microbatched(2, "tokens", graph_sizes=tuple(s for s in GRAPH_SIZES if s < big) + (big,)), None, False))
    out.append(("reused prefix (prefix cache), 2 microbatches", microbatched(2, "tokens"), None, True))
    out.append(("preemption and recompute (small KV pool), 2 microbatches",
                microbatched(2, "tokens", num_blocks=base.max_blocks_per_seq + 2), None, False))
    r = int(np.argmax(np.diff(first_qsl)))  # sweep every cut inside the longest first-step row
    for c in range(int(first_qsl[r]) + 1, int(first_qsl[r + 1])):
        out.append((f"first step cut at token {c}", microbatched(2, "tokens"), [0, c, int(first_qsl[-1])], False))
    return out


def verify(loaded: LoadedModel, seed: int = 0, num_requests: int = 6, gen_tokens: int = 16,
           overrides: dict | None = None, only: str | tuple[str, ...] | None = None, progress=None,
           runner_cls: type[ModelRunner] = ModelRunner, make_runner=None, reference: LoadedModel | None = None,
           device: str = "cpu") -> dict:
    """Run every case (or those whose name contains `only`, a string or a tuple of them). `overrides`
    (RunnerConfig fields, e.g. debug_ownership) and `runner_cls` (a test subclass with a protection off:
    a negative control) apply to the compared cases, never to the whole-step baseline.

    Tensor parallel: `make_runner` builds each case's runner on every rank (baseline included: the
    same parallel size, whole steps); `reference` (the unsharded model) adds "vs_single_process": the
    whole-step baseline against one process, where greedy tokens must match and |logit diff| is reported."""
    work = Workload.seeded(seed, num_requests, loaded.config.vocab_size, gen_tokens)
    total = sum(map(len, work.prompts))
    base_cfg = RunnerConfig(max_num_seqs=num_requests, max_model_len=max(map(len, work.prompts)) + gen_tokens + 1,
                            max_num_batched_tokens=total, num_blocks=num_requests * 8 + 64, block_size=16,
                            microbatch=MicrobatchConfig(1), device=device)
    base_cfg = dataclasses.replace(base_cfg, max_model_len=-(-base_cfg.max_model_len // 16) * 16)
    base = run_case(loaded, work, base_cfg, make_runner=make_runner)
    first_qsl = np.concatenate([[0], np.cumsum([len(p) for p in work.prompts])])
    rows, straddling = [], 0
    only = (only,) if isinstance(only, str) else only
    all_cases = [c for c in cases(base_cfg, first_qsl) if only is None or any(o in c[0] for o in only)]
    for i, (name, cfg, bounds, reuse) in enumerate(all_cases):
        cfg = dataclasses.replace(cfg, **(overrides or {}))
        rec = run_case(loaded, work, cfg, bounds, max_steps=1 if bounds else None, reuse_prefix=reuse,
                       runner_cls=runner_cls, make_runner=make_runner)
        straddling += rec.straddling_rows
        res = compare(base, rec, work, tokens=not bounds)
        rows.append({"case": name, "steps": rec.steps, "microbatched_steps": rec.microbatched_steps,
                     "preemptions": rec.preemptions,
                     "straddling_rows": rec.straddling_rows, **res})
        if progress:
            progress(i + 1, len(all_cases))
    summary = {
        "cases": rows, "straddling_rows": straddling,
        "hash_mismatches": sum(r["hash_mismatches"] for r in rows),
        "row_mismatches": sum(r["row_mismatches"] for r in rows),
        "logit_mismatches": sum(r["logit_mismatches"] for r in rows),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        "greedy_mismatches": sum(r["greedy_mismatches"] for r in rows),
    }
    summary["passed"] = all(summary[k] == 0 for k in ("hash_mismatches", "row_mismatches", "logit_mismatches",
                                                      "greedy_mismatches"))
    if reference is not None:
        single = run_case(reference, work, base_cfg)
        res = compare(single, base, work)
        summary["vs_single_process"] = {k: res[k] for k in ("compared_tokens", "hash_mismatches",
                                                              "max_abs_logit_diff", "greedy_mismatches")}
        summary["passed"] = summary["passed"] and res["hash_mismatches"] == 0 and res["greedy_mismatches"] == 0
    return summary
