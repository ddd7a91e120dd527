"""The OpenAI-compatible server (jaxddtree.serving, scripts/serve.py) end to end: one real uvicorn server on
127.0.0.1 (a free port) with the demo pair, talked to through the `openai` client and raw httpx."""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MAX_CONTEXT = 1024
MAX_BATCH = 4  # the real server's slots: the concurrent tests run batched rounds of 2 and 4 slots


def _serve(engine):
    """A uvicorn server over `engine` on a free port in a thread -> (base url, stop())."""
    from helpers_serve import serve_app
    from jaxddtree.serving import create_app

    return serve_app(create_app(engine), on_stop=engine.close)


def _pool_factory():
    """The real SlotPool (jaxddtree.speculative.batch) when present, else a pool over generate per request."""
    try:
        from jaxddtree.speculative.batch import SlotPool
        return SlotPool
    except ImportError:
        from helpers_pool import GeneratePool
        return GeneratePool


@pytest.fixture(scope="module")
def pair(demo_pair):
    return demo_pair


@pytest.fixture(scope="module")
def server(pair):
    from jaxddtree.serving import Engine
    from jaxddtree.text import encode_text

    engine = Engine(pair.target, pair.drafter, pair.tokenizer, name="demo", method="ddtree", budget=64,
                    max_context=MAX_CONTEXT, queue_size=64, max_batch=MAX_BATCH, pool_factory=_pool_factory())
    engine.warmup(encode_text(pair.tokenizer, "Hello"))
    base, stop = _serve(engine)
    yield base, engine
    stop()


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
        # then 2 and 3 requests at once (batched rounds of 2 and 4 slots; joins, leaves), greedy and sampled
        # (truncated too), short and long prompts, streamed or not
        reqs = [dict(prompt="import os", max_tokens=30, temperature=0.0, stream=True),
                dict(prompt=long_prompt, max_tokens=9, temperature=0.7, extra_body={"top_p": 0.9}),
                dict(prompt="x = ", max_tokens=20, temperature=1.0, stream=True)]

        def call(kw):
            out = client.completions.create(model="demo", **kw)
            return "".join(c.choices[0].text for c in out if c.choices) if kw.get("stream") else out
        for n in (2, 3):
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(call, reqs[:n]))
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
    """16 streaming clients at once (8 prompts x 2) on MAX_BATCH slots: each stream equals its prompt's non-streamed
    text (computed one at a time)."""
    prompts = ["import os\n", "import sys\n", "class A:\n    ", "def main():\n    ", "return ",
               "for i in x:\n    ", "import re\n", "try:\n    "]
    kw = dict(model="demo", max_tokens=16, temperature=0)

    def stream(p):
        return "".join(c.choices[0].text for c in client.completions.create(prompt=p, stream=True, **kw)
                       if c.choices)

    with ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(stream, prompts * 2))
    want = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in prompts}
    assert len(set(want.values())) >= 3  # different prompts give different texts: interleaving would show
    for p, s in zip(prompts * 2, streamed):
        assert s == want[p], p


