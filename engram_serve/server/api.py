"""The OpenAI-compatible HTTP app over an `AsyncLLMEngine` (FastAPI): `build_app`.

Endpoints, by module of `routes/`: `completions` (POST /v1/completions), `chat` (POST
/v1/chat/completions), both plain JSON or SSE (`generation.py`: `data: {...}\\n\\n` chunks, then
`data: [DONE]`); `misc` (GET /v1/models and /v1/models/{id}, POST /tokenize and /detokenize, GET
/version and /health); `metrics` (GET /metrics, Prometheus). They share one `AppContext`
(`context.py`). `/openapi.json` publishes every request and response schema (`openapi.py`).

Bad input gets an HTTP 4xx with the OpenAI error body `{"error": {"message", "type", "param",
"code"}}` (`http_errors.py`), `param` naming the field, before anything reaches the batch: malformed
or too deeply nested JSON, unencodable text, a body over the size limit (413, `limits.py`), an
unknown field, an OpenAI field this server does not implement (`protocol.REFUSED`), a wrongly typed
or out-of-range value, a prompt longer than the model allows (cut before tokenizing when its bytes
alone prove it), a token id outside the tokenizer. A full waiting queue answers 503 (retry later).
With an API key set, every path but /health and /metrics answers 401 without it (`auth.py`). A
request whose logits turn non-finite, or whose rows make the forward raise, ends alone with
finish_reason "error" and an `error` object in its choice. A client that disconnects has its
request aborted (KV blocks and history freed).
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from .context import AppContext
from .limits import BodyLimit

if TYPE_CHECKING:  # fastapi and torch load in the functions
    from fastapi import FastAPI

    from ..engine.async_engine import AsyncLLMEngine

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


def build_app(async_engine: "AsyncLLMEngine", model_name: str, *, own_engine: bool = False,
              disconnect_poll_s: float = 0.25, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, chat_template=None) -> "FastAPI":
    """The FastAPI app. With `own_engine`, the app's shutdown shuts the engine down.
    `chat_template`: a template file (else tokenizer_config.json's, else the built-in one)."""
    from fastapi import FastAPI

    from .. import __version__
    from . import http_errors
    from . import protocol as P
    from .auth import ApiKey
    from .openapi import publish_schemas
    from .routes import chat, completions, metrics, misc

    ctx = AppContext.build(async_engine, model_name, chat_template, disconnect_poll_s)

    @asynccontextmanager
    async def lifespan(app: "FastAPI"):
        yield
        ctx.close()
        if own_engine:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="engram-serve", version=__version__, lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    http_errors.install(app)
    for family in (completions, chat, misc, metrics):
        family.register(app, ctx)
    publish_schemas(app, [P.CompletionRequest, P.ChatCompletionRequest, P.TokenizeRequest, P.DetokenizeRequest],
                    model_name)
    app.state.metrics = ctx.metrics
    return app
