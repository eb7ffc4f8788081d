"""GET /v1/models and /v1/models/{id}; POST /tokenize and /detokenize, GET /tokenizer_info (vLLM's shapes:
evaluation harnesses such as lm-evaluation-harness tokenize through them); GET /version and /health."""
# (no `from __future__ import annotations`: FastAPI reads an endpoint's `request: Request` annotation
# as a class, and that class is imported inside the function that defines the endpoint)

from typing import TYPE_CHECKING

from .. import protocol as P
from ..http_errors import ApiError
from ..openapi import ERRORS, request_body

if TYPE_CHECKING:
    from fastapi import FastAPI

    from ..context import AppContext


def register(app: "FastAPI", ctx: "AppContext") -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from ... import __version__

    @app.get("/v1/models", response_model=P.ModelList, responses=ERRORS)
    async def models():
        return {"object": "list", "data": [ctx.card()]}

    @app.get("/v1/models/{model_id}", response_model=P.ModelCard, responses=ERRORS)
    async def model(model_id: str):
        ctx.check_model(model_id)
        return ctx.card()

    @app.post("/tokenize", openapi_extra=request_body(P.TokenizeRequest),
              responses={200: {"model": P.TokenizeResponse}, **ERRORS})
    async def tokenize_endpoint(request: Request):
        body: P.TokenizeRequest = await ctx.parse(request, P.TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if body.prompt is not None:
            ids = await ctx.tokenize(body.prompt, "prompt", body.add_special_tokens)
        else:
            ids = await ctx.tokenize(ctx.render_chat(body.messages), "messages", False)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx.max_len})

    @app.post("/detokenize", openapi_extra=request_body(P.DetokenizeRequest),
              responses={200: {"model": P.DetokenizeResponse}, **ERRORS})
    async def detokenize(request: Request):
        body: P.DetokenizeRequest = await ctx.parse(request, P.DetokenizeRequest)
        for i, t in enumerate(body.tokens):
            if not 0 <= t < ctx.num_ids:
                raise ApiError(400, f"tokens.{i}: token id {t} is outside the tokenizer's ids [0, {ctx.num_ids})",
                               f"tokens.{i}")
        return JSONResponse({"prompt": ctx.tokenizer.decode(body.tokens, skip_special_tokens=False)})

    @app.get("/tokenizer_info", response_model=P.TokenizerInfo, responses=ERRORS)
    async def tokenizer_info():
        cfg = ctx.engine.engine.loaded.config
        text = lambda i: ctx.tokenizer.id_to_token(i)  # noqa: E731
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": text(cfg.eos_token_id),
                "bos_token": text(cfg.bos_token_id), "pad_token": None, "model_max_length": ctx.max_len}

    @app.get("/version", response_model=P.VersionResponse, responses=ERRORS)
    async def version():
        return {"version": __version__}

    @app.get("/health", response_model=P.HealthResponse, responses={503: {"model": P.HealthResponse}})
    async def health():
        alive = ctx.engine.is_running
        return JSONResponse({"status": "ok" if alive else "down"}, status_code=200 if alive else 503)
