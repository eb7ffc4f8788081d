"""OpenAI-compatible HTTP server over an `AsyncLLMEngine` (FastAPI).

Endpoints: POST /v1/completions and /v1/chat/completions (plain JSON or SSE: `data: {...}\\n\\n`
chunks, then `data: [DONE]`), GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize,
GET /version, /health and /metrics (Prometheus, `metrics.py`). `/openapi.json` publishes every
request and response schema.

Bad input gets an HTTP 4xx with the OpenAI error body `{"error": {"message", "type", "param",
"code"}}`, `param` naming the field, before anything reaches the batch: malformed or too deeply
nested JSON, unencodable text, a body over the size limit (413), an unknown field, an OpenAI field
this server does not implement (`protocol.REFUSED`), a wrongly typed or out-of-range value, a prompt
longer than the model allows (cut before tokenizing when its bytes alone prove it), a token id
outside the tokenizer. With an API key set, every path but /health and /metrics answers 401
without it. A request whose logits turn non-finite, or whose rows make the forward raise, ends
alone with finish_reason "error" and an `error` object in its choice. A client that disconnects
has its request aborted (KV blocks and history freed).

`n` / `best_of`: each choice is its own engine request; with a `seed`, choice j samples with
seed + j (choice 0 is the same request sent alone). `best_of` > n returns the n choices of highest
cumulative logprob. Logprobs are the log-softmax of the model's logits for the token (see
`runner/sampler.py`).
"""

import asyncio
import logging
import reprlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

from ..errors import InvalidRequest
from .limits import BadJson, BodyLimit, parse_json, too_large
from .protocol import MAX_CHOICES, MAX_PROMPTS, ErrorResponse, error_body

if TYPE_CHECKING:  # fastapi and torch load in the functions
    from fastapi import FastAPI

    from ..engine.async_engine import AsyncLLMEngine

log = logging.getLogger("engram_serve.server")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_PARAMS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
           "seed", "stop_token_ids", "stop", "ignore_eos", "n", "best_of", "model", "stream", "stream_options",
           "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
           "top_logprobs", "echo", "tokens")
_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist = 60, 60, 6


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _param_of(message: str) -> str | None:
    """The request field an InvalidRequest message names first (messages start with the field)."""
    import re
    found = [(m.start(), p) for p in _PARAMS for m in [re.search(rf"(?<![\w.]){p}(?![\w])", message)] if m]
    return min(found)[1] if found else None


def _invalid(e: Exception, rename: dict[str, str] | None = None) -> ApiError:
    """400 for an InvalidRequest; `rename` maps engine field names to this endpoint's (prompt -> messages)."""
    message, param = str(e), _param_of(str(e))
    new = (rename or {}).get(param, param)
    if new != param and message.startswith(f"{param}"):
        message = f"{new} ({param}){message[len(param):]}"
    return ApiError(400, message, new)


def _from_pydantic(errors: list[dict]) -> ApiError:
    """400 naming the first bad field (`messages.0.role`)."""
    import re

    def path(e: dict) -> list[str]:
        # pydantic puts a union member's type in the location (`prompt.str`); keep the field path
        return [str(p) for p in e.get("loc", ()) if p != "body" and not re.fullmatch(
            r"(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*|Strict.*|nullable\[.*\]|union\[.*\]|"
            r"constrained-.*)", str(p))]

    # of the first bad field's errors: those of the union member that fits best (fewest errors),
    # the deepest, preferring a value error over "not of this type"
    first = path(errors[0])[:1]
    mine = [x for x in errors if path(x)[:1] == first]

    def member(x: dict):
        loc = [str(p) for p in x.get("loc", ()) if p != "body"]
        return loc[1] if len(loc) > 1 and loc[1] not in path(x) else None

    count: dict = {}
    for x in mine:
        count[member(x)] = count.get(member(x), 0) + 1
    e = max(mine, key=lambda x: (-count[member(x)], len(path(x)),
                                 not str(x.get("type", "")).endswith(("_type", "_parsing"))))
    param = ".".join(path(e)) or None
    what = f"{param}: " if param else ""
    if e.get("type") == "extra_forbidden":
        return ApiError(400, f"{what}unknown field: this server does not implement it", param)
    msg = e.get("msg", "invalid value")
    if e.get("type") == "finite_number" or (isinstance(e.get("input"), float) and e["input"] != e["input"]):
        msg = "must be a finite number"
    got = f" (got {_SHORT.repr(e['input'])})" if "input" in e and e.get("type") != "missing" else ""
    return ApiError(400, f"{what}{msg}{got}", param)


