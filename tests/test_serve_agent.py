"""What a coding agent needs from the server, end to end through a real uvicorn server over a scripted pool
(helpers_pool.ScriptedPool: no model runs, so these are fast): API keys (--api-key), reasoning_content apart from
content (thinking on / off per request), typed tool-call arguments streamed as they parse,
usage.prompt_tokens_details.cached_tokens, and /metrics in Prometheus' text format."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prom = pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

KEYS = ["k-one", "k-two"]
# a Qwen3.6-like template: the generation prompt opens a think block unless enable_thinking is false
THINKING = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
            "{%- if m['reasoning_content'] is defined %}{{ '[r:' + m['reasoning_content'] + ']' }}{% endif %}"
            "{{ '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if tools %}{{ '<tools>' }}{%- for t in tools %}{{ t['function']['name'] + ';' }}{%- endfor %}"
            "{{ '</tools>' }}{%- endif %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "dry_run": {"type": "boolean"},
    "text": {"type": "string"}}}}}]
CALL = ("<tool_call>\n<function=edit>\n<parameter=path>\na.py\n</parameter>\n<parameter=line>\n12\n</parameter>\n"
        "<parameter=dry_run>\nTrue\n</parameter>\n<parameter=text>\nx = '</parameter>'\n</parameter>\n</function>\n"
        "</tool_call>")
ARGS = {"path": "a.py", "line": 12, "dry_run": True, "text": "x = '</parameter>'"}


@pytest.fixture(scope="module")
def served():
    """(base url, engine, script): a server with API keys over a scripted pool; script["text"] is what it
    'generates' for every request (4 tokens a round)."""
    from helpers_pool import FakePool, ScriptedPool
    from helpers_serve import serve_app
    from jaxddtree.checkpoint import builtin
    from jaxddtree.serving import Engine, create_app

    if builtin.demo_dirs() is None:
        pytest.skip("the demo pair (demo/) is absent")
    pair = builtin.load("float32")
    engine = Engine(pair.target, pair.drafter, pair.tokenizer, name="demo", method="ddtree", budget=64,
                    max_context=1024, queue_size=8, max_batch=2, pool_factory=FakePool)
    script = {"text": "Hello."}
    engine.pool = ScriptedPool(engine, lambda prompt: script["text"], per_round=4)
    base, stop = serve_app(create_app(engine, api_keys=KEYS), on_stop=engine.close)
    yield base, engine, script
    stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEYS[1], max_retries=0, timeout=60)


@pytest.fixture
def thinking(served, monkeypatch):
    monkeypatch.setattr(served[1].tokenizer, "chat_template", THINKING)


def test_api_keys(served, client):
    base = served[0]
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k-one"},
                    {"Authorization": "Bearer"}):
        r = httpx.get(base + "/v1/models", headers=headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    r = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401
    for key in KEYS:
        assert httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(base + "/health").status_code == 200 and httpx.get(base + "/metrics").status_code == 200
    assert client.completions.create(model="demo", prompt="hi", max_tokens=3).choices[0].text
    bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_reasoning_content(served, client, thinking):
    """Thinking on (the template's default): <think>…</think> -> reasoning_content, whole and streamed; off per
    request (chat_template_kwargs): all content; the history's reasoning_content reaches the template."""
    _, engine, script = served
    script["text"] = "First I add.\nThen I check.\n</think>\n\nIt is 4."
    msgs = [{"role": "user", "content": "2 + 2?"}]
    r = client.chat.completions.create(model="demo", messages=msgs, max_tokens=100)
    m = r.choices[0].message
    assert (m.content, m.model_extra["reasoning_content"]) == ("It is 4.", "First I add.\nThen I check.")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="demo", messages=msgs, max_tokens=100, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("First I add.\nThen I check.", "It is 4.")
    off = client.chat.completions.create(model="demo", messages=msgs, max_tokens=100,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == script["text"]
    assert "reasoning_content" not in (off.choices[0].message.model_extra or {})
    assert engine.pool.prompts[-1].endswith("<think>\n\n</think>\n\n")
    history = msgs + [{"role": "assistant", "content": "It is 4.", "reasoning_content": "First I add."},
                      {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="demo", messages=history, max_tokens=10)
    assert "It is 4.[r:First I add.]" in engine.pool.prompts[-1]


def test_tool_call_in_the_think_block(served, client, thinking):
    """A call the model makes before closing its think block is a call (as vLLM's qwen3 reasoning parser):
    typed arguments, a literal </parameter> kept in the value; streamed, the arguments come in several deltas
    (one per parameter) that concatenate to the non-streamed arguments."""
    _, engine, script = served
    script["text"] = "I should edit the file.\n" + CALL
    msgs = [{"role": "user", "content": "Fix it"}]
    r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.model_extra["reasoning_content"] == "I should edit the file."
    (call,) = c.message.tool_calls
    assert call.function.name == "edit" and json.loads(call.function.arguments) == ARGS
    assert "<tools>edit;</tools>" in engine.pool.prompts[-1]
    pieces, ids, finish = [], set(), None
    for chunk in client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=200,
                                                stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                assert tc.index == 0
                ids.add(tc.id) if tc.id else None
                pieces.append(tc.function.arguments or "")
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1
    assert len([p for p in pieces if p]) >= 4 and json.loads("".join(pieces)) == ARGS
    script["text"] = "<tool_call>\n<function=rm>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>"
    r = client.chat.completions.create(model="demo", messages=msgs, tools=TOOLS, max_tokens=200,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == script["text"] and not r.choices[0].message.tool_calls  # not a tool


def test_cached_tokens(served, client, monkeypatch):
    """usage.prompt_tokens_details.cached_tokens on every response (0 without a prefix cache; a pool's
    Pending.cached_tokens when it reports one)."""
    _, engine, script = served
    script["text"] = "Hello there."

    def details(usage):
        return usage.prompt_tokens_details.cached_tokens

    r = client.completions.create(model="demo", prompt="hi", max_tokens=3)
    assert details(r.usage) == 0
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert details(r.usage) == 0
    usage = [ch.usage for ch in client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}) if ch.usage]
    assert len(usage) == 1 and details(usage[0]) == 0
    real = engine.pool.prefill

    def cached_prefill(req):
        pending = real(req)
        pending.cached_tokens = len(req.ids) - 1
        return pending
    monkeypatch.setattr(engine.pool, "prefill", cached_prefill)
    r = client.completions.create(model="demo", prompt="one two three", max_tokens=3)
    assert details(r.usage) == r.usage.prompt_tokens - 1 > 0


def _samples(base) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(base + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics(served, client):
    base, engine, script = served
    script["text"] = "abcdefghijklmnopqrstuvwxyz " * 3
    before = _samples(base)
    for _ in range(2):
        client.completions.create(model="demo", prompt="count", max_tokens=12)
    for _ in range(50):  # the observer runs on the scheduler thread: the figures land a moment later
        after = _samples(base)
        if after[("jaxddtree_requests_total", (("finish_reason", "length"),))] >= \
                before.get(("jaxddtree_requests_total", (("finish_reason", "length"),)), 0) + 2:
            break
        time.sleep(0.05)

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)
    assert grew("jaxddtree_requests_total", (("finish_reason", "length"),)) == 2
    assert grew("jaxddtree_generation_tokens_total") == 24
    assert grew("jaxddtree_prompt_tokens_total") > 0 and grew("jaxddtree_cached_prompt_tokens_total") == 0
    assert grew("jaxddtree_time_to_first_token_seconds_count") == 2
    assert grew("jaxddtree_inter_token_latency_seconds_count") == 22  # the tokens after each first round's one
    assert grew("jaxddtree_spec_rounds_total") > 0 and after[("jaxddtree_mean_acceptance_length", ())] > 1
    assert sum(v for (n, _), v in after.items() if n == "jaxddtree_tree_budget_rounds_total") > 0
    assert after[("jaxddtree_running_requests", ())] == 0 and after[("jaxddtree_waiting_requests", ())] == 0
    assert after[("jaxddtree_max_batch", ())] == 2
    assert after[("jaxddtree_prefix_cache_bytes", ())] == 0
    assert after[("jaxddtree_prefix_cache_hit_rate", ())] == pytest.approx(  # (test_cached_tokens' hit counts)
        after[("jaxddtree_cached_prompt_tokens_total", ())] / after[("jaxddtree_prompt_tokens_total", ())])
