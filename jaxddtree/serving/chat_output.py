"""A chat completion's text -> its message: reasoning (`reasoning.py`), content and tool calls (`tools.py`).

`ChatOutput(tools, in_think)` reads the model's text incrementally (`feed` / `finish` -> events in order:
("reasoning", text), ("content", text), ("tool", ToolCallDelta)) and keeps the whole message for a response
that is not streamed (`message`). Without tools and thinking the text is the content, untouched."""

from __future__ import annotations

from jaxddtree.serving.reasoning import ReasoningParser
from jaxddtree.serving.tools import ToolCallParser


class ChatOutput:
    def __init__(self, tools=None, in_think: bool = False):
        self.reasoning = ReasoningParser() if in_think else None
        self.tools = ToolCallParser(tools) if tools else None
        self.parts = {"reasoning": [], "content": []}

    def feed(self, text: str) -> list[tuple]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [("content", text)], final=False)

    def finish(self) -> list[tuple]:
        return self._route(self.reasoning.finish() if self.reasoning else [], final=True)

    def _route(self, events: list[tuple], final: bool) -> list[tuple]:
        out = []
        for kind, value in events:
            if kind == "content" and self.tools is not None:
                out += self.tools.feed(value)
            else:
                out.append((kind, value))
        if final and self.tools is not None:
            out += self.tools.finish()
        for kind, value in out:
            if kind in self.parts:
                self.parts[kind].append(value)
        return out

    @property
    def calls(self) -> list:
        return self.tools.calls if self.tools is not None else []

    def message(self) -> dict:
        """The OpenAI assistant message of everything fed (after `finish`): content (None when empty beside
        tool calls), reasoning_content (where thinking was on), tool_calls (where there are some)."""
        content = "".join(self.parts["content"])
        msg = {"role": "assistant", "content": content if (content or not self.calls) else None}
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(self.parts["reasoning"]) or None
        if self.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls]
        return msg