def _sse(obj: dict) -> str:
    import json
    return f"data: {json.dumps(obj, allow_nan=False, ensure_ascii=False)}\n\n"


def _wrap64(v: int) -> int:
    return (v + 2 ** 63) % 2 ** 64 - 2 ** 63


class TokenText:
    """Token id -> the text OpenAI's logprobs show, and its UTF-8 bytes. For a byte-level BPE token
    that is part of a character, the text is `bytes:\\xNN...` (as vLLM writes it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_of = None
        dec = tokenizer.decoder
        if dec is not None and type(dec).__name__ == "ByteLevel":
            self._byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            raw = self.tokenizer.id_to_token(token) or ""
            if self._byte_of is not None and all(c in self._byte_of for c in raw):
                data = bytes(self._byte_of[c] for c in raw)
            else:
                data = text.encode("utf-8", "surrogatepass")
            if "\ufffd" in text:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
            hit = self._cache[token] = (text, list(data))
        return hit


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# ---- the app --------------------------------------------------------------------------------------

def build_app(async_engine: "AsyncLLMEngine", model_name: str, *, own_engine: bool = False,
              disconnect_poll_s: float = 0.25, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template=None) -> "FastAPI":
    """The FastAPI app. With `own_engine`, the app's shutdown shuts the engine down.
    `chat_template`: a template file (else tokenizer_config.json's, else the built-in one)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel, ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    from .. import __version__
    from ..sampling_params import SamplingParams
    from . import protocol as P
    from .chat_template import ChatTemplate
    from .metrics import CONTENT_TYPE, ServerMetrics

    engine = async_engine
    tokenizer = engine.tokenizer
    ecfg = engine.engine.cfg
    chat = ChatTemplate(tokenizer, getattr(engine.engine.loaded, "path", None), chat_template)
    max_len = min(ecfg.max_model_len, ecfg.num_blocks * ecfg.block_size)
    num_ids = engine.engine.num_token_ids
    texts = tokenizer.decode_batch([[i] for i in range(num_ids)], skip_special_tokens=False)
    max_token_bytes = max(len(t.encode("utf-8", "surrogatepass")) for t in texts) or 1
    max_prompt_bytes = max_len * max(max_token_bytes, 4)
    token_text = TokenText(tokenizer)
    created = int(time.time())
    metrics = ServerMetrics(engine)
    tok_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-tokenize")

    @asynccontextmanager
    async def lifespan(app: "FastAPI"):
        yield
        tok_pool.shutdown(wait=False, cancel_futures=True)
        if own_engine:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="engram-serve", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(_ApiKey, key=api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(error_body(e.message, e.param, e.code, e.type), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):  # FastAPI would say 422
        err = _from_pydantic(e.errors())
        return JSONResponse(error_body(err.message, err.param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), type_=kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type_="server_error"),
                            status_code=500)

    async def read_body(request: Request) -> bytes:
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body_bytes:
                    raise ApiError(413, too_large(size, max_body_bytes)["error"]["message"], code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            log.info("client %s disconnected while sending its request body (%d bytes received)",
                     request.client.host if request.client else "?", size)
            raise _Gone() from None
        return b"".join(chunks)

    async def parse(request: Request, model: type[BaseModel]):
        raw = await read_body(request)
        try:
            data = parse_json(raw)
        except BadJson as e:
            raise ApiError(400, str(e), e.param) from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise _from_pydantic(e.errors()) from None
        name = getattr(body, "model", None)
        if name is not None and name != model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")
        refused = body.refused_field() if hasattr(body, "refused_field") else None
        if refused:
            raise ApiError(400, f"{refused[0]}={_SHORT.repr(refused[1])}: not supported by this server", refused[0])
        return body

    def render_chat(messages, add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages`; a failure is a 400 naming `messages`."""
        try:
            return chat.render(messages, add_generation_prompt)
        except InvalidRequest as e:
            raise _invalid(e) from None
        except Exception as e:  # a template that fails to render on these messages
            raise ApiError(400, f"messages: the chat template failed: {type(e).__name__}: {e}", "messages") from None

    async def tokenize(text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize on the worker thread, after the byte-length cut."""
        size = len(text.encode("utf-8"))
        if size > max_prompt_bytes:
            raise ApiError(400, f"{param}: {size} bytes of text cannot fit the model's max_model_len={max_len} "
                                f"tokens (no token covers more than {max_token_bytes} bytes)", param)
        loop = asyncio.get_running_loop()
        enc = await loop.run_in_executor(
            tok_pool, lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return enc.ids

    def sampling(body, prompt_len: int, rename: dict[str, str] | None, logprobs: int | None, j: int):
        kwargs = body.sampling_kwargs()
        given = body.model_fields_set
        mt = body.max_tokens if ("max_tokens" in given or body.max_completion_tokens is None) else None
        mct = body.max_completion_tokens
        if mt is not None and mct is not None and "max_tokens" in given and mt != mct:
            raise ApiError(400, f"max_completion_tokens={mct} and max_tokens={mt} disagree; give one",
                           "max_completion_tokens")
        kwargs["max_tokens"] = mct if mct is not None else mt
        if kwargs["max_tokens"] is None:  # chat: the rest of the context
            kwargs["max_tokens"] = max(1, max_len - prompt_len)
        if body.seed is not None:
            kwargs["seed"] = _wrap64(body.seed + j)
        kwargs["logprobs"] = logprobs
        try:
            return SamplingParams(**kwargs)
        except (InvalidRequest, TypeError, ValueError) as e:
            raise _invalid(e, rename) from None

    async def start_all(prompts: list[list[int]], body, rename, logprobs, per_prompt: int):
        """One engine request per (prompt, choice); on any refusal the started ones are aborted."""
        streams = []
        try:
            for ids in prompts:
                for j in range(per_prompt):
                    params = sampling(body, len(ids), rename, logprobs, j)
                    try:
                        streams.append(await engine.add_request(ids, params, f"req-{uuid.uuid4().hex}"))
                    except InvalidRequest as e:
                        raise _invalid(e, rename) from None
                    except RuntimeError as e:  # shut down
                        raise ApiError(503, str(e), type_="server_error") from None
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        return streams

    async def collect_all(request: Request, streams) -> list[dict] | None:
        """Run every stream to its end; None if the client went away (then all are aborted)."""
        async def run(stream):
            out = {"text": [], "token_ids": [], "lps": [], "finish_reason": None, "error": None}
            async for d in stream:
                out["text"].append(d.text)
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
                done, _ = await asyncio.wait({task}, timeout=disconnect_poll_s)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
            for s in streams:
                await s.aclose()

    def usage(prompt_tokens: int, n: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}

    def choice_extra(body, token_ids: list[int], error: str | None) -> dict:
        extra = {}
        if body.return_token_ids:
            extra["token_ids"] = token_ids
        if error is not None:
            extra["error"] = {"message": error, "type": "engine_error"}
        return extra

    def completion_logprobs(ids: list[int], lps: list, offset: int) -> dict:
        tokens, offsets = [], []
        for t in ids:
            offsets.append(offset)
            s = token_text(t)[0]
            tokens.append(s)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{token_text(i)[0]: v for i, v in top} for _, top in lps], "text_offset": offsets}

    def chat_logprobs(ids: list[int], lps: list, top_n: int) -> dict:
        content = []
        for t, (lp, top) in zip(ids, lps):
            s, b = token_text(t)
            content.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": [
                {"token": token_text(i)[0], "logprob": v, "bytes": token_text(i)[1]} for i, v in top[:top_n]]})
        return {"content": content}

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

    async def merged(streams, first_text: list[str]) -> AsyncIterator[tuple[int, object]]:
        """(choice index, delta) from every stream, as they come; the first delta of choice i is
        preceded by `first_text[i]` (echo)."""
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

    def check_stream_options(body) -> None:
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options: only allowed with stream=true", "stream_options")

    # ---- endpoints ----
    def post(path: str, request_model, response_model):
        return app.post(path, openapi_extra=_request_body(request_model), responses={
            200: {"model": response_model, "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
            **_ERRORS})

    @post("/v1/completions", P.CompletionRequest, P.CompletionResponse)
    async def completions(request: Request):
        try:
            body: P.CompletionRequest = await parse(request, P.CompletionRequest)
        except _Gone:
            return Response(status_code=499)
        check_stream_options(body)
        n, best_of = body.n, body.best_of or body.n
        if best_of < n:
            raise ApiError(400, f"best_of={best_of} must be >= n={n}", "best_of")
        if body.stream and best_of != n:
            raise ApiError(400, f"best_of={best_of}: with stream=true best_of must equal n={n}", "best_of")
        if body.echo and body.logprobs is not None:
            raise ApiError(400, "echo=true with logprobs: prompt logprobs are not supported", "echo")
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: {len(prompt)} prompts, at most {MAX_PROMPTS} per request", "prompt")
        if len(prompt) * best_of > MAX_CHOICES:
            raise ApiError(400, f"n={n}, best_of={best_of} over {len(prompt)} prompts ask for "
                                f"{len(prompt) * best_of} sequences; at most {MAX_CHOICES}", "n")
        ids_list, echo_text = [], []
        for i, p in enumerate(prompt):
            param = "prompt" if len(prompt) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                ids_list.append(await tokenize(p, param))
                echo_text.append(p)
            else:
                ids_list.append(list(p))
                echo_text.append(tokenizer.decode(list(p), skip_special_tokens=False) if body.echo else "")
        lp = body.logprobs if body.logprobs is not None else (0 if best_of > n else None)
        streams = await start_all(ids_list, body, None, lp, best_of)
        prompt_tokens = sum(map(len, ids_list))
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": now, "model": model_name}
        echo_of = [echo_text[i // n] if body.echo else "" for i in range(len(streams))]

        if body.stream:
            async def events():
                counts, offsets, started = [0] * len(streams), [0] * len(streams), [False] * len(streams)
                async for i, d in merged(streams, echo_of):
                    text = d.text
                    if not started[i]:
                        started[i], text = True, echo_of[i] + text
                        offsets[i] = len(echo_of[i])
                    c = {"index": i, "text": text, "logprobs": None, "finish_reason": d.finish_reason}
                    if d.token_id is not None:
                        counts[i] += 1
                        if body.logprobs is not None:
                            c["logprobs"] = completion_logprobs([d.token_id], [(d.logprob, d.top_logprobs or [])],
                                                                offsets[i])
                            offsets[i] += len(token_text(d.token_id)[0])
                    c |= choice_extra(body, [] if d.token_id is None else [d.token_id], d.error)
                    yield _sse(base | {"choices": [c]})
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield _sse(base | {"choices": [], "usage": usage(prompt_tokens, sum(counts))})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        outs = await collect_all(request, streams)
        if outs is None:
            return Response(status_code=499)
        outs = pick(outs, n, best_of)
        choices = []
        for i, o in enumerate(outs):
            prefix = echo_text[i // n] if body.echo else ""
            c = {"index": i, "text": prefix + o["text"], "finish_reason": o["finish_reason"],
                 "logprobs": completion_logprobs(o["token_ids"], o["lps"], len(prefix))
                 if body.logprobs is not None else None}
            choices.append(c | choice_extra(body, o["token_ids"], o["error"]))
        return JSONResponse(base | {"choices": choices,
                                    "usage": usage(prompt_tokens, sum(len(o["token_ids"]) for o in outs))})

    @post("/v1/chat/completions", P.ChatCompletionRequest, P.ChatCompletionResponse)
    async def chat_completions(request: Request):
        try:
            body: P.ChatCompletionRequest = await parse(request, P.ChatCompletionRequest)
        except _Gone:
            return Response(status_code=499)
        check_stream_options(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs: only allowed with logprobs=true", "top_logprobs")
        rename = {"prompt": "messages"}
        if body.max_tokens is None and body.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        text = render_chat(body.messages, body.add_generation_prompt)
        prompt_ids = await tokenize(text, "messages", add_special_tokens=False)  # the template holds the BOS
        if len(prompt_ids) >= max_len and body.max_tokens is None and body.max_completion_tokens is None:
            raise ApiError(400, f"messages: the prompt rendered from them has {len(prompt_ids)} tokens; the model "
                                f"allows {max_len} tokens including at least one generated", "messages")
        top_n = body.top_logprobs or 0
        streams = await start_all([prompt_ids], body, rename, top_n if body.logprobs else None, body.n)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name}

        if body.stream:
            async def events():
                counts = [0] * len(streams)
                for i in range(len(streams)):
                    yield _sse(base | {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                async for i, d in merged(streams, [""] * len(streams)):
                    delta = {"content": d.text} if d.text or not d.finished else {}
                    c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": d.finish_reason}
                    if d.token_id is not None:
                        counts[i] += 1
                        if body.logprobs:
                            c["logprobs"] = chat_logprobs([d.token_id], [(d.logprob, d.top_logprobs or [])], top_n)
                    c |= choice_extra(body, [] if d.token_id is None else [d.token_id], d.error)
                    yield _sse(base | {"choices": [c]})
                if body.stream_options is not None and body.stream_options.include_usage:
                    yield _sse(base | {"choices": [], "usage": usage(len(prompt_ids), sum(counts))})
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        outs = await collect_all(request, streams)
        if outs is None:
            return Response(status_code=499)
        choices = []
        for i, o in enumerate(outs):
            c = {"index": i, "message": {"role": "assistant", "content": o["text"]},
                 "logprobs": chat_logprobs(o["token_ids"], o["lps"], top_n) if body.logprobs else None,
                 "finish_reason": o["finish_reason"]}
            choices.append(c | choice_extra(body, o["token_ids"], o["error"]))
        return JSONResponse(base | {"object": "chat.completion", "choices": choices,
                                    "usage": usage(len(prompt_ids), sum(len(o["token_ids"]) for o in outs))})

    def card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "engram-serve",
                "max_model_len": max_len}

    @app.get("/v1/models", response_model=P.ModelList, responses=_ERRORS)
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id}", response_model=P.ModelCard, responses=_ERRORS)
    async def model(model_id: str):
        if model_id != model_name:
            raise ApiError(404, f"model {model_id!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")
        return card()

    @app.post("/tokenize", openapi_extra=_request_body(P.TokenizeRequest),
              responses={200: {"model": P.TokenizeResponse}, **_ERRORS})
    async def tokenize_endpoint(request: Request):
        try:
            body: P.TokenizeRequest = await parse(request, P.TokenizeRequest)
        except _Gone:
            return Response(status_code=499)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            ids = await tokenize(body.prompt, "prompt", body.add_special_tokens)
        else:
            ids = await tokenize(render_chat(body.messages), "messages", False)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})

    @app.post("/detokenize", openapi_extra=_request_body(P.DetokenizeRequest),
              responses={200: {"model": P.DetokenizeResponse}, **_ERRORS})
    async def detokenize(request: Request):
        try:
            body: P.DetokenizeRequest = await parse(request, P.DetokenizeRequest)
        except _Gone:
            return Response(status_code=499)
        for i, t in enumerate(body.tokens):
            if not 0 <= t < num_ids:
                raise ApiError(400, f"tokens.{i}: token id {t} is outside the tokenizer's ids [0, {num_ids})",
                               f"tokens.{i}")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

    @app.get("/version", response_model=P.VersionResponse, responses=_ERRORS)
    async def version():
        return {"version": __version__}

    @app.get("/health", response_model=P.HealthResponse, responses={503: {"model": P.HealthResponse}})
    async def health():
        alive = engine.is_running
        return JSONResponse({"status": "ok" if alive else "down"}, status_code=200 if alive else 503)

    @app.get("/metrics", responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}},
             response_class=Response)
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    _publish_schemas(app, [P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest, P.DetokenizeRequest],
                     model_name)
    app.state.metrics = metrics
    return app


class _Gone(Exception):
    """The client disconnected while sending its body (already logged in one line)."""


def _ref(model) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _request_body(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _ref(model)}}}}


# with stream=true: each server-sent event is `data: <one chunk as JSON>` or `data: [DONE]`
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
              "description": "one server-sent event: a JSON chunk of the response, or [DONE]"}
_ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 500, 503)}


def _publish_schemas(app, models, model_name: str) -> None:
    """Put the request models (parsed by hand, to bound the work before validation) into
    /openapi.json's components, next to the response models FastAPI adds itself; `model` can only
    be this server's model name."""
    original = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        for m in models:
            s = m.model_json_schema(ref_template="#/components/schemas/{model}")
            comps.update(s.pop("$defs", {}))
            if "model" in s.get("properties", {}):
                s["properties"]["model"] = {"anyOf": [{"const": model_name}, {"type": "null"}], "default": None}
            comps[m.__name__] = s
        for op in schema.get("paths", {}).values():
            for method in op.values():
                for prm in method.get("parameters", []):
                    if prm.get("name") == "model_id":
                        prm["schema"] = {"type": "string", "enum": [model_name]}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


class _ApiKey:
    """ASGI middleware: `Authorization: Bearer <key>` is required on every path but /health and
    /metrics; otherwise 401 with an OpenAI error body."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in self.OPEN:
            import hmac
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(auth.encode(), f"Bearer {self.key}".encode()):
                from .limits import _reply
                return await _reply(send, 401, error_body("missing or wrong API key (Authorization: Bearer <key>)",
                                                          None, "invalid_api_key"))
        return await self.app(scope, receive, send)
