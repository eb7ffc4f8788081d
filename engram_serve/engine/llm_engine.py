"""The engine: scheduler (torch-free bookkeeping) + model runner + sampler, one `step()` at a time.

Per step: (speculative decoding: drafts proposed) -> schedule -> build the step batch from the token store
-> run it (whole or as microbatches) -> sample on the device -> commit sampled tokens (verify rows: the
accepted run, spec/acceptance.py) to the token store on the device and, with one host transfer for the whole
step, to the sequences -> finish what stopped.
"""
from __future__ import annotations

import logging
import numbers
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.scheduler import MAX_WAITING, Scheduler, SchedulerConfig, SchedulerOutput
from ..engine.sequence import Sequence
from ..errors import ConfigError, InvalidRequest, OwnershipError, SliceError, StaticBufferError
from ..inputs.batch import StepBatch
from ..microbatch.plan import check_bounds
from ..model.loader import LoadedModel
from ..runner.model_runner import ModelRunner, RunnerConfig, StepOutput
from ..runner.sampler import GREEDY_BELOW, Penalties, Sampler, SamplingBatch
from ..sampling_params import SamplingParams
from ..spec.acceptance import accepted_drafts
from ..spec.config import SpeculativeConfig
from ..spec.drafters import DraftRequest, Drafter, make_drafter
from ..spec.planner import SpecPlanner
from .threads import set_torch_threads

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """One sampled token of one request (token is None when the request ended without one)."""

    request_id: str
    token: int | None
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None  # the sampled token's logprob (requests with `logprobs` set)
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), most probable first
    # on a request's first event, with SamplingParams.prompt_logprobs: per prompt token (None for the first)
    # (its logprob, [(token id, logprob), ...] the top ones at its position)
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    microbatched_steps: int = 0
    straddling_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    errors: int = 0  # requests ended with finish_reason "error"
    step_failures: int = 0  # steps whose forward raised (their offending rows ended, the rest re-run)
    # speculative decoding, as vLLM counts it: verify rows, drafts verified, drafts accepted, accepted by position
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    events: list[TokenEvent]
    scheduled: SchedulerOutput
    output: StepOutput | None = None
    req_ids: list[str] = field(default_factory=list)  # request id of each row
    sampled: list[bool] = field(default_factory=list)  # whether each row's last token was sampled
    # per row: its first tokens whose computation plain decoding also makes (a verify row: up to the last
    # emitted token, or the row that ended the request with an error; every other row: all of them)
    standing: list[int] = field(default_factory=list)


