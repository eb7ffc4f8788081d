"""`AppContext`: what every endpoint of one app shares (engine, tokenizer, limits, metrics, the
served name), built once by `build_app`, and the request-side steps they all take: parse a body,
render chat messages, tokenize text within the model's limits."""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidRequest
from .http_errors import SHORT, ApiError, ClientGone, from_invalid, from_pydantic
from .limits import BadJson, parse_json

if TYPE_CHECKING:
    from fastapi import Request
    from pydantic import BaseModel

    from ..engine.async_engine import AsyncLLMEngine
    from .chat_template import ChatTemplate
    from .logprobs import TokenText
    from .metrics import ServerMetrics

log = logging.getLogger("engram_serve.server")


@dataclass
class AppContext:
    """One app's shared state. `max_len` is the most tokens a request may hold (max_model_len, or
    the whole KV cache if smaller). `max_prompt_bytes = max_len * max(max_token_bytes, 4)`: no
    token covers more than `max_token_bytes` UTF-8 bytes, so a longer text cannot fit and is
    refused before tokenizing. Tokenization runs on `tok_pool`'s one worker thread."""

    engine: "AsyncLLMEngine"
    model_name: str
    chat: "ChatTemplate"
    max_len: int
    num_ids: int  # token ids are [0, num_ids): the tokenizer's
    max_token_bytes: int
    max_prompt_bytes: int
    token_text: "TokenText"
    metrics: "ServerMetrics"
    tok_pool: ThreadPoolExecutor
    created: int  # the model card's time
    disconnect_poll_s: float  # how often a non-streaming request checks that its client is there

    @classmethod
    def build(cls, engine: "AsyncLLMEngine", model_name: str, chat_template=None,
              disconnect_poll_s: float = 0.25) -> "AppContext":
        from .chat_template import ChatTemplate
        from .logprobs import TokenText
        from .metrics import ServerMetrics
        tokenizer, ecfg = engine.tokenizer, engine.engine.cfg
        max_len = min(ecfg.max_model_len, ecfg.num_blocks * ecfg.block_size)
        num_ids = engine.engine.num_token_ids
        texts = tokenizer.decode_batch([[i] for i in range(num_ids)], skip_special_tokens=False)
        max_token_bytes = max(len(t.encode("utf-8", "surrogatepass")) for t in texts) or 1
        return cls(engine, model_name, ChatTemplate(tokenizer, getattr(engine.engine.loaded, "path", None),
                                                    chat_template),
                   max_len, num_ids, max_token_bytes, max_len * max(max_token_bytes, 4), TokenText(tokenizer),
                   ServerMetrics(engine), ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-tokenize"),
                   int(time.time()), disconnect_poll_s)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        self.tok_pool.shutdown(wait=False, cancel_futures=True)

    def card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "engram-serve",
                "max_model_len": self.max_len}

    def check_model(self, name: str | None, param: str = "model") -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.model_name!r}", param,
                           "model_not_found")

    async def parse(self, request: "Request", model: type["BaseModel"]):
        """The body as `model`: JSON (bounded depth, encodable text), then the schema, this server's
        model name and no field it refuses; else an ApiError naming the field."""
        from pydantic import ValidationError
        try:
            data = parse_json(await _read_body(request))
        except BadJson as e:
            raise ApiError(400, str(e), e.param) from None
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            raise from_pydantic(e.errors()) from None
        self.check_model(getattr(body, "model", None))
        refused = body.refused_field() if hasattr(body, "refused_field") else None
        if refused:
            raise ApiError(400, f"{refused[0]}={SHORT.repr(refused[1])}: not supported by this server", refused[0])
        return body

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages`; a failure is a 400 naming `messages`."""
        try:
            return self.chat.render(messages, add_generation_prompt)
        except InvalidRequest as e:
            raise from_invalid(e) from None
        except Exception as e:  # a template that fails to render on these messages
            raise ApiError(400, f"messages: the chat template failed: {type(e).__name__}: {e}", "messages") from None

    async def tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize on the worker thread, after the byte-length cut."""
        size = len(text.encode("utf-8"))
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"{param}: {size} bytes of text cannot fit the model's max_model_len={self.max_len} "
                                f"tokens (no token covers more than {self.max_token_bytes} bytes)", param)
        loop = asyncio.get_running_loop()
        enc = await loop.run_in_executor(
            self.tok_pool, lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return enc.ids


async def _read_body(request: "Request") -> bytes:
    """The whole body (its size is bounded by `limits.BodyLimit` as it arrives)."""
    from starlette.requests import ClientDisconnect
    chunks = []
    try:
        async for chunk in request.stream():
            chunks.append(chunk)
    except ClientDisconnect:
        log.info("client %s disconnected while sending its request body (%d bytes received)",
                 request.client.host if request.client else "?", sum(map(len, chunks)))
        raise ClientGone() from None
    return b"".join(chunks)
