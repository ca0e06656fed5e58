"""The OpenAI-compatible requests tinkerd accepts (/v1/completions, /v1/chat/completions), and the
OpenAI error shape.

Fields tinkerd cannot honour are refused with a 400 naming them when they are set to anything but
their no-op value (a penalty of 0, an empty logit_bias): silently ignoring `tools` or a penalty would
answer something other than what was asked. Unknown fields are ignored, as OpenAI's own server and
vLLM do, so newer clients keep working. Two vLLM extensions are accepted: `top_k`, and
`return_tokens_as_token_ids`, which reports each logprob token as "token_id:<id>" so a caller can
compare ids exactly.
"""

from __future__ import annotations

from typing import Literal, Union

import pydantic
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tinkerd.errors import OpenAIError

# OpenAI's own bounds for top_logprobs (chat) and logprobs (completions).
MAX_TOP_LOGPROBS = 20


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_response(status_code: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    """{"error": {"message", "type", "param", "code"}}: what the `openai` client turns into its
    BadRequestError / NotFoundError / AuthenticationError / InternalServerError."""
    return JSONResponse(error_body(status_code, message, param, code), status_code=status_code, headers=headers)


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error object alone: also what a stream sends when it fails after its first chunk."""
    kind = _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    if code is None:
        code = {401: "invalid_api_key", 404: "model_not_found"}.get(status_code)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None  # vLLM's extension; -1 or 0 is off
    n: int = Field(default=1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    return_tokens_as_token_ids: bool = False
    user: str | None = None

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise OpenAIError(f"{name} is not supported by tinkerd; send 0 or leave it out", name)
        if self.logit_bias:
            raise OpenAIError("logit_bias is not supported by tinkerd", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed with stream: true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise OpenAIError("a stop string is empty", "stop")
        if len(stops) > 4:
            raise OpenAIError(f"at most 4 stop sequences are allowed, got {len(stops)}", "stop")
        return stops


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None

    def text(self, i: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(f"messages[{i}]: {part.type} content parts are not supported by tinkerd's text "
                                  f"models", "messages")
            parts.append(part.text)
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None
    tool_choice: object | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise OpenAIError("tools are not supported by tinkerd", "tools")
        if self.tool_choice not in (None, "none"):
            raise OpenAIError("tool_choice is not supported by tinkerd", "tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise OpenAIError("response_format other than text is not supported by tinkerd", "response_format")
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", "top_logprobs")

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def topk(self) -> int | None:
        """None: no logprobs; else the top-k count per token (0: the chosen token's alone)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(i), **({"name": m.name} if m.name else {})}
                for i, m in enumerate(self.messages)]


class CompletionRequest(_Request):
    # A string, a list of token ids, or a batch of either: one choice list per prompt, in order.
    prompt: Union[str, list[str], list[int], list[list[int]]]
    # OpenAI's default for the legacy endpoint.
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise OpenAIError("echo is not supported by tinkerd", "echo")
        if self.suffix:
            raise OpenAIError("suffix is not supported by tinkerd", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError("best_of other than n is not supported by tinkerd", "best_of")

    def token_limit(self) -> int | None:
        return self.max_tokens

    def topk(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def parse(model: type[_Request], data: object) -> _Request:
    try:
        req = model.model_validate(data)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise OpenAIError(f"invalid {param or 'body'}: {err['msg']}", param) from e
    req.check_supported()
    return req
