"""Tool calls: the Qwen3.5 / 3.6 block parser (jaxddtree/serving/tools.py) on model outputs, whole and split into
stream chunks (always the same content and calls), the typed arguments, and the ChatML fallback template's
rendering of tools, tool calls and tool results.

Where the cases come from (rewritten here, not copied): vLLM's tests/tool_parsers/test_qwen3coder_tool_parser.py,
test_qwen3_xml_coder_shared.py and test_qwen36_bugs.py (typed parameters, Python-repr objects, parallel calls, two
calls in one delta, arrays with JSON booleans) and its qwen3coder parser's structural scan (a literal
</parameter> or a whole <tool_call> block inside a value, a missing </parameter>); SGLang PR #27337 (drifted end
tags: </parameter1>, </parameter/>, </parameter_x>, a truncated </parameter) and SGLang's
test/registered/unit/function_call/test_qwen3_coder_detector.py (values ending like a drifted tag, linear time)
and test_unknown_tool_name.py (an unknown tool between known ones); ollama PR #17914 (a dropped
closing tag, closed by the next tag); mlx-lm PR #1881 (a parameter name whose ">" was dropped); ninfer issue #138
(Python True, a value holding a <parameter=...>...</parameter> pair); vLLM issue #39771 (a malformed parameter
must not lose the other calls)."""

from __future__ import annotations

import json
import random

import pytest

from jaxddtree.serving.tools import ToolCallParser, parse_text, prompt_in_think, typed_value

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "opts": {"type": "object"},
    "units": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "area", "parameters": {"type": "object", "properties": {
        "shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"},
        "scale": {"type": "number"}, "exact": {"type": "boolean"}, "tags": {"type": "array"},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "mode": {"oneOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "object"}]},
        "depth": {"type": "integer", "nullable": True},
        "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}}}}}}]


def block(name, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def events_of(text, tools=TOOLS, seed=0, pieces=None):
    """The parser's events for `text` fed in random pieces (pieces=n: n cuts)."""
    r = random.Random(seed)
    n = pieces if pieces is not None else r.randint(1, 40)
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, n))) if len(text) > 1 else []
    p = ToolCallParser(tools)
    events = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        events += p.feed(text[a:b])
    return events + p.finish(), p


def streamed(text, tools=TOOLS, seed=0, pieces=None):
    """(content, [(name, arguments)]) as a client assembles the stream: the arguments are the concatenated JSON
    fragments of each call's deltas."""
    events, p = events_of(text, tools, seed, pieces)
    content = "".join(v for k, v in events if k == "content")
    calls = {}
    for k, d in events:
        if k == "tool":
            c = calls.setdefault(d.index, ["", "", ""])
            c[0] += d.id or ""
            c[1] += d.name or ""
            c[2] += d.arguments
    out = [(c[1], json.loads(c[2])) for _, c in sorted(calls.items())]
    assert [c[0] for _, c in sorted(calls.items())] == [c.id for c in p.calls]
    assert out == [(c.name, c.arguments) for c in p.calls]
    assert [c[2] for _, c in sorted(calls.items())] == [json.dumps(c.arguments, ensure_ascii=False) for c in p.calls]
    return content, out


def whole(text, tools=TOOLS):
    content, calls = parse_text(text, tools)
    return content, [(x.name, x.arguments) for x in calls]


FILE = ("def f(x):\n    return '</parameter>' if x else \"<tool_call>\"\n</parameter>\nnot the end\n"
        "</parameter>\n</function>\nstill not\n")