def test_batched_requests_equal_their_texts_alone(server, client):
    """3 requests at once through the real pool (T = 0, the tiny fp32 pair): different prompts, lengths and a stop
    string, one finishing early, and a 4th client leaving mid-stream; each text equals its one-at-a-time text, and
    the rounds ran batched (each slot's budget the bucket's: 2 slots x (63 + 1) or 4 x (31 + 1) verify rows)."""
    _, engine = server
    reqs = [dict(prompt="import os\nimport sys\n", max_tokens=40),
            dict(prompt="class Parser:\n    def __init__(self):\n", max_tokens=12),
            dict(prompt="def main():\n", max_tokens=32, stop=["\n\n\n"])]

    def run(kw):
        r = client.completions.create(model="demo", temperature=0, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.model_extra["speculative"]
    def leave():  # a 4th client that leaves mid-stream: its slot is freed while the others go on
        stream = client.completions.create(model="demo", prompt="def leave():\n", max_tokens=200, temperature=0,
                                           stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                stream.close()
                return
    alone = [run(kw) for kw in reqs]
    assert all(a[2]["batch"] == 1 and a[2]["tree_budget"] == "64" for a in alone)
    cancelled = engine.counts["cancelled"]
    with ThreadPoolExecutor(4) as ex:
        left = ex.submit(leave)
        together = list(ex.map(run, reqs))
        left.result()
    assert [t[:2] for t in together] == [a[:2] for a in alone]
    for _ in range(200):
        if engine.counts["cancelled"] > cancelled and not engine.busy:
            break
        time.sleep(0.05)
    assert engine.counts["cancelled"] == cancelled + 1 and engine.running() == 0
    assert max(t[2]["batch"] for t in together) >= 2
    seen = set().union(*(t[2]["tree_budget_rounds"] for t in together))
    assert seen & {"63", "31"}, seen


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
    # sampling controls out of range
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "top_k": 2.5}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_p": 1.0}, 400, "min_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "min_p": -0.1}, 400, "min_p"),
    # sampling fields the server does not honour, with a value that would change the answer
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -1}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.1}, 400, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "echo": True}, 400, "echo"),
    ({"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    # tools
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]}, 400, "messages[1]"),
], ids=["malformed-json", "empty-messages", "content-type", "max-tokens-type", "max-tokens-0",
        "beyond-context", "unknown-model", "n-2", "prompt-too-long", "empty-prompt", "temperature-type",
        "ids-outside-vocab", "missing-prompt", "top-p-0", "top-p-big", "top-k-negative", "top-k-float",
        "min-p-1", "min-p-negative", "frequency-penalty", "presence-penalty", "logit-bias", "logprobs",
        "top-logprobs", "repetition-penalty", "response-format", "best-of", "echo", "completion-logprobs",
        "tool-choice-unknown", "tool-choice-without-tools", "tool-without-function", "tool-arguments-not-json"])
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
    """One request joins (its prefill held), `queue` wait, the next gets 503; the waiting ones still complete."""
    base, engine = server
    gate, started = threading.Event(), threading.Event()
    original = engine.pool.prefill

    def held(*a, **kw):  # hold the scheduler until the queue is full
        started.set()
        gate.wait(60)
        return original(*a, **kw)

    monkeypatch.setattr(engine.pool, "prefill", held)
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


