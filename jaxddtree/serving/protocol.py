"""OpenAI request bodies (the fields the server honours; other fields are accepted and ignored, except the
sampling fields of `UNHONOURED` with a non-default value: `unhonoured` names them, the app answers 400) and the
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
    top_p: float | None = None
    top_k: int | None = None  # vLLM / SGLang extra field; 0 or -1 = off
    min_p: float | None = None  # vLLM / SGLang extra field
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


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    arguments: str | dict[str, Any]  # OpenAI: a JSON string; a JSON object is taken too


class MessageToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: dict[str, Any]


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


def _is(*defaults):
    """Default test: the value is None or equals one of `defaults` (a bool only equals a bool)."""
    return lambda v: v is None or any(v == d and isinstance(v, bool) == isinstance(d, bool) for d in defaults)


def _empty(v) -> bool:
    return v is None or v == {} or v == [] or v == ""


# sampling / output fields the server does not honour -> whether a value changes nothing (the default). A request
# with any other value gets a 400 naming the field, rather than a silently different answer.
UNHONOURED = {
    "frequency_penalty": _is(0), "presence_penalty": _is(0), "repetition_penalty": _is(1),
    "length_penalty": _is(1), "logit_bias": _empty, "logprobs": _is(False), "top_logprobs": _is(0),
    "prompt_logprobs": _is(0), "best_of": _is(1), "echo": _is(False), "suffix": _empty, "min_tokens": _is(0),
    "use_beam_search": _is(False), "ignore_eos": _is(False), "typical_p": _is(1), "stop_token_ids": _empty,
    "bad_words": _empty, "allowed_token_ids": _empty, "logits_processors": _empty,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "guided_json": _empty, "guided_regex": _empty, "guided_choice": _empty, "guided_grammar": _empty,
    "structured_outputs": _empty,
}


def unhonoured(req: BaseModel) -> str | None:
    """The first field of `UNHONOURED` that the request sets to a value other than its default, if any."""
    extra = req.model_extra or {}
    return next((k for k, is_default in UNHONOURED.items() if k in extra and not is_default(extra[k])), None)


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
