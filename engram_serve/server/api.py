"""OpenAI-compatible HTTP server over an `AsyncLLMEngine`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with or without SSE streaming:
`data: {...}\\n\\n` chunks, then `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus text).

Bad input (malformed JSON, a missing or wrongly typed field, an out-of-range value, a prompt longer
than the model allows, a token id outside the vocabulary, n != 1) gets HTTP 400 with the OpenAI
error body `{"error": {"message", "type": "invalid_request_error", "param", "code"}}`, where
`param` names the field. It is refused before it reaches the batch. A request whose logits turn
non-finite ends alone with finish_reason "error" and an `error` object in its choice (HTTP 200:
the status line is sent before generation when streaming, so both modes report it the same way).
A client that disconnects has its request aborted (KV blocks and history freed).
"""

import argparse
import asyncio
import json
import logging
import re
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator

from ..errors import InvalidRequest

log = logging.getLogger("engram_serve.server")

if TYPE_CHECKING:  # fastapi, pydantic and torch load in the functions, so the CLI parser stays light
    from fastapi import FastAPI

    from ..engine.async_engine import AsyncLLMEngine
    from .protocol import ChatMessage

_PARAMS = ("prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
           "stop_token_ids", "stop", "ignore_eos", "n", "model", "stream")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


def _param_of(message: str) -> str | None:
    """The request field an InvalidRequest message names first (messages start with the field)."""
    found = [(m.start(), p) for p in _PARAMS for m in [re.search(rf"(?<![\w.]){p}(?![\w])", message)] if m]
    return min(found)[1] if found else None


def _invalid(e: Exception, rename: dict[str, str] | None = None) -> ApiError:
    """400 for an InvalidRequest; `rename` maps engine field names to this endpoint's (prompt -> messages)."""
    message, param = str(e), _param_of(str(e))
    new = (rename or {}).get(param, param)
    if new != param and message.startswith(f"{param}:"):
        message = f"{new} ({param}): {message[len(param) + 1:].lstrip()}"
    return ApiError(400, message, new)


# ---- chat template ------------------------------------------------------------------------------

DEFAULT_ROLES = ("<|system|>", "<|user|>", "<|assistant|>", "<|endoftext|>")


