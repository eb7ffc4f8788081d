"""Bounded work before a request is admitted: body size, JSON depth, text that cannot be encoded.

- `BodyLimit` (ASGI middleware): a body larger than `max_bytes` gets HTTP 413 at once when its
  Content-Length says so, else as soon as the bytes received pass the limit; nothing of it is kept,
  so memory does not grow with what a client sends.
- `refuse` answers such a request (and a 401) without losing the answer: the response goes out at
  once, then up to `DRAIN_BYTES` more of the body are read and dropped, for at most
  `DRAIN_SECONDS`, before the connection closes. A client that reads while it uploads (curl, a
  blocking client) reads the answer at once; one that finishes its upload first (an async httpx
  client) reads it after the drain. Closing on unread bytes would send a reset, and that client
  would lose the answer; a body beyond the drain bound still ends that way, so a huge body ties
  up nothing but its own connection, for a bounded time.
- `parse_json`: JSON nested deeper than `MAX_DEPTH` and strings holding lone UTF-16 surrogates
  (`"\\ud800"`: valid JSON, not encodable text) are refused with 400, naming the field.
- `context.py` also cuts a text prompt that is too long to fit before tokenizing it: no token of
  the tokenizer covers more than `max_token_bytes` UTF-8 bytes, so a prompt longer than
  `max_model_len * max_token_bytes` bytes cannot fit; tokenization runs on a worker thread.
"""
from __future__ import annotations

import asyncio
import json
import logging

from .protocol import error_body

MAX_DEPTH = 32
DRAIN_BYTES = 64 * 1024 * 1024  # of a refused body, read and dropped at most (after the answer is sent)
DRAIN_SECONDS = 10.0  # for at most this long
log = logging.getLogger("engram_serve.server")


class BodyLimit:
    """ASGI middleware: a request whose Content-Length is over `max_bytes` gets 413 before any of
    its body is read; a body without one (chunked) gets 413 once the bytes received pass the limit
    (the app's read of the body raises `BodyTooLarge`, which ends here)."""

    def __init__(self, app, max_bytes: int, drain_bytes: int = DRAIN_BYTES, drain_seconds: float = DRAIN_SECONDS):
        self.app, self.max_bytes = app, max_bytes
        self.drain = dict(drain_bytes=drain_bytes, drain_seconds=drain_seconds)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                return await refuse(receive, send, 400, error_body(f"Content-Length {length[:40]!r} is not an integer"),
                                    **self.drain)
            if size > self.max_bytes:
                return await refuse(receive, send, 413, too_large(size, self.max_bytes), **self.drain)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(received, message.get("more_body", False))
            return message

        try:
            await self.app(scope, counted, send)
        except BodyTooLarge as e:
            await refuse(receive if e.more_body else None, send, 413, too_large(e.size, self.max_bytes),
                         **self.drain)


class BodyTooLarge(Exception):
    """The body passed the limit after `size` bytes; `more_body`: the client has more to send."""

    def __init__(self, size: int, more_body: bool):
        super().__init__(f"request body over the limit after {size} bytes")
        self.size, self.more_body = size, more_body


def too_large(size: int, limit: int) -> dict:
    return error_body(f"the request body ({size} bytes or more) is larger than the limit of {limit} bytes "
                      f"(--max-body-bytes)", None, "request_too_large")


async def refuse(receive, send, status: int, body: dict, drain_bytes: int = DRAIN_BYTES,
                 drain_seconds: float = DRAIN_SECONDS) -> None:
    """Answer `status` with the JSON `body` and `Connection: close` at once, then drain what is left
    of the request body (`receive` None: nothing is) before the answer ends and the connection
    closes. The whole answer is on the wire before the drain: its Content-Length delimits it."""
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data, "more_body": receive is not None})
    if receive is not None:
        await _drain(receive, drain_bytes, drain_seconds)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive, max_bytes: int, seconds: float) -> None:
    """Read and drop request-body messages until the body ends, the client leaves, `max_bytes` were
    read or `seconds` passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while max_bytes > 0:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        max_bytes -= len(message.get("body", b""))


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
