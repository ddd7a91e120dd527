"""TextStream (jaxddtree/text.py): incremental detokenisation with OpenAI-style stop strings gives the same
text for every chunking of the ids, never splits a UTF-8 character, and cuts before the first stop string."""

from __future__ import annotations

import random

import pytest

from jaxddtree.checkpoint.builtin import ByteTokenizer
from jaxddtree.text import TextStream

TEXT = "héllo — 日本語 abc STOP x 😀 b c tail"


def run(ids, stops, rng):
    s, out, hit = TextStream(ByteTokenizer(), stops), [], False
    i = 0
    while i < len(ids) and not hit:
        n = rng.randint(1, 5)
        delta, hit = s.feed(ids[i:i + n])
        assert "\ufffd" not in delta
        out.append(delta)
        i += n
    if not hit:
        out.append(s.finish())
    return "".join(out), hit


@pytest.mark.parametrize("stops, expected", [
    ((), TEXT),
    (("STOP",), TEXT[:TEXT.index("STOP")]),
    (("😀", "STOP"), TEXT[:TEXT.index("STOP")]),  # the earliest occurrence wins, whatever the list order
    (("b c", "zz"), TEXT[:TEXT.index("b c")]),
    (("日本",), "héllo — "),
    (("héllo",), ""),
    (("not there", "tail!"), TEXT),
])
def test_chunkings_agree(stops, expected):
    ids = list(TEXT.encode("utf-8"))
    rng = random.Random(0)
    for _ in range(30):
        text, hit = run(ids, stops, rng)
        assert text == expected
        assert hit == (expected != TEXT)
