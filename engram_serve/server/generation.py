"""Running the requests of /v1/completions and /v1/chat/completions: one engine request per
(prompt, choice), their streams collected (plain JSON) or merged into one server-sent-event stream
(`stream=true`: `data: {...}\\n\\n` chunks, then `data: [DONE]`), written once for both endpoints.

`n` / `best_of`: each choice is its own engine request; with a `seed`, choice j samples with
seed + j (choice 0 is the same request sent alone). `best_of` > n keeps the n choices of highest
cumulative logprob (`pick`).
"""
# (no `from __future__ import annotations`: FastAPI reads an endpoint's `request: Request` annotation
# as a class, and that class is imported inside the function that defines the endpoint)

import asyncio
import json
import uuid
from typing import TYPE_CHECKING, AsyncIterator, Callable

from ..errors import InvalidRequest, QueueFull
from .http_errors import ApiError, ClientGone, from_invalid

if TYPE_CHECKING:
    from fastapi import FastAPI, Request
    from starlette.responses import StreamingResponse

    from ..engine.async_engine import RequestStream
    from ..sampling_params import SamplingParams
    from .context import AppContext


def _wrap64(v: int) -> int:
    return (v + 2 ** 63) % 2 ** 64 - 2 ** 63


def generation_route(app: "FastAPI", ctx: "AppContext", path: str, request_model, response_model):
    """Decorator: `handler(request, body)` becomes the endpoint POST `path`, its body parsed as
    `request_model` (`stream_options` only with `stream`), answering `response_model` or SSE."""
    from fastapi import Request

    from .openapi import post_route

    def register(handler):
        async def endpoint(request: Request):
            body = await ctx.parse(request, request_model)
            if body.stream_options is not None and not body.stream:
                raise ApiError(400, "stream_options: only allowed with stream=true", "stream_options")
            return await handler(request, body)
        endpoint.__name__ = handler.__name__  # the operationId in /openapi.json
        post_route(app, path, request_model, response_model)(endpoint)
        return handler
    return register


def sampling(ctx: "AppContext", body, prompt_len: int, rename: dict[str, str] | None, logprobs: int | None,
             j: int, prompt_logprobs: int | None = None) -> "SamplingParams":
    """The SamplingParams of choice `j` of a prompt of `prompt_len` tokens (seed + j)."""
    from ..sampling_params import SamplingParams
    kwargs = body.sampling_kwargs()
    given = body.model_fields_set
    mt = body.max_tokens if ("max_tokens" in given or body.max_completion_tokens is None) else None
    mct = body.max_completion_tokens
    if mt is not None and mct is not None and "max_tokens" in given and mt != mct:
        raise ApiError(400, f"max_completion_tokens={mct} and max_tokens={mt} disagree; give one",
                       "max_completion_tokens")
    kwargs["max_tokens"] = mct if mct is not None else mt
    if kwargs["max_tokens"] is None:  # chat: the rest of the context
        kwargs["max_tokens"] = max(1, ctx.max_len - prompt_len)
    if body.seed is not None:
        kwargs["seed"] = _wrap64(body.seed + j)
    kwargs["logprobs"] = logprobs
    kwargs["prompt_logprobs"] = prompt_logprobs
    try:
        return SamplingParams(**kwargs)
    except (InvalidRequest, TypeError, ValueError) as e:
        raise from_invalid(e, rename) from None


async def start_all(ctx: "AppContext", prompts: list[list[int]], body, rename: dict[str, str] | None,
                    logprobs: int | None, per_prompt: int, prompt_logprobs: int | None = None) -> list["RequestStream"]:
    """One engine request per (prompt, choice); on any refusal the started ones are aborted."""
    streams = []
    try:
        for ids in prompts:
            for j in range(per_prompt):
                params = sampling(ctx, body, len(ids), rename, logprobs, j, prompt_logprobs)
                try:
                    streams.append(await ctx.engine.add_request(ids, params, f"req-{uuid.uuid4().hex}"))
                except QueueFull as e:  # overloaded: the client may retry
                    raise ApiError(503, str(e), code="queue_full", type_="server_error") from None
                except InvalidRequest as e:
                    raise from_invalid(e, rename) from None
                except RuntimeError as e:  # shut down
                    raise ApiError(503, str(e), type_="server_error") from None
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams


async def collect_all(ctx: "AppContext", request: "Request", streams) -> list[dict]:
    """Run every stream to its end: per stream {text, token_ids, lps, prompt_lps, finish_reason, error}.
    ClientGone if the client went away (then all are aborted)."""
    async def run(stream):
        out = {"text": [], "token_ids": [], "lps": [], "prompt_lps": None, "finish_reason": None, "error": None}
        async for d in stream:
            out["text"].append(d.text)
            if d.prompt_logprobs is not None:
                out["prompt_lps"] = d.prompt_logprobs
            if d.token_id is not None:
                out["token_ids"].append(d.token_id)
                out["lps"].append((d.logprob, d.top_logprobs or []))
            if d.finished:
                out["finish_reason"], out["error"] = d.finish_reason, d.error
        out["text"] = "".join(out["text"])
        return out

    task = asyncio.ensure_future(asyncio.gather(*(run(s) for s in streams)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=ctx.disconnect_poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
        for s in streams:
            await s.aclose()


def pick(outs: list[dict], n: int, per_prompt: int) -> list[dict]:
    """Per prompt, the n choices of highest cumulative logprob (all of them when best_of == n)."""
    if per_prompt == n:
        return outs
    picked = []
    for i in range(0, len(outs), per_prompt):
        group = outs[i:i + per_prompt]
        order = sorted(range(len(group)), key=lambda j: (-sum(lp for lp, _ in group[j]["lps"]), j))
        picked += [group[j] for j in order[:n]]
    return picked


def usage(prompt_tokens: int, n: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


def choice_extra(body, token_ids: list[int], error: str | None) -> dict:
    """A choice's optional fields: its token ids (`return_token_ids`), its error."""
    extra = {}
    if body.return_token_ids:
        extra["token_ids"] = token_ids
    if error is not None:
        extra["error"] = {"message": error, "type": "engine_error"}
    return extra


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, allow_nan=False, ensure_ascii=False)}\n\n"


def stream_response(body, streams, base: dict, prompt_tokens: int, fields: Callable[[int, object], dict],
                    opening: list[dict] = ()) -> "StreamingResponse":
    """The SSE answer: a chunk per choice of `opening`, then a chunk per delta of any stream, as they
    come: {index, **fields(index, delta), finish_reason, token_ids?, error?}; the usage chunk if
    `stream_options.include_usage`; `[DONE]`. A client that goes away aborts every stream."""
    from starlette.responses import StreamingResponse

    async def events():
        for c in opening:
            yield sse(base | {"choices": [c]})
        counts = [0] * len(streams)
        async for i, d in _merged(streams):
            c = {"index": i, **fields(i, d), "finish_reason": d.finish_reason}
            if d.token_id is not None:
                counts[i] += 1
            c |= choice_extra(body, [] if d.token_id is None else [d.token_id], d.error)
            yield sse(base | {"choices": [c]})
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse(base | {"choices": [], "usage": usage(prompt_tokens, sum(counts))})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _merged(streams) -> AsyncIterator[tuple[int, object]]:
    """(choice index, delta) from every stream, as they come; closing this closes every stream."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for d in s:
                await q.put((i, d))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(streams)
        while live:
            i, d = await q.get()
            if d is None:
                live -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()
