"""argparse types shared by the command-line tools (scripts/generate.py, scripts/serve.py): each error is one line
("expected an integer, got 'x'", "must be >= 1, got 0"). Imports nothing heavy (the tools check their arguments
before jax loads)."""

from __future__ import annotations

import argparse
import math
import os


def checked(cast, ok, rule: str):
    """An argparse type: `cast(text)` ("expected an integer/a number" otherwise) for which `ok` holds ("must be
    <rule>" otherwise)."""
    noun = "an integer" if cast is int else "a number"

    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got '{text}'") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return v
    return parse


positive_int = checked(int, lambda v: v >= 1, ">= 1")
non_negative_int = checked(int, lambda v: v >= 0, ">= 0 (0 = off)")
non_negative_float = checked(float, lambda v: v >= 0, ">= 0")
finite_non_negative = checked(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
port = checked(int, lambda v: 0 <= v <= 65535, "in [0, 65535] (0 = any free port)")


def auto_or_positive_int(text: str):
    """'auto' (any case) or an integer >= 1 (--budget, --max-batch)."""
    if text.strip().lower() == "auto":
        return "auto"
    return positive_int(text)


def draft_vocab(text: str):
    """--draft-vocab: an integer N >= 1, or the path of an existing file (of token ids)."""
    try:
        n = int(text)
    except ValueError:
        if not os.path.isfile(text):
            raise argparse.ArgumentTypeError(f"expected an integer N >= 1 or a file of token ids, got '{text}' "
                                             "(no such file)") from None
        return text
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return n
