"""HTTP errors as OpenAI error bodies `{"error": {"message", "type", "param", "code"}}`.

`ApiError` is what endpoints raise (`ClientGone` when the client left); `from_invalid` turns an
`InvalidRequest` into one (its `param` is the exception's own), `from_pydantic` a validation
failure (the first bad field's path, e.g. `messages.0.role`). `install` registers the handlers that write every error, FastAPI's own
included (a 422 of FastAPI's becomes a 400), in that shape.
"""
from __future__ import annotations

import logging
import re
import reprlib
from typing import TYPE_CHECKING

from .protocol import error_body

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("engram_serve.server")
SHORT = reprlib.Repr()  # values shown in messages
SHORT.maxstring, SHORT.maxother, SHORT.maxlist = 60, 60, 6

# pydantic puts a union member's type in an error's location (`prompt.str`); these are not fields
_NOT_A_FIELD = re.compile(r"(str|int|float|bool|list\[.*\]|dict\[.*\]|function-.*|Strict.*|nullable\[.*\]|"
                          r"union\[.*\]|constrained-.*)")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


class ClientGone(Exception):
    """The client went away (while sending its body, or before its answer was ready); answered
    with 499, which nobody reads."""


def from_invalid(e: Exception, rename: dict[str, str] | None = None) -> ApiError:
    """400 naming the InvalidRequest's `param`; `rename` maps engine field names to this endpoint's
    (prompt -> messages), and the message then names both."""
    message, param = str(e), getattr(e, "param", None)
    new = (rename or {}).get(param, param)
    if new != param and message.startswith(param):
        message = f"{new} ({param}){message[len(param):]}"
    return ApiError(400, message, new)


def from_pydantic(errors: list[dict]) -> ApiError:
    """400 naming the first bad field (`messages.0.role`)."""
    def path(e: dict) -> list[str]:
        return [str(p) for p in e.get("loc", ()) if p != "body" and not _NOT_A_FIELD.fullmatch(str(p))]

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
    got = f" (got {SHORT.repr(e['input'])})" if "input" in e and e.get("type") != "missing" else ""
    return ApiError(400, f"{what}{msg}{got}", param)


def install(app: "FastAPI") -> None:
    """Every error the app answers with, as an OpenAI error body."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse(error_body(e.message, e.param, e.code, e.type), status_code=e.status)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):  # FastAPI would say 422
        err = from_pydantic(e.errors())
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
