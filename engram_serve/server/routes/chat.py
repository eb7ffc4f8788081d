"""POST /v1/chat/completions: messages rendered by the chat template, `n`, `logprobs` /
`top_logprobs`; plain JSON or SSE (`generation.stream_response`, after one opening chunk per
choice that carries the assistant role)."""
from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING

from .. import protocol as P
from ..generation import choice_extra, collect_all, generation_route, start_all, stream_response, usage
from ..http_errors import ApiError
from ..logprobs import chat_logprobs

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..context import AppContext


def register(app: "FastAPI", ctx: "AppContext") -> None:
    from fastapi.responses import JSONResponse

    @generation_route(app, ctx, "/v1/chat/completions", P.ChatCompletionRequest, P.ChatCompletionResponse)
    async def chat_completions(request, body: P.ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: only allowed with logprobs=true", "top_logprobs")
        rename = {"prompt": "messages"}  # the engine's field names -> this endpoint's
        if body.max_tokens is None and body.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        text = ctx.render_chat(body.messages, body.add_generation_prompt)
        prompt_ids = await ctx.tokenize(text, "messages", add_special_tokens=False)  # the template holds the BOS
        if len(prompt_ids) >= ctx.max_len and body.max_tokens is None and body.max_completion_tokens is None:
            raise ApiError(400, f"messages: the prompt rendered from them has {len(prompt_ids)} tokens; the model "
                                f"allows {ctx.max_len} tokens including at least one generated", "messages")
        top_n = body.top_logprobs or 0
        streams = await start_all(ctx, [prompt_ids], body, rename, top_n if body.logprobs else None, body.n)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": ctx.model_name}

        def logprobs(ids: list[int], lps: list) -> dict | None:
            return chat_logprobs(ctx.token_text, ids, lps, top_n) if body.logprobs else None

        if body.stream:
            def fields(i: int, d) -> dict:
                return {"delta": {"content": d.text} if d.text or not d.finished else {},
                        "logprobs": None if d.token_id is None else
                        logprobs([d.token_id], [(d.logprob, d.top_logprobs or [])])}
            opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(len(streams))]
            return stream_response(body, streams, base, len(prompt_ids), fields, opening)

        outs = await collect_all(ctx, request, streams)
        choices = []
        for i, o in enumerate(outs):
            c = {"index": i, "message": {"role": "assistant", "content": o["text"]},
                 "logprobs": logprobs(o["token_ids"], o["lps"]), "finish_reason": o["finish_reason"]}
            choices.append(c | choice_extra(body, o["token_ids"], o["error"]))
        return JSONResponse(base | {"object": "chat.completion", "choices": choices,
                                    "usage": usage(len(prompt_ids), sum(len(o["token_ids"]) for o in outs))})
