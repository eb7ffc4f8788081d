"""Incremental detokenization and stop strings, shared by `LLM` and `AsyncLLMEngine`.

Each token is decoded once, by `tokenizers`' `DecodeStream` (it keeps the few ids of a partial
UTF-8 character until the character is complete, so a delta never ends in half a character).
When the request finishes, whatever the stream still holds is flushed from one decode of the
output, so `text` is exactly `tokenizer.decode(token_ids)`, up to a stop string.

Stop strings are ours: the tail of the text that could still grow into a stop string is held
back; once one appears, the text is cut before it. Stop strings are looked for only in text
decoded after `min_tokens` tokens exist (as vLLM does).

`OutputProcessor` turns the engine's `TokenEvent`s into `RequestDelta`s. It never calls the engine:
it returns the ids whose text hit a stop string, and its caller aborts them. `AsyncLLMEngine`
runs it on its own output thread, off the engine's step loop.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Text of one request's output tokens, emitted in deltas that never end in a partial character.

    Invariants: `text` is the decode of the tokens the stream has released (cut before a stop
    string once one is hit); `text[:emitted]` has been handed out; with stop strings, the part of
    `text` past `emitted` is a suffix that could still become a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.min_tokens = min_tokens
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # chars of `text` handed out as deltas
        self.search_from = 0 if min_tokens == 0 else None  # where stop strings may start (None: not yet)
        self.stopped = False

    def add(self, token: int) -> str:
        """Append one token; return the text delta that is now safe to emit ('' if none)."""
        if self.stopped:
            raise ValueError("add: the request already hit a stop string")
        self.token_ids.append(int(token))
        chunk = self.stream.step(self.tokenizer, int(token))
        if chunk:
            self.text += chunk
        if self.search_from is None and len(self.token_ids) >= self.min_tokens:
            self.search_from = len(self.text) - len(chunk or "")
        return self._release() if chunk else ""

    def flush(self) -> str:
        """The request finished: release what the stream still holds (a partial character stays
        U+FFFD, as `tokenizer.decode` shows it) and whatever was held back."""
        delta = ""
        if not self.stopped and self.token_ids:
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
            if len(full) > len(self.text) and full.startswith(self.text):
                self.text = full
                if self.search_from is None:
                    self.search_from = len(self.text)
                delta = self._release()  # a stop string may complete in the flushed text
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return delta + rest

    def _release(self) -> str:
        """Check stop strings; return the newly safe delta."""
        if self.stop and self.search_from is not None:
            # a stop string can only begin in the last len(stop)-1 chars already released, or later
            start = max(self.search_from, self.emitted - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                delta, self.emitted = self.text[self.emitted:], len(self.text)
                return delta
            safe = len(self.text) - _held_back(self.text[self.search_from:], self.stop)
        else:
            safe = len(self.text)
        safe = max(safe, self.emitted)
        delta, self.emitted = self.text[self.emitted:safe], safe
        return delta


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@dataclass
class RequestDelta:
    """What one step produced for one request: new text (possibly ''), the sampled token (None when
    the request ended without one), and on the last delta `finished`, `finish_reason`, `error`."""

    request_id: str
    text: str
    token_id: int | None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprob: float | None = None  # the sampled token's logprob (requests that asked for logprobs)
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list | None = None  # on the request's first delta (SamplingParams.prompt_logprobs)


@dataclass
class _State:
    detok: IncrementalDetokenizer
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)


class OutputProcessor:
    """Per-request detokenizer state; engine events in, deltas out. Not thread-safe: use it on the
    thread that owns the engine."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add(self, request_id: str, num_prompt_tokens: int, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._states[request_id] = _State(IncrementalDetokenizer(self.tokenizer, stop, min_tokens=min_tokens),
                                          num_prompt_tokens)

    def discard(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def process(self, events: Iterable) -> tuple[list[RequestDelta], list[str]]:
        """Deltas for `events` (TokenEvents), and the ids that hit a stop string: the caller must
        `engine.abort` those (they are finished here, with finish_reason "stop")."""
        deltas, to_abort = [], []
        for ev in events:
            st = self._states.get(ev.request_id)
            if st is None:
                continue  # aborted or stopped earlier: nothing more is reported for it
            text = ""
            if ev.token is not None:
                st.token_ids.append(int(ev.token))
                text = st.detok.add(ev.token)
            finished, reason, error = ev.finished, ev.finish_reason, ev.error
            if st.detok.stopped:  # a stop string wins over "length" on the same token
                if not finished:
                    to_abort.append(ev.request_id)
                finished, reason = True, "stop"
            if finished:
                text += st.detok.flush()
                del self._states[ev.request_id]
            deltas.append(RequestDelta(ev.request_id, text, None if ev.token is None else int(ev.token), finished,
                                       reason, error, st.num_prompt_tokens, len(st.token_ids),
                                       getattr(ev, "logprob", None), getattr(ev, "top_logprobs", None),
                                       getattr(ev, "prompt_logprobs", None)))
        return deltas, to_abort

    def fail_all(self, message: str) -> list[RequestDelta]:
        """Finish every tracked request with finish_reason "error" (the step loop itself failed)."""
        out = [RequestDelta(rid, st.detok.flush(), None, True, "error", message, st.num_prompt_tokens,
                            len(st.token_ids)) for rid, st in self._states.items()]
        self._states.clear()
        return out
