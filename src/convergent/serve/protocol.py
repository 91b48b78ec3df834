"""OpenAI-compatible request and response records (pydantic), validated strictly.

Requests forbid unknown fields, reject wrong JSON types (no string-to-number coercion) and
out-of-range values, and refuse fields of the OpenAI API that this server does not
implement (``tools``, ``response_format``, ``logit_bias``, penalties, ...) instead of
ignoring them: :func:`parse_request` turns any of these into :class:`RequestError`
naming the field (the API answers 400). vLLM extensions accepted: ``top_k``,
``stop_token_ids``, ``ignore_eos``. Completions take ``echo`` (the prompt's text before
the completion and, with ``logprobs``, its tokens' logprobs, the first ``null``; with
``max_tokens: 0`` the prompt alone), as OpenAI's legacy API and vLLM do.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from convergent.serve.sampling import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "RequestError",
    "Usage",
    "parse_request",
]

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class RequestError(Exception):
    """A request the API answers with 400: ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# fields of the OpenAI API we know but do not implement: 400 unless absent / null / default
UNSUPPORTED = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "best_of": (None, 1),
    "echo": (None, False),  # chat; completions implement it
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM: -1 / 0 = off
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None

    @model_validator(mode="after")
    def _finite(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number")
        if isinstance(self.stop, list) and any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.stop == "":
            raise ValueError("stop strings must not be empty")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def logprob_count(self) -> int:
        """Logprobs asked for: -1 none; k >= 0 the chosen token's and the top k."""
        raise NotImplementedError

    @property
    def prompt_logprob_count(self) -> int:
        """Prompt logprobs asked for (completions' ``echo``): -1 none, else top k."""
        return -1

    def check(self) -> None:
        """Rules across fields that name one field (:class:`RequestError`); none here."""

    def sampling_params(self, choice: int = 0) -> SamplingParams:
        """The engine's sampling settings of choice ``choice`` (0-based, of ``n``): unset
        fields are off (greedy, no top-k / top-p, no logprobs); the seed is ``seed +
        choice``, or drawn at random when the request has none."""
        return SamplingParams(
            temperature=self.temperature or 0.0,
            top_k=self.top_k if self.top_k and self.top_k > 0 else 0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            seed=random.getrandbits(31) if self.seed is None else self.seed + choice,
            logprobs=self.logprob_count,
            prompt_logprobs=self.prompt_logprob_count,
        )


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]],
            Field(min_length=1),
        ]
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: only with echo
    echo: bool = False

    @property
    def logprob_count(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    @property
    def prompt_logprob_count(self) -> int:
        return self.logprob_count if self.echo else -1

    def check(self) -> None:
        """``max_tokens: 0`` only with ``echo``; ``echo`` not streamed (400 naming the field)."""
        if self.max_tokens == 0 and not self.echo:
            raise RequestError(
                "max_tokens: 0 is allowed only with echo: true (the prompt's logprobs)",
                "max_tokens",
            )
        if self.echo and self.stream:
            raise RequestError("echo: not supported with stream: true", "echo")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        c = self.content
        if isinstance(c, list):
            c = "".join(p.text for p in c)
        d: dict[str, Any] = {"role": self.role, "content": c or ""}
        if self.name is not None:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _lp(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def logprob_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1


def _loc(loc: tuple) -> str:
    out = ""
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif not (isinstance(x, str) and (x[:1].isupper() or x in _TYPE_TAGS or "[" in x)):
            out += ("." if out else "") + str(x)
    return out


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "constrained-int"}


def parse_request(body: bytes, kind: type[_Sampling]) -> _Sampling:
    """Validate a JSON body as ``kind``; raise :class:`RequestError` naming the field."""
    import json

    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object", None, "invalid_json")
    for key, allowed in UNSUPPORTED.items():
        if key in kind.model_fields:  # implemented by this kind of request
            continue
        if key in data and data[key] not in allowed:
            raise RequestError(
                f"'{key}' is not supported by this server", key, "unsupported_parameter"
            )
        data.pop(key, None)
    try:
        req = kind.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        param = _loc(e["loc"]) or None
        if e["type"] == "extra_forbidden":
            msg = f"unknown field '{param}'"
            code = "unknown_parameter"
        else:
            msg = f"{param}: {e['msg']}" if param else e["msg"]
            code = "invalid_value"
        raise RequestError(msg, param, code) from None
    req.check()
    return req


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


# ----------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "convergent"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unhealthy", "shutting_down"]
    reason: str | None = None
    restarts: int = 0


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
