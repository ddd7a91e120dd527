"""An HF tokenizer directory read without transformers (whose import pulls in torch: seconds of start-up in
every user command): tokenizer.json through the `tokenizers` package, the special tokens of
tokenizer_config.json (and special_tokens_map.json), and the chat template (chat_template.jinja,
chat_template.json or tokenizer_config.json's `chat_template`) rendered by jinja2 as transformers renders it
(`apply_chat_template`: a sandboxed environment with trim_blocks / lstrip_blocks, loop controls, its `tojson`,
`raise_exception` and `strftime_now`; messages without their None fields, reasoning under its aliases; the
special tokens as template variables).

`HfTokenizer` has what jaxddtree uses of a transformers tokenizer: `tok(text, add_special_tokens=)["input_ids"]`,
`encode`, `decode(ids, skip_special_tokens=)`, `eos_token_id`, `chat_template`, `apply_chat_template`,
`get_vocab`, `convert_tokens_to_ids`. A directory without tokenizer.json (a slow tokenizer only) is not read
here: `jaxddtree.text.load_hf_tokenizer` hands it to transformers."""

from __future__ import annotations

import json
import os

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases of a message's reasoning


def readable(path: str) -> bool:
    """Whether `path` holds a tokenizer this module reads (tokenizer.json)."""
    return os.path.isfile(os.path.join(path, "tokenizer.json"))


def _json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        out = json.load(f)
    return out if isinstance(out, dict) else {}


def _content(tok) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def _chat_template(path: str, config: dict):
    """The directory's chat template: a string, a dict of named templates, or None."""
    named = {}
    extra = os.path.join(path, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as f:
                    named[name[:-len(".jinja")]] = f.read()
    default = None
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
        with open(os.path.join(path, "chat_template.jinja"), encoding="utf-8") as f:
            default = f.read()
    else:
        default = _json(os.path.join(path, "chat_template.json")).get("chat_template") or config.get("chat_template")
    if isinstance(default, list):  # [{"name": ..., "template": ...}]
        named.update({t["name"]: t["template"] for t in default})
        default = named.pop("default", None)
    if named:
        return dict(named, **({"default": default} if default else {}))
    return default or None


class HfTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        self._tk = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        self._tk.no_truncation()
        self._tk.no_padding()
        config = _json(os.path.join(path, "tokenizer_config.json"))
        specials = _json(os.path.join(path, "special_tokens_map.json"))
        self.special_tokens_map = {k: t for k in SPECIAL if (t := _content(config.get(k, specials.get(k))))}
        for k in SPECIAL:
            setattr(self, k, self.special_tokens_map.get(k))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _chat_template(path, config)

    @property
    def eos_token_id(self) -> int | None:
        return self._tk.token_to_id(self.eos_token) if self.eos_token is not None else None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:  # transformers' clean_up_tokenization
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, tokenize: bool = True,
                            add_generation_prompt: bool = False, chat_template: str | None = None, **kwargs):
        """The chat rendered as transformers' `apply_chat_template` renders it (text, or its ids with
        tokenize=True, without added special tokens)."""
        template = self._template(chat_template, tools)
        chat = []
        for m in messages:
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in REASONING if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
            chat.append(m)
        text = _compile(template).render(messages=chat, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, name: str | None, tools) -> str:
        t = self.chat_template
        if isinstance(t, dict):
            if name is not None and name in t:
                return t[name]
            if name is None:
                key = "tool_use" if tools is not None and "tool_use" in t else "default"
                if key not in t:
                    raise ValueError(f"{self.path}: several chat templates ({', '.join(sorted(t))}) and no default")
                return t[key]
        if name is not None:
            return name
        if not t:
            raise ValueError(f"{self.path}: the tokenizer has no chat template")
        return t


_COMPILED: dict[str, object] = {}


def _compile(template: str):
    """transformers' chat-template environment (utils/chat_template_utils.py), without the {% generation %}
    tracking (assistant masks are for training)."""
    if template in _COMPILED:
        return _COMPILED[template]
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # {% generation %} ... {% endgeneration %}: rendered as is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    _COMPILED[template] = compiled = env.from_string(template)
    return compiled
