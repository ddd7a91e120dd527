"""The FastAPI app: /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent events),
/v1/models, /health, /metrics (Prometheus, serving/metrics.py). Requests are validated here (OpenAI-style 4xx
errors) and run by the `Engine`; with `api_keys`, every /v1 request needs `Authorization: Bearer KEY` (401
otherwise; /health and /metrics stay open).

Sampling: temperature, top_p, top_k, min_p (vLLM's extra fields), seed, stop, max_tokens are honoured; a sampling
field it does not honour with a non-default value is a 400 naming it (protocol.UNHONOURED). Chat `tools` go
through the chat template, the model's tool-call blocks come back as `tool_calls` (serving/tools.py); with thinking
on, the reasoning comes back as `reasoning_content` (serving/reasoning.py)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxddtree.serving.auth import APIKeys
from jaxddtree.serving.chat_output import ChatOutput
from jaxddtree.serving.engine import Engine, Job, QueueFull
from jaxddtree.serving.metrics import ServerMetrics
from jaxddtree.serving.protocol import APIError, ChatRequest, CompletionRequest, parse, unhonoured
from jaxddtree.serving.tools import prompt_in_think
from jaxddtree.speculative.tree import check_truncation
from jaxddtree.text import encode_rendered, encode_text, ensure_chat_template, render_chat

MAX_STOPS = 4


def create_app(engine: Engine, api_keys=None) -> FastAPI:
    """The app over `engine`; api_keys: the keys a /v1 request may carry (None or empty: no key needed)."""
    app = FastAPI(title="jaxddtree", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics = ServerMetrics(engine)
    created = int(time.time())
    if api_keys:
        app.add_middleware(APIKeys, keys=list(api_keys))

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request, e):
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": engine.name, "busy": engine.busy, "running": engine.running(),
                "waiting": engine.waiting(), "max_batch": engine.max_batch, **engine.counts}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": created,
                                            "owned_by": "jaxddtree", "max_model_len": engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _checked(parse(CompletionRequest, await _json(request)))
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        if isinstance(prompt, str):
            ids = encode_text(engine.tokenizer, prompt)
        else:
            V = engine.target.config.vocab_size
            bad = [i for i in prompt if not 0 <= i < V]
            if bad:
                raise APIError(400, f"prompt token ids {bad[:5]} outside the vocabulary [0, {V})", param="prompt")
            ids = list(prompt)
        job = _job(req, ids, req.max_tokens, "max_tokens", default_max=16)
        return await _respond(request, req, job, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _checked(parse(ChatRequest, await _json(request)))
        if not req.messages:
            raise APIError(400, "'messages' must contain at least one message", param="messages")
        tok = engine.tokenizer
        tools = _tools(req)  # rendered
        known = [t.model_dump(exclude_none=True) for t in req.tools] if tools else None  # parsed: every tool
        turns = [_turn(m, i) for i, m in enumerate(req.messages)]
        try:
            ensure_chat_template(tok)
            text = render_chat(tok, turns, tools=tools, **(req.chat_template_kwargs or {}))
            ids = encode_rendered(tok, text)
        except Exception as e:  # the template rejected the conversation
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        max_tokens, param = ((req.max_completion_tokens, "max_completion_tokens")
                             if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens"))
        job = _job(req, ids, max_tokens, param, default_max=engine.default_max_tokens)
        in_think = prompt_in_think(text)
        parser = (lambda: ChatOutput(known, in_think)) if (known or in_think) else None
        return await _respond(request, req, job, chat=True, parser=parser)

    def _checked(req):
        name = unhonoured(req)
        if name is not None:
            raise APIError(400, f"'{name}' is not supported by this server: leave it out or send its default "
                           f"(honoured: temperature, top_p, top_k, min_p, seed, stop, max_tokens)", param=name,
                           code="unsupported_parameter")
        return req

    def _tools(req: ChatRequest) -> list[dict] | None:
        """The tools to render and parse (as dicts), or None. tool_choice "none": none; "auto" (default) and
        "required": all (required is not enforced: the model may still answer in text); a named function: that
        one only (not enforced either)."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise APIError(400, "'tool_choice' names a tool, but the request has no 'tools'", param="tool_choice")
            return None
        if choice == "none":
            return None
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if choice is not None and not isinstance(choice, str):
            name = choice.function.get("name")
            tools = [t for t in tools if t["function"]["name"] == name]
            if not tools:
                raise APIError(400, f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                               param="tool_choice")
        return tools

    def _turn(m, i: int) -> dict:
        """A message as the chat templates take it: tool calls with their arguments as a dict."""
        turn = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        args = None
                if not isinstance(args, dict):
                    raise APIError(400, f"'messages[{i}].tool_calls': the arguments of {c.function.name!r} must be "
                                   "a JSON object", param=f"messages[{i}]")
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                            "arguments": args}})
            turn["tool_calls"] = calls
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        reasoning = (m.model_extra or {}).get("reasoning_content")
        if m.role == "assistant" and isinstance(reasoning, str):  # Qwen3.6's template renders it back
            turn["reasoning_content"] = reasoning
        return turn

    def _job(req, ids, max_tokens, param, default_max) -> Job:
        if req.model is not None and req.model != engine.name:
            raise APIError(404, f"the model '{req.model}' does not exist (this server serves '{engine.name}')",
                           param="model", code="model_not_found")
        if req.n is not None and req.n != 1:
            raise APIError(400, "only n = 1 is supported", param="n")
        if not ids:
            raise APIError(400, "the prompt is empty after tokenisation", param="prompt")
        ctx = engine.max_context
        if len(ids) >= ctx:
            raise APIError(400, f"this server's maximum context length is {ctx} tokens, but the prompt has "
                           f"{len(ids)} tokens", param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default_max, ctx - len(ids))
        elif max_tokens < 1:
            raise APIError(400, f"'{param}' must be >= 1, got {max_tokens}", param=param, code="invalid_value")
        elif len(ids) + max_tokens > ctx:
            raise APIError(400, f"this server's maximum context length is {ctx} tokens, but {len(ids)} prompt "
                           f"tokens + {max_tokens} completion tokens were requested", param=param,
                           code="context_length_exceeded")
        temperature = 1.0 if req.temperature is None else float(req.temperature)
        if not (0 <= temperature <= 2 and math.isfinite(temperature)):
            raise APIError(400, f"'temperature' must be in [0, 2], got {req.temperature}", param="temperature",
                           code="invalid_value")
        top_k = 0 if req.top_k in (None, -1) else req.top_k  # -1: off, as vLLM
        top_p = 1.0 if req.top_p is None else req.top_p
        min_p = 0.0 if req.min_p is None else req.min_p
        for name, value in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
            try:
                check_truncation(**{name: value})
            except ValueError as e:
                raise APIError(400, f"'{name}': {e}".replace(f"{name} must", "must", 1), param=name,
                               code="invalid_value") from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOPS:
            raise APIError(400, f"at most {MAX_STOPS} stop sequences", param="stop", code="invalid_value")
        seed = req.seed if req.seed is not None else (0 if temperature == 0 else random.randrange(2 ** 31))
        return Job(prompt_ids=ids, max_tokens=max_tokens, temperature=temperature, seed=seed % 2 ** 32,
                   stop=tuple(stop), top_k=top_k, top_p=float(top_p), min_p=float(min_p))

    async def _respond(request: Request, req, job: Job, chat: bool, parser=None):
        try:
            engine.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), type="server_error", code="server_busy") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": engine.name}
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(_stream(job, base, chat, include_usage, parser), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        parts, info = [], None
        try:
            while info is None:
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), 1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        job.cancel()
                        return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
                    continue
                if kind == "delta":
                    parts.append(value)
                elif kind == "error":
                    raise APIError(500, value, type="server_error")
                else:
                    info = value
        finally:
            job.cancel()  # no-op once done; stops the generation if this handler was cancelled
        text = "".join(parts)
        if chat:
            message, finish = {"role": "assistant", "content": text}, info["finish_reason"]
            if parser is not None:
                p = parser()
                p.feed(text)
                p.finish()
                message = p.message()
                if p.calls:
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": info["finish_reason"]}
        return {**base, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": info["usage"], "speculative": info["speculative"]}

    async def _stream(job: Job, base: dict, chat: bool, include_usage: bool, parser=None):
        def event(obj) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(delta: str | None, finish=None, role=False, tool_calls=None, reasoning=None):
            if chat:
                d = {} if delta is None else {"content": delta}
                if role:
                    d["role"] = "assistant"
                if reasoning is not None:
                    d["reasoning_content"] = reasoning
                if tool_calls:
                    d["tool_calls"] = tool_calls
                c = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return {**base, "choices": [c]}

        p = parser() if parser is not None else None
        n_calls = 0

        def parsed(text: str, final: bool):  # reasoning, content and tool-call chunks of a text delta, in order
            nonlocal n_calls
            for kind, value in (p.finish() if final else p.feed(text)):
                if kind == "content":
                    yield event(chunk(value))
                elif kind == "reasoning":
                    yield event(chunk(None, reasoning=value))
                else:
                    n_calls = max(n_calls, value.index + 1)
                    yield event(chunk(None, tool_calls=[value.openai()]))

        try:
            if chat:
                yield event(chunk("", role=True))
            while True:
                kind, value = await job.events.get()
                if kind == "delta":
                    if p is None:
                        yield event(chunk(value))
                    else:
                        for e in parsed(value, final=False):
                            yield e
                elif kind == "error":
                    yield event(APIError(500, value, type="server_error").body())
                    break
                else:
                    finish = value["finish_reason"]
                    if p is not None:
                        for e in parsed("", final=True):
                            yield e
                        finish = "tool_calls" if (n_calls and finish == "stop") else finish
                    last = chunk(None, finish=finish)
                    last["speculative"] = value.get("speculative")
                    if not include_usage:
                        last["usage"] = value.get("usage")
                    yield event(last)
                    if include_usage:
                        yield event({**base, "choices": [], "usage": value.get("usage")})
                    break
            yield "data: [DONE]\n\n"
        finally:  # also when the client disconnects (the generator is closed or cancelled)
            job.cancel()

    async def _json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None

    return app
