"""`engram-serve verify`: run one seeded workload under many cuts and compare with the whole-step run.

Compared per token, keyed by (request, absolute position): hash ids, staged Engram rows and the
logits of sampled positions bit for bit (tolerance 0; the maximum absolute difference is reported),
and the greedy tokens exactly. The whole-step run is the baseline on one thread of the C kernels' pool; every
case runs on `threads` (`--threads`: the engine's count), so each case also compares N threads against one, and
the case "whole steps, N threads" compares nothing else (docs/exactness.md, "Threads").

The workload is sized from the model's config so that DeepSeek-V4.1's per-request state is exercised
where it is hard (docs/deepseek_v41.md): one prompt is longer than the sliding window, than index_topk
entries of every compress ratio (the top-k really selects) and than the candidate blocks cover (the
candidate source restricts the later index sources); microbatch cuts and prefill chunks fall inside
ratio-2 pairs; a small KV pool preempts; a prefix-cache case with an odd block size starts requests
from a cached prefix that ends inside a pair. Each case reports how often it met these (`Coverage`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from . import thread_pool
from .config import ModelConfig
from .engine.llm_engine import EngineStats, LLMEngine
from .microbatch.plan import MicrobatchConfig
from .model.loader import LoadedModel
from .runner.model_runner import ModelRunner, RunnerConfig
from .sampling_params import SamplingParams

GRAPH_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
PAIR_BLOCK = 5  # the odd block size of the prefix-cache case: a cached prefix of an odd block count ends inside a pair
MAX_BOUNDARIES = 96  # the first-step cut sweep covers every offset of a row up to this many, else this many spread over it


@dataclass
class Workload:
    prompts: list[list[int]]
    gen_tokens: int

    @classmethod
    def seeded(cls, seed: int, num_requests: int, vocab: int, gen_tokens: int = 16,
               long_prompt: int = 40) -> "Workload":
        """Prompt lengths from 1 to 70 tokens (so rows straddle cuts), the first at least `long_prompt`;
        one prompt caches an odd number of PAIR_BLOCK-token blocks (a prefix hit inside a ratio-2 pair).
        Ids avoid the first 6 (special) ids."""
        rng = np.random.default_rng(seed)
        lens = rng.integers(1, 71, size=num_requests)
        lens[0] = max(lens[0], long_prompt)  # at least one long prompt to sweep cuts through
        if not any(((n - 1) // PAIR_BLOCK) % 2 for n in lens):  # cached blocks: all but the last token's
            lens[-1] += PAIR_BLOCK
        return cls([rng.integers(6, vocab, size=int(n)).tolist() for n in lens], gen_tokens)


def long_prompt_len(cfg: ModelConfig, gen_tokens: int) -> int:
    """A prompt length past every V4.1 threshold of `cfg`: longer than the sliding window, than index_topk
    entries of its largest compress ratio, and than the candidate blocks cover (bounded by the model's
    maximum length)."""
    ratios = [r for r in cfg.ratios if r]
    need = [40, cfg.sliding_window + 1]
    if ratios:
        need.append(cfg.index_topk * max(ratios) + 1)
    c = cfg.candidate_source_layer_id
    if c >= 0:
        need.append(cfg.candidate_topk_blocks * cfg.candidate_block_size * cfg.ratios[c] + 1)
    return min(max(need) + 1, cfg.max_position_embeddings - gen_tokens - 1)


@dataclass
class Coverage:
    """How often one run met DeepSeek-V4.1's hard places, counted over what it computed:
    `pair_bounds`: microbatch cuts whose first token closes a ratio-2 pair opened in the microbatch before;
    `pair_chunks`: prefill chunks (after a request's first) that start inside a ratio-2 pair;
    `prefix_hits`, `pair_prefix_hits`: requests started from a cached prefix, and those whose cached
    prefix ends inside a ratio-2 pair; `past_window`: tokens at positions >= sliding_window;
    `selecting`: tokens that see more compressed entries than index_topk (the top-k selects);
    `restricted`: tokens whose later index sources see more entries than the candidate blocks cover;
    `draft_bounds`: microbatch cuts inside a verify row's draft block (speculative decoding).
    The ratio-2 counts stay 0 for a model without ratio-2 layers."""

    pair_bounds: int = 0
    pair_chunks: int = 0
    prefix_hits: int = 0
    pair_prefix_hits: int = 0
    past_window: int = 0
    selecting: int = 0
    restricted: int = 0
    draft_bounds: int = 0

    def add_step(self, cfg: ModelConfig, rows, bounds: list[int], done: dict) -> None:
        """Count one step: its scheduled `rows`, its microbatch `bounds`; `done` maps each request to the
        tokens its rows reached so far (updated here)."""
        ratios = [r for r in cfg.ratios if r]
        pairs = 2 in ratios
        num_new = np.array([r.num_new for r in rows])
        pos = np.concatenate([np.arange(r.num_computed, r.num_computed + r.num_new) for r in rows])
        qsl = np.concatenate([[0], np.cumsum(num_new)])
        inner = [b for b in bounds[1:-1] if b not in qsl]  # cuts inside a row: token b continues token b - 1
        self.pair_bounds += int(pairs and sum(pos[b] % 2 for b in inner))
        drafts = np.array([r.num_draft for r in rows])
        self.draft_bounds += int(sum(((qsl[1:] - drafts <= b) & (b < qsl[1:]) & (drafts > 0)).any() for b in inner))
        for r in rows:
            s, start = r.seq, r.num_computed
            if start and done.get(id(s)) == start:  # a later chunk of the same run of the request
                self.pair_chunks += int(pairs and start < s.num_prompt_tokens and start % 2)
            elif start:  # its first row starts past 0: a cached prefix
                self.prefix_hits += 1
                self.pair_prefix_hits += int(pairs and start % 2)
            done[id(s)] = start + r.num_new
        self.past_window += int((pos >= cfg.sliding_window).sum())
        if ratios:  # every compressed layer selects: even its largest ratio has more than index_topk entries
            self.selecting += int(((pos + 1) // max(ratios) > cfg.index_topk).sum())
        c = cfg.candidate_source_layer_id
        if c >= 0 and any(i > c for i in cfg.index_source_layer_ids):
            cover = cfg.candidate_topk_blocks * cfg.candidate_block_size
            self.restricted += int(((pos + 1) // cfg.ratios[c] > cover).sum())


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
    coverage: Coverage = dataclasses.field(default_factory=Coverage)
    spec: dict = dataclasses.field(default_factory=dict)  # speculative decoding's counts (EngineStats spec_*)
    # per request, per event: (token, logprob, top logprobs, finish reason)
    outputs: list[list[tuple]] = dataclasses.field(default_factory=list)


def run_case(loaded: LoadedModel, work: Workload, cfg: RunnerConfig, first_step_bounds: list[int] | None = None,
             max_steps: int | None = None, reuse_prefix: bool = False,
             runner_cls: type[ModelRunner] = ModelRunner, make_runner=None, speculative=None, drafter=None,
             params: SamplingParams | None = None, engine_cls: type[LLMEngine] = LLMEngine) -> Record:
    """Run the workload and record it. `reuse_prefix`: run it once unrecorded with prefix caching on,
    then record a second pass whose prompts start from the cached KV blocks of the first.
    `make_runner(cfg)` (tensor parallel): builds the runner instead, e.g. `TPCluster.make_runner`.
    `speculative`, `drafter`: speculative decoding (LLMEngine's); a verify row records only the positions
    whose computation stands (StepResult.standing), so the record compares with a plain run's.
    `params`: the requests' sampling (default greedy, `gen_tokens` each)."""
    engine = engine_cls(loaded, cfg, enable_prefix_caching=reuse_prefix, runner_cls=runner_cls,
                        runner=make_runner(cfg) if make_runner is not None else None, speculative=speculative,
                        drafter=drafter)
    params = params or SamplingParams(max_tokens=work.gen_tokens, temperature=0.0, ignore_eos=True)
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
    outputs: list[list[tuple]] = [[] for _ in work.prompts]
    steps, coverage, done = 0, Coverage(), {}
    try:
        while engine.has_unfinished() and (max_steps is None or steps < max_steps):
            res = engine.step(first_step_bounds if steps == 0 else None, record=True)
            steps += 1
            for ev in res.events:
                if ev.request_id not in index:
                    continue  # a warm-up request of a second engine user (never here: warm ones ran before)
                outputs[index[ev.request_id]].append((ev.token, ev.logprob, ev.top_logprobs, ev.finish_reason))
                if ev.token is not None:
                    tokens[index[ev.request_id]].append(ev.token)
            if res.output is None:
                continue
            ran = set(res.req_ids)  # (a row that failed was ended and left out of the step)
            rows = [r for r in res.scheduled.rows if r.seq.request_id in ran]
            coverage.add_step(loaded.config, rows, res.output.bounds, done)
            stand = np.array(res.standing, dtype=np.int64)  # each row's first tokens that plain decoding computes
            req = np.repeat([index[r] for r in res.req_ids], stand)
            pos = np.concatenate([np.arange(r.num_computed, r.num_computed + n) for r, n in zip(rows, stand)])
            first = np.cumsum([0] + [r.num_new for r in rows])
            at = torch.from_numpy(np.concatenate([np.arange(f, f + n) for f, n in zip(first, stand)]))
            keys.append(np.stack([req, pos], 1))
            hashes.append(res.output.hash_ids.reshape(first[-1], -1)[at])
            staged.append(res.output.staged.permute(1, 0, 2, 3).reshape(first[-1], -1)[at])
            sampled = [(index[rid], r, n) for rid, r, n, flag in zip(res.req_ids, rows, stand, res.sampled) if flag]
            lkeys.append(np.array([(i, r.num_computed + r.num_new - r.num_draft - 1 + j) for i, r, n in sampled
                                   for j in range(n if r.num_draft else 1)], dtype=np.int64).reshape(-1, 2))
            lfirst = np.cumsum([0] + [r.num_draft + 1 for _, r, _ in sampled])
            logits.append(res.output.logits[torch.from_numpy(np.concatenate(
                [np.arange(f, f + (n if r.num_draft else 1)) for f, (_, r, n) in zip(lfirst, sampled)] or [[]]
            ).astype(np.int64))])
        if not keys:  # every row of every step ended with an error: nothing was computed
            e = loaded.config.engram
            keys, lkeys = [np.zeros((0, 2), np.int64)], [np.zeros((0, 2), np.int64)]
            hashes = [torch.zeros(0, e.num_layers * e.num_columns, dtype=torch.int64)]
            staged = [torch.zeros(0, e.num_layers * e.num_columns * e.engram_head_dim)]
            logits = [torch.zeros(0, loaded.config.vocab_size)]
        st = engine.stats
        spec = {"drafts": st.spec_drafts, "draft_tokens": st.spec_draft_tokens,
                "accepted_tokens": st.spec_accepted_tokens}
        return Record(np.concatenate(keys), torch.cat(hashes), torch.cat(staged), np.concatenate(lkeys),
                      torch.cat(logits), tokens, steps, st.microbatched_steps, st.straddling_rows, st.preemptions,
                      coverage, spec, outputs)
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


COVERAGE = tuple(f.name for f in dataclasses.fields(Coverage))


def cases(base: RunnerConfig, first_qsl: np.ndarray, threads: int = 1) -> list[tuple[str, RunnerConfig, list | None,
                                                                                      bool]]:
    """(name, runner config, forced bounds of the first step, reuse a cached prefix) per comparison; `threads`: the
    kernels' pool size the cases run on (the first case is the baseline's steps on it)."""
    big = base.max_num_batched_tokens
    def microbatched(n, policy, **kw):
        return dataclasses.replace(base, microbatch=MicrobatchConfig(n, policy, 0, 0, when="always"), **kw)
    out = [(f"whole steps, {threads} threads", base, None, False)]
    out += [(f"{n} microbatches, {p} policy", microbatched(n, p), None, False)
            for n in (2, 3) for p in ("tokens", "requests")]
    out += [(f"prefill chunk {c}, 2 microbatches",
             microbatched(2, "tokens", max_num_batched_tokens=c, max_num_seqs=min(c, base.max_num_seqs)), None, False)
            for c in (1, 3, 17)]
    out.append(("prefill chunk unlimited, 2 microbatches", microbatched(2, "tokens", max_num_batched_tokens=big),
                None, False))
    out.append(("graph mode, padded, 2 microbatches",
                microbatched(2, "tokens", graph_sizes=tuple(s for s in GRAPH_SIZES if s < big) + (big,)), None, False))
    out.append(("reused prefix (prefix cache), 2 microbatches", microbatched(2, "tokens"), None, True))
    out.append((f"reused prefix, block size {PAIR_BLOCK} (hits inside a ratio-2 pair), 2 microbatches",
                microbatched(2, "tokens", block_size=PAIR_BLOCK,
                             num_blocks=-(-base.num_blocks * base.block_size // PAIR_BLOCK) * 2), None, True))
    out.append(("preemption and recompute (small KV pool), 2 microbatches",
                microbatched(2, "tokens", num_blocks=base.max_blocks_per_seq + 2), None, False))
    r = int(np.argmax(np.diff(first_qsl)))  # sweep the cuts inside the longest first-step row
    for c in boundary_offsets(int(first_qsl[r]), int(first_qsl[r + 1])):
        out.append((f"first step cut at token {c}", microbatched(2, "tokens"), [0, c, int(first_qsl[-1])], False))
    return out


def boundary_offsets(start: int, end: int, limit: int = MAX_BOUNDARIES) -> list[int]:
    """Every token offset strictly inside [start, end), or `limit` of them spread evenly over a longer row
    (a pair's first and second tokens alike: the spacing is odd)."""
    inside = end - start - 1
    if inside <= limit:
        return list(range(start + 1, end))
    step = -(-inside // limit) | 1
    return list(range(start + 1, end, step))[:limit]


def verify(loaded: LoadedModel, seed: int = 0, num_requests: int = 6, gen_tokens: int = 16,
           overrides: dict | None = None, only: str | tuple[str, ...] | None = None, progress=None,
           runner_cls: type[ModelRunner] = ModelRunner, make_runner=None, reference: LoadedModel | None = None,
           device: str = "cpu", threads: int | None = None, set_threads=None, speculative: int | None = None,
           drafter=None) -> dict:
    """Run every case (or those whose name contains `only`, a string or a tuple of them). `overrides`
    (RunnerConfig fields, e.g. debug_ownership) and `runner_cls` (a test subclass with a protection off:
    a negative control) apply to the compared cases, never to the whole-step baseline.

    Threads: the baseline runs on one thread of the C kernels' pool, the cases on `threads` (default: the pool's
    size now), set by `set_threads(n)` (default `thread_pool.set_threads`; tensor parallel: on every rank).

    Tensor parallel: `make_runner` builds each case's runner on every rank (baseline included: the
    same parallel size, whole steps); `reference` (the unsharded model) adds "vs_single_process": the
    whole-step baseline against one process, where greedy tokens must match and |logit diff| is reported.

    `speculative` N: every compared case decodes speculatively, N drafts a request, from `drafter` (default: the
    baseline's own tokens with 30% of them replaced by seeded random ones, so that drafts are accepted and
    rejected at every draft position; "dspark": the checkpoint's DSpark drafter, min(N, its block) drafts, built by
    each case's engine), against the plain baseline; the summary counts drafts, accepted drafts and cuts inside
    draft blocks."""
    work = Workload.seeded(seed, num_requests, loaded.config.vocab_size, gen_tokens,
                           long_prompt_len(loaded.config, gen_tokens))
    total = sum(map(len, work.prompts))
    base_cfg = RunnerConfig(max_num_seqs=num_requests, max_model_len=max(map(len, work.prompts)) + gen_tokens + 1,
                            max_num_batched_tokens=total, num_blocks=num_requests * 8 + 64, block_size=16,
                            microbatch=MicrobatchConfig(1), device=device)
    base_cfg = dataclasses.replace(base_cfg, max_model_len=-(-base_cfg.max_model_len // 16) * 16)
    set_threads = set_threads or thread_pool.set_threads
    threads = thread_pool.threads() if threads is None else threads
    set_threads(1)
    try:
        base = run_case(loaded, work, base_cfg, make_runner=make_runner)
    finally:
        set_threads(threads)
    first_qsl = np.concatenate([[0], np.cumsum([len(p) for p in work.prompts])])
    spec = None
    if speculative is not None:
        from .spec.config import SpeculativeConfig
        from .spec.drafters import OracleDrafter
        spec = SpeculativeConfig("random", speculative, when="always")  # the config's own drafter is replaced below
        if drafter == "dspark":  # each case's engine builds it over its own cache
            block = loaded.config.dspark.dspark_block_size
            spec, drafter = SpeculativeConfig("dspark", min(speculative, block), when="always", block_size=block), None
        outputs = {f"r{i}": t for i, t in enumerate(base.tokens)}
        vocab = min(int(loaded.token_map.shape[0]), loaded.config.vocab_size)
        make_drafter = (lambda: drafter) if drafter is not None else (
            lambda: OracleDrafter(outputs, vocab, error_rate=0.3, seed=seed))
    rows, straddling = [], 0
    only = (only,) if isinstance(only, str) else only
    all_cases = [c for c in cases(base_cfg, first_qsl, threads) if only is None or any(o in c[0] for o in only)]
    for i, (name, cfg, bounds, reuse) in enumerate(all_cases):
        cfg = dataclasses.replace(cfg, **(overrides or {}))
        rec = run_case(loaded, work, cfg, bounds, max_steps=1 if bounds else None, reuse_prefix=reuse,
                       runner_cls=runner_cls, make_runner=make_runner, speculative=spec,
                       drafter=None if spec is None or spec.method == "dspark" else make_drafter())
        straddling += rec.straddling_rows
        res = compare(base, rec, work, tokens=not bounds)
        rows.append({"case": name, "steps": rec.steps, "microbatched_steps": rec.microbatched_steps,
                     "preemptions": rec.preemptions,
                     "straddling_rows": rec.straddling_rows, **res, **dataclasses.asdict(rec.coverage),
                     **{f"spec_{k}": v for k, v in rec.spec.items()}})
        if progress:
            progress(i + 1, len(all_cases))
    summary = {
        "cases": rows, "straddling_rows": straddling,
        "hash_mismatches": sum(r["hash_mismatches"] for r in rows),
        "row_mismatches": sum(r["row_mismatches"] for r in rows),
        "logit_mismatches": sum(r["logit_mismatches"] for r in rows),
        "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
        "greedy_mismatches": sum(r["greedy_mismatches"] for r in rows),
        "coverage": {k: sum(r[k] for r in rows) for k in (*COVERAGE, "preemptions")},
        "longest_prompt": max(map(len, work.prompts)),
        "threads": threads,
    }
    if spec is not None:
        summary["speculative"] = {k: sum(r[f"spec_{k}"] for r in rows) for k in ("drafts", "draft_tokens",
                                                                                 "accepted_tokens")}
        summary["speculative"]["draft_bounds"] = summary["coverage"]["draft_bounds"]
    summary["passed"] = all(summary[k] == 0 for k in ("hash_mismatches", "row_mismatches", "logit_mismatches",
                                                      "greedy_mismatches"))
    if reference is not None:
        single = run_case(reference, work, base_cfg)
        res = compare(single, base, work)
        summary["vs_single_process"] = {k: res[k] for k in ("compared_tokens", "hash_mismatches",
                                                              "max_abs_logit_diff", "greedy_mismatches")}
        summary["passed"] = summary["passed"] and res["hash_mismatches"] == 0 and res["greedy_mismatches"] == 0
    return summary
