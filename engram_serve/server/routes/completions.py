"""POST /v1/completions: text or token-id prompts (one or a list), `n` / `best_of`, `echo`,
`logprobs`; plain JSON or SSE (`generation.stream_response`)."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from .. import protocol as P
from ..generation import choice_extra, collect_all, generation_route, pick, start_all, stream_response, usage
from ..http_errors import ApiError
from ..logprobs import completion_logprobs

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
        streams = await start_all(ctx, ids_list, body, None, lp, best_of)
        prompt_tokens = sum(map(len, ids_list))
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": ctx.model_name}
        if body.stream:
            echo_of = [echo_text[i // n] if body.echo else "" for i in range(len(streams))]
            return stream_response(body, streams, base, prompt_tokens, _StreamedChoice(ctx, body, echo_of))

        outs = pick(await collect_all(ctx, request, streams), n, best_of)
        choices = []
        for i, o in enumerate(outs):
            prefix = echo_text[i // n] if body.echo else ""
            c = {"index": i, "text": prefix + o["text"], "finish_reason": o["finish_reason"],
                 "logprobs": completion_logprobs(ctx.token_text, o["token_ids"], o["lps"], len(prefix))
                 if body.logprobs is not None else None}
            choices.append(c | choice_extra(body, o["token_ids"], o["error"]))
        return JSONResponse(base | {"choices": choices,
                                    "usage": usage(prompt_tokens, sum(len(o["token_ids"]) for o in outs))})


def _prompts(body: P.CompletionRequest, n: int, best_of: int) -> list:
    """The request's prompts as a list (one string or token-id list each), within the limits."""
    if best_of < n:
        raise ApiError(400, f"best_of={best_of} must be >= n={n}", "best_of")
    if body.stream and best_of != n:
        raise ApiError(400, f"best_of={best_of}: with stream=true best_of must equal n={n}", "best_of")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "echo=true with logprobs: prompt logprobs are not supported", "echo")
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
    is preceded by `echo_of[i]`, and logprob text offsets count from the start of its text."""

    def __init__(self, ctx: "AppContext", body: P.CompletionRequest, echo_of: list[str]):
        self.ctx, self.body, self.echo_of = ctx, body, echo_of
        self.offsets: list[int | None] = [None] * len(echo_of)  # None: nothing sent yet

    def __call__(self, i: int, d) -> dict:
        text = d.text
        if self.offsets[i] is None:
            text, self.offsets[i] = self.echo_of[i] + text, len(self.echo_of[i])
        logprobs = None
        if d.token_id is not None and self.body.logprobs is not None:
            logprobs = completion_logprobs(self.ctx.token_text, [d.token_id], [(d.logprob, d.top_logprobs or [])],
                                           self.offsets[i])
            self.offsets[i] += len(self.ctx.token_text(d.token_id)[0])
        return {"text": text, "logprobs": logprobs}
