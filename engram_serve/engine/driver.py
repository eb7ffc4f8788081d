"""`EngineDriver`: requests in, token events (or detokenized deltas) out, around one `LLMEngine`.

It adds an admission queue: requests beyond the engine's token-store slots wait in `pending`
(already validated) and enter the engine as slots free up. `step_events` runs one engine step and
returns its `TokenEvent`s; `step` also detokenizes them (the synchronous `LLM` path; the async
engine detokenizes on its own output thread instead).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InvalidRequest
from .detokenizer import OutputProcessor, RequestDelta
from .llm_engine import LLMEngine, TokenEvent


@dataclass
class _Pending:
    prompt_ids: list[int]
    params: object
    dead: list[bool] | None = None


class EngineDriver:
    """Not thread-safe: one thread makes every call.

    Invariant: every request id is in exactly one of `pending` (validated, not yet in the engine)
    or the engine (until its finishing event is returned or it is aborted)."""

    def __init__(self, engine: LLMEngine, detokenize: bool = True):
        self.engine = engine
        self.outputs = OutputProcessor(engine.loaded.tokenizer) if detokenize else None
        self.pending: OrderedDict[str, _Pending] = OrderedDict()

    def add(self, request_id: str, prompt_ids: Sequence[int], params, dead=None) -> None:
        """Validate (InvalidRequest) and queue; the request enters the engine when a slot is free."""
        if request_id in self.pending or request_id in self.engine.seqs or (
                self.outputs is not None and request_id in self.outputs):
            raise InvalidRequest(f"request_id={request_id!r} is already in use")
        ids = self.engine.validate(prompt_ids, params)
        dead = self.engine.validate_dead(dead, len(ids))
        self.pending[request_id] = _Pending(ids, params, dead)
        if self.outputs is not None:
            self.outputs.add(request_id, len(ids), params.stop, params.min_tokens)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its KV blocks and token-store slot are freed."""
        if self.outputs is not None:
            self.outputs.discard(request_id)
        if self.pending.pop(request_id, None) is not None:
            return True
        return self.engine.abort(request_id)

    def has_work(self) -> bool:
        return bool(self.pending) or self.engine.has_unfinished()

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    def step_events(self) -> tuple[list[TokenEvent], list[str]]:
        """Admit what fits, run one engine step; (its events, the request id of each row)."""
        events = self._admit()
        rows: list[str] = []
        if self.engine.has_unfinished():
            result = self.engine.step()
            events += result.events
            rows = result.req_ids
        return events, rows

    def step(self) -> list[RequestDelta]:
        """One step, detokenized; requests that hit a stop string are aborted here."""
        events, _ = self.step_events()
        deltas, stopped = self.outputs.process(events)
        for rid in stopped:
            self.engine.abort(rid)
        return deltas

    def fail_all(self, message: str) -> list[TokenEvent]:
        """End every request with finish_reason "error" (the step loop itself failed) and free them."""
        ids = list(self.pending) + list(self.engine.seqs)
        self.pending.clear()
        for rid in list(self.engine.seqs):
            self.engine.abort(rid)
        return [TokenEvent(rid, None, True, "error", message) for rid in ids]

    def _admit(self) -> list[TokenEvent]:
        """Move pending requests into the engine while it has token-store slots."""
        failed = []
        while self.pending and self.engine.runner.store.num_free > 0 \
                and len(self.engine.seqs) < self.engine.cfg.max_num_seqs:
            rid, p = self.pending.popitem(last=False)
            try:
                self.engine.add_request(rid, p.prompt_ids, p.params, p.dead)
            except InvalidRequest as e:  # checked already; kept so one bad request never blocks the queue
                failed.append(TokenEvent(rid, None, True, "error", str(e)))
        return failed
