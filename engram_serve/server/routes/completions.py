"""POST /v1/completions: text or token-id prompts (one or a list), `n` / `best_of`, `echo`,
`logprobs`; plain JSON or SSE (`generation.stream_response`)."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from .. import protocol as P
from ..generation import choice_extra, collect_all, generation_route, pick, start_all, stream_response, usage
from ..http_errors import ApiError
from ..logprobs import completion_logprobs, echo_logprobs

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..context import AppContext


def register(app: "FastAPI", ctx: "AppContext") -> None:
    from fastapi.responses import JSONResponse

    @generation_route(app, ctx, "/v1/completions", P.CompletionRequest, P.CompletionResponse)
    async def completions(request, body: P.CompletionRequest):
        n, best_of = body.n, body.best_of or body.n
        prompts = _prompts(body, n, best_of)
        ids_list, echo_text = [], []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids_list.append(await ctx.tokenize(p, "prompt" if len(prompts) == 1 else f"prompt.{i}"))
                echo_text.append(p)
            else:
                ids_list.append(list(p))
                echo_text.append(ctx.tokenizer.decode(list(p), skip_special_tokens=False) if body.echo else "")
        lp = body.logprobs if body.logprobs is not None else (0 if best_of > n else None)
        # echo: the prompt scored too (with max_tokens 0 it is all there is to do)
        plp = (body.logprobs or 0) if body.echo and (body.logprobs is not None or body.max_tokens == 0) else None
        streams = await start_all(ctx, ids_list, body, None, lp, best_of, plp)
        prompt_tokens = sum(map(len, ids_list))
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": ctx.model_name}
        if body.stream:
            echo_of = [echo_text[i // n] if body.echo else "" for i in range(len(streams))]
            ids_of = [ids_list[i // n] for i in range(len(streams))]
            return stream_response(body, streams, base, prompt_tokens, _StreamedChoice(ctx, body, echo_of, ids_of))

        outs = pick(await collect_all(ctx, request, streams), n, best_of)
        choices = []
        for i, o in enumerate(outs):
            prefix = echo_text[i // n] if body.echo else ""
            c = {"index": i, "text": prefix + o["text"], "finish_reason": o["finish_reason"],
                 "logprobs": _logprobs(ctx, body, ids_list[i // n], o, len(prefix))}
            choices.append(c | choice_extra(body, o["token_ids"], o["error"]))
        return JSONResponse(base | {"choices": choices,
                                    "usage": usage(prompt_tokens, sum(len(o["token_ids"]) for o in outs))})


def _logprobs(ctx: "AppContext", body: P.CompletionRequest, prompt_ids: list[int], o: dict, gen_offset: int):
    """A non-streamed choice's logprobs object (None without `logprobs`); with echo, the prompt's first."""
    if body.logprobs is None:
        return None
    if body.echo and o["prompt_lps"] is not None:
        return echo_logprobs(ctx.token_text, prompt_ids, o["prompt_lps"], o["token_ids"], o["lps"], gen_offset)
    return completion_logprobs(ctx.token_text, o["token_ids"], o["lps"], gen_offset)


def _prompts(body: P.CompletionRequest, n: int, best_of: int) -> list:
    """The request's prompts as a list (one string or token-id list each), within the limits."""
    if best_of < n:
        raise ApiError(400, f"best_of={best_of} must be >= n={n}", "best_of")
    if body.stream and best_of != n:
        raise ApiError(400, f"best_of={best_of}: with stream=true best_of must equal n={n}", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens=0: only with echo=true (the prompt scored alone)", "max_tokens")
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ApiError(400, "prompt: must not be empty", "prompt")
    if len(prompts) > P.MAX_PROMPTS:
        raise ApiError(400, f"prompt: {len(prompts)} prompts, at most {P.MAX_PROMPTS} per request", "prompt")
    if len(prompts) * best_of > P.MAX_CHOICES:
        raise ApiError(400, f"n={n}, best_of={best_of} over {len(prompts)} prompts ask for "
                            f"{len(prompts) * best_of} sequences; at most {P.MAX_CHOICES}", "n")
    return prompts


class _StreamedChoice:
    """A streamed completion choice's text and logprobs, delta by delta: choice i's first text
    is preceded by `echo_of[i]` (and with echo and logprobs, its first logprobs by those of the prompt
    `ids_of[i]`), and logprob text offsets count from the start of its text."""

    def __init__(self, ctx: "AppContext", body: P.CompletionRequest, echo_of: list[str], ids_of: list[list[int]]):
        self.ctx, self.body, self.echo_of, self.ids_of = ctx, body, echo_of, ids_of
        self.offsets: list[int | None] = [None] * len(echo_of)  # None: nothing sent yet

    def __call__(self, i: int, d) -> dict:
        text, first = d.text, self.offsets[i] is None
        if first:
            text, self.offsets[i] = self.echo_of[i] + text, len(self.echo_of[i])
        if self.body.logprobs is None:
            return {"text": text, "logprobs": None}
        ids, lps = ([d.token_id], [(d.logprob, d.top_logprobs or [])]) if d.token_id is not None else ([], [])
        if first and self.body.echo and d.prompt_logprobs is not None:
            logprobs = echo_logprobs(self.ctx.token_text, self.ids_of[i], d.prompt_logprobs, ids, lps, self.offsets[i])
        else:
            logprobs = completion_logprobs(self.ctx.token_text, ids, lps, self.offsets[i]) if ids else None
        if ids:
            self.offsets[i] += len(self.ctx.token_text(d.token_id)[0])
        return {"text": text, "logprobs": logprobs}