class LLMEngine:
    """The class attributes below are protections that a test subclass turns off (a negative control)."""

    penalties_see_earlier_drafts_only = True  # a verify row's position j counts drafts 1..j, never later ones
    report_ended_rows = True  # the drafter observes the rows of requests that ended in the step (cached blocks)

    def __init__(self, loaded: LoadedModel, cfg: RunnerConfig | None = None, enable_prefix_caching: bool = True,
                 runner_cls: type[ModelRunner] = ModelRunner, runner: ModelRunner | None = None,
                 threads: int | None = None, seed: int | None = None, max_waiting: int | None = MAX_WAITING,
                 speculative: SpeculativeConfig | dict | str | None = None, drafter: Drafter | None = None):
        """`runner_cls`: a test may pass a subclass (negative controls). `runner`: a prepared runner over
        `loaded` with config `cfg` (tensor parallel: rank 0's ParallelModelRunner). `threads`: the C
        kernels' and torch's threads (engine/threads.py: default, the cores of the affinity mask); `seed`:
        seeds the draws of per-request seeds for requests that give none. `max_waiting`: requests the scheduler's
        waiting queue holds before `add_request` refuses more (QueueFull); None = no bound. `speculative`: a
        SpeculativeConfig (or its JSON) turns speculative decoding on, with `drafter` or the config's own
        (spec/drafters.py `make_drafter`); it changes how many tokens a step gives, never which."""
        self.threads = set_torch_threads(threads)
        cfg = cfg or RunnerConfig()
        if cfg.max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings={loaded.config.max_position_embeddings}")
        self.loaded, self.cfg = loaded, cfg
        self.runner = runner if runner is not None else runner_cls(loaded, cfg)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
            enable_prefix_caching=enable_prefix_caching, max_waiting=max_waiting))
        self.sampler = Sampler()
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.eos = loaded.config.eos_token_id
        # ids >= num_token_ids are outside the tokenizer: refused in prompts, never sampled
        self.num_token_ids = min(int(loaded.token_map.shape[0]), loaded.config.vocab_size)
        self._next_seed = np.random.default_rng(seed)
        self._scored: dict[str, Sequence] = {}  # requests whose prompt logprobs are complete, not yet delivered
        self.spec = None if speculative is None else SpeculativeConfig.parse(speculative, getattr(loaded, "path", None))
        self.drafter = None if self.spec is None else (drafter or make_drafter(self.spec, loaded, cfg))
        self.spec_planner = None if self.spec is None else SpecPlanner(self.spec)
        self._ended: list[str] = []  # requests that ended in this step: released after `observe`
        self._drafted: list[Sequence] = []  # the requests given drafts by the last `_propose`
        self._keep_context = True  # whether the drafter keeps its context of this step's tokens (the planner's)
        if self.spec is not None:
            self.stats.spec_accepted_per_position = [0] * self.spec.num_speculative_tokens
            layers = tuple(self.drafter.feature_layers)
            if layers:  # the runner captures the stream means entering these layers (StepOutput.features)
                want = tuple(loaded.config.dspark.dspark_target_layer_ids)
                if layers != want:
                    raise ConfigError(f"drafter feature_layers={layers}: the runner captures the checkpoint's "
                                      f"dspark_target_layer_ids={want}")
                self.runner.capture_features = True

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids, params) -> list[int]:
        """The prompt as a list of ints, or InvalidRequest naming the field and both values. Checked:
        types, an empty prompt, ids outside the tokenizer (the engine's token-id space is
        `[0, num_token_ids)`: the tokenizer's size, which the loader keeps <= vocab_size), stop
        token ids and logit_bias keys likewise, prompt + max_tokens beyond max_model_len, and a
        request the KV cache could never hold (it would wait forever)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params: expected SamplingParams, got {type(params).__name__}", "params")
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (list, tuple, np.ndarray)):
            raise InvalidRequest(f"prompt: expected a list of token ids, got {type(prompt_ids).__name__}", "prompt")
        if isinstance(prompt_ids, np.ndarray) and prompt_ids.ndim != 1:
            raise InvalidRequest(f"prompt: expected a 1-D array of token ids, got shape {prompt_ids.shape}", "prompt")
        integers = isinstance(prompt_ids, np.ndarray) and prompt_ids.dtype.kind in "iu"
        ids = prompt_ids.tolist() if integers else list(prompt_ids)  # Python ints from an integer array
        if not ids:
            raise InvalidRequest("prompt: must hold at least one token", "prompt")
        n = self.num_token_ids
        plain = set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < n  # the common case, at C speed
        for i, t in enumerate(() if plain else ids):  # else find the first bad token and name it
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
                raise InvalidRequest(f"prompt: token {i} is {t!r} ({type(t).__name__}), not an integer token id",
                                     "prompt")
            if not 0 <= t < n:
                raise InvalidRequest(f"prompt: token id {int(t)} at index {i} is outside the tokenizer's ids "
                                     f"[0, {n})", "prompt")
        for i, t in enumerate(params.stop_token_ids):
            if t >= n:
                raise InvalidRequest(f"stop_token_ids[{i}]={t}: outside the tokenizer's ids [0, {n})", "stop_token_ids")
        for t in params.logit_bias:
            if t >= n:
                raise InvalidRequest(f"logit_bias: token id {t} is outside the tokenizer's ids [0, {n})", "logit_bias")
        cfg, total = self.cfg, len(ids) + params.max_tokens
        if total > cfg.max_model_len and len(ids) < cfg.max_model_len:  # the prompt fits: max_tokens is at fault
            raise InvalidRequest(f"max_tokens={params.max_tokens}: the prompt's {len(ids)} tokens + max_tokens = "
                                 f"{total} exceeds the model's maximum length max_model_len={cfg.max_model_len}",
                                 "max_tokens")
        if total > cfg.max_model_len:
            raise InvalidRequest(f"prompt: {len(ids)} tokens + max_tokens={params.max_tokens} = {total} exceeds the "
                                 f"model's maximum length max_model_len={cfg.max_model_len}", "prompt")
        if -(-total // cfg.block_size) > cfg.num_blocks:
            raise InvalidRequest(f"prompt: {len(ids)} tokens + max_tokens={params.max_tokens} need "
                                 f"{-(-total // cfg.block_size)} KV blocks, the cache has num_blocks={cfg.num_blocks}",
                                 "prompt")
        return ids if plain else [int(t) for t in ids]

    @staticmethod
    def validate_dead(dead, num_tokens: int) -> list[bool] | None:
        """None, or one bool per prompt token (a list, tuple or 1-D array of bools or 0/1)."""
        if dead is None:
            return None
        if isinstance(dead, (str, bytes)) or not isinstance(dead, (list, tuple, np.ndarray)):
            raise InvalidRequest(f"dead={dead!r:.60}: expected a list of one bool per prompt token, "
                                 f"got {type(dead).__name__}", "dead")
        flags = list(np.asarray(dead).reshape(-1)) if isinstance(dead, np.ndarray) else list(dead)
        if len(flags) != num_tokens:
            raise InvalidRequest(f"dead: {len(flags)} flags for a prompt of {num_tokens} tokens", "dead")
        for i, d in enumerate(flags):
            if not (isinstance(d, (bool, np.bool_)) or (isinstance(d, numbers.Integral) and d in (0, 1))):
                raise InvalidRequest(f"dead[{i}]={d!r}: must be a bool (or 0/1)", "dead")
        return [bool(d) for d in flags]

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    dead: list[bool] | None = None) -> Sequence:
        """Validate once and queue the request in the scheduler's waiting queue (the only one). Bad
        input raises InvalidRequest, a full queue QueueFull, before anything touches the batch."""
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str):
            raise InvalidRequest(f"request_id={request_id!r}: must be a string", "request_id")
        ids = self.validate(prompt_ids, params)
        dead = self.validate_dead(dead, len(ids))
        seq = Sequence(request_id, ids, params, dead=dead)
        if params.prompt_logprobs is not None:  # every prompt position computed: no cached prefix
            seq.reuse_prefix, seq.prompt_logprobs = False, [None] * len(ids)
        self.scheduler.add(seq)  # refuses a live request_id or a full queue; the token-store slot
        # is taken when the request is first scheduled
        if params.seed is None:  # drawn once the request is accepted
            seq.params = params.with_seed(int(self._next_seed.integers(0, 2**62)))
        self.seqs[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        self._scored.pop(request_id, None)
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        self._free_slot(seq)
        if self.drafter is not None:
            self.drafter.release(request_id)
            self.spec_planner.release(request_id)
        return True

    def _free_slot(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.runner.state.clear(seq.slot)
            self.runner.store.free(seq.slot)
            seq.slot = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ---------------------------------------------------------------------------
    def step(self, bounds: list[int] | None = None, record: bool = False) -> StepResult:
        """One engine step; `bounds` forces the microbatch cut, `record` keeps hash ids and staged rows.
        (The drafter's `release` of the requests that ended in it comes last, after its `observe`.)"""
        try:
            return self._step(bounds, record)
        finally:
            ended, self._ended = self._ended, []
            for rid in ended:
                self.drafter.release(rid)
                self.spec_planner.release(rid)

    def _step(self, bounds: list[int] | None, record: bool) -> StepResult:
        """`step`.

        If the forward raises, the rows that make it raise (found by re-running halves) end with
        finish_reason "error", the failure is counted, and the step re-runs without them: one
        request never ends its batch mates. If every row of a multi-row step fails even alone, the
        step itself is broken: the error is raised. Broken engine invariants (OwnershipError,
        SliceError, StaticBufferError) and malformed `bounds` (InvalidRequest) are raised at once."""
        started = time.perf_counter()
        if self.spec is not None:
            self._propose()
        out = self.scheduler.schedule()
        events = [self._finish(s, s.finish_reason or "length") for s in out.finished if s.request_id in self.seqs]
        self.stats.preemptions += len(out.preempted)
        state = self.runner.state  # persistent block tables: updated incrementally, never rebuilt
        for s in out.preempted:
            if s.slot is not None:
                state.clear(s.slot)
            if self.drafter is not None:
                self.drafter.release(s.request_id)
        if not out.rows:
            return StepResult(events, out)
        rows = out.rows
        sample = [r.sample for r in rows]  # before update(): it depends on the sequence's length
        for s in (r.seq for r in rows):
            if s.slot is None:  # first time scheduled: running + preempted <= max_num_seqs slots
                s.slot = self.runner.store.add(s.token_ids, s.dead)
            state.sync(s.slot, s.block_ids)  # O(new blocks): usually nothing
        verify = [r for r in rows if r.num_draft] if self.spec is not None else []
        if verify:  # the drafts go where the step reads its input ids: past the committed tokens
            self.runner.store.write(np.repeat([r.seq.slot for r in verify], [r.num_draft for r in verify]),
                                    np.concatenate([np.arange(r.seq.num_tokens, r.seq.num_tokens + r.num_draft)
                                                    for r in verify]),
                                    np.concatenate([r.seq.draft_ids for r in verify]))

        def run(rows, sample, bounds=None, record=False) -> tuple[StepOutput, StepBatch]:
            n = len(rows)
            slots = np.fromiter((r.seq.slot for r in rows), np.int64, n)
            computed = np.fromiter((r.num_computed for r in rows), np.int64, n)
            new, sampled = np.fromiter((r.num_new for r in rows), np.int64, n), np.fromiter(sample, bool, n)
            drafts = np.fromiter((r.num_draft for r in rows), np.int64, n)
            score = [i for i, r in enumerate(rows) if r.seq.prompt_logprobs is not None
                     and r.num_computed < r.seq.num_prompt_tokens]
            if bounds is None and not score and (new == 1).all() and sampled.all():
                batch = self.runner.build_decode(slots, computed)  # a decode step: its inputs in place
            else:
                batch = self.runner.build(slots, computed, new, None, sampled)
            if bounds is not None:
                check_bounds(bounds, batch.num_tokens, self.cfg.microbatch.num_microbatches)
            if not drafts.any():
                return self.runner.execute(batch, bounds, record, score or None), batch
            return self.runner.execute(batch, bounds, record, score or None,  # verify rows: every position read
                                       reads=np.where(sampled, drafts + 1, 0)), batch

        try:
            result, batch = run(rows, sample, bounds, record)
        except (InvalidRequest, OwnershipError, SliceError, StaticBufferError):
            raise  # malformed bounds, or a broken engine invariant (debug checks): not a row's fault
        except Exception as e:
            bad = self._culprits(rows, sample, run, e)
            if len(bad) == len(rows) > 1:
                raise  # every row fails even alone: the step itself is broken, not a request
            events += self._end_rows([rows[i] for i in bad], e)
            keep = [i for i, r in enumerate(rows) if r.seq.request_id in self.seqs]
            rows, sample = [rows[i] for i in keep], [sample[i] for i in keep]
            if not rows:
                return StepResult(events, out)
            result, batch = run(rows, sample, None, record)
        self.scheduler.update(out)  # rows of sequences ended above are skipped
        self._account(rows, result)
        if result.scored is not None:
            events += self._prompt_logprobs(rows, result.scored)
        sampled = [r.seq for r, flag in zip(rows, sample) if flag]
        drafts = [r.num_draft for r, flag in zip(rows, sample) if flag]
        logits = result.logits

        def keep_rows(keep: list[int]) -> None:  # the sampled rows `keep`, and their logits rows
            nonlocal sampled, drafts, logits
            first = np.cumsum([0] + [k + 1 for k in drafts])
            logits = logits[np.concatenate([np.arange(first[i], first[i + 1]) for i in keep] or [[]]).astype(np.int64)]
            sampled, drafts = [sampled[i] for i in keep], [drafts[i] for i in keep]
        if len(events) and any(s.request_id not in self.seqs for s in sampled):  # ended above: not sampled
            keep_rows([i for i, s in enumerate(sampled) if s.request_id in self.seqs])
        if any(s.params.max_tokens == 0 for s in sampled):  # the prompt scored alone: nothing to sample
            events += [self._finish(s, "length") for s in sampled if not s.params.max_tokens]
            keep_rows([i for i, s in enumerate(sampled) if s.params.max_tokens])
        standing = {}
        if sampled and any(drafts):
            events += self._sample(sampled, logits, drafts, standing)
        elif sampled:
            events += self._sample(sampled, logits)
        if self.drafter is not None:
            self._observe(rows, batch, standing, result)
            if all(sample) and all(r.num_new - r.num_draft == 1 for r in rows):  # a decode step: the planner's measure
                self.spec_planner.record_step(len(rows), any(r.num_draft for r in rows),
                                              (time.perf_counter() - started) * 1e3,
                                              sum(ev.token is not None for ev in events))
        for ev in events:  # the prompt's logprobs ride on the request's first event
            seq = self._scored.pop(ev.request_id, None)
            if seq is not None:
                ev.prompt_logprobs = seq.prompt_logprobs
        return StepResult(events, out, result, [r.seq.request_id for r in rows], sample,
                          [standing.get(id(r.seq), r.num_new) for r in rows])

    # ---- speculative decoding ---------------------------------------------------------------
    def _propose(self) -> None:
        """Drafts for the running decodes the planner lets speculate (`seq.draft_ids`); the scheduler trims them
        to the step's budget and free blocks. A drafted id outside the tokenizer ends its proposal there."""
        for s in self._drafted:  # the last step's proposals (kept by a request that was not scheduled)
            s.draft_ids = []
        decodes = [s for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        ks = self.spec_planner.num_drafts(decodes, len(decodes))
        self._keep_context = self.spec_planner.needs_context(len(decodes), self.drafter.window)
        if self.drafter.feature_layers:  # the features of a step whose context the drafter drops: not computed
            self.runner.capture_features = self._keep_context
        asked = [(s, k) for s, k in zip(decodes, ks) if k]
        self._drafted = [s for s, _ in asked]
        if not asked:
            return
        reqs = [DraftRequest(s.request_id, s.token_ids, s.num_prompt_tokens, k, s.block_ids) for s, k in asked]
        for (seq, k), d in zip(asked, self.drafter.propose(reqs, self._pick([s for s, _ in asked]))):
            d = np.asarray(d, dtype=np.int64)[:k]
            bad = np.flatnonzero((d < 0) | (d >= self.num_token_ids))
            seq.draft_ids = d[: bad[0] if len(bad) else len(d)].tolist()

    def _pick(self, seqs: list[Sequence]):
        """The drafters' `pick(j, z)` (spec/drafters.py `PickFn`) for these requests."""
        p = [s.params for s in seqs]

        greedy = all(x.temperature < GREEDY_BELOW for x in p)

        def pick(j: int, z: torch.Tensor) -> torch.Tensor:
            z = z[:, : self.num_token_ids].float()
            if greedy:
                return self.sampler.greedy(z).tokens
            batch = SamplingBatch.build(z.shape[1], [x.temperature for x in p], [x.top_k for x in p],
                                        [x.top_p for x in p], [x.seed for x in p], [s.num_tokens + j for s in seqs],
                                        [x.min_p for x in p], device=z.device)
            return self.sampler.sample(z, batch).tokens
        pick.greedy = greedy  # every row greedy: a drafter may take its own greedy choice (the same argmax)
        return pick

    def _observe(self, rows, batch: StepBatch, standing: dict, result: StepOutput) -> None:
        """Tell the drafter, in one call, the positions each row computed from committed tokens (never a rejected
        draft's: a verify row's first `standing` tokens), their KV slots (the step's `slot_mapping`) and the runner's
        features of those tokens when it captured any. A request that ended in this step is reported too: its
        blocks may live on as a cached prefix. No loop per token."""
        positions, slots, feats = batch.positions, batch.slot_mapping, result.features
        if standing or not self.report_ended_rows:  # the first kept[r] of each row's new[r] tokens
            n = len(rows)
            new = np.fromiter((r.num_new for r in rows), np.int64, n)
            kept = np.fromiter((standing.get(id(r.seq), r.num_new) if self.report_ended_rows or r.seq.request_id in
                                self.seqs else 0 for r in rows), np.int64, n)
            idx = np.repeat(np.cumsum(new) - new, kept) + np.arange(kept.sum()) - np.repeat(np.cumsum(kept) - kept, kept)
            idx = torch.from_numpy(idx).to(positions.device)
            positions, slots = positions[idx], slots[idx]
            feats = feats[idx.to(feats.device)] if feats is not None else None
        # (the step's own buffers: the drafter copies what it keeps)
        self.drafter.observe(positions, slots, feats, self._keep_context)

    def _prompt_logprobs(self, rows, scored: torch.Tensor) -> list[TokenEvent]:
        """Store the prompt logprobs of the scored rows (run's `score`, in row order): the logits at position p
        give token p + 1's logprob and the top ones, log-softmax as the sampler computes it; one transfer. A
        request whose scored logits are not finite ends with an error (its events), as a sampled one does."""
        rows = [r for r in rows if r.seq.prompt_logprobs is not None and r.num_computed < r.seq.num_prompt_tokens]
        x = scored[:, : self.num_token_ids]
        k = max(r.seq.params.prompt_logprobs for r in rows)
        nxt = torch.tensor([r.seq.token_ids[p + 1] if p + 1 < r.seq.num_tokens else 0
                            for r in rows for p in range(r.num_computed, r.num_computed + r.num_new)], device=x.device)
        lse = torch.logsumexp(x, dim=1)
        cols = [(x.gather(1, nxt[:, None]).squeeze(1) - lse)[:, None].double()]
        if k:
            vals, ids = x.topk(k, dim=1)
            cols += [ids.double(), (vals - lse[:, None]).double()]
        cols.append(torch.isfinite(x).all(1)[:, None].double())
        host = torch.cat(cols, 1).cpu().numpy()
        t, events = 0, []
        for r in rows:
            seq, want = r.seq, r.seq.params.prompt_logprobs
            if not host[t:t + r.num_new, -1].all():
                t += r.num_new
                self.stats.errors += 1
                events.append(self._finish(seq, "error", "non-finite logits (NaN or Inf) for this request"))
                continue
            for p in range(r.num_computed, r.num_computed + r.num_new):
                if p + 1 < seq.num_prompt_tokens:
                    top = [(int(i), float(v)) for i, v in zip(host[t, 1:1 + want], host[t, 1 + k:1 + k + want])]
                    seq.prompt_logprobs[p + 1] = (float(host[t, 0]), top)
                t += 1
            if r.num_computed + r.num_new >= seq.num_prompt_tokens and not seq.prompt_logprobs_sent:
                self._scored[seq.request_id] = seq  # complete: delivered with the request's next event
                seq.prompt_logprobs_sent = True  # (a recompute after preemption computes the same values)
        return events

    def _culprits(self, rows, sample, run, error: Exception) -> list[int]:
        """The rows that make the forward raise. Halves are re-run (whole, outputs discarded: a row's
        KV writes are the same values each time) until single failing rows remain; a part that fails
        while both its halves pass counts as a whole."""
        self.stats.step_failures += 1
        log.warning("engine step failed (%s: %s); isolating the rows that cause it", type(error).__name__, error)

        def fails(idx: list[int]) -> bool:
            try:
                run([rows[i] for i in idx], [sample[i] for i in idx])
                return False
            except Exception:
                return True

        bad, parts = [], [list(range(len(rows)))]  # each part is known to fail
        while parts:
            part = parts.pop()
            if len(part) == 1:
                bad += part
                continue
            halves = [h for h in (part[:len(part) // 2], part[len(part) // 2:]) if fails(h)]
            if halves:
                parts += halves
            else:  # it fails only as a whole: end all of it
                bad += part
        return sorted(set(bad))

    def _end_rows(self, rows, error: Exception) -> list[TokenEvent]:
        """End these rows with finish_reason "error"; their events."""
        message = f"the engine step failed for this request: {type(error).__name__}: {error}"
        self.stats.errors += len(rows)
        return [self._finish(r.seq, "error", message) for r in rows]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[int] | None = None,
                standing: dict | None = None) -> list[TokenEvent]:
        """Sample one token per sequence; one device-to-host transfer for the whole step. `drafts` (a verify
        step): sequence i has drafts[i] drafts and drafts[i] + 1 rows of logits; each row j is sampled as plain
        decoding samples output position num_tokens + j, seeing the drafts before it as outputs."""
        dev = logits.device
        if logits.shape[1] > self.num_token_ids:
            logits = logits[:, : self.num_token_ids]  # ids outside the tokenizer are never sampled
        vocab = logits.shape[1]
        groups, counts = seqs, None
        if drafts is not None:  # one virtual row per position: the sequence, and j drafts before it
            counts = np.asarray(drafts) + 1
            seqs = [s for s, c in zip(groups, counts) for _ in range(c)]
            j = (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)).tolist()
        else:
            j = [0] * len(seqs)
        # drafts a row's penalties count: those before its position (the control: all of the row's)
        seen = j if counts is None or self.penalties_see_earlier_drafts_only else np.repeat(counts - 1, counts).tolist()
        p = [s.params for s in seqs]
        if all(x.temperature < GREEDY_BELOW and x.logprobs is None and not x.logit_bias and not x.penalised
               and not (x.min_tokens and s.num_output_tokens + i < x.min_tokens) for s, x, i in zip(seqs, p, j)):
            out, batch = self.sampler.greedy(logits), None  # the common case: one argmax, no batch
            return self._commit(seqs, out, batch) if drafts is None else \
                self._commit_verified(groups, drafts, out, batch, standing)
        # (`greedy` gives the tokens and finite flags that `sample` gives greedy rows)
        ban_rows, ban_tokens, bias_rows, bias_tokens, bias_values = [], [], [], [], []
        pen_rows = []
        for i, (s, x) in enumerate(zip(seqs, p)):  # host bookkeeping of the few rows that ask for extras
            if x.min_tokens and s.num_output_tokens + j[i] < x.min_tokens:
                stops = [t for t in x.stop_token_ids + ([] if x.ignore_eos or self.eos is None else [self.eos])
                         if t < vocab]
                ban_rows += [i] * len(stops)
                ban_tokens += stops
            if x.logit_bias:
                bias_rows += [i] * len(x.logit_bias)
                bias_tokens += list(x.logit_bias)
                bias_values += list(x.logit_bias.values())
            if x.penalised:
                pen_rows.append(i)
        penalties = None
        if pen_rows:
            ps = [seqs[i] for i in pen_rows]
            slots = torch.tensor([s.slot for s in ps], device=dev)
            width = max(s.num_tokens + seen[i] for i, s in zip(pen_rows, ps))
            penalties = Penalties(
                torch.tensor(pen_rows, device=dev),
                torch.tensor([s.params.repetition_penalty for s in ps], dtype=torch.float32, device=dev),
                torch.tensor([s.params.frequency_penalty for s in ps], dtype=torch.float32, device=dev),
                torch.tensor([s.params.presence_penalty for s in ps], dtype=torch.float32, device=dev),
                self.runner.store.ids.index_select(0, slots)[:, :width],  # [P, L] each row's own tokens
                torch.tensor([s.num_prompt_tokens for s in ps], device=dev),
                torch.tensor([s.num_tokens + seen[i] for i, s in zip(pen_rows, ps)], device=dev))
        batch = SamplingBatch.build(
            vocab, [x.temperature for x in p], [x.top_k for x in p], [x.top_p for x in p], [x.seed for x in p],
            [s.num_tokens + i for s, i in zip(seqs, j)], [x.min_p for x in p], device=dev,
            bias=(bias_rows, bias_tokens, bias_values) if bias_rows else None,
            ban=(ban_rows, ban_tokens) if ban_rows else None, penalties=penalties,
            logprobs=[x.logprobs for x in p])
        out = self.sampler.sample(logits, batch)
        return self._commit(seqs, out, batch) if drafts is None else \
            self._commit_verified(groups, drafts, out, batch, standing)

    def _commit(self, seqs: list[Sequence], out, batch: SamplingBatch | None) -> list[TokenEvent]:
        """Append the sampled tokens (SamplerOutput `out`) to their sequences; the step's token events.
        `batch` None: no row wants logprobs."""
        slots = np.fromiter((s.slot for s in seqs), np.int64, len(seqs))
        self.runner.store.append(slots, out.tokens)  # on the device; rows that fail are freed below
        toks, finite, host, n = self._to_host(out, batch, len(seqs))
        events = []
        for k, (seq, tok) in enumerate(zip(seqs, toks)):
            if not finite[k]:
                self.stats.errors += 1
                events.append(self._finish(seq, "error", "non-finite logits (NaN or Inf) for this request"))
                continue
            events.append(self._emit(seq, tok, host, k, n))
        self.stats.generated_tokens += sum(finite)  # the rows that got a token (True counts 1)
        return events

    def _commit_verified(self, seqs: list[Sequence], drafts: list[int], out, batch: SamplingBatch | None,
                         standing: dict) -> list[TokenEvent]:
        """`_commit` of a verify step: sequence i's rows are its drafts[i] + 1 positions (spec/acceptance.py).
        It emits the tokens of its accepted run, each exactly as plain decoding emits it (a stop, EOS, max_tokens
        or non-finite logits inside the run end the request there, with nothing after), then commits them to
        the token store (the first rejected draft overwritten) and counts the accepted drafts computed.
        `standing[id(seq)]`: the row's positions whose computation stands."""
        toks, finite, host, n = self._to_host(out, batch, len(out.tokens))
        k = np.asarray(drafts, dtype=np.int64)
        flat = np.concatenate([s.draft_ids for s in seqs]).astype(np.int64) if k.any() else np.zeros(0, np.int64)
        acc = accepted_drafts(np.asarray(toks), np.asarray(finite), flat, k).tolist()
        events, first, st = [], 0, self.stats
        commit_slots, commit_pos, commit_tok, live = [], [], [], []
        for i, seq in enumerate(seqs):
            start = seq.num_tokens
            for j in range(acc[i] + 1):  # the accepted run: drafts 1..acc equal rows 0..acc-1, then row acc
                row = first + j
                if not finite[row]:
                    st.errors += 1
                    events.append(self._finish(seq, "error", "non-finite logits (NaN or Inf) for this request"))
                    break
                events.append(self._emit(seq, toks[row], host, row, n))
                st.generated_tokens += 1
                if seq.is_finished:
                    break
            if k[i]:  # (a row without drafts, e.g. the last chunk of a prompt: every token stands)
                standing[id(seq)] = j + 1
            if k[i]:
                st.spec_drafts += 1
                st.spec_draft_tokens += int(k[i])
                st.spec_accepted_tokens += acc[i]
                per = st.spec_accepted_per_position
                per += [0] * (int(k[i]) - len(per))
                for pos in range(acc[i]):
                    per[pos] += 1
                self.spec_planner.record(seq.request_id, int(k[i]), acc[i])
            if not seq.is_finished:
                commit_slots += [seq.slot] * (acc[i] + 1)
                commit_pos += range(start, start + acc[i] + 1)
                commit_tok += toks[first:first + acc[i] + 1]
                live.append((seq, acc[i]))
            first += int(k[i]) + 1
        if live:
            store = self.runner.store
            store.write(np.asarray(commit_slots), np.asarray(commit_pos), np.asarray(commit_tok))
            store.set_lengths(np.asarray([s.slot for s, _ in live]), np.asarray([s.num_tokens for s, _ in live]))
            for seq, a in live:
                self.scheduler.accept(seq, a)
        return events

    def _to_host(self, out, batch: SamplingBatch | None, rows: int):
        """(tokens, finite flags, the host array of logprob columns or None, top logprobs per row) of a
        SamplerOutput, in one transfer."""
        dev = out.tokens.device
        n = 0 if batch is None else batch.num_logprobs
        if dev.type == "cpu" and batch is None:  # no transfer: the tensors' own memory
            host, toks, finite = None, out.tokens.numpy().tolist(), out.finite.numpy().tolist()
        else:
            packed = torch.stack([out.tokens.double(), out.finite.double()], dim=1)  # [R, 2]
            if batch is not None and batch.logprob_rows is not None:
                lp = torch.cat([out.logprob.double()[:, None], out.top_ids.double(), out.top_logprobs.double()], 1) \
                    if n else out.logprob.double()[:, None]  # [Q, 1 + 2n]
                full = torch.full((rows, lp.shape[1]), float("nan"), dtype=torch.float64, device=dev)
                packed = torch.cat([packed, full.index_copy_(0, batch.logprob_rows, lp)], dim=1)
            host = packed.cpu().numpy()  # the one transfer of the step
            toks, finite = host[:, 0].astype(np.int64).tolist(), (host[:, 1] != 0).tolist()  # two calls, not 2 a row
        return toks, finite, host, n

    def _emit(self, seq: Sequence, tok: int, host, k: int, n: int) -> TokenEvent:
        """Append token `tok` (row k of the step's host array, `n` top logprobs a row) to `seq`: its event."""
        seq.append_token(tok)
        want = seq.params.logprobs
        reason = self._stop_reason(seq, tok)
        ev = self._finish(seq, reason, token=tok) if reason else TokenEvent(seq.request_id, tok, False)
        if want is not None:
            row = host[k]
            ev.logprob = float(row[2])
            ev.top_logprobs = [(int(i), float(v)) for i, v in zip(row[3:3 + want], row[3 + n:3 + n + want])]
        return ev

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        params: SamplingParams = seq.params
        if (tok == self.eos and not params.ignore_eos) or tok in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, token: int | None = None) -> TokenEvent:
        if seq.request_id in self.seqs:
            self.scheduler.finish(seq, reason)
            self._free_slot(seq)
            del self.seqs[seq.request_id]
            if self.drafter is not None:
                self._ended.append(seq.request_id)  # released at the end of the step (`step`)
        return TokenEvent(seq.request_id, token, True, reason, error)

    def _account(self, rows, result: StepOutput) -> None:
        st = self.stats
        st.steps += 1
        st.microbatched_steps += len(result.bounds) > 2
        st.straddling_rows += result.straddling_rows
        st.prompt_tokens += sum(min(r.num_new, max(0, r.seq.num_prompt_tokens - r.num_computed)) for r in rows)

    def close(self) -> None:
        self.runner.close()