CASES = {
    # well-formed (vLLM's basic cases)
    "one call": ("Let me check.\n\n" + block("get_weather", city="Paris", days=3) + "\n",
                 ("Let me check.", [("get_weather", {"city": "Paris", "days": 3})])),
    "content glued to the call": ("Sure!" + block("get_weather", city="Dallas"),
                                  ("Sure!", [("get_weather", {"city": "Dallas"})])),
    "several calls": (block("get_weather", city="Paris") + "\n" + block("ping") + "\n"
                      + block("get_weather", city="42", opts='{"a": [1, 2]}', units="null"),
                      ("", [("get_weather", {"city": "Paris"}), ("ping", {}),
                            ("get_weather", {"city": "42", "opts": {"a": [1, 2]}, "units": None})])),
    "multi-line values": (block("area", shape="rectangle", dimensions='{"width": 10,\n "height": 20}', precision=2),
                          ("", [("area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20},
                                          "precision": 2})])),
    "multi-line string": (block("get_weather", city="New\nYork <b>"), ("", [("get_weather", {"city": "New\nYork <b>"})])),
    "inline values": ("<tool_call><function=get_weather><parameter=city>Beijing</parameter>"
                      "<parameter=days>2</parameter></function></tool_call>",
                      ("", [("get_weather", {"city": "Beijing", "days": 2})])),
    "text after a call": (block("ping") + "\n\nDone.  ", ("Done.  ", [("ping", {})])),
    "no call": ("def f(x):\n    return x < 3\n\n", ("def f(x):\n    return x < 3\n\n", [])),
    "partial tag at the end": ("see <tool_", ("see <tool_", [])),
    # typed arguments (vLLM's type conversion, Python spellings, double-encoded JSON)
    "types": (block("area", precision="42", scale="3.14", exact="true", dimensions='{"key": "value"}',
                    tags='["a", "b", 1, true]', shape="null"),
              ("", [("area", {"precision": 42, "scale": 3.14, "exact": True, "dimensions": {"key": "value"},
                              "tags": ["a", "b", 1, True], "shape": "null"})])),
    "python spellings": (block("area", dimensions="{'key': 'value', 'ok': True, 'none': None}", exact="True",
                               tags="['x', 'y']", limit="None"),
                         ("", [("area", {"dimensions": {"key": "value", "ok": True, "none": None}, "exact": True,
                                         "tags": ["x", "y"], "limit": None})])),
    "double-encoded JSON": (block("area", dimensions='"{\\"w\\": 2}"', tags='"[1, 2]"', precision='"7"'),
                            ("", [("area", {"dimensions": {"w": 2}, "tags": [1, 2], "precision": 7})])),
    "anyOf / oneOf / nullable / nested": (block("area", limit="5", mode="a", depth="null",
                                                points='[{"x": "3"}, {"x": 4.0}]'),
                                          ("", [("area", {"limit": 5, "mode": "a", "depth": None,
                                                          "points": [{"x": 3}, {"x": 4}]})])),
    "oneOf object": (block("area", mode='{"k": 1}'), ("", [("area", {"mode": {"k": 1}})])),
    "untypeable stays text": (block("get_weather", days="three"), ("", [("get_weather", {"days": "three"})])),
    "undeclared parameter: text": (block("get_weather", extra="[1]"), ("", [("get_weather", {"extra": "[1]"})])),
    # malformed XML the models emit
    "</parameter> forgotten before the next": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>", ("", [("get_weather", {"city": "Paris", "days": 3})])),
    "</parameter> forgotten before </function>": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        ("", [("get_weather", {"city": "Paris"})])),
    "drifted end tags": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter1>\n<parameter=days>\n3\n"
        "</parameter/>\n<parameter=units>\nC\n</parameter_function>\n</function>\n</tool_call>",
        ("", [("get_weather", {"city": "Paris", "days": 3, "units": "C"})])),
    "truncated end tag": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter\n"
                          "</function>\n</tool_call>", ("", [("get_weather", {"city": "Paris"})])),
    "dropped > after a parameter name": ("<tool_call>\n<function=get_weather>\n<parameter=city\nOslo\n"
                                         "</parameter>\n</function>\n</tool_call>",
                                         ("", [("get_weather", {"city": "Oslo"})])),
    "two functions in one block": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
        "<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n</function>\n</tool_call>",
        ("", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})])),
    "</tool_call> forgotten": (block("ping")[:-len("</tool_call>")] + "Then text.",
                               ("Then text.", [("ping", {})])),
    "</tool_call> forgotten at the end": (block("get_weather", city="Rome")[:-len("\n</tool_call>")],
                                          ("", [("get_weather", {"city": "Rome"})])),
    "</function> forgotten": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                              "</tool_call>", ("", [("get_weather", {"city": "Rome"})])),
    "repeated parameter: the first": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n<parameter=city>\nB\n"
        "</parameter>\n</function>\n</tool_call>", ("", [("get_weather", {"city": "A"})])),
    "cut by the end of the text": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                                   "<parameter=days>\n3\n</param", ("", [("get_weather", {"city": "Paris", "days": 3})])),
    "a parameter tag never closed (vLLM #39771)": (
        "<tool_call>\n<function=get_weather>\n<parameter=city</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n" + block("ping"), ("", [("get_weather", {"days": 2}), ("ping", {})])),
    # literal tags inside a value (a file's contents), scanned with the schema's parameter names
    "</parameter> and <tool_call> inside a value": (
        block("write_file", path="a.py", content=FILE), ("", [("write_file", {"path": "a.py", "content": FILE})])),
    "a whole block inside a value": (
        block("write_file", path="t.txt", content=block("get_weather", city="x")),
        ("", [("write_file", {"path": "t.txt", "content": block("get_weather", city="x")})])),
    "a parameter pair inside a value": (
        block("write_file", path="p.py", content="pattern = r'<parameter=edits>\\n(.*?)\\n</parameter>'\nprint(1)"),
        ("", [("write_file", {"path": "p.py",
                              "content": "pattern = r'<parameter=edits>\\n(.*?)\\n</parameter>'\nprint(1)"})])),
    "a line <parameter=x> of another name inside a value": (
        block("write_file", content="a\n<parameter=query>\nb", path="q"),
        ("", [("write_file", {"content": "a\n<parameter=query>\nb", "path": "q"})])),
    "<tool_call> left out (vLLM's fallback)": (
        "Calling:\n<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>\nDone.",
        ("Calling:Done.", [("get_weather", {"city": "Dallas"})])),
    "<function=...> inside a line is text": ("Call it as <function=ping> please, or " + block("ping"),
                                             ("Call it as <function=ping> please, or", [("ping", {})])),
    "a value ending like a drifted tag, then </parameter>": (  # (SGLang's test_qwen3_coder_detector.py)
        block("get_weather", city="<config>\n  <p>1</p>\n</parameters>", units="x </parameterList>"),
        ("", [("get_weather", {"city": "<config>\n  <p>1</p>\n</parameters>", "units": "x </parameterList>"})])),
    "an unknown block between two calls": (block("ping") + block("nope", a=1) + block("get_weather", city="Oslo"),
                                           (block("nope", a=1), [("ping", {}), ("get_weather", {"city": "Oslo"})])),
    # <tool_call> that is not a call: content, and the calls after it still parsed
    "mentioned in prose": ("Use <tool_call> tags to call.\n" + block("ping"),
                           ("Use <tool_call> tags to call.", [("ping", {})])),
}
NOT_CALLS = [
    "<tool_call>\nget_weather(city='Paris')\n</tool_call>",                          # no <function=...>
    '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>',                  # Qwen3's JSON style
    "<tool_call>\n<function=>\n</function>\n</tool_call>",                           # no name
    block("delete_everything", path="/"),                                            # not in tools
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",                # a space
    "<tool_call>\n<function={name}>\n</function>\n</tool_call>",                     # braces
    "<tool_call>\n<function=\"ping\">\n</function>\n</tool_call>",                   # quotes
    "<tool_call>\n<function=get_weather>\nParis\n</function>\n</tool_call>",          # text, no parameter
    "<tool_call>\n<function=get_weather",                                            # cut in the header
    "<function=get_weather>\nParis\n</function>",                                    # bare, no parameter
    "<function=nope>\n<parameter=a>\n1\n</parameter>\n</function>",                    # bare, not a tool
]