# ------------------------------------------------------------------------------------------- sampling controls
def test_defaults_of_unhonoured_fields_accepted(server, client):
    """Fields that change nothing (a default value, `user`, stream options, ...) are accepted as clients send
    them, and the answer is the plain request's."""
    base, _ = server
    msgs = [{"role": "user", "content": "def parse(path):"}]
    plain = _chat(client, "def parse(path):", max_tokens=8).choices[0].message.content
    extra = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
             "repetition_penalty": 1, "user": "u-1", "top_p": 1, "top_k": -1, "min_p": 0, "n": 1,
             "parallel_tool_calls": True, "store": False, "metadata": {"a": "b"}, "response_format": {"type": "text"},
             "stream_options": None, "tool_choice": "none"}
    r = httpx.post(base + "/v1/chat/completions", json={"model": "demo", "messages": msgs, "max_tokens": 8,
                                                         "temperature": 0, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == plain
    r = httpx.post(base + "/v1/completions", json={"model": "demo", "prompt": "import os\n", "max_tokens": 4,
                                                    "temperature": 0, "best_of": 1, "echo": False, "suffix": None,
                                                    "logprobs": None, "user": "u"}, timeout=120)
    assert r.status_code == 200, r.text


def test_truncation_reaches_generate(client):
    """top_k = 1 (or min_p near 1) keeps only the most probable token: sampling at T = 1.5 then gives the greedy
    text, through the speculative rounds; without truncation the same seeds give other texts."""
    kw = dict(model="demo", prompt="class Parser:\n    def __init__(self):\n", max_tokens=12)
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    for seed in (1, 2):
        topk = client.completions.create(temperature=1.5, seed=seed, extra_body={"top_k": 1}, **kw)
        assert topk.choices[0].text == greedy
        minp = client.completions.create(temperature=1.5, seed=seed, extra_body={"min_p": 0.999}, **kw)
        assert minp.choices[0].text == greedy
    free = {client.completions.create(temperature=1.5, seed=s, **kw).choices[0].text for s in (1, 2)}
    assert free != {greedy}


# ------------------------------------------------------------------------------------------------ tool calls
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]


def _block(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _scripted(engine, text, prompts):
    """A pool (in place of engine.pool) that records the prompts and 'generates' `text` (then a stop id) in
    5-token rounds, so that tags are split across stream events."""
    from helpers_pool import ScriptedPool

    pool = ScriptedPool(engine, lambda prompt: text, per_round=5)
    pool.prompts = prompts
    return pool


def _stream_message(stream):
    """(content, [(id, name, arguments)], finish_reason) accumulated from a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                cur = calls.setdefault(tc.index, ["", "", ""])
                cur[0] += tc.id or ""
                cur[1] += (tc.function.name or "") if tc.function else ""
                cur[2] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_tool_call_round_trip(server, client, monkeypatch):
    """tools through the template; the model's blocks back as tool_calls (whole and streamed), finish_reason
    tool_calls; the assistant's calls and the tool results rendered back in the next prompt."""
    _, engine = server
    assert engine.stop_ids
    prompts = []
    out = "Let me check.\n\n" + _block("get_weather", city="Paris", days=3) + "\n" + _block("get_time", tz="UTC")
    monkeypatch.setattr(engine, "pool", _scripted(engine, out, prompts))
    msgs = [{"role": "user", "content": "Weather and time in Paris?"}]
    r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]
    assert all(t.type == "function" and t.id.startswith("call_") for t in c.message.tool_calls)
    assert "<tools>" in prompts[0] and json.dumps(TOOLS[0]) in prompts[0] and prompts[0].endswith("assistant\n")

    content, calls, finish = _stream_message(client.chat.completions.create(
        model="demo", messages=msgs, tools=TOOLS, max_tokens=200, stream=True))
    assert content == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls] == got and all(i.startswith("call_") for i, _, _ in calls)

    history = msgs + [c.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": c.message.tool_calls[0].id, "content": "sunny, 21 C"},
                      {"role": "tool", "tool_call_id": c.message.tool_calls[1].id, "content": "12:00"}]
    monkeypatch.setattr(engine, "pool", _scripted(engine, "Sunny, 21 C; it is noon.", prompts))
    r2 = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=200)
    assert r2.choices[0].message.content == "Sunny, 21 C; it is noon." and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls
    p = prompts[-1]
    assert ("Let me check.\n\n" + _block("get_weather", city="Paris", days=3) + "\n"
            + _block("get_time", tz="UTC")) in p
    assert "<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in p


def test_tool_call_malformed_and_tool_choice(server, client, monkeypatch):
    _, engine = server
    prompts = []
    bad = "Sure.\n<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>"
    monkeypatch.setattr(engine, "pool", _scripted(engine, bad, prompts))
    msgs = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=200)
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    content, calls, finish = _stream_message(client.chat.completions.create(
        model="demo", messages=msgs, tools=TOOLS, max_tokens=200, stream=True))
    assert (content, calls, finish) == (bad, [], "stop")

    good = _block("get_weather", city="Oslo")
    monkeypatch.setattr(engine, "pool", _scripted(engine, good, prompts))
    r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=200)
    assert r.choices[0].message.content == good and not r.choices[0].message.tool_calls  # neither rendered nor parsed
    assert "<tools>" not in prompts[-1]
    r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=200,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"  # named: rendered, not enforced
    assert '"get_time"' in prompts[-1] and '"get_weather"' not in prompts[-1]
    r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, tool_choice="required",
                                       max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls"


# ------------------------------------------------------------------------------- the scheduler (a fake pool)
FAKE_BATCH = 2


def _reply(prompt: str) -> str:
    """The scripted pool's 'generation' for a prompt: distinct per prompt, long enough for many rounds."""
    tail = prompt.strip()[-12:]
    return "".join(f"<{tail}:{i}> " for i in range(40))


