"""What `/openapi.json` publishes beyond FastAPI's own: the request schemas (the bodies are parsed
by hand, to bound the work before validation), the SSE event of `stream=true`, the error bodies,
and `model` / `model_id` restricted to the served model's name."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .protocol import ErrorResponse

if TYPE_CHECKING:
    from fastapi import FastAPI

# with stream=true: each server-sent event is `data: <one chunk as JSON>` or `data: [DONE]`
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}},
             "description": "one server-sent event: a JSON chunk of the response, or [DONE]"}
ERRORS = {s: {"model": ErrorResponse} for s in (400, 401, 404, 413, 500, 503)}


def request_body(model) -> dict:
    """`openapi_extra` naming `model` as the JSON request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def post_route(app: "FastAPI", path: str, request_model, response_model):
    """The decorator of a generation endpoint: JSON in, JSON or SSE out, OpenAI errors."""
    return app.post(path, openapi_extra=request_body(request_model), responses={
        200: {"model": response_model, "content": {"text/event-stream": {"schema": SSE_EVENT}}}, **ERRORS})


def publish_schemas(app: "FastAPI", models, model_name: str) -> None:
    """Put the request models into /openapi.json's components, next to the response models FastAPI
    adds itself; `model` can only be this server's model name."""
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
