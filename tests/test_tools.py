"""Tool calls: the Qwen3.5 / 3.6 block parser (jaxddtree/serving/tools.py) on crafted outputs, whole and split
into stream chunks, and the ChatML fallback template's rendering of tools, tool calls and tool results."""

from __future__ import annotations

import json
import random

import pytest

from jaxddtree.serving.tools import ToolCallParser, parse_block, parse_text, prompt_in_think

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"},
    "units": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


def block(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def streamed(text, tools=TOOLS, in_think=False, seed=0, pieces=None):
    """(content, [(name, arguments)]) of `text` fed in random pieces."""
    r = random.Random(seed)
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, pieces or r.randint(1, 25)))) if len(text) > 1 else []
    p = ToolCallParser(tools, in_think)
    content, calls = "", []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        c, n = p.feed(text[a:b])
        content, calls = content + c, calls + n
    c, n = p.finish()
    return content + c, [(x.name, x.arguments) for x in calls + n]


def whole(text, tools=TOOLS, in_think=False):
    content, calls = parse_text(text, tools, in_think)
    return content, [(x.name, x.arguments) for x in calls]


CASES = {
    "one call": ("Let me check.\n\n" + block("get_weather", city="Paris", days=3) + "\n",
                 ("Let me check.", [("get_weather", {"city": "Paris", "days": 3})])),
    "several calls": (block("get_weather", city="Paris") + "\n" + block("ping") + "\n"
                      + block("get_weather", city="42", opts='{"a": [1, 2]}', units="null"),
                      ("", [("get_weather", {"city": "Paris"}), ("ping", {}),
                            ("get_weather", {"city": "42", "opts": {"a": [1, 2]}, "units": None})])),
    "multi-line string": (block("get_weather", city="New\nYork <b>"),
                          ("", [("get_weather", {"city": "New\nYork <b>"})])),
    "unknown tool: strings": (block("other", x="1"), ("", [("other", {"x": "1"})])),
    "bad JSON for an integer stays text": (block("get_weather", days="three"),
                                           ("", [("get_weather", {"days": "three"})])),
    "no call": ("def f(x):\n    return x < 3\n\n", ("def f(x):\n    return x < 3\n\n", [])),
    "text after a call": (block("ping") + "\n\nDone.  ", ("Done.  ", [("ping", {})])),
    "partial tag at the end": ("see <tool_", ("see <tool_", [])),
}
MALFORMED = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",   # never closed
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",                              # no <function=...>
    "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",             # stray text
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",  # open parameter
    "<tool_call>\n<function=>\n</function>\n</tool_call>",                               # no name
    "<tool_call>\n<function=ping>\n</function>\nextra\n</tool_call>",                    # text after </function>
    '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',                      # Qwen3's JSON style
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>\n"
    "</tool_call>",                                                                      # repeated parameter
]


@pytest.mark.parametrize("name", list(CASES))
def test_parse_cases(name):
    text, want = CASES[name]
    assert whole(text) == want
    for seed in range(30):  # the same however the text is split into stream chunks
        assert streamed(text, seed=seed) == want, seed
    assert streamed(text, pieces=len(text) - 1) == want  # one character at a time


@pytest.mark.parametrize("i", range(len(MALFORMED)))
def test_malformed_stays_text(i):
    text = "Calling.\n" + MALFORMED[i]
    assert whole(text) == (text, [])
    for seed in range(10):
        assert streamed(text, seed=seed) == (text, [])
    assert parse_block(MALFORMED[i][len("<tool_call>"):-len("</tool_call>")]) is None or i == 0
    # a malformed block does not hide the well-formed call after it
    text2 = MALFORMED[i] + "\n" + block("ping") if i else MALFORMED[i]
    if i:
        assert whole(text2) == (MALFORMED[i], [("ping", {})])


def test_thinking_is_never_parsed():
    text = "I could use " + block("ping") + " here.\n</think>\n\n" + block("get_weather", city="Oslo")
    want = ("I could use " + block("ping") + " here.\n</think>", [("get_weather", {"city": "Oslo"})])
    assert whole(text, in_think=True) == want
    for seed in range(20):
        assert streamed(text, in_think=True, seed=seed) == want
    assert whole(text)[1][0] == ("ping", {})  # outside thinking the first block is a call
    assert prompt_in_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_in_think("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not prompt_in_think("x")


def test_openai_form():
    _, calls = parse_text(block("get_weather", city="Zürich", days=2), TOOLS)
    d = calls[0].openai(index=0)
    assert d["index"] == 0 and d["type"] == "function" and d["id"].startswith("call_")
    assert d["function"]["name"] == "get_weather"
    assert json.loads(d["function"]["arguments"]) == {"city": "Zürich", "days": 2}
    assert "Zürich" in d["function"]["arguments"]  # not \u-escaped
    _, again = parse_text(block("ping") * 2)
    assert again[0].id != again[1].id


@pytest.fixture(scope="module")
def demo_tokenizer():
    from jaxddtree.checkpoint import builtin
    from jaxddtree.text import ensure_chat_template, load_hf_tokenizer
    dirs = builtin.demo_dirs()
    if dirs is None:
        pytest.skip("the demo pair (demo/) is absent")
    tok = load_hf_tokenizer(dirs[0])
    ensure_chat_template(tok)
    return tok


def test_fallback_template_renders_tools(demo_tokenizer):
    """The ChatML fallback renders tools, calls and results in the Qwen format, and the parser reads the
    calls it renders back as the same calls."""
    from jaxddtree.text import render_chat
    args = {"city": "Paris", "days": 3, "opts": {"a": [1, "x"]}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}},
                {"id": "c2", "type": "function", "function": {"name": "ping", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "pong"}]
    text = render_chat(demo_tokenizer, msgs, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n" in text
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\npong\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>" in text
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn.startswith("Checking.\n\n<tool_call>\n<function=get_weather>\n")
    assert whole(turn) == ("Checking.", [("get_weather", args), ("ping", {})])
    # without tools: plain ChatML, as before
    plain = render_chat(demo_tokenizer, [{"role": "user", "content": "hi"}])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
