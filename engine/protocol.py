"""The OpenAI-compatible request and response bodies (pydantic), and the error object.

Requests are strict: an unknown field, or a known one of the wrong type, is a 400 with an
OpenAI-style error naming the field. Accepted OpenAI fields that this engine cannot honour
(penalties, logit_bias, suffix) are refused at their non-default values rather than ignored.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGPROBS = 20  # the most top logprobs per token (OpenAI's chat limit; vLLM's default max_logprobs)
MAX_N = 128  # the most samples per prompt (n, best_of); the token limit per request bounds them too


@dataclass
class ServerOptions:
    """`moetune serve`'s settings that are not performance knobs: access and limits. The defaults
    here are the only ones (the command line's flags take them from this class)."""

    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    metrics_public: bool = False  # /metrics without a key even when keys are set
    loopback: bool = True  # the server listens on a loopback address only (see `show_paths`)
    max_body_bytes: int = 16 << 20  # a larger request body gets 413
    max_prompts: int = 64  # prompts in one completions request
    max_request_tokens: int = 1 << 18  # (prompt + max_tokens) × samples, summed over a request's prompts
    request_timeout: float = 600.0  # seconds until a request is cancelled with 408 (0: never)
    shutdown_grace: float = 30.0  # seconds running requests get to finish after SIGTERM / SIGINT

    def show_paths(self, authenticated: bool) -> bool:
        """Filesystem paths (/info, /v1/models) go to an authenticated client; with no key set, only
        to a server that listens on loopback (its clients are on this machine)."""
        return authenticated or (not self.api_keys and self.loopback)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM/SGLang): -1 or 0 = off
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate exactly max_tokens (load tests)
    user: str | None = None
    presence_penalty: Literal[0, 0.0] = 0
    frequency_penalty: Literal[0, 0.0] = 0
    logit_bias: dict[str, float] | None = Field(None, max_length=0)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: Literal[None] = None


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class CompletionLogprobs(BaseModel):
    """The legacy completions form: per token its text, logprob (None for a first prompt token), the
    top ones {text: logprob} (they include the token itself), and its offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


def new_id(prefix: str) -> tuple[str, int]:
    """A response id and its creation time (unix seconds)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())


class ApiError(Exception):
    """A client error: rendered as {"error": {message, type, param, code}} with `status`."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
             408: "timeout_error", 413: "invalid_request_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
