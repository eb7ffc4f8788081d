"""Incremental detokenization and stop strings, shared by `LLM` and `AsyncLLMEngine`.

The tokenizer is byte-level BPE: one token may hold part of a UTF-8 character. Text is emitted
only once it does not end in a partial character (decoding shows that as U+FFFD at the end); the
rest waits for the next token, and is flushed when the request finishes (then `text` is exactly
`tokenizer.decode(token_ids)`, up to a stop string).

`OutputProcessor` turns the engine's `TokenEvent`s into `RequestDelta`s. It never calls the engine:
it returns the ids whose text hit a stop string, and the caller (on the engine's own thread)
aborts them so their KV blocks and token-store slot are freed before the next step.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of one request's output tokens, emitted in deltas that never end in a partial character.

    Invariants: `emitted == text[:len(emitted)]` of the full decode of `token_ids[:read_offset]`;
    `token_ids[prefix_offset:read_offset]` is the small window decoded again for context, and its
    text ends on a whole character (so decoding a window and appending is the same as decoding all).
    With stop strings, the tail of the text that could still become a stop string is held back.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded text of token_ids[:read_offset] (stop string removed once hit)
        self.emitted = 0  # chars of `text` handed out as deltas
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token: int) -> str:
        """Append one token; return the text delta that is now safe to emit ('' if none)."""
        if self.stopped:
            raise ValueError("add: the request already hit a stop string")
        self.token_ids.append(int(token))
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""  # nothing new, or the last character is not complete yet
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._release()

    def flush(self) -> str:
        """The request finished: decode what was held back (a partial character stays U+FFFD)."""
        delta = ""
        if not self.stopped and self.read_offset < len(self.token_ids):
            prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.token_ids[self.prefix_offset:])
            self.text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset = len(self.token_ids)
            delta = self._release()  # a stop string may complete in the flushed text
        rest, self.emitted = self.text[self.emitted:], len(self.text)
        return delta + rest

    def _release(self) -> str:
        """Check stop strings; return the newly safe delta."""
        if self.stop:
            # a stop string can only begin in the last len(stop)-1 chars already seen, or later
            start = max(0, self.emitted - max(map(len, self.stop)) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                delta, self.emitted = self.text[self.emitted:], len(self.text)
                return delta
            safe = len(self.text) - _held_back(self.text, self.stop)
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

    def add(self, request_id: str, num_prompt_tokens: int, stop: Sequence[str] = ()) -> None:
        self._states[request_id] = _State(IncrementalDetokenizer(self.tokenizer, stop), num_prompt_tokens)

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
                                       reason, error, st.num_prompt_tokens, len(st.token_ids)))
        return deltas, to_abort

    def fail_all(self, message: str) -> list[RequestDelta]:
        """Finish every tracked request with finish_reason "error" (the step loop itself failed)."""
        out = [RequestDelta(rid, st.detok.flush(), None, True, "error", message, st.num_prompt_tokens,
                            len(st.token_ids)) for rid, st in self._states.items()]
        self._states.clear()
        return out