@pytest.mark.parametrize("name", list(CASES))
def test_parse_cases(name):
    text, want = CASES[name]
    assert whole(text) == want
    for seed in range(30):  # the same however the text is split into stream chunks
        assert streamed(text, seed=seed) == want, seed
    assert streamed(text, pieces=len(text) - 1) == want  # one character at a time
    assert streamed(text, pieces=0) == want  # all at once (e.g. two calls in one delta)


@pytest.mark.parametrize("i", range(len(NOT_CALLS)))
def test_not_calls_stay_text(i):
    text = "Calling.\n" + NOT_CALLS[i]
    assert whole(text) == (text, [])
    for seed in range(10):
        assert streamed(text, seed=seed) == (text, [])
    # it does not hide the well-formed call after it
    assert whole(text + "\n" + block("ping")) == (text, [("ping", {})])


def test_long_values_parse_in_linear_time():
    """A long whitespace run in a value whose </parameter> was forgotten (SGLang's linear-time case)."""
    import time
    value = "a" + " " * 100_000 + "b"
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n" + value + "\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
    t = time.perf_counter()
    assert whole(text) == ("", [("get_weather", {"city": value, "days": 3})])
    assert streamed(text, pieces=20) == whole(text)
    assert time.perf_counter() - t < 1.0


def test_unknown_names_without_tools():
    """Without tools any plain name is a call (strings as they came); a name with quotes or braces is not."""
    assert whole(block("other", x="1"), tools=None) == ("", [("other", {"x": "1"})])
    assert whole(block("a{b}", x="1"), tools=None)[1] == []


def test_prose_is_not_held_back():
    """Text after a <tool_call> that is not a call comes out as soon as that is known, not at the end."""
    p = ToolCallParser(TOOLS)
    got = "".join(v for k, v in p.feed("Wrap it in <tool_call>") if k == "content")
    assert got == "Wrap it in"  # undecided: it may be a call
    got += "".join(v for k, v in p.feed(" tags and then") if k == "content")
    assert got == "Wrap it in <tool_call> tags and then"
    p = ToolCallParser(TOOLS)
    assert p.feed("<tool_call>\n<function=rm_r") == []
    # not a tool of the request: decided at its ">"
    assert "".join(v for k, v in p.feed("f>")) == "<tool_call>\n<function=rm_rf>"