@pytest.fixture(scope="module")
def fake(pair):
    """A server whose engine drives a scripted pool of FAKE_BATCH slots (helpers_pool.ScriptedPool: 3 tokens a
    round, 10 ms a step), so the scheduler's joins, leaves and waits are observable in
    the pool's log."""
    from helpers_pool import FakePool, ScriptedPool
    from jaxddtree.serving import Engine

    engine = Engine(pair.target, pair.drafter, pair.tokenizer, name="demo", method="ddtree", budget=64,
                    max_context=MAX_CONTEXT, queue_size=8, max_batch=FAKE_BATCH, pool_factory=FakePool)
    engine.pool = ScriptedPool(engine, _reply, per_round=3, delay=0.01)
    base, stop = _serve(engine)
    yield base, engine, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    stop()


def _stream_completion(client, prompt, max_tokens, stop_after=None):
    """(text, finish_reason, speculative) of a streamed completion; stop_after=k: leave after k text events."""
    parts, finish, spec = [], None, None
    stream = client.completions.create(model="demo", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            parts.append(chunk.choices[0].text)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
            spec = chunk.model_extra.get("speculative")
        if stop_after is not None and len(parts) >= stop_after:
            stream.close()
            break
    return "".join(parts), finish, spec


def _log_since(pool, n):
    return list(pool.log[n:])


def test_scheduler_join_leave_and_wait_for_a_slot(fake):
    """3 requests on 2 slots at once (different max_tokens, so one leaves early): each text is its one-at-a-time
    text; the third waits in the queue until a slot is released and then takes that slot; while 2 run, each
    slot's budget is the pool's 2-slot budget."""
    _, engine, client = fake
    pool = engine.pool
    jobs = [("import os\n", 10), ("import sys\n", 90), ("class A:\n", 25)]
    alone = [_stream_completion(client, p, m)[:2] for p, m in jobs]
    assert len({t for t, _ in alone}) == 3 and all(f == "length" for _, f in alone)
    start = len(pool.log)
    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda j: _stream_completion(client, *j), jobs))
    assert [o[:2] for o in outs] == alone
    log = _log_since(pool, start)
    admits = [e for e in log if e[0] == "admit"]
    assert len(admits) == 3
    first_release = next(i for i, e in enumerate(log) if e[0] == "release")
    third = log.index(admits[2])
    assert third > first_release  # it waited for a free slot
    assert admits[2][2] == log[first_release][1]  # ... and took the freed one
    assert max(len(e[1]) for e in log if e[0] == "step") == FAKE_BATCH
    spec = outs[1][2]  # the longest: ran next to the others, then alone
    assert spec["batch"] == 2 and spec["max_batch"] == FAKE_BATCH and spec["rounds"] >= 1
    assert set(spec["tree_budget_rounds"]) == {"63", "64"}  # 2 slots: 2 x (63 + 1) rows; alone: its own 64
    assert spec["tree_budget"] in ("63", "64") and 2.5 < spec["mean_acceptance_length"] <= 3.0
    assert engine.running() == 0 and engine.waiting() == 0


