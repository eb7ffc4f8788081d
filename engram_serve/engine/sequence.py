"""One request's token bookkeeping (pure Python, torch-free).

A `Sequence` is what the scheduler and the block manager move around. It knows its
tokens, how many of them already have KV in the cache, and which KV blocks hold them.
"""
from __future__ import annotations

import enum
import itertools
from typing import Any

from ..errors import InvalidRequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no KV blocks; num_computed_tokens == 0
    RUNNING = "running"  # admitted; holds KV blocks covering num_computed_tokens
    FINISHED = "finished"  # done (stopped, aborted, errored); holds no KV blocks


_ARRIVALS = itertools.count()  # process-wide FCFS order; a plain counter, no side effects


class Sequence:
    """A request: prompt tokens, then the tokens sampled for it.

    Invariants (the scheduler and block manager keep them; `Scheduler.check_invariants` checks):
    - `token_ids[:num_prompt_tokens]` is the prompt; `token_ids[num_prompt_tokens:]` the outputs,
      each appended exactly once, in order, via `append_token`.
    - `0 <= num_computed_tokens <= num_tokens`: positions `< num_computed_tokens` have KV in
      the blocks `block_ids[pos // block_size]`.
    - `len(block_ids) * block_size >= num_computed_tokens`.
    - WAITING sequences hold no blocks and have `num_computed_tokens == 0`; FINISHED ones
      hold no blocks (their count is kept for reporting only).
    - `dead`, when not None, has one flag per token (`len(dead) == num_tokens`).
    - `arrival` only orders sequences (earlier = smaller); it never changes.
    - `draft_ids` (speculative decoding) are proposals, never part of `token_ids`: set by the engine before a
      step is scheduled, trimmed by the scheduler to what the step verifies, cleared after the step.

    `slot`, `params` and `dead` are opaque here: the engine owns their meaning. `reuse_prefix` False:
    the request needs every prompt position computed (prompt logprobs), so no cached prefix is reused.
    """

    def __init__(self, request_id: str, token_ids: list[int], params: Any = None, *,
                 dead: list[bool] | None = None, arrival: int | None = None):
        self.request_id = request_id
        self.token_ids: list[int] = [int(t) for t in token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.params = params
        self.finish_reason: str | None = None
        self.arrival = next(_ARRIVALS) if arrival is None else int(arrival)
        if dead is not None:
            dead = [bool(d) for d in dead]
            if len(dead) != len(self.token_ids):
                raise InvalidRequest(f"request {request_id!r}: dead mask length {len(dead)} "
                                     f"!= prompt length {len(self.token_ids)}", "dead")
        self.dead: list[bool] | None = dead
        self.reuse_prefix = True
        self.prompt_logprobs: list | None = None  # the engine's, per prompt position (prompt logprobs)
        self.prompt_logprobs_sent = False
        self.draft_ids: list[int] = []  # this step's proposals (speculative decoding)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Commit one sampled token (never dead)."""
        self.token_ids.append(int(token_id))
        if self.dead is not None:
            self.dead.append(False)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids})")
