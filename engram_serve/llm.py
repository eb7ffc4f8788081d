"""Offline generation, the user-facing Python API: `LLM(model).generate(prompts, params)`.

    llm = LLM()                      # the built-in tiny model; or LLM("path/to/checkpoint", max_num_seqs=8)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.8, seed=1))
    print(out[0].text, out[0].finish_reason)

Engine options are `RunnerConfig` fields (max_num_seqs, max_model_len, microbatch, device, ...) plus
`enable_prefix_caching`, `tensor_parallel_size`, `threads`, `seed`, `max_waiting` (the
scheduler's waiting-queue bound; offline the default is none: every prompt of a call queues) and
`speculative_config` (vLLM's, e.g. `{"method": "ngram", "num_speculative_tokens": 3}`: more tokens a step,
the same tokens); an unknown option raises ConfigError naming it.
The engine factory lives in `engine/factory.py`, the synchronous driver in `engine/driver.py`, the
loader (`load_model`) in `model/loader.py`.
"""
from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass, field
from typing import Sequence, Union

import numpy as np

from .engine.factory import build_engine
from .errors import InvalidRequest

Prompt = Union[str, Sequence[int]]

__all__ = ["LLM", "RequestOutput", "build_engine"]


@dataclass
class RequestOutput:
    """The result of one request. `text` is the decoded output (cut before a stop string);
    `token_ids` every sampled token (including an EOS or the tokens of a stop string); `error` is
    set when `finish_reason == "error"`. With `SamplingParams.logprobs` set, `logprobs[i]` is
    (logprob of token_ids[i], [(token id, logprob), ...] the top ones)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_))


class LLM:
    """Synchronous generation: queue every prompt, step the engine until all finish."""

    def __init__(self, model=None, *, enable_prefix_caching: bool = True, progress: bool = False,
                 tensor_parallel_size: int = 1, max_waiting: int | None = None, **options):
        from .engine.driver import EngineDriver  # here, not at import: the CLI's parser stays torch-free
        self.engine = build_engine(model, enable_prefix_caching=enable_prefix_caching, progress=progress,
                                   tensor_parallel_size=tensor_parallel_size, max_waiting=max_waiting, **options)
        self.driver = EngineDriver(self.engine)
        self.tokenizer = self.engine.loaded.tokenizer
        self._ids = itertools.count()

    @property
    def loaded(self):
        return self.engine.loaded

    @property
    def stats(self):
        return self.engine.stats

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt).ids
        return None, list(prompt)

    def generate(self, prompts: Prompt | Sequence[Prompt], params=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `prompts`: a string, a list of strings, a list of
        token-id lists (or one token-id list; numpy integers are token ids too). `params`: one
        SamplingParams for all, or one per prompt. Every request is validated before any runs: a
        bad one raises InvalidRequest naming its index."""
        from .sampling_params import SamplingParams
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            prompts = [prompts]
        elif isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                          and all(_is_token_id(t) for t in prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple, np.ndarray)):
            raise InvalidRequest(f"prompts: expected a string, a list of token ids or a list of those, "
                                 f"got {type(prompts).__name__}", "prompts")
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise InvalidRequest(f"params: {len(params)} SamplingParams for {len(prompts)} prompts", "params")
        outputs: dict[str, RequestOutput] = {}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if not isinstance(prompt, (str, list, tuple, np.ndarray)):
                    raise InvalidRequest(f"prompts[{i}]: expected a string or a list of token ids, "
                                         f"got {type(prompt).__name__}", "prompts")
                text, ids = self.encode(prompt)
                rid = str(next(self._ids))
                try:
                    self.driver.add(rid, ids, p)
                except InvalidRequest as e:
                    raise type(e)(f"prompts[{i}]: {e}", e.param) from None
                outputs[rid] = RequestOutput(rid, text, [int(t) for t in ids],
                                             logprobs=[] if p.logprobs is not None else None)
            done = 0
            while done < len(outputs):
                if not self.driver.has_work():
                    raise RuntimeError(f"the engine went idle with {len(outputs) - done} request(s) unfinished")
                for d in self.driver.step():
                    out = outputs[d.request_id]
                    out.text += d.text
                    if d.prompt_logprobs is not None:
                        out.prompt_logprobs = d.prompt_logprobs
                    if d.token_id is not None:
                        out.token_ids.append(d.token_id)
                        if out.logprobs is not None:
                            out.logprobs.append((d.logprob, d.top_logprobs or []))
                    if d.finished:
                        out.finish_reason, out.error = d.finish_reason, d.error
                        done += 1
        except BaseException:
            for rid in outputs:  # leave the engine clean for the next call (KV blocks, slots)
                self.driver.abort(rid)
            raise
        return list(outputs.values())

    def close(self) -> None:
        self.engine.close()