@pytest.mark.parametrize("per_round", [1, 2])
def test_scheduler_prefill_budget_per_round(fake, monkeypatch, per_round):
    """A long prompt joining while another request decodes is prefilled `prefill_tokens` rows per round (here 1 or 2
    chunks of 256 between steps; its start follows its last chunk at once); with nothing decoding its chunks run
    back to back."""
    _, engine, client = fake
    pool = engine.pool
    monkeypatch.setattr(engine, "prefill_tokens", 256 * per_round)
    long_prompt = "def f(x):\n    return x + 1\n" * 80  # 3-4 chunks of 256 tokens

    def chunks(log, rid):
        return [i for i, e in enumerate(log) if e[0] in ("advance", "start") and e[1] == rid]
    start = len(pool.log)
    _stream_completion(client, long_prompt, 4)
    log = _log_since(pool, start)
    idx = chunks(log, log[0][1])
    assert len(idx) >= 4 and idx == list(range(idx[0], idx[0] + len(idx)))  # alone: back to back
    with ThreadPoolExecutor(2) as ex:
        start = len(pool.log)
        running = ex.submit(_stream_completion, client, "import re\n", 150)
        for _ in range(500):
            if any(e[0] == "step" and e[1] for e in pool.log[start:]):
                break
            time.sleep(0.01)
        joining = ex.submit(_stream_completion, client, long_prompt, 4)
        outs = running.result(), joining.result()
    log = _log_since(pool, start)
    rid = [e[1] for e in log if e[0] == "prefill"][1]  # the joining one's
    idx = chunks(log, rid)
    assert len(idx) >= 4 and log[idx[-1]][0] == "start"
    runs_of_chunks, n = [], 0  # chunks between consecutive steps
    for a, b in zip(idx[:-2], idx[1:-1]):
        n += 1
        if [e for e in log[a:b] if e[0] == "step"]:
            runs_of_chunks.append(n)
            n = 0
    runs_of_chunks.append(n + 1)
    assert max(runs_of_chunks) == per_round, runs_of_chunks
    assert idx[-1] == idx[-2] + 1  # the start right after the last chunk
    assert outs[0][1] == "length" and outs[1][1] == "length"


def test_scheduler_groups_joiners_of_one_shape(pair):
    """Jobs right behind the next one in the queue whose prompts have its shape prefill with it as one group (the
    largest group size the pool takes that the run of matching jobs fills, up to the free slots); a job of another
    shape stops the run (FIFO: none overtakes it); the group's members are admitted together; a cancelled member
    is dropped at admission, the others go on."""
    from helpers_pool import FakePool
    from jaxddtree.serving import Engine
    from jaxddtree.serving.engine import Job

    class Grouping(FakePool):
        def __init__(self, *a, **kw):
            kw["max_group"] = 4
            super().__init__(*a, **kw)

        def rounds_of(self, req):
            return [[1]] + [[2, 3]] * 3

    engine = Engine(pair.target, pair.drafter, pair.tokenizer, name="demo", method="ddtree", budget=64,
                    max_context=MAX_CONTEXT, queue_size=8, max_batch=4, pool_factory=Grouping)
    engine.close()
    engine._thread.join(10)
    assert not engine._thread.is_alive()
    pool = engine.pool
    class Loop:  # the jobs' events, without an event loop
        def call_soon_threadsafe(self, f, *a):
            f(*a)

    def job(ids):
        return Job(prompt_ids=ids, max_tokens=6, loop=Loop(), events=queue.SimpleQueue())
    short = [job([5 + i] * 20) for i in range(5)]  # one chunk of 64
    other = job([7] * 300)  # two chunks of 256
    engine._queue = q = type(engine._queue)(8)
    for j in short[1:3] + [other] + short[3:]:
        q.put_nowait(j)
    joining = engine._join(pool, short[0])  # 3 of its shape in a row: a group of 2 (sizes 2, 4)
    assert [r.job for r in joining] == short[:2] and q.qsize() == 4
    assert pool.log[-1][0] == "group" and len(pool.log[-1][1]) == 2
    runs = {}
    short[1].cancel()
    assert engine._advance(pool, joining, runs) == []  # nothing decodes: every pass at once
    assert [r.job for r in runs.values()] == [short[0]] and engine.counts["cancelled"] == 1
    assert short[1].events.get_nowait() == ("done", {"finish_reason": "cancelled"})
    joining = engine._join(pool, q.get())  # short[2], then `other`: alone
    assert [r.job for r in joining] == [short[2]] and q.qsize() == 3
    engine._advance(pool, joining, runs)
    joining = engine._join(pool, q.get())  # `other` (another shape): alone, short[3:] stay queued
    assert [r.job for r in joining] == [other] and q.qsize() == 2
    engine.prefill_tokens = 256
    assert len(engine._advance(pool, joining, runs)) == 1  # runs decode: one 256-row chunk this round


