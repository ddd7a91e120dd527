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
before `</parameter>` belong to the format. `ToolCallParser` reads the model's text incrementally and is as
lenient as the models need (what vLLM, SGLang, llama.cpp and ollama met in practice):

- a block is a call once `<tool_call>` is followed (after whitespace) by `<function=NAME>` with NAME one of the
  request's tools (without tools: any name free of whitespace, quotes and `{}<>()=,;/\\`), and then by a
  `<parameter=`, `</function>` or `</tool_call>` tag; otherwise `<tool_call>` is text (content), released as soon
  as that is known, never held back to the end;
- a value ends at a `</parameter>` (or a drifted form: `</parameter1>`, `</parameter/>`, `</parameter_x>`, a
  truncated `</parameter`) that whitespace and then a tag (`<parameter=` a parameter of the function's schema,
  `</function>` before `</tool_call>` / `<function=` / the end, `</tool_call>`) or the end of the text follow; at a line `<parameter=NAME>` of a schema
  parameter not given yet (the `</parameter>` forgotten); at a line `</function>` followed by `</tool_call>`.
  Any other `</parameter>`, `<tool_call>`, ... (a file's contents) is part of the value, as is a whole nested
  `<tool_call>...</tool_call>` block;
- a `<function=NAME>` block at the start of a line without `<tool_call>` is read as if it had one (vLLM's
  fallback); two `<function=` blocks in one `<tool_call>` are two calls; a missing `</tool_call>` or `</function>` ends the
  block where the next text starts; a block still open when the text ends is a call with what it holds (the
  finish reason says "length" when max_tokens cut it);
- a repeated parameter keeps its first value; values get the types of the tool's JSON schema (`typed_value`).

The parser returns events in order: ("content", text) and ("tool", ToolCallDelta) — a call's first delta has
its id and name, the next ones the JSON of its arguments as each parameter ends, the last "}" — so the
arguments stream as they parse, and the deltas of a call concatenate to `json.dumps(arguments)`. Decisions only
depend on text already seen: however the text is split, the events concatenate to the same content and calls.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
import warnings
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNC, FUNC_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
THINK_END = "</think>"
MAX_NAME = 256  # a function name longer than this is not one
_BAD_NAME = re.compile(r"[\s\"'`{}<>()=,;/\\]")
_TAGS = (PARAM, FUNC_END, CLOSE)  # what may follow a function header or a parameter's end
# in a value: the tags that may end it or open / close a nested block
_MARK = re.compile(r"<tool_call>|</tool_call>|</parameter|<parameter=|</function>")
_DRIFT = re.compile(r"</parameter([^\s<>]{0,16})>")  # </parameter>, </parameter1>, </parameter/>, ...
MAX_LITERAL = 1 << 20  # longer values are not parsed as Python literals


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


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the first has `id` and `name` (arguments ""), the others a fragment of the
    arguments' JSON."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


# ------------------------------------------------------------------------------------------------ typed values
def _schemas(tools) -> dict[str, dict] | None:
    """{function name: {parameter: its JSON schema}} of OpenAI `tools` (dicts); None without tools."""
    if tools is None:
        return None
    out = {}
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
            out[fn["name"]] = props
    return out


_KINDS = {"string": "string", "str": "string", "text": "string", "integer": "integer", "int": "integer",
          "number": "number", "float": "number", "double": "number", "boolean": "boolean", "bool": "boolean",
          "object": "object", "dict": "object", "array": "array", "list": "array", "null": "null"}


def _kinds(schema) -> set[str]:
    """The JSON types a schema admits: "type" (a name or a list), anyOf / oneOf / allOf (recursively),
    "nullable", "enum" / "const" (their values' types); an empty set: anything."""
    if not isinstance(schema, dict):
        return set()
    out = set()
    t = schema.get("type")
    for name in (t if isinstance(t, list) else [t] if t is not None else []):
        if isinstance(name, str):
            out.add(_KINDS.get(name.strip().lower(), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            sub_kinds = _kinds(sub)
            if not sub_kinds:  # a branch that admits anything
                return set()
            out |= sub_kinds
    for v in list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else []):
        out.add(_kind_of(v))
    if schema.get("nullable") is True and out:
        out.add("null")
    if not out and isinstance(schema.get("properties"), dict):
        out.add("object")
    if not out and "items" in schema:
        out.add("array")
    return out


def _kind_of(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, dict):
        return "object"
    if isinstance(v, (list, tuple)):
        return "array"
    return "string"


def _fits(v, kinds: set[str]) -> bool:
    k = _kind_of(v)
    return k in kinds or (k == "integer" and "number" in kinds) or (
        k == "number" and "integer" in kinds and float(v).is_integer())


def _jsonable(v, depth: int = 0) -> bool:
    """Whether a parsed value is plain JSON (no set, bytes, complex, NaN, non-string key; not absurdly deep)."""
    if depth > 100:
        return False
    if v is None or isinstance(v, (bool, int, str)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(_jsonable(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, (str, int)) and not isinstance(k, bool) and _jsonable(x, depth + 1)
                   for k, x in v.items())
    return False


def _literals(text: str):
    """The values `text` may spell, most likely first: JSON, a Python literal (True / None, single quotes), and
    each again when it is a string (double-encoded JSON); only plain JSON values."""
    out, seen = [], set()

    def parse(s):
        for f in (json.loads, ast.literal_eval):
            if f is ast.literal_eval and len(s) > MAX_LITERAL:
                continue
            try:
                with warnings.catch_warnings():  # ("invalid escape sequence" in a string literal)
                    warnings.simplefilter("ignore")
                    v = f(s)
            except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                continue
            if _jsonable(v):
                yield v
    for v in parse(text.strip()):
        key = repr(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
        if isinstance(v, str) and v.strip() != text.strip():
            for w in parse(v.strip()):
                if repr(w) not in seen:
                    seen.add(repr(w))
                    out.append(w)
    return out


def _coerce(v, schema):
    """A parsed value with nested values typed as `schema` says (strings that spell a number, a bool, ...;
    tuples as lists); others as they are."""
    kinds = _kinds(schema)
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, str) and kinds and "string" not in kinds:
        for w in _literals(v):
            if _fits(w, kinds):
                v = w
                break
    if isinstance(v, float) and "integer" in kinds and "number" not in kinds and v.is_integer():
        return int(v)
    if isinstance(v, dict):
        props = schema.get("properties") if isinstance(schema, dict) else None
        extra = schema.get("additionalProperties") if isinstance(schema, dict) else None
        return {str(k): _coerce(x, (props or {}).get(k, extra if isinstance(extra, dict) else None))
                for k, x in v.items()}
    if isinstance(v, list):
        items = schema.get("items") if isinstance(schema, dict) else None
        return [_coerce(x, items) for x in v]
    return v


def typed_value(text: str, schema) -> object:
    """A parameter's value from its raw text and its JSON schema (None: undeclared -> the raw text):
    "null" / "None" is None where the schema admits null or no string; where a string is admitted the raw text, unless it
    spells an object or array the schema admits too; otherwise the first reading of the text (JSON, a Python
    literal, double-encoded JSON) that has an admitted type, nested values typed by the schema too; the raw text
    when none has (or the schema names no type)."""
    kinds = _kinds(schema) if schema is not None else set()
    if not kinds:
        return text
    if text.strip() in ("null", "None") and ("null" in kinds or "string" not in kinds):
        return None  # (as vLLM: an optional integer the model leaves null is null, not the text "null")
    wanted = kinds - {"string"} if "string" not in kinds else kinds & {"object", "array"}
    if not wanted:
        return text
    for v in _literals(text):
        if not isinstance(v, str) and _fits(v, wanted):
            return _coerce(v, schema)
    if "boolean" in wanted and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    return text


# ----------------------------------------------------------------------------------------------- block scanning
@dataclass
class _Call:
    name: str
    params: list = field(default_factory=list)  # [(key, raw value)], first of each key
    done: bool = False


@dataclass
class _Scan:
    calls: list  # the calls decided so far (a prefix of the final ones; the last may still grow)
    end: int | None = None  # where the block ends, once known
    not_call: bool = False  # the <tool_call> is text


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


def _could_be(rest: str, tags) -> bool:
    """Whether `rest` (the text to the end) is a proper prefix of one of `tags`."""
    return any(t.startswith(rest) and len(rest) < len(t) for t in tags)


def _good_name(name: str, names) -> bool:
    return bool(name) and len(name) <= MAX_NAME and not _BAD_NAME.search(name) and (names is None or name in names)


def _param_name(text: str, i: int):
    """`<parameter=` at i: (name, value start) — the name ends at ">" or, where the model dropped it, at a
    newline; None while neither has come."""
    start = i + len(PARAM)
    gt, nl = text.find(">", start), text.find("\n", start)
    if gt < 0 and nl < 0:
        return None
    if gt >= 0 and (nl < 0 or gt < nl):
        v = gt + 1
        if v < len(text) and text[v] == "\n":
            v += 1
        elif v == len(text):
            return None  # the newline that belongs to the format may come
        return text[start:gt].strip(), v
    return text[start:nl].strip(), nl + 1


def _value_end(text: str, v: int, keys, seen: set, final: bool, bare: bool = False):
    """The end of the value that starts at v -> (value end, where the next tag starts), or None while undecided.
    `keys`: the function's schema parameters (None: any name); `seen`: the parameters given so far; bare: the
    block has no <tool_call> (a </function> then ends it whatever follows)."""
    depth = 0  # nested <tool_call> blocks inside the value (a file that holds one)
    n = len(text)
    for m in _MARK.finditer(text, v):
        tag, i = m.group(), m.start()
        if tag == OPEN:
            rest = text[_skip_ws(text, m.end()):]
            if rest.startswith(FUNC):
                depth += 1
            elif not final and _could_be(rest, (FUNC,)) or not rest and not final:
                return None
            continue
        if tag == CLOSE:
            depth = max(0, depth - 1)
            continue
        if depth:
            continue
        if tag == "</parameter":
            d = _DRIFT.match(text, i)
            if d is not None:
                after = d.end()
            else:  # "</parameter" not closed by ">": truncated when whitespace, a tag or the end follows
                after = m.end()
                if after == n and not final:
                    return None
                if after < n and not (text[after].isspace() or text[after] == "<"):
                    if not final and re.fullmatch(r"[^\s<>]{0,16}", text[after:]):
                        return None  # a drifted tag still coming
                    continue
            ok = _follows_param(text, _skip_ws(text, after), keys, None, final, bare)
        elif tag == PARAM:  # the previous </parameter> forgotten: a line that opens a parameter not given yet
            if text[i - 1] != "\n":
                continue
            ok = _follows_param(text, i, keys, seen, final)
        else:  # </function> on a line of its own, then </tool_call> or the end: the </parameter> forgotten
            if text[i - 1] != "\n":
                continue
            rest = text[_skip_ws(text, m.end()):]
            if rest.startswith(CLOSE) or (final and not rest):
                ok = True
            else:
                ok = None if not final and (not rest or _could_be(rest, (CLOSE,))) else False
        if ok is None:
            return None
        if ok:
            end = i - 1 if i > v and text[i - 1] == "\n" else i
            return end, (i if tag != "</parameter" else _skip_ws(text, after))
    if not final:
        return None
    end = n  # the text ended inside the value: it is what came (without a partial end tag)
    for k in range(min(len(PARAM_END) - 1, n - v), 0, -1):
        if text.endswith(PARAM_END[:k]):
            end = n - k
            break
    if end > v and text[end - 1] == "\n":
        end -= 1
    return end, n


def _follows_param(text: str, j: int, keys, unseen_of, final: bool, bare: bool = False):
    """Whether a parameter can end before position j: a tag follows (`<parameter=NAME>` with NAME a schema
    parameter, and not given yet when `unseen_of` is the set given), or the end of the text. None: undecided."""
    rest = text[j:]
    if not rest:
        return True if final else None
    if rest.startswith(CLOSE):
        return True
    if rest.startswith(FUNC_END):  # ... itself followed by </tool_call>, the next function or the end
        if bare:
            return True
        after = text[_skip_ws(text, j + len(FUNC_END)):]
        if after.startswith(CLOSE) or after.startswith(FUNC) or (final and not after):
            return True
        return None if not final and (not after or _could_be(after, (CLOSE, FUNC))) else False
    if rest.startswith(PARAM):
        got = _param_name(text, j)
        if got is None:
            return False if final else None
        name = got[0]
        if not name or _BAD_NAME.search(name):
            return False
        if unseen_of is not None and name in unseen_of:
            return False
        return keys is None or name in keys
    if not final and _could_be(rest, _TAGS):
        return None
    return False


def scan_block(text: str, final: bool, schemas) -> _Scan:
    """Read the block that starts `text` (with "<tool_call>", or a bare "<function=") as far as it is decided."""
    calls: list[_Call] = []
    pos = len(OPEN) if text.startswith(OPEN) else 0
    n = len(text)
    while True:  # a function in the block
        p = _skip_ws(text, pos)
        if not text.startswith(FUNC, p):
            rest = text[p:]
            if not final and (not rest or _could_be(rest, (FUNC, CLOSE) if calls else (FUNC,))):
                return _Scan(calls)
            if not calls:
                return _Scan(calls, not_call=True)
            if rest.startswith(CLOSE):
                return _Scan(calls, end=p + len(CLOSE))
            return _Scan(calls, end=pos)  # </tool_call> forgotten: the text after the call is content again
        start = p + len(FUNC)
        gt = text.find(">", start)
        head = text[start:gt if gt >= 0 else n]
        if gt < 0:
            if not final and len(head) <= MAX_NAME and not _BAD_NAME.search(head.strip()):
                return _Scan(calls)
            return _Scan(calls, not_call=True) if not calls else _Scan(calls, end=pos)
        name = head.strip()
        if not _good_name(name, schemas):
            return _Scan(calls, not_call=True) if not calls else _Scan(calls, end=pos)
        q = _skip_ws(text, gt + 1)
        rest = text[q:]
        if not any(rest.startswith(t) for t in _TAGS):  # a header must be followed by a tag
            if not final and (not rest or _could_be(rest, _TAGS)):
                return _Scan(calls)
            if final and not rest:  # "<function=NAME>" and the end: a call without arguments
                calls.append(_Call(name, done=True))
                return _Scan(calls, end=n)
            return _Scan(calls, not_call=True) if not calls else _Scan(calls, end=pos)
        call = _Call(name)
        calls.append(call)
        keys = None if schemas is None or not schemas.get(name) else set(schemas[name])
        seen: set[str] = set()
        p = q
        while True:  # its parameters
            p = _skip_ws(text, p)
            if text.startswith(PARAM, p):
                got = _param_name(text, p)
                if got is None:
                    if final:
                        call.done = True
                        return _Scan(calls, end=n)
                    return _Scan(calls)
                key, v = got
                if "<" in key:  # "<parameter=city</parameter>": no name; the value is dropped
                    key = ""
                ends = _value_end(text, v, keys, seen | {key}, final, bare=not text.startswith(OPEN))
                if ends is None:
                    return _Scan(calls)
                vend, p = ends
                if key and key not in seen:
                    seen.add(key)
                    call.params.append((key, text[v:vend]))
                if p >= n and final:
                    call.done = True
                    return _Scan(calls, end=n)
                continue
            if text.startswith(FUNC_END, p):
                call.done = True
                pos = p + len(FUNC_END)
                break  # the next function of the block, or its end
            if text.startswith(CLOSE, p):
                call.done = True
                return _Scan(calls, end=p + len(CLOSE))
            rest = text[p:]
            if final:
                call.done = True
                return _Scan(calls, end=p if rest else n)
            if not rest or _could_be(rest, _TAGS):
                return _Scan(calls)
            call.done = True  # not reached: a decided value end is followed by a tag
            return _Scan(calls, end=p)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Incremental: `feed(text_delta)` and `finish()` return the new events in order: ("content", text) and
    ("tool", ToolCallDelta). `calls`: the calls so far (ToolCall, arguments typed by the schema).

    However the text is split, the content deltas concatenate to the same text and the calls come out the same.
    Held back until decided: a suffix that may start "<tool_call>", a block until it is known to be a call (or
    not), a value until its end is known, and trailing whitespace. Whitespace right before and right after a call
    is dropped (the template puts newlines around the blocks); all other text is kept as it came.
    """

    def __init__(self, tools=None):
        self.schemas = _schemas(tools)
        self.buf = ""            # undecided text (in a block: from its "<tool_call>")
        self.in_block = False
        self.prev = "\n"         # the character before buf (a bare <function= must start a line)
        self.ws = ""             # whitespace held: dropped if a call follows
        self.after_call = False  # whitespace right after a call is dropped
        self.calls: list[ToolCall] = []
        self._sent: list[list] = []  # per call of the current block: [ToolCall, index, parameters sent, closed]

    def feed(self, delta: str) -> list[tuple]:
        self.buf += delta
        return self._advance(final=False)

    def finish(self) -> list[tuple]:
        return self._advance(final=True)

    def _content(self, out: list, text: str, final: bool):
        text = self.ws + text
        self.ws = ""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if not final:
            kept = text.rstrip()
            self.ws, text = text[len(kept):], kept
        if text:
            out.append(("content", text))

    def _advance(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        while True:
            if not self.in_block:
                i = self._block_start()
                if i < 0:
                    keep = 0 if final else max(_partial_suffix(self.buf, OPEN), _partial_suffix(self.buf, FUNC))
                    self._consume(out, len(self.buf) - keep, final)
                    return out
                self._consume(out, i, final=False)
                self.in_block, self._sent = True, []
            scan = scan_block(self.buf, final, self.schemas)
            if scan.not_call:
                self._consume(out, len(OPEN) if self.buf.startswith(OPEN) else len(FUNC), final=False)
                self.in_block = False
                continue
            self._emit_calls(out, scan.calls)
            if scan.end is None:
                if final:  # not reached: a final scan decides
                    self._content(out, self.buf, final=True)
                    self.buf, self.in_block = "", False
                return out
            self.prev = self.buf[scan.end - 1] if scan.end else self.prev
            self.buf = self.buf[scan.end:]
            self.in_block, self.after_call = False, True

    def _block_start(self) -> int:
        """Where the next block may start in buf: "<tool_call>", or "<function=" at the start of a line (the
        models sometimes leave out <tool_call>, as vLLM's fallback reads); -1: none."""
        i = self.buf.find(OPEN)
        j = self.buf.find(FUNC)
        while j >= 0 and not (self.buf[j - 1] == "\n" if j else self.prev == "\n"):
            j = self.buf.find(FUNC, j + 1)
        return min(k for k in (i, j) if k >= 0) if max(i, j) >= 0 else -1

    def _consume(self, out: list, n: int, final: bool):
        """The first n characters of buf are content."""
        if n:
            self.prev = self.buf[n - 1]
        self._content(out, self.buf[:n], final)
        self.buf = self.buf[n:]

    def _emit_calls(self, out: list, calls: list):
        for k, c in enumerate(calls):
            if k == len(self._sent):
                self.ws = ""  # whitespace before a call goes
                tc = ToolCall(c.name, {})
                self.calls.append(tc)
                self._sent.append([tc, len(self.calls) - 1, 0, False])
                out.append(("tool", ToolCallDelta(len(self.calls) - 1, "", id=tc.id, name=tc.name)))
            tc, index, sent, closed = self._sent[k]
            props = (self.schemas or {}).get(c.name) or {}
            for key, raw in c.params[sent:]:
                tc.arguments[key] = typed_value(raw, props.get(key))
                piece = json.dumps({key: tc.arguments[key]}, ensure_ascii=False)[1:-1]
                out.append(("tool", ToolCallDelta(index, ("{" if not sent else ", ") + piece)))
                sent += 1
            if c.done and not closed:
                out.append(("tool", ToolCallDelta(index, "}" if sent else "{}")))
                closed = True
            self._sent[k] = [tc, index, sent, closed]


def parse_text(text: str, tools=None) -> tuple[str, list[ToolCall]]:
    """The whole text at once: (content, calls)."""
    p = ToolCallParser(tools)
    events = p.feed(text) + p.finish()
    return "".join(e[1] for e in events if e[0] == "content"), list(p.calls)


def prompt_in_think(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a <think> block open (Qwen3.6's generation prompt ends with
    "<think>\\n" in thinking mode): the model's text then starts with its reasoning."""
    return prompt_text.rfind("<think>") > prompt_text.rfind(THINK_END)
