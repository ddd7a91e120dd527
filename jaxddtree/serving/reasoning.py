"""Thinking apart from the answer: Qwen3.6's `<think>…</think>` -> `reasoning_content`, the rest -> `content`.

In thinking mode the chat template ends the prompt with "<think>\\n" (`tools.prompt_in_think`), so the model's
text starts with its reasoning and only "</think>" appears in it. `ReasoningParser` reads that text
incrementally, as vLLM's and SGLang's qwen3 reasoning parsers do:
- everything before "</think>" is reasoning, everything after it content;
- a `<tool_call>` followed (after whitespace) by `<function=` ends the reasoning too (Qwen3.5 / 3.6 sometimes call
  a tool without closing the think block): the call and what follows are content (and so parsed as calls); a
  `<tool_call>` mentioned otherwise stays reasoning;
- a text that never closes the block (cut by max_tokens) is all reasoning.
Whitespace around the reasoning and at the start of the answer is dropped (the template's newlines). With
thinking off (`chat_template_kwargs: {"enable_thinking": false}`: the prompt closes the block itself) the app
does not use this parser: all text is content.
"""

from __future__ import annotations

import re

THINK_END = "</think>"
OPEN, FUNC = "<tool_call>", "<function="
_MARK = re.compile(r"</think>|<tool_call>")


def _partial_suffix(text: str, tags) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    for k in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(len(t) > k and text.endswith(t[:k]) for t in tags):
            return k
    return 0


class ReasoningParser:
    """Incremental: `feed(text_delta)` / `finish()` -> new events in order: ("reasoning", text), ("content", text).
    However the text is split, each kind concatenates to the same text."""

    def __init__(self):
        self.buf = ""
        self.in_think = True
        self.started = False  # reasoning text seen (leading whitespace goes)
        self.ws = ""          # reasoning's trailing whitespace, held
        self.answer = False   # content seen (its leading whitespace goes)

    def feed(self, delta: str) -> list[tuple]:
        self.buf += delta
        return self._advance(final=False)

    def finish(self) -> list[tuple]:
        return self._advance(final=True)

    def _reasoning(self, out: list, text: str, final: bool):
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        text = self.ws + text
        kept = text.rstrip()
        self.ws = "" if final else text[len(kept):]
        if kept:
            out.append(("reasoning", kept))

    def _content(self, out: list, text: str):
        if not self.answer:
            text = text.lstrip()
            self.answer = bool(text)
        if text:
            out.append(("content", text))

    def _advance(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        if not self.in_think:
            self._content(out, self.buf)
            self.buf = ""
            return out
        for m in _MARK.finditer(self.buf):
            if m.group() == THINK_END:
                end, rest = m.start(), m.end()
            else:
                after = self.buf[m.end():].lstrip()
                if not after.startswith(FUNC):
                    if not final and FUNC.startswith(after):  # undecided: hold from the <tool_call> on
                        self._reasoning(out, self.buf[:m.start()], final=False)
                        self.buf = self.buf[m.start():]
                        return out
                    continue  # a <tool_call> mentioned in the reasoning
                end, rest = m.start(), m.start()
            self._reasoning(out, self.buf[:end], final=False)
            self.ws, self.in_think = "", False  # the reasoning's trailing whitespace goes
            self._content(out, self.buf[rest:])
            self.buf = ""
            return out
        keep = 0 if final else _partial_suffix(self.buf, (THINK_END, OPEN))
        self._reasoning(out, self.buf[:len(self.buf) - keep], final)
        self.buf = self.buf[len(self.buf) - keep:]
        return out