def test_scheduler_cancel_frees_the_slot(fake):
    """A client leaving mid-stream frees its slot at the next step (counted as cancelled); the other stream goes
    on to its full text and a waiting request takes the freed slot."""
    _, engine, client = fake
    pool = engine.pool
    want = _stream_completion(client, "import json\n", 60)[0]
    before = dict(engine.counts)
    start = len(pool.log)
    with ThreadPoolExecutor(3) as ex:
        stays = ex.submit(_stream_completion, client, "import json\n", 60)
        leaves = ex.submit(_stream_completion, client, "import time\n", 200, 2)
        left = leaves.result()
        later = ex.submit(_stream_completion, client, "import abc\n", 5)
        assert stays.result()[0] == want and later.result()[1] == "length"
    assert left[1] is None and left[0]
    for _ in range(200):
        if engine.counts["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.02)
    assert engine.counts["cancelled"] == before["cancelled"] + 1
    assert engine.counts["completed"] == before["completed"] + 2
    log = _log_since(pool, start)
    releases = [e[1] for e in log if e[0] == "release"]
    assert len(releases) == 3
    assert engine.running() == 0


def test_scheduler_errors_fail_only_their_request(fake, monkeypatch):
    """A request whose prefill fails gets a 500 (its message); one whose rounds fail mid-way too; the requests
    beside it complete, and the server keeps serving."""
    base, engine, client = fake
    pool = engine.pool
    real = pool.rounds_of

    def rounds_of(req):
        if engine.tokenizer.decode(req.ids).startswith("boom"):
            raise RuntimeError("device on fire")
        return real(req)

    monkeypatch.setattr(pool, "rounds_of", rounds_of)
    want = _stream_completion(client, "import io\n", 30)[0]
    with ThreadPoolExecutor(2) as ex:
        ok = ex.submit(_stream_completion, client, "import io\n", 30)
        bad = ex.submit(httpx.post, base + "/v1/completions", json={"model": "demo", "prompt": "boom", "max_tokens": 8},
                        timeout=60)
        r = bad.result()
        assert ok.result()[0] == want
    assert r.status_code == 500 and "device on fire" in r.json()["error"]["message"]
    assert _stream_completion(client, "import io\n", 30)[0] == want


def test_scheduler_join_failure_fails_only_that_request(fake, monkeypatch):
    """A failure while a job joins (here the pool's group sizes) is that request's 500, and the server goes on."""
    base, engine, client = fake
    pool = engine.pool
    real, calls = pool.group_sizes, []

    def group_sizes(n):
        if not calls:
            calls.append(1)
            raise RuntimeError("no sizes today")
        return real(n)
    monkeypatch.setattr(pool, "group_sizes", group_sizes)
    r = httpx.post(base + "/v1/completions", json={"model": "demo", "prompt": "import io\n", "max_tokens": 8},
                   timeout=60)
    assert r.status_code == 500 and "no sizes today" in r.json()["error"]["message"]
    assert _stream_completion(client, "import io\n", 8)[1] == "length"


def test_scheduler_step_failure_fails_the_running_requests(fake, monkeypatch):
    """A round that fails fails the requests running in it (500 / an error event), not the server: the next
    requests complete."""
    base, engine, client = fake
    pool = engine.pool
    real, calls = pool.step, []

    def step():  # fails once, when both requests run
        if len(pool.slots) == 2 and not calls:
            calls.append(1)
            raise RuntimeError("XLA went away")
        return real()

    want = _stream_completion(client, "import io\n", 30)[0]
    monkeypatch.setattr(pool, "step", step)
    body = {"model": "demo", "prompt": "import io\n", "max_tokens": 150}
    with ThreadPoolExecutor(2) as ex:
        rs = list(ex.map(lambda _: httpx.post(base + "/v1/completions", json=body, timeout=60), range(2)))
    assert [r.status_code for r in rs] == [500, 500]
    assert all("XLA went away" in r.json()["error"]["message"] for r in rs)
    assert _stream_completion(client, "import io\n", 30)[0] == want
    assert engine.running() == 0 and not pool.slots  # their slots released


# ------------------------------------------------------------------------------- the prefix cache (issue 39)
PREFIX_GRID = 256  # snapshots every 256 tokens inside prompts (the default 8192 needs longer prompts)


@pytest.fixture(scope="module")
def cached(pair, server):
    """(engine, client, ids) of a server with a prefix cache (2 slots, snapshots every PREFIX_GRID tokens) on the
    real pool; `server` first: its warm-up compiled what this engine runs (one cache capacity). ids(text): the
    completions endpoint's token ids of a text."""
    from jaxddtree.serving import Engine
    from jaxddtree.text import encode_text

    engine = Engine(pair.target, pair.drafter, pair.tokenizer, name="demo", method="ddtree", budget=64,
                    max_context=MAX_CONTEXT, queue_size=8, max_batch=2, prefix_cache_grid=PREFIX_GRID)
    assert engine.prefix_cache is not None and engine.pool.prefix_cache is engine.prefix_cache
    base, stop = _serve(engine)
    yield engine, openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120), \
        lambda text: encode_text(pair.tokenizer, text)
    stop()


