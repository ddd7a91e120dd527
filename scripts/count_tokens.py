#!/usr/bin/env python
"""Count the token ids of text files with a target's tokenizer: the frequency table a draft vocabulary is taken
from (`generate.py --draft-vocab N` and `jaxddtree.load_drafter(..., draft_vocab=N)` read the N most frequent ids
of DRAFTER_DIR/token_counts.json). Prints the share of the counted tokens the most frequent N ids cover.

  python scripts/count_tokens.py --target DIR --out DRAFTER_DIR/token_counts.json FILE|DIR ...

Directories are read recursively (files ending in --ext). The counts are a JSON list (or .npy) of
config.json's vocab_size integers, one per token id."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def text_files(paths, exts) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            for d, dirs, files in os.walk(p):
                dirs.sort()
                out += [os.path.join(d, f) for f in sorted(files) if f.endswith(exts)]
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise SystemExit(f"count_tokens.py: error: {p}: no such file or directory")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="FILE|DIR", help="text to count")
    ap.add_argument("--target", required=True, metavar="DIR", help="target directory: its tokenizer and "
                    "config.json's vocab_size")
    ap.add_argument("--out", required=True, metavar="FILE", help="the counts: .json (a list) or .npy")
    ap.add_argument("--ext", default=".py,.txt,.md", help="file endings read in directories (default: "
                    ".py,.txt,.md)")
    args = ap.parse_args(argv)
    from jaxddtree.model import draft_vocab
    from jaxddtree.model.config import load_config
    from jaxddtree.text import load_hf_tokenizer

    V = load_config(args.target).vocab_size
    tok = load_hf_tokenizer(args.target)
    files = text_files(args.paths, tuple(e.strip() for e in args.ext.split(",") if e.strip()))
    counts = np.zeros((V,), np.int64)
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            counts = draft_vocab.count(tok.encode(fh.read(), add_special_tokens=False), V, counts)
    draft_vocab.save(args.out, counts)
    total = int(counts.sum())
    print(f"{total:,} tokens of {len(files)} files, {int((counts > 0).sum()):,} of {V:,} ids seen -> {args.out}")
    for frac in (2, 4, 8, 16, 32):
        n = max(1, V // frac)
        cov = draft_vocab.coverage(counts, draft_vocab.frequent_ids(counts, n))
        print(f"  the {n:,} most frequent ids (1/{frac} of the vocabulary) cover {100 * cov:.2f} % of the tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