def test_arguments_stream_as_they_parse():
    """The call's id and name come once the header is confirmed, each parameter as its end is known, "}" after
    </function>: before the block is complete."""
    p = ToolCallParser(TOOLS)
    assert p.feed("<tool_call>\n<function=get_weather>\n") == []
    assert p.feed("<param") == []  # may still be text
    (kind, head), = p.feed("eter=")
    assert kind == "tool" and head.name == "get_weather" and head.id.startswith("call_") and head.arguments == ""
    assert head.openai() == {"index": 0, "id": head.id, "type": "function",
                             "function": {"name": "get_weather", "arguments": ""}}
    assert p.feed("city>\nParis\n</parameter>\n") == []  # undecided: the value may go on
    (_, d), = p.feed("<parameter=days>\n")
    assert d.arguments == '{"city": "Paris"' and d.openai() == {"index": 0, "function": {"arguments": d.arguments}}
    assert p.feed("2\n</parameter>\n</function>") == []  # a </function> inside a value must meet </tool_call>
    assert p.feed("\n</tool") == []
    assert [e[1].arguments for e in p.feed("_call>")] == [', "days": 2', "}"]
    assert p.finish() == []
    assert p.calls[0].arguments == {"city": "Paris", "days": 2}


@pytest.mark.parametrize("text, schema, want", [
    ("42", {"type": "integer"}, 42), ("4.0", {"type": "integer"}, 4), ("-1.5", {"type": "number"}, -1.5),
    ("7", {"type": "number"}, 7), ("True", {"type": "boolean"}, True), ("FALSE", {"type": "boolean"}, False),
    ("null", {"type": "integer"}, None), ("null", {"type": ["integer", "null"]}, None),
    ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
    ("None", {"type": "string"}, "None"), ("42", {"type": "string"}, "42"), ("42", None, "42"),
    ("42", {"description": "no type"}, "42"), ("[1, 2]", {"type": ["string", "array"]}, [1, 2]),
    ("12", {"type": ["string", "integer"]}, "12"), ("x", {"enum": [1, 2]}, "x"), ("2", {"enum": [1, 2]}, 2),
    ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}), ('{"a": "1"}', {"type": "object", "properties": {
        "a": {"type": "integer"}}}, {"a": 1}), ('{"a": "1"}', {"type": "object"}, {"a": "1"}),
    ("[1,", {"type": "array"}, "[1,"), ("{1, 2}", {"type": "array"}, "{1, 2}"), ("NaN", {"type": "number"}, "NaN"),
    ("{'a': b'x'}", {"type": "object"}, "{'a': b'x'}"), ("'\\d'", {"type": "integer"}, "'\\d'"), ("__import__('os')", {"type": "object"}, "__import__('os')"),
])
def test_typed_value(text, schema, want):
    got = typed_value(text, schema)
    assert got == want and type(got) is type(want)


def test_thinking_prompt():
    assert prompt_in_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_in_think("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not prompt_in_think("x")


def test_openai_form():
    _, calls = parse_text(block("get_weather", city="Zürich", days=2), TOOLS)
    d = calls[0].openai(index=0)
    assert d["index"] == 0 and d["type"] == "function" and d["id"].startswith("call_")
    assert d["function"]["name"] == "get_weather"
    assert json.loads(d["function"]["arguments"]) == {"city": "Zürich", "days": 2}
    assert "Zürich" in d["function"]["arguments"]  # not \u-escaped
    _, again = parse_text(block("ping") * 2, TOOLS)
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


N_FUZZ = 300


def test_fuzz_streaming_equals_whole():
    """Random damage to well-formed outputs (pieces of tags cut, doubled, spliced): never an exception, and the
    stream always gives what the whole text gives."""
    r = random.Random(7)
    bits = ["<tool_call>", "</tool_call>", "<function=get_weather>", "<function=ping>", "</function>",
            "<parameter=city>", "<parameter=days>", "</parameter>", "</parameter1>", "\n", " ", "x", "<", ">", "3",
            "</think>", "'", "{", "}", "[", "True", "None", "\\", "\"", "NaN", "{1, 2}", "<parameter=opts>"]
    seeds = [CASES[k][0] for k in sorted(CASES)]
    for i in range(N_FUZZ):
        text = r.choice(seeds)
        for _ in range(r.randint(1, 6)):
            j = r.randrange(len(text) + 1)
            if r.random() < 0.5:
                text = text[:j] + r.choice(bits) + text[j:]
            else:
                text = text[:j] + text[j + r.randint(1, 12):]
        want = whole(text)
        for seed in range(3):
            assert streamed(text, seed=seed) == want, (i, text)
