"""A small byte-level BPE tokenizer for the demo pair, trained with the `tokenizers` package.

Special tokens: id 0 `<|endoftext|>` (end of document, the model's eos) and id 1 `<|mask|>` (the DFlash
drafter's mask token). Saved in the transformers layout (tokenizer.json + tokenizer_config.json), so
`transformers.AutoTokenizer.from_pretrained(dir)` returns a `PreTrainedTokenizerFast`.
"""

from __future__ import annotations

import os
import zlib
from typing import Iterable, Sequence

EOS = "<|endoftext|>"
MASK = "<|mask|>"
EOS_ID, MASK_ID = 0, 1

STDLIB = "/root/.pyenv/versions/3.12.1/lib/python3.12"


def stdlib_files(root: str = STDLIB, heldout_every: int = 25) -> tuple[list[str], list[str]]:
    """(train, held-out) `.py` files of the standard library, skipping site-packages and test dirs. A file is
    held out when crc32(relative path) % heldout_every == 0 (a deterministic ~4 % split)."""
    train, held = [], []
    for d, dirs, files in os.walk(root):
        rel_d = os.path.relpath(d, root)
        parts = rel_d.split(os.sep)
        if "site-packages" in parts or "test" in parts or "tests" in parts or "__pycache__" in parts:
            dirs[:] = []
            continue
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.normpath(os.path.join(rel_d, f))
                (held if zlib.crc32(rel.encode()) % heldout_every == 0 else train).append(os.path.join(root, rel))
    return train, held


def read_texts(files: Iterable[str]) -> list[str]:
    out = []
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            out.append(fh.read())
    return out


def train_tokenizer(texts: Sequence[str], vocab_size: int = 2048):
    """Byte-level BPE (GPT-2 style pre-tokenisation) -> `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(EOS) == EOS_ID and tok.token_to_id(MASK) == MASK_ID
    return tok


def save_tokenizer(tok, out_dir: str) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json (transformers layout)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, mask_token=MASK, pad_token=EOS,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out_dir)


def load_tokenizer(path: str):
    """The saved tokenizer as a `transformers.PreTrainedTokenizerFast`."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


def heldout_prompts(tok, n: int, length: int, seed: int = 1, files: Sequence[str] | None = None) -> list[list[int]]:
    """n prompts of `length` tokens (`tok`: a transformers tokenizer) cut at line starts from the texts of `files`
    longer than 4,000 characters (default: the held-out stdlib files of `stdlib_files`)."""
    import numpy as np

    files = stdlib_files()[1] if files is None else files
    texts = [t for t in read_texts(files) if len(t) > 4000]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = texts[i % len(texts)]
        s = int(rng.integers(0, len(t) - 3000))
        s = t.index("\n", s) + 1
        out.append(tok(t[s:s + 2000])["input_ids"][:length])
    return out