class ChatTemplate:
    """messages -> prompt text. The `chat_template` of a `tokenizer_config.json` beside the model
    (rendered with jinja2 in a sandbox) if there is one; else the built-in default
    `<|role|>\\n{content}<|endoftext|>\\n` per message, then `<|assistant|>\\n`."""

    def __init__(self, tokenizer, model_dir: Path | None):
        self.source, self._jinja, self.tokens = "default", None, {}
        cfg_path = model_dir / "tokenizer_config.json" if model_dir is not None else None
        if cfg_path is not None and cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            template = cfg.get("chat_template")
            if isinstance(template, list):  # HF allows [{"name": "default", "template": ...}, ...]
                template = next((t["template"] for t in template if t.get("name") == "default"), None)
            if isinstance(template, str):
                from jinja2.sandbox import ImmutableSandboxedEnvironment
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                self._jinja, self.source = env.from_string(template), str(cfg_path)
                self.tokens = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token")}
        if self._jinja is None:
            missing = [t for t in DEFAULT_ROLES if tokenizer.token_to_id(t) is None]
            if missing:
                self.source = None
                self.missing = missing

    def render(self, messages: list["ChatMessage"]) -> str:
        if self.source is None:
            raise InvalidRequest(f"messages: this model has no chat template (no tokenizer_config.json chat_template "
                                 f"and the tokenizer lacks {self.missing}); use /v1/completions")
        if self._jinja is not None:
            return self._jinja.render(messages=[{"role": m.role, "content": m.text()} for m in messages],
                                      add_generation_prompt=True, **{k: v or "" for k, v in self.tokens.items()})
        parts = [f"<|{'system' if m.role == 'developer' else m.role}|>\n{m.text()}<|endoftext|>\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"


def _token_text(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


# ---- the app --------------------------------------------------------------------------------------

def build_app(async_engine: "AsyncLLMEngine", model_name: str, *, own_engine: bool = False,
              disconnect_poll_s: float = 0.25) -> "FastAPI":
    """The FastAPI app. With `own_engine`, the app's shutdown shuts the engine down."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from pydantic import BaseModel, ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .protocol import ChatCompletionRequest, CompletionRequest, error_body, unsupported_field

    @asynccontextmanager
    async def lifespan(app: "FastAPI"):
        yield
        if own_engine:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="engram-serve", lifespan=lifespan)
    engine = async_engine
    tokenizer = engine.tokenizer
    loaded = engine.engine.loaded
    chat = ChatTemplate(tokenizer, getattr(loaded, "path", None))
    max_len = min(engine.engine.cfg.max_model_len, engine.engine.cfg.num_blocks * engine.engine.cfg.block_size)
    created = int(time.time())

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
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", type_="server_error"),
                            status_code=500)

    async def parse(request: Request, model: type[BaseModel]):
        raw = await request.body()
        try:
            data = json.loads(raw, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise _from_pydantic(e.errors()) from None
        if body.n != 1:
            raise ApiError(400, f"n={body.n}: only n=1 is supported", "n")
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")
        bad = unsupported_field(body)
        if bad:
            raise ApiError(400, f"{bad[0]}={bad[1]!r} is not supported by this server", bad[0])
        return body

    def sampling(body, prompt_len: int, rename: dict[str, str] | None = None):
        from ..sampling_params import SamplingParams
        kwargs = body.sampling_kwargs()
        if kwargs.get("max_tokens") is None:  # chat: the rest of the context
            kwargs["max_tokens"] = max(1, max_len - prompt_len)
        try:
            return SamplingParams(**kwargs)
        except (InvalidRequest, TypeError, ValueError) as e:
            raise _invalid(e, rename) from None

    async def start(prompt_ids: list[int], params, rename: dict[str, str] | None = None):
        try:
            return await engine.add_request(prompt_ids, params, f"req-{uuid.uuid4().hex}")
        except InvalidRequest as e:
            raise _invalid(e, rename) from None
        except RuntimeError as e:  # shut down
            raise ApiError(503, str(e), type_="server_error") from None

    async def collect(request: Request, stream) -> dict | None:
        """Run a non-streaming request to the end; None if the client went away (then it is aborted)."""
        async def run():
            out = {"text": [], "token_ids": [], "finish_reason": None, "error": None}
            async for d in stream:
                out["text"].append(d.text)
                if d.token_id is not None:
                    out["token_ids"].append(d.token_id)
                if d.finished:
                    out["finish_reason"], out["error"] = d.finish_reason, d.error
            out["text"] = "".join(out["text"])
            return out

        task = asyncio.ensure_future(run())
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
            await stream.aclose()

    def usage(prompt_len: int, n: int) -> dict:
        return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}

    def choice_extra(body, token_ids: list[int], error: str | None) -> dict:
        extra = {}
        if body.return_token_ids:
            extra["token_ids"] = token_ids
        if error is not None:
            extra["error"] = {"message": error, "type": "engine_error"}
        return extra

    async def sse(stream, body, prompt_len: int, first: list[dict], make_chunk) -> AsyncIterator[str]:
        """SSE lines: the `first` chunks, one chunk per delta, an optional usage chunk, [DONE]."""
        n = 0
        try:
            for c in first:
                yield _sse(c)
            async for d in stream:
                n += d.token_id is not None
                yield _sse(make_chunk(d))
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse(make_chunk(None) | {"choices": [], "usage": usage(prompt_len, n)})
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # a disconnect cancels us here: the request is aborted

    # ---- endpoints ----
    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse(request, CompletionRequest)
        prompt_ids = tokenizer.encode(body.prompt).ids if isinstance(body.prompt, str) else list(body.prompt)
        params = sampling(body, len(prompt_ids))
        stream = await start(prompt_ids, params)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": now, "model": model_name}

        if body.stream:
            def chunk(d):
                if d is None:
                    return dict(base)
                c = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
                c |= choice_extra(body, [] if d.token_id is None else [d.token_id], d.error)
                return base | {"choices": [c]}
            return StreamingResponse(sse(stream, body, len(prompt_ids), [], chunk), media_type="text/event-stream")

        out = await collect(request, stream)
        if out is None:
            return Response(status_code=499)
        c = {"index": 0, "text": out["text"], "logprobs": None, "finish_reason": out["finish_reason"]}
        c |= choice_extra(body, out["token_ids"], out["error"])
        return JSONResponse(base | {"choices": [c], "usage": usage(len(prompt_ids), len(out["token_ids"]))})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
        rename = {"prompt": "messages", "max_tokens": "max_tokens"}
        if body.max_tokens is None and body.max_completion_tokens is not None:
            rename["max_tokens"] = "max_completion_tokens"
        try:
            prompt_ids = tokenizer.encode(chat.render(body.messages)).ids
        except InvalidRequest as e:
            raise _invalid(e) from None
        except Exception as e:  # a template that fails to render on these messages
            raise ApiError(400, f"messages: the chat template failed: {type(e).__name__}: {e}", "messages") from None
        if len(prompt_ids) >= max_len and body.max_tokens is None and body.max_completion_tokens is None:
            raise ApiError(400, f"messages: the prompt rendered from them has {len(prompt_ids)} tokens; the model "
                                f"allows {max_len} tokens including at least one generated", "messages")
        params = sampling(body, len(prompt_ids), rename)
        stream = await start(prompt_ids, params, rename)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name}

        if body.stream:
            def chunk(d):
                if d is None:
                    return dict(base)
                delta = {"content": d.text} if d.text or not d.finished else {}
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": d.finish_reason}
                c |= choice_extra(body, [] if d.token_id is None else [d.token_id], d.error)
                return base | {"choices": [c]}
            first = [base | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}]
            return StreamingResponse(sse(stream, body, len(prompt_ids), first, chunk), media_type="text/event-stream")

        out = await collect(request, stream)
        if out is None:
            return Response(status_code=499)
        c = {"index": 0, "message": {"role": "assistant", "content": out["text"]}, "logprobs": None,
             "finish_reason": out["finish_reason"]}
        c |= choice_extra(body, out["token_ids"], out["error"])
        return JSONResponse(base | {"object": "chat.completion", "choices": [c],
                                    "usage": usage(len(prompt_ids), len(out["token_ids"]))})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "engram-serve", "max_model_len": max_len}]}

    @app.get("/health")
    async def health():
        alive = engine.is_running
        return JSONResponse({"status": "ok" if alive else "down"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.metrics()), media_type="text/plain; version=0.0.4")

    return app


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _from_pydantic(errors: list[dict]) -> ApiError:
    """400 naming the first bad field (`messages.0.role`); a JSON decode error has no field."""
    if errors[0].get("type") == "json_invalid":
        e = errors[0]
        return ApiError(400, f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")

    def path(e: dict) -> list[str]:
        # pydantic puts a union member's type in the location (`prompt.str`); keep the field path
        return [str(p) for p in e.get("loc", ()) if p != "body" and not re.fullmatch(
            r"(str|int|float|bool|list\[.*\]|function-.*|Strict.*|nullable\[.*\]|union\[.*\])", str(p))]

    # of the first bad field's errors, the deepest: for [1, true] "prompt.1: not an integer", not "not a string"
    first = path(errors[0])[:1]
    e = max((x for x in errors if path(x)[:1] == first), key=lambda x: len(path(x)))
    param = ".".join(path(e)) or None
    what = f"{param}: " if param else ""
    got = f" (got {e['input']!r})" if "input" in e and e.get("type") != "missing" and len(repr(e["input"])) < 80 else ""
    return ApiError(400, f"{what}{e.get('msg', 'invalid value')}{got}", param)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, allow_nan=False, ensure_ascii=False)}\n\n"


_METRICS = (  # name, type, help, key in AsyncLLMEngine.metrics()
    ("engram_requests_running", "gauge", "Requests scheduled in the running batch.", "requests_running"),
    ("engram_requests_waiting", "gauge", "Requests waiting for a slot or KV blocks.", "requests_waiting"),
    ("engram_kv_blocks_used", "gauge", "KV-cache blocks held by live requests.", "kv_blocks_used"),
    ("engram_kv_blocks_total", "gauge", "KV-cache blocks in the pool.", "kv_blocks_total"),
    ("engram_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.", "kv_cache_usage"),
    ("engram_generated_tokens_total", "counter", "Tokens sampled.", "generated_tokens_total"),
    ("engram_prompt_tokens_total", "counter", "Prompt tokens computed (prefill).", "prompt_tokens_total"),
    ("engram_generation_tokens_per_second", "gauge", "Sampled tokens per second over the last 10 s.",
     "generation_tokens_per_second"),
    ("engram_requests_total", "counter", "Requests accepted.", "requests_total"),
    ("engram_steps_total", "counter", "Engine steps run.", "steps_total"),
    ("engram_microbatched_steps_total", "counter", "Steps split into more than one microbatch.",
     "microbatched_steps_total"),
    ("engram_straddling_rows_total", "counter", "Rows cut by a microbatch boundary.", "straddling_rows_total"),
    ("engram_preemptions_total", "counter", "Requests preempted (KV blocks dropped, recomputed later).",
     "preemptions_total"),
    ("engram_request_errors_total", "counter", "Requests ended by non-finite logits.", "request_errors_total"),
)


def prometheus_text(m: dict) -> str:
    lines = []
    for name, kind, help_, key in _METRICS:
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(m.get(key, 0)):g}"]
    return "\n".join(lines) + "\n"


# ---- running it -------------------------------------------------------------------------------------

class BackgroundServer:
    """uvicorn on a loopback socket in a daemon thread (tests, benchmarks). The socket is bound
    before the thread starts, so `base_url` is valid at once (port 0 = a free port)."""

    def __init__(self, app: "FastAPI", host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="engram-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.base_url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(model_path: str | Path | None = None, host: str = "127.0.0.1", port: int = 8000, *,
          model_name: str | None = None, log_level: str = "info", enable_prefix_caching: bool = True,
          **runner_options) -> None:
    """Load the model (with a progress bar), start the engine thread and serve until interrupted."""
    import uvicorn

    from ..engine.async_engine import AsyncLLMEngine
    from ..llm import build_engine
    engine = build_engine(model_path, enable_prefix_caching=enable_prefix_caching, progress=True, **runner_options)
    name = model_name or f"engram-{engine.loaded.path.name}"
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, name, own_engine=True)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=5))

    def fatal(message: str) -> None:  # engine thread: e.g. a tensor-parallel worker died
        log.error("engine stopped: %s; shutting the server down", message)
        server.should_exit = True
    async_engine.on_fatal = fatal
    cluster = getattr(engine.runner, "cluster", None)
    if cluster is not None:  # a worker that dies while the server is idle stops it too
        cluster.on_death = async_engine.fail
    try:
        server.run()
    finally:
        async_engine.shutdown()
    if async_engine.fatal_error is not None:
        from ..errors import EngineFailed
        raise EngineFailed(f"the server shut down: {async_engine.fatal_error}")


# ---- CLI: engram-serve serve --------------------------------------------------------------------------

def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a TCP port (0..65535)")
    return v


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from ..bench.common import positive_int
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--model", type=Path, default=None, metavar="PATH",
                        help="checkpoint directory (default: the built-in tiny model)")
    parser.add_argument("--model-name", default=None, metavar="NAME",
                        help="the name clients use in `model` (default: engram-<checkpoint directory name>)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64, metavar="N",
                        help="requests in the running batch at most (default 64)")
    parser.add_argument("--ubatches", type=positive_int, default=2, metavar="N",
                        help="microbatches per large step (default 2: dual-batch overlap; 1 = off)")
    from ..parallel.options import add_parallel_args
    add_parallel_args(parser)


def run_serve(args: argparse.Namespace) -> int:
    from ..inputs.ubatch import SplitConfig
    from ..parallel.options import engine_options
    serve(args.model, args.host, args.port, model_name=args.model_name, max_num_seqs=args.max_num_seqs,
          split=SplitConfig(num_ubatches=args.ubatches), **engine_options(args))
    return 0
