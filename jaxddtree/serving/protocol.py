"""OpenAI request bodies (the fields the server honours; unknown fields are accepted and ignored) and the
OpenAI-style error (`APIError` -> {"error": {"message", "type", "param", "code"}})."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err["loc"]
        param = str(loc[0]) if loc else ""
        if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
            param = f"messages[{loc[1]}]"
        what = "is required" if err["type"] == "missing" else f"is invalid: {err['msg']}"
        raise APIError(400, f"'{param}' {what}", param=param or None,
                       code="missing_required_parameter" if err["type"] == "missing" else "invalid_type") from None
