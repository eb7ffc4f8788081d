"""OpenAI-style request bodies (pydantic) and the error body.

Types are strict: a string where a number is expected, a float where an integer is expected, a
bool where a token id is expected, NaN or Infinity anywhere: each is refused, naming the field.
Value ranges (max_tokens, top_p, ...) are checked by `SamplingParams`, the one place they live.
Unknown fields are ignored, as OpenAI-compatible servers do, except the ones listed in
`UNSUPPORTED` when they ask for something this server does not do.
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]  # JSON 1 and 1.0 are both fine for a float field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None  # extension (not in OpenAI's API)
    seed: Optional[StrictInt] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None  # extension
    ignore_eos: Optional[StrictBool] = None  # extension
    stream: StrictBool = False
    stream_options: Optional["StreamOptions"] = None
    n: StrictInt = 1
    return_token_ids: StrictBool = False  # extension: each choice / chunk also carries its token ids

    def sampling_kwargs(self) -> dict:
        """The SamplingParams keyword arguments that were given (the rest keep SamplingParams' defaults)."""
        out = {k: getattr(self, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
               if getattr(self, k) is not None}
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class CompletionRequest(_Body):
    prompt: Union[StrictStr, list[StrictInt]] = Field(...)
    max_tokens: Optional[StrictInt] = 16  # OpenAI's default for completions


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[StrictInt] = None  # newer OpenAI name of max_tokens

    def sampling_kwargs(self) -> dict:
        out = super().sampling_kwargs()
        if self.max_completion_tokens is not None and self.max_tokens is None:
            out["max_tokens"] = self.max_completion_tokens
        return out


# fields OpenAI defines that this server does not implement: (field, the values that are fine)
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
}


def unsupported_field(body: BaseModel) -> tuple[str, object] | None:
    """The first extra field that asks for a feature this server lacks, with its value."""
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
            return name, value
    return None


def error_body(message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_Body.model_rebuild()
