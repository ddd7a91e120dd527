"""The OpenAI-compatible server (jaxddtree.serving, scripts/serve.py) end to end: one real uvicorn server on
127.0.0.1 (a free port) with the demo pair, talked to through the `openai` client and raw httpx."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MAX_CONTEXT = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    import uvicorn

    from jaxddtree.checkpoint import builtin
    from jaxddtree.serving import Engine, create_app
    from jaxddtree.text import encode_text

    if builtin.demo_dirs() is None:
        pytest.skip("the demo pair (demo/) is absent")
    pair = builtin.load("float32")
    engine = Engine(pair.target, pair.drafter, pair.tokenizer, name="demo", method="ddtree", budget=64,
                    max_context=MAX_CONTEXT, queue_size=64)
    engine.warmup(encode_text(pair.tokenizer, "Hello"), temperatures=(0.0, 1.0))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started, "the server did not start"
    yield base, engine
    srv.should_exit = True
    thread.join(10)
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def _chat(client, content, **kw):
    return client.chat.completions.create(model="demo", messages=[{"role": "user", "content": content}],
                                          temperature=0, **kw)


def _stream_text(stream) -> tuple[str, int, str | None]:
    """(concatenated deltas, number of content chunks, finish_reason) of a streamed chat completion."""
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            finish = c.finish_reason or finish
    return "".join(parts), len(parts), finish


def test_nothing_compiles_after_warmup(server, client):
    """After `warmup` (what serve.py runs before it listens), requests of every kind — short and long prompts
    (both prefill widths), completions and chat, streamed or not, greedy and sampled, any max_tokens — compile
    nothing: every compilation jax logs while they run fails the test. (First in the file: it runs first.)"""
    import logging

    import jax

    seen = []

    class Grab(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if "Compiling" in msg or "compil" in msg.lower() and "cache" not in msg.lower():
                seen.append(msg[:160])

    handler = Grab(level=logging.DEBUG)
    loggers = [logging.getLogger(n) for n in ("jax._src.interpreters.pxla", "jax._src.dispatch", "jax")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG)
    jax.config.update("jax_log_compiles", True)
    try:
        long_prompt = "def f(x):\n    return x + 1\n" * 12  # > 64 tokens: the 256-row prefill width
        for i, (prompt, max_tokens, temperature, stream) in enumerate(
                [("import os", 5, 0.0, False), (long_prompt, 17, 0.0, True), ("x = ", 40, 0.8, False),
                 (long_prompt, 3, 1.2, True)]):
            if i % 2:
                out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=max_tokens, temperature=temperature, stream=stream)
            else:
                out = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens,
                                                temperature=temperature, stream=stream)
            if stream:
                list(out)
    finally:
        jax.config.update("jax_log_compiles", False)
        for lg, lv in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(lv)
    assert not seen, seen


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["demo"]
    h = httpx.get(server[0] + "/health").json()
    assert h["status"] == "ok" and h["model"] == "demo"


def test_completion(client):
    r = client.completions.create(model="demo", prompt="import os\nimport sys\n", max_tokens=24, temperature=0)
    c = r.choices[0]
    assert c.text and c.finish_reason in ("length", "stop")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["speculative"]
    assert spec["method"] == "ddtree" and spec["rounds"] >= 1 and spec["mean_acceptance_length"] >= 1
    # the same request again: greedy decoding is deterministic
    assert client.completions.create(model="demo", prompt="import os\nimport sys\n", max_tokens=24,
                                     temperature=0).choices[0].text == c.text


def test_stream_chat_equals_non_streamed(client):
    full = _chat(client, "def parse(path):", max_tokens=48)
    text = full.choices[0].message.content
    assert text and full.choices[0].message.role == "assistant"
    streamed, chunks, finish = _stream_text(_chat(client, "def parse(path):", max_tokens=48, stream=True))
    assert streamed == text
    assert chunks >= 2  # several rounds, one event each
    assert finish == full.choices[0].finish_reason


def test_stop_strings(client):
    prompt = "class Parser:\n    def __init__(self):\n"
    text = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    assert len(text) > 6
    stop = text[3:6]  # ends the text at its first occurrence, which may come before position 3
    expected = text[:text.find(stop)]
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0,
                                  stop=[stop, "\x00never"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_concurrent_streams(client):
    """32 streaming clients at once (8 prompts x 4): each stream equals its prompt's non-streamed text."""
    prompts = ["import os\n", "import sys\n", "class A:\n    ", "def main():\n    ", "return ",
               "for i in x:\n    ", "import re\n", "try:\n    "]
    kw = dict(model="demo", max_tokens=16, temperature=0)

    def stream(p):
        return "".join(c.choices[0].text for c in client.completions.create(prompt=p, stream=True, **kw)
                       if c.choices)

    with ThreadPoolExecutor(32) as pool:
        streamed = list(pool.map(stream, prompts * 4))
    want = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in prompts}
    assert len(set(want.values())) >= 3  # different prompts give different texts: interleaving would show
    for p, s in zip(prompts * 4, streamed):
        assert s == want[p], p


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000}, 400,
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi " * 2000}]}, 400, "messages"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ({"max_tokens": 5}, 400, "prompt"),
], ids=["malformed-json", "empty-messages", "content-type", "max-tokens-type", "max-tokens-0",
        "beyond-context", "unknown-model", "n-2", "prompt-too-long", "empty-prompt", "temperature-type",
        "ids-outside-vocab", "missing-prompt"])
def test_bad_input(server, body, status, param):
    url = server[0] + ("/v1/completions" if "messages" not in body else "/v1/chat/completions")
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_bad_input_then_success(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert _chat(client, "def ok():", max_tokens=8).choices[0].message.content is not None


def test_disconnect_cancels(server, client):
    base, engine = server
    before = dict(engine.counts)
    body = {"model": "demo", "prompt": "def main():\n", "max_tokens": 256, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                events += 1
                if events == 2:
                    break  # leave mid-stream: closing the response drops the connection
    for _ in range(200):
        if engine.counts["cancelled"] > before["cancelled"] and not engine.busy:
            break
        time.sleep(0.05)
    assert engine.counts["cancelled"] == before["cancelled"] + 1
    assert engine.counts["completed"] == before["completed"]
    r = client.completions.create(model="demo", prompt="def main():\n", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8


def test_queue_full_503(server, client, monkeypatch):
    """One request runs, `queue` wait, the next gets 503; the waiting ones still complete."""
    base, engine = server
    gate, started = threading.Event(), threading.Event()
    original = engine._generate

    def held(*a, **kw):  # hold the worker until the queue is full
        started.set()
        gate.wait(60)
        return original(*a, **kw)

    monkeypatch.setattr(engine, "_generate", held)
    monkeypatch.setattr(engine._queue, "maxsize", 1)
    monkeypatch.setattr(engine, "queue_size", 1)
    body = {"model": "demo", "prompt": "def main():\n", "max_tokens": 8, "temperature": 0}
    post = lambda: httpx.post(base + "/v1/completions", json=body, timeout=60)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post)
        assert started.wait(30)
        waiting = pool.submit(post)
        for _ in range(200):
            if engine.waiting() == 1:
                break
            time.sleep(0.02)
        r = post()
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "server_error"
        gate.set()
        assert running.result().status_code == 200 and waiting.result().status_code == 200
