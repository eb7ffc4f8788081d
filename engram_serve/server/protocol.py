"""OpenAI-style request and response bodies (pydantic), the error body, and the field tables.

Types are strict: a string where a number is expected, a float where an integer is expected, a
bool where a token id is expected, NaN or Infinity anywhere: each is refused, naming the field.
Value ranges that sampling depends on are checked again by `SamplingParams` (the one place they
live for the Python API too). A field this server does not know is refused with a 400 naming it,
and so is a known OpenAI field it does not implement (`REFUSED`), unless it carries that field's
"off" value; nothing is silently ignored.

The response models are what `/openapi.json` publishes; the endpoints build plain dicts of the
same shape.
"""
from __future__ import annotations

from typing import Any, Generic, Literal, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat  # JSON 1 and 1.0 are both fine for a float field; "1", true and NaN are not
TokenIds = list[StrictInt]
MAX_N = 16  # n and best_of, each
MAX_CHOICES = 256  # prompts x best_of per request
MAX_PROMPTS = 64  # prompts in one request (a prompt list)

# OpenAI fields this server does not implement: name -> the values that mean "off" (accepted)
REFUSED: dict[str, tuple] = {
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None,), "response_format": (None, {"type": "text"}),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "service_tier": (None, "auto", "default"), "store": (None, False),
    "metadata": (None,), "verbosity": (None,),
}
_REFUSED_DOC = "Not supported: any value other than null (or this field's 'off' value) is refused with HTTP 400."


def _refused(default=None):
    return Field(default, description=_REFUSED_DOC, json_schema_extra={"type": "null"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Body(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = Field(None, ge=1, le=2 ** 63 - 1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1, le=2 ** 63 - 1)
    temperature: Optional[Number] = Field(None, ge=0)
    top_p: Optional[Number] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=-1, le=2 ** 63 - 1, description="extension; 0 or -1 = off")
    min_p: Optional[Number] = Field(None, ge=0, le=1, description="extension")
    seed: Optional[StrictInt] = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stop_token_ids: Optional[list[StrictInt]] = Field(None, description="extension")
    ignore_eos: Optional[StrictBool] = Field(None, description="extension")
    min_tokens: Optional[StrictInt] = Field(None, ge=0, le=2 ** 63 - 1, description="extension")
    presence_penalty: Optional[Number] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[Number] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[Number] = Field(None, ge=0.01, le=100, description="extension")
    logit_bias: Optional[dict[str, Number]] = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = Field(None, description="accepted, not used")
    return_token_ids: StrictBool = Field(False, description="extension: each choice / chunk also carries its token ids")
    tools: Optional[Any] = _refused()
    tool_choice: Optional[Any] = _refused()
    functions: Optional[Any] = _refused()
    function_call: Optional[Any] = _refused()
    parallel_tool_calls: Optional[Any] = _refused()
    response_format: Optional[Any] = _refused()
    audio: Optional[Any] = _refused()
    modalities: Optional[Any] = _refused()
    prediction: Optional[Any] = _refused()
    reasoning_effort: Optional[Any] = _refused()
    web_search_options: Optional[Any] = _refused()
    service_tier: Optional[Any] = _refused()
    store: Optional[Any] = _refused()
    metadata: Optional[Any] = _refused()
    verbosity: Optional[Any] = _refused()

    def refused_field(self) -> tuple[str, object] | None:
        """The first field that asks for a feature this server lacks, with its value."""
        for name, off in REFUSED.items():
            if name in type(self).model_fields:
                value = getattr(self, name)
                if value not in off:
                    return name, value
        return None

    def sampling_kwargs(self) -> dict:
        """The SamplingParams keyword arguments that were given (the rest keep SamplingParams' defaults)."""
        out = {k: getattr(self, k) for k in ("temperature", "top_p", "min_p", "seed", "ignore_eos", "min_tokens",
                                               "presence_penalty", "frequency_penalty", "repetition_penalty")
               if getattr(self, k) is not None}
        if self.top_k is not None:
            out["top_k"] = max(0, self.top_k)  # -1 (vLLM's "off") = 0
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids is not None:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias is not None:
            out["logit_bias"] = dict(self.logit_bias)
        return out


class CompletionRequest(_Body):
    prompt: Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]] = Field(
        ..., description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: Optional[StrictInt] = Field(16, ge=0, le=2 ** 63 - 1)  # OpenAI's default; 0 only with echo
    best_of: Optional[StrictInt] = Field(None, ge=1, le=MAX_N)
    echo: StrictBool = False
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    suffix: Optional[Any] = _refused()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: Union[StrictStr, list[TextPart], None] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)
    add_generation_prompt: StrictBool = Field(True, description="extension")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[StrictStr] = None
    tokens: TokenIds


# ---- responses (published in /openapi.json) ----------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChoiceError(BaseModel):
    message: str
    type: str


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


L = TypeVar("L", bound=BaseModel)


class _Choice(BaseModel, Generic[L]):
    """Fields of a choice of either endpoint; `L`: its logprobs type."""

    index: int
    logprobs: Optional[L] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None
    error: Optional[ChoiceError] = None


C = TypeVar("C", bound=_Choice)


class _Response(BaseModel, Generic[C]):
    """Fields of a response of either endpoint; `C`: its choice type."""

    id: str
    created: int
    model: str
    choices: list[C]
    usage: Optional[Usage] = None


class CompletionChoice(_Choice[CompletionLogprobs]):
    text: str


class CompletionResponse(_Response[CompletionChoice]):
    object: Literal["text_completion"]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: Optional[str] = None


class ChatChoice(_Choice[ChatLogprobs]):
    message: ChatMessageOut


class ChatCompletionResponse(_Response[ChatChoice]):
    object: Literal["chat.completion"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: Optional[str]
    bos_token: Optional[str]
    pad_token: Optional[str]
    model_max_length: int


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: str


def error_body(message: str, param: str | None = None, code: str | None = None,
               type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_Body.model_rebuild()
