"""Tool calls in Qwen3.5 / 3.6 output -> OpenAI `tool_calls`.

The Qwen3.5 / 3.6 chat template asks for, and renders back, one block per call (the XML style that vLLM's
`qwen3_coder` tool parser reads; Qwen3's earlier JSON-in-<tool_call> "hermes" style is a different format):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

A string VALUE is rendered raw, any other JSON value as JSON; the newline after `<parameter=ARG>` and the one
before `</parameter>` belong to the format. `ToolCallParser` reads the model's text incrementally: text outside
the blocks is content, each well-formed block becomes a call, and anything else (a block that does not parse, a
block still open when the text ends) stays content, so a malformed call is text, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_END = "</think>"
_NAME = r"[^<>\n]+"
_PARAM = re.compile(r"<parameter=(" + _NAME + r")>\n?(.*?)\n?</parameter>", re.S)
_FUNCTION = re.compile(r"\s*<function=(" + _NAME + r")>(.*)</function>\s*", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        """The OpenAI form: {"id", "type": "function", "function": {"name", "arguments": JSON string}} (+ the
        stream's "index")."""
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}
        return d if index is None else {"index": index, **d}


def _schema_types(tools) -> dict[str, dict[str, object]]:
    """{function name: {parameter: its JSON-schema "type"}} of OpenAI `tools` (dicts)."""
    out = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()}
    return out


def _value(text: str, kind) -> object:
    """A parameter's value: raw text for a string (or an undeclared parameter; "null" is None where the schema
    allows null), else the JSON it spells (the raw text when it is not JSON)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if text == "null" and "null" in kinds:
        return None
    if kind is None or "string" in kinds:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_block(inner: str, tools=None) -> ToolCall | None:
    """The call in the text between <tool_call> and </tool_call>, or None when it is not one well-formed
    <function=...> block of <parameter=...> blocks (separated by whitespace only)."""
    m = _FUNCTION.fullmatch(inner)
    if not m:
        return None
    name, body = m.group(1).strip(), m.group(2)
    if not name:
        return None
    types = _schema_types(tools).get(name, {})
    args, pos = {}, 0
    for p in _PARAM.finditer(body):
        if body[pos:p.start()].strip():
            return None  # stray text between parameters
        key = p.group(1).strip()
        if not key or key in args:
            return None
        args[key] = _value(p.group(2), types.get(key))
        pos = p.end()
    if body[pos:].strip():
        return None
    return ToolCall(name, args)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Incremental: `feed(text_delta)` and `finish()` return (content_delta, [new ToolCall, ...]).

    The content deltas concatenate to the same text and the calls come out the same however the text is
    split. Held back until they are decided: a suffix that may start "<tool_call>", an open block, and
    trailing whitespace. Whitespace right before and right after a call is dropped (the template puts
    newlines around the blocks); all other text is kept as it came. `in_think`: the text starts inside a <think> block (the
    prompt ended with an open "<think>"): everything up to "</think>" is content, never a call.
    """

    def __init__(self, tools=None, in_think: bool = False):
        self.tools = tools
        self.in_think = in_think
        self.buf = ""            # undecided text
        self.after_call = False  # whitespace right after a call is dropped
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        return self._advance(final=True)

    def _emit(self, out: list, text: str):
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        out.append(text)

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        out, new = [], []
        while self.buf:
            if self.in_think:
                i = self.buf.find(THINK_END)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.buf, THINK_END)
                    self._emit(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._emit(out, self.buf[:i + len(THINK_END)])
                self.buf = self.buf[i + len(THINK_END):]
                self.in_think = False
                continue
            i = self.buf.find(OPEN)
            if i < 0:  # no block starts here: content, but for a possible start of the tag and whitespace
                keep = 0 if final else _partial_suffix(self.buf, OPEN)
                head, tail = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                text = head if final else head.rstrip()  # whitespace waits: a call may follow it
                self._emit(out, text)
                self.buf = head[len(text):] + tail
                break
            before = self.buf[:i]
            j = self.buf.find(CLOSE, i + len(OPEN))
            if j < 0:  # an open block: wait for its end (still open at the end of the text: content)
                if final:
                    self._emit(out, self.buf)
                    self.buf = ""
                else:
                    self._emit(out, before.rstrip())
                    self.buf = before[len(before.rstrip()):] + self.buf[i:]
                break
            end = j + len(CLOSE)
            call = parse_block(self.buf[i + len(OPEN):j], self.tools)
            if call is None:  # malformed: the block stays text
                self._emit(out, self.buf[:end])
            else:
                self._emit(out, before.rstrip())
                new.append(call)
                self.after_call = True
            self.buf = self.buf[end:]
        self.calls.extend(new)
        return "".join(out), new


def parse_text(text: str, tools=None, in_think: bool = False) -> tuple[str, list[ToolCall]]:
    """The whole text at once: (content, calls)."""
    p = ToolCallParser(tools, in_think)
    content, calls = p.feed(text)
    rest, more = p.finish()
    return content + rest, calls + more


def prompt_in_think(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a <think> block open (Qwen3.6's generation prompt ends with
    "<think>\\n" in thinking mode): the model's text then starts with its reasoning."""
    return prompt_text.rfind("<think>") > prompt_text.rfind(THINK_END)