CODE = "".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n\n" for i in range(40))


def _settle(engine):
    """Wait until the engine has snapshotted the finished requests' ends (`Engine.remembering`)."""
    for _ in range(1200):
        if not engine.remembering():
            return
        time.sleep(0.05)
    raise AssertionError("the finished requests' ends were not snapshotted within 60 s")


def _complete(engine, client, ids, max_tokens=20):
    """(text, cached_tokens) of a greedy completion of token ids (its end snapshotted before it returns)."""
    r = client.completions.create(model="demo", prompt=ids, max_tokens=max_tokens, temperature=0)
    _settle(engine)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def _fresh(engine, client, ids, max_tokens=20):
    """What a freshly started server returns: the text with an empty prefix cache (emptied again after)."""
    _settle(engine)
    engine.prefix_cache.clear()
    text, got = _complete(engine, client, ids, max_tokens)
    engine.prefix_cache.clear()
    assert got == 0
    return text


def test_prefix_cache_completions_exact(cached):
    """A prompt's end and its grid points are snapshotted, and after the request the end of its completion
    (prompt + completion, `SlotPool.remember`): the same prompt again hits the grid point below its end (the last
    prompt token is always recomputed), an agent step (the prompt + the completion + new tokens) hits the
    completion's end, new tokens right after the prompt hit the prompt's end (inside a chunk: 300 is no multiple
    of 64), a prompt diverging at 280 hits the grid point 256 (a partial match); each text equals a fresh
    server's, and usage reports the cached tokens."""
    engine, client, ids = cached
    P = ids(CODE)[:300]
    assert len(P) == 300
    first = _fresh(engine, client, P, 24)
    pc = engine.prefix_cache
    done = engine.remembered
    assert _complete(engine, client, P, 24) == (first, 0)
    assert engine.remembered == done + 1
    end = pc.snapshots()[-1]
    assert sorted(s.p for s in pc.snapshots()) == [256, 300, end.p] and end.p > 300 and pc.bytes > 0
    assert list(end.ids[:300]) == P and engine.tokenizer.decode(list(end.ids[300:])) == first
    assert engine.prefix_cache_bytes() == pc.bytes
    assert _complete(engine, client, P, 24) == (first, 256)  # the identical prompt: the grid point below its end
    assert engine.remembered == done + 1  # (its end is kept already)
    step = [int(x) for x in end.ids] + ids("\n\ndef g(y):\n    return")
    want = _fresh(engine, client, step, 24)
    _complete(engine, client, P, 24)
    assert _complete(engine, client, step, 24) == (want, end.p)  # the completion's end
    other = P + ids("\n\ndef g(y):\n    return")
    want = _fresh(engine, client, other, 24)
    _complete(engine, client, P, 24)
    assert _complete(engine, client, other, 24) == (want, 300)  # the previous prompt's end
    part = P[:280] + ids("class Z:\n    pass\n")
    want = _fresh(engine, client, part, 24)
    _complete(engine, client, P, 24)
    assert _complete(engine, client, part, 24) == (want, 256)  # matched to 280, the deepest snapshot below: 256


