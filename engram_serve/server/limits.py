"""Bounded work before a request is admitted: body size, JSON depth, text that cannot be encoded.

- `BodyLimit` (ASGI middleware): a body larger than `max_bytes` gets HTTP 413 at once when its
  Content-Length says so, else as soon as the bytes received pass the limit; the rest is never
  read or kept, so memory does not grow with what a client sends.
- `parse_json`: JSON nested deeper than `MAX_DEPTH` and strings holding lone UTF-16 surrogates
  (`"\\ud800"`: valid JSON, not encodable text) are refused with 400, naming the field.
- `api.py` also cuts a text prompt that is too long to fit before tokenizing it: no token of the
  tokenizer covers more than `max_token_bytes` UTF-8 bytes, so a prompt longer than
  `max_model_len * max_token_bytes` bytes cannot fit; tokenization runs on a worker thread.
"""
from __future__ import annotations

import json
import logging

from .protocol import error_body

MAX_DEPTH = 32
log = logging.getLogger("engram_serve.server")


class BodyLimit:
    """ASGI middleware: a request whose Content-Length is over `max_bytes` gets 413 before any of
    its body is read. (A body without Content-Length is counted as it arrives, by `read_body`.)"""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope.get("headers") or ()).get(b"content-length")
            if length is not None:
                try:
                    size = int(length)
                except ValueError:
                    return await _reply(send, 400, error_body(f"Content-Length {length[:40]!r} is not an integer"))
                if size > self.max_bytes:
                    return await _reply(send, 413, too_large(size, self.max_bytes))
        return await self.app(scope, receive, send)


def too_large(size: int, limit: int) -> dict:
    return error_body(f"the request body ({size} bytes or more) is larger than the limit of {limit} bytes "
                      f"(--max-body-bytes)", None, "request_too_large")


async def _reply(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


class BadJson(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def parse_json(raw: bytes):
    """The JSON value of a request body, or BadJson (malformed, too deep, unencodable text)."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise BadJson(f"malformed JSON body: JSON nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadJson(f"malformed JSON body: {e}") from None
    check(data)
    return data


def check(data) -> None:
    """Depth <= MAX_DEPTH and no lone surrogates, iteratively (no recursion on hostile input)."""
    stack = [(data, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            field = path.split(".")[0] or None
            raise BadJson(f"{field + ': ' if field else ''}JSON nested deeper than {MAX_DEPTH} levels", field)
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, path)
                if isinstance(v, (dict, list, str)):
                    stack.append((v, depth + 1, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if isinstance(v, (dict, list, str)):
                    stack.append((v, depth + 1, f"{path}.{i}"))


def _check_text(s: str, path: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadJson(f"{path or 'body'}: text holds a lone UTF-16 surrogate ({s[e.start]!r} at character "
                          f"{e.start}); send valid Unicode", path or None) from None
