"""Thinking apart from the answer: jaxddtree/serving/reasoning.py (and chat_output.py, which chains it with the
tool-call parser), whole and split into stream chunks. Cases after vLLM's qwen3 reasoning parser
(vllm/reasoning/qwen3_reasoning_parser.py: only </think> in the output, a <tool_call><function=...> inside an
unclosed think block ends the reasoning, a bare <tool_call> mention does not, no </think> = all reasoning)."""

from __future__ import annotations

import json
import random

import pytest

from jaxddtree.serving.chat_output import ChatOutput
from jaxddtree.serving.reasoning import ReasoningParser

TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}}}}}]
CALL = "<tool_call>\n<function=ping>\n<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>"


def pieces(text, seed):
    r = random.Random(seed)
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randint(1, 30)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def split(text, seed=None):
    """(reasoning, content) of `text`, whole (seed None) or in random pieces."""
    p = ReasoningParser()
    events = []
    for piece in ([text] if seed is None else pieces(text, seed)):
        events += p.feed(piece)
    events += p.finish()
    return "".join(v for k, v in events if k == "reasoning"), "".join(v for k, v in events if k == "content")


CASES = [
    ("Let me think.\nIt is 4.\n</think>\n\nThe answer is 4.", ("Let me think.\nIt is 4.", "The answer is 4.")),
    ("\n\nshort</think>answer", ("short", "answer")),
    ("cut by max_tokens, never closed\n", ("cut by max_tokens, never closed", "")),
    ("</think>\n\nno reasoning", ("", "no reasoning")),
    ("I would write <tool_call> tags.\nDone.</think>ok", ("I would write <tool_call> tags.\nDone.", "ok")),
    ("I will call it.\n" + CALL, ("I will call it.", CALL)),  # a call before </think>: the reasoning ends
    ("a</think>b</think>c", ("a", "b</think>c")),
    ("a </thi", ("a </thi", "")),
]


@pytest.mark.parametrize("i", range(len(CASES)))
def test_reasoning_split(i):
    text, want = CASES[i]
    assert split(text) == want
    for seed in range(25):
        assert split(text, seed) == want, seed


def test_reasoning_streams_before_the_end():
    p = ReasoningParser()
    assert p.feed("\nStep one.\n") == [("reasoning", "Step one.")]  # the trailing newline waits
    assert p.feed("Step two </th") == [("reasoning", "\nStep two")]  # so does a partial </think>
    assert p.feed("ink>\n\nAnswer") == [("content", "Answer")]


def test_chat_output_message():
    """Reasoning, content and a call from one text, the same streamed as whole; a call inside the unclosed think
    block is a call; thinking off: all content."""
    text = "Plan: ping.\n</think>\n\nPinging.\n" + CALL
    for in_think, want in ((True, ("Plan: ping.", "Pinging.")), (False, (None, text.split(CALL)[0].rstrip()))):
        whole = ChatOutput(TOOLS, in_think)
        whole.feed(text)
        whole.finish()
        msg = whole.message()
        assert (msg.get("reasoning_content"), msg["content"]) == want
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
            [("ping", {"n": 2})]
        for seed in range(10):
            s = ChatOutput(TOOLS, in_think)
            events = [e for piece in pieces(text, seed) for e in s.feed(piece)] + s.finish()
            assert "".join(v for k, v in events if k == "content") == (want[1] or "")
            assert "".join(v for k, v in events if k == "reasoning") == (want[0] or "")
            assert "".join(v.arguments for k, v in events if k == "tool") == '{"n": 2}'
    inside = ChatOutput(TOOLS, True)
    inside.feed("Calling now " + CALL)
    inside.finish()
    msg = inside.message()
    assert msg["reasoning_content"] == "Calling now" and msg["content"] is None and len(msg["tool_calls"]) == 1
    plain = ChatOutput(None, True)
    plain.feed("hmm</think>hi")
    plain.finish()
    assert plain.message() == {"role": "assistant", "content": "hi", "reasoning_content": "hmm"}
