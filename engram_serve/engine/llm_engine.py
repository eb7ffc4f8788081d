"""The engine: scheduler (torch-free bookkeeping) + model runner + sampler, one `step()` at a time.

Per step: schedule -> build the step batch from the token store -> run it (whole or as
microbatches) -> sample on the device -> commit sampled tokens to the token store on the device
and, with one host transfer for the whole step, to the sequences -> finish what stopped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from ..engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from ..engine.sequence import Sequence
from ..errors import InvalidRequest
from ..model.loader import LoadedModel
from ..runner.model_runner import ModelRunner, RunnerConfig, StepOutput
from ..runner.sampler import Sampler
from ..sampling_params import SamplingParams

MAX_QUEUED = 4096  # requests held (running + waiting) before add_request refuses more


@dataclass
class TokenEvent:
    """One sampled token of one request (token is None when the request ended without one)."""

    request_id: str
    token: int | None
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class EngineStats:
    steps: int = 0
    microbatched_steps: int = 0
    straddling_rows: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    errors: int = 0


@dataclass
class StepResult:
    events: list[TokenEvent]
    scheduled: SchedulerOutput
    output: StepOutput | None = None
    req_ids: list[str] = field(default_factory=list)  # request id of each row
    sampled: list[bool] = field(default_factory=list)  # whether each row's last token was sampled


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: RunnerConfig | None = None, enable_prefix_caching: bool = True,
                 runner_cls: type[ModelRunner] = ModelRunner):
        cfg = cfg or RunnerConfig()
        if cfg.max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's "
                             f"max_position_embeddings={loaded.config.max_position_embeddings}")
        self.loaded, self.cfg = loaded, cfg
        self.runner = runner_cls(loaded, cfg)  # a test may pass a subclass (negative controls)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_model_len=cfg.max_model_len,
            enable_prefix_caching=enable_prefix_caching))
        self.sampler = Sampler()
        self.seqs: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self.eos = loaded.config.eos_token_id
        self._next_seed = np.random.default_rng()

    # ---- requests ---------------------------------------------------------------------------
    def validate(self, prompt_ids, params) -> list[int]:
        """The prompt as a list of ints, or InvalidRequest naming the field and both values. Checked:
        types, an empty prompt, ids outside the vocabulary, prompt + max_tokens beyond max_model_len,
        and a request the KV cache could never hold (it would wait forever)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, (list, tuple, np.ndarray)):
            raise InvalidRequest(f"prompt: expected a list of token ids, got {type(prompt_ids).__name__}")
        ids = list(prompt_ids)
        if not ids:
            raise InvalidRequest("prompt: must hold at least one token")
        vocab = self.loaded.config.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise InvalidRequest(f"prompt: token {i} is {t!r} ({type(t).__name__}), not an integer token id")
            if not 0 <= t < vocab:
                raise InvalidRequest(f"prompt: token id {int(t)} at index {i} is outside the vocabulary [0, {vocab})")
        cfg, total = self.cfg, len(ids) + params.max_tokens
        if total > cfg.max_model_len:
            raise InvalidRequest(f"prompt: {len(ids)} tokens + max_tokens={params.max_tokens} = {total} exceeds the "
                                 f"model's maximum length max_model_len={cfg.max_model_len}")
        if -(-total // cfg.block_size) > cfg.num_blocks:
            raise InvalidRequest(f"prompt: {len(ids)} tokens + max_tokens={params.max_tokens} need "
                                 f"{-(-total // cfg.block_size)} KV blocks, the cache has num_blocks={cfg.num_blocks}")
        return [int(t) for t in ids]

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    dead: list[bool] | None = None) -> Sequence:
        """Validate and queue a request. Bad input raises InvalidRequest before touching the batch."""
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise InvalidRequest(f"request_id={request_id!r} is already running")
        ids = self.validate(prompt_ids, params)
        if len(self.seqs) >= MAX_QUEUED:
            raise InvalidRequest(f"the engine is full ({len(self.seqs)} requests); retry later")
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._next_seed.integers(0, 2**62)))
        seq = Sequence(request_id, ids, params, dead=dead)
        self.scheduler.add(seq)  # its token-store slot is taken when it is first scheduled
        self.seqs[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.abort(request_id)
        self._free_slot(seq)
        return True

    def _free_slot(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.runner.store.free(seq.slot)
            seq.slot = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step ---------------------------------------------------------------------------
    def step(self, bounds: list[int] | None = None, record: bool = False) -> StepResult:
        """One engine step; `bounds` forces the microbatch cut, `record` keeps hash ids and staged rows."""
        out = self.scheduler.schedule()
        events = [self._finish(s, s.finish_reason or "length") for s in out.finished if s.request_id in self.seqs]
        self.stats.preemptions += len(out.preempted)
        if not out.rows:
            return StepResult(events, out)
        rows = out.rows
        seqs = [r.seq for r in rows]
        sample = [r.sample for r in rows]  # before update(): it depends on the sequence's length
        for s in seqs:
            if s.slot is None:  # first time scheduled: running + preempted <= max_num_seqs slots
                s.slot = self.runner.store.add(s.token_ids, s.dead)
        batch = self.runner.build(
            np.array([s.slot for s in seqs]), np.array([r.num_computed for r in rows]),
            np.array([r.num_new for r in rows]), np.array(out.block_table_array(self.cfg.max_blocks_per_seq)),
            np.array(sample))
        result = self.runner.execute(batch, bounds, record)
        self.scheduler.update(out)
        self._account(out, result)
        sampled = [s for s, flag in zip(seqs, sample) if flag]
        if sampled:
            events += self._sample(sampled, result.logits)
        return StepResult(events, out, result, [s.request_id for s in seqs], sample)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        dev = logits.device
        p = [s.params for s in seqs]
        tokens, finite = self.sampler.sample(
            logits,
            torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.top_k for x in p], dtype=torch.int64, device=dev),
            torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev),
            torch.tensor([x.seed for x in p], dtype=torch.int64, device=dev),
            torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64, device=dev),
            filters=any(x.top_k > 0 or x.top_p < 1 for x in p), random=any(x.temperature > 0 for x in p))
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        ok = finite
        self.runner.store.append(slots[ok], tokens[ok])  # on the device, no Python round trip
        host_tokens, host_ok = tokens.tolist(), finite.tolist()  # one transfer for the whole step
        events = []
        for seq, tok, good in zip(seqs, host_tokens, host_ok):
            if not good:
                self.stats.errors += 1
                events.append(self._finish(seq, "error", "non-finite logits (NaN or Inf) for this request"))
                continue
            seq.append_token(tok)
            self.stats.generated_tokens += 1
            reason = self._stop_reason(seq, tok)
            events.append(self._finish(seq, reason, token=tok) if reason else TokenEvent(seq.request_id, tok, False))
        return events

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
        return TokenEvent(seq.request_id, token, True, reason, error)

    def _account(self, out: SchedulerOutput, result: StepOutput) -> None:
        st = self.stats
        st.steps += 1
        st.microbatched_steps += len(result.bounds) > 2
        st.straddling_rows += result.straddling_rows
        st.prompt_tokens += sum(min(r.num_new, max(0, r.seq.num_prompt_tokens - r.num_computed)) for r in out.rows)

    def close(self) -> None:
        self.runner.close()
