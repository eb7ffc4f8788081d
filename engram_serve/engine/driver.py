"""`EngineDriver`: requests in, token events (or detokenized deltas) out, around one `LLMEngine`.

Admission is the engine's: `add` validates the request once and queues it in the scheduler's
waiting queue, the only one (bounded by `max_waiting`); the scheduler moves it into the running
batch when a slot and KV blocks are free. `step_events` runs one engine step and returns its
`TokenEvent`s; `step` also detokenizes them (the synchronous `LLM` path; the async engine
detokenizes on its own output thread instead).
"""
from __future__ import annotations

import collections.abc

from .detokenizer import OutputProcessor, RequestDelta
from .llm_engine import LLMEngine, TokenEvent
from .sequence import Sequence


class EngineDriver:
    """Not thread-safe: one thread makes every call.

    Invariant: with detokenization on, the requests the output processor tracks are live in the
    engine (queued or running) between calls."""

    def __init__(self, engine: LLMEngine, detokenize: bool = True):
        self.engine = engine
        self.outputs = OutputProcessor(engine.loaded.tokenizer) if detokenize else None

    def add(self, request_id: str, prompt_ids: collections.abc.Sequence[int], params, dead=None) -> Sequence:
        """Validate and queue (InvalidRequest, QueueFull); the request runs when the scheduler admits it."""
        seq = self.engine.add_request(request_id, prompt_ids, params, dead)
        if self.outputs is not None:
            self.outputs.add(request_id, seq.num_prompt_tokens, seq.params.stop, seq.params.min_tokens)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its KV blocks and token-store slot are freed."""
        if self.outputs is not None:
            self.outputs.discard(request_id)
        return self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step_events(self) -> tuple[list[TokenEvent], list[str]]:
        """One engine step: (its events, the request id of each row)."""
        result = self.engine.step()
        return result.events, result.req_ids

    def step(self) -> list[RequestDelta]:
        """One step, detokenized; requests that hit a stop string are aborted here."""
        events, _ = self.step_events()
        deltas, stopped = self.outputs.process(events)
        for rid in stopped:
            self.engine.abort(rid)
        return deltas

    def fail_all(self, message: str) -> list[TokenEvent]:
        """End every request with finish_reason "error" (the step loop itself failed) and free them."""
        ids = list(self.engine.seqs)
        for rid in ids:
            self.engine.abort(rid)
        return [TokenEvent(rid, None, True, "error", message) for rid in ids]
