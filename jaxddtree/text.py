"""Tokenizer helpers shared by scripts/generate.py and the server (jaxddtree.serving): loading a directory's
tokenizer, a minimal ChatML template for tokenizers without one (the demo pair's), prompt encoding, the default
stop ids, and incremental detokenisation with OpenAI-style stop strings (`TextStream`)."""

from __future__ import annotations

import os

# a tokenizer without a chat template (the demo's) gets ChatML, as plain text where the vocabulary lacks
# <|im_start|> / <|im_end|>. With `tools`, it renders them, the assistant's tool calls and the tool results in the
# Qwen3.5 / 3.6 format (jaxddtree/serving/tools.py): the tools as JSON lines in <tools> in a system turn (after
# the system message, if any), each call as a <tool_call><function=...><parameter=...> block after the
# assistant's text, the results of consecutive tool messages as <tool_response> blocks of one user turn.
CHATML = (  # literal text as expressions: transformers renders templates with trim_blocks (a newline after a tag goes)
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ (messages[0]['content'] or '') + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nThese functions are available:\\n<tools>' }}"
    "{%- for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call one, reply with one block per call, and nothing after them:\\n<tool_call>\\n"
    "<function=NAME>\\n<parameter=ARGUMENT>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and tools and loop.first %}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + (m['content'] or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif m['role'] == 'assistant' and m['tool_calls'] %}{{ '<|im_start|>assistant\\n' + (m['content'] or '') }}"
    "{%- for c in m['tool_calls'] %}{% set f = c['function'] if c['function'] is defined else c %}"
    "{%- if not loop.first %}{{ '\\n' }}{% elif m['content'] %}{{ '\\n\\n' }}{% endif %}"
    "{{ '<tool_call>\\n<function=' + f['name'] + '>\\n' }}"
    "{%- for k, v in f['arguments'].items() %}{{ '<parameter=' + k + '>\\n' }}"
    "{{- v if v is string else v | tojson }}{{ '\\n</parameter>\\n' }}{% endfor %}"
    "{{ '</function>\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' }}{{ m['content'] }}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def has_tokenizer(path: str) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any(os.path.isfile(os.path.join(path, n)) for n in names)


def load_hf_tokenizer(path: str):
    """The directory's tokenizer: a `jaxddtree.tokenizer.HfTokenizer` when it has tokenizer.json (no transformers,
    so no torch import), else transformers' AutoTokenizer (a slow tokenizer: tokenizer.model / vocab.json)."""
    from jaxddtree import tokenizer
    try:
        if tokenizer.readable(path):
            return tokenizer.HfTokenizer(path)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # a broken/unsupported tokenizer is an unusable input, not a crash
        msg = " ".join(str(e).split())
        raise ValueError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {msg})") from None


def ensure_chat_template(tok) -> None:
    """Give a tokenizer (transformers' or `HfTokenizer`) without a chat template the minimal ChatML one; ValueError for a
    tokenizer that cannot apply templates at all (the random pair's byte tokenizer)."""
    if getattr(tok, "chat_template", None):
        return
    if not hasattr(tok, "apply_chat_template"):
        raise ValueError("the chat template needs a transformers tokenizer (the random pair's byte tokenizer "
                         "has none)")
    tok.chat_template = CHATML


def render_chat(tok, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> str:
    """`messages` (and OpenAI `tools`, when given) rendered by the tokenizer's chat template, ending with the
    assistant's prompt. Assistant tool calls carry their arguments as a dict (the templates iterate them)."""
    if tools:
        template_kwargs["tools"] = tools
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)


def encode_rendered(tok, text: str) -> list[int]:
    """Token ids of a rendered chat (its special tokens are in the text already)."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


def encode_chat(tok, messages: list[dict], **template_kwargs) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template, ending with the assistant's prompt."""
    return encode_rendered(tok, render_chat(tok, messages, **template_kwargs))


def encode_text(tok, text: str) -> list[int]:
    """Token ids of plain `text` (no template)."""
    if hasattr(tok, "apply_chat_template"):  # HF tokenizer
        return list(tok(text)["input_ids"])
    return tok.encode(text)


def encode_prompt(tok, text: str, chat: bool, system: str | None = None, thinking: bool | None = None) -> list[int]:
    """Token ids of `text`: one user turn (after a `system` turn) through the chat template when `chat` and
    the tokenizer has one; `thinking` (None: the template's default) is passed as enable_thinking."""
    if chat and getattr(tok, "chat_template", None):
        turns = [{"role": "system", "content": system}] if system is not None else []
        kw = {} if thinking is None else {"enable_thinking": thinking}
        return encode_chat(tok, turns + [{"role": "user", "content": text}], **kw)
    return encode_text(tok, text)


def default_stop_ids(cfg, tok) -> list[int]:
    """The config's EOS ids and the tokenizer's EOS id, within the vocabulary."""
    ids = set(int(i) for i in getattr(cfg, "eos_token_ids", ()) or ())
    eos = getattr(tok, "eos_token_id", None) if tok is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    return sorted(i for i in ids if 0 <= i < cfg.vocab_size)


def decode(tok, ids) -> str:
    if hasattr(tok, "apply_chat_template"):
        return tok.decode(ids, skip_special_tokens=True)
    return tok.decode(ids)


class TextStream:
    """Incremental detokenisation with stop strings, as the OpenAI API cuts them.

    `feed(ids)` returns (delta, hit): the text that became final, and whether a stop string was found (then the
    text ends right before its first occurrence, which is not included, and nothing more comes). Text that
    could still change is held back: a trailing incomplete UTF-8 character (U+FFFD) and a suffix that could be
    the start of a stop string. `finish()` returns the held-back rest at the end of generation. The deltas
    concatenate to the same text however the ids are chunked.
    """

    def __init__(self, tok, stops=()):
        self.tok, self.ids, self.sent = tok, [], ""
        self.stops = [s for s in stops if s]
        self.done = False

    def feed(self, ids) -> tuple[str, bool]:
        self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def finish(self) -> str:
        return self._advance(final=True)[0]

    @property
    def text(self) -> str:
        return self.sent

    def _advance(self, final: bool) -> tuple[str, bool]:
        if self.done:
            return "", True
        text = decode(self.tok, self.ids)
        if not final:
            text = text.rstrip("\ufffd")
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            end, hit = min(hits), True
        else:
            end, hit = len(text) - (0 if final else self._holdback(text)), False
        if not text.startswith(self.sent):  # decoding changed earlier text (not for byte-level BPE): keep going
            return "", hit
        end = max(end, len(self.sent))
        delta = text[len(self.sent):end]
        self.sent += delta
        self.done = hit or final
        return delta, hit

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