def test_prefix_cache_chat_exact(cached):
    """A chat's next turn (the first turn, the answer, a new question) hits the first request's completion end (a
    template that renders the answer otherwise than it was generated, e.g. without its reasoning, hits the prompt's
    end instead) and answers as a fresh server; so does the identical conversation sent again; streamed usage
    reports it too."""
    engine, client, _ = cached
    _settle(engine)
    engine.prefix_cache.clear()
    turn1 = [{"role": "user", "content": "Write a parser for this:\n" + CODE[:400]}]
    r1 = client.chat.completions.create(model="demo", messages=turn1, max_tokens=16, temperature=0)
    _settle(engine)
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "Now add tests."}]

    def ask(**kw):
        r = client.chat.completions.create(model="demo", messages=turn2, max_tokens=16, temperature=0, **kw)
        _settle(engine)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    hit = ask()
    assert hit[1] == r1.usage.prompt_tokens + r1.usage.completion_tokens  # (the demo's template: as generated)
    engine.prefix_cache.clear()
    fresh = ask()
    assert fresh == (hit[0], 0)
    stream = client.chat.completions.create(model="demo", messages=turn2, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == hit[0]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_prefix_cache_eviction_under_pressure(cached, monkeypatch):
    """With room for one prompt's snapshots, a second prompt evicts the first's (least recently used first, the
    bytes within the budget): the first's agent step then misses and still answers as a fresh server; a hit that
    does not fit at all is not kept."""
    engine, client, ids = cached
    pc = engine.prefix_cache
    A, B = ids(CODE)[:300], ids("# other\n" + CODE)[:300]
    assert A[:4] != B[:4]
    step = A + ids(" # next")
    want = _fresh(engine, client, step)
    _complete(engine, client, A)
    one = pc.bytes
    monkeypatch.setattr(pc, "budget", int(one * 1.5))
    _complete(engine, client, B)
    assert pc.bytes <= pc.budget and pc.stats["evicted"] >= 1
    assert all(s.ids[0] == B[0] for s in pc.snapshots())
    assert _complete(engine, client, step) == (want, 0)
    pc.set_budget(0)  # nothing fits: nothing is kept, the server still answers
    assert len(pc) == 0 and pc.bytes == 0
    assert _complete(engine, client, step) == (want, 0) and len(pc) == 0


def test_prefix_cache_shared_prefix_concurrent_and_joining(cached):
    """Two requests at once extending one cached prefix both resume from it (copy-on-write: the snapshot's
    arrays are unchanged after), and a request with a cached prefix joining a running batch; every text equals
    a fresh server's."""
    import numpy as np

    import jax

    engine, client, ids = cached
    pc = engine.prefix_cache
    P = ids(CODE)[:300]
    steps = [P + ids("\n# one"), P + ids("\nclass Two:\n")]
    long_prompt = ids("import os\nimport sys\n")
    want = [_fresh(engine, client, s) for s in steps]
    want_long = _fresh(engine, client, long_prompt, 600)
    _complete(engine, client, P)
    snap = next(s for s in pc.snapshots() if s.p == 300)

    def checksum():
        return [float(np.sum(np.asarray(x, np.float64))) for x in jax.tree.leaves(pc.arrays(snap))]
    before = checksum()
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda s: _complete(engine, client, s), steps))
    assert got == [(w, 300) for w in want]
    assert checksum() == before
    # a long request decoding, then a hit joins it (submitted once the long one streams)
    stream = client.completions.create(model="demo", prompt=long_prompt, max_tokens=600, temperature=0, stream=True)
    parts, spec = [], None
    with ThreadPoolExecutor(1) as ex:
        joined = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                parts.append(chunk.choices[0].text)
                if joined is None:
                    joined = ex.submit(_complete, engine, client, steps[0])
            if chunk.choices and chunk.choices[0].finish_reason:
                spec = chunk.model_extra.get("speculative")
        assert joined.result() == (want[0], 300)
    assert "".join(parts) == want_long and spec["batch"] == 2  # (the hit ran next to it)
