"""jaxddtree.tokenizer.HfTokenizer (an HF tokenizer directory read without transformers, so without torch) against
transformers' AutoTokenizer on the same directories: token ids, decoded text, the EOS id, and chat templates
rendered the same way (the demo's ChatML with tools and tool calls, a Qwen-style template with thinking,
reasoning fields, tojson and raise_exception), each template stored where transformers stores it."""

from __future__ import annotations

import json
import os
import string

import pytest

from jaxddtree import text, tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TARGET = os.path.join(ROOT, "demo", "target")
TEXTS = ["def parse(path):\n    return open(path).read()", "", "  spaces   and\ttabs\n\n", "naïve café ✓ 東京 🙂",
         "<|endoftext|> in the text", "x" * 300]

QWEN_STYLE = (  # the constructs of Qwen3.6's template: tools as JSON, reasoning, thinking on / off, errors
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}"
    "{%- endif %}"
    "<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>"
    "\n\n{% endif %}"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}{{ c.text }}{% endfor %}"
    "{%- endif %}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}{{ eos_token if false }}\n   {% if tools %}\nT{% endif %}\n")  # trim_blocks, lstrip_blocks


def _char_tokenizer(path, template, as_list=False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = list(dict.fromkeys(string.ascii_letters + string.digits + " \n" + string.punctuation + "ï"))
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"], chat_template=template)
    tok.save_pretrained(path)
    if as_list:  # the older layout: templates in tokenizer_config.json, as a list of named ones
        os.remove(os.path.join(path, "chat_template.jinja"))
        cfg_path = os.path.join(path, "tokenizer_config.json")
        cfg = json.load(open(cfg_path))
        cfg["chat_template"] = [{"name": "default", "template": template},
                                {"name": "tool_use", "template": "TOOLS {{ tools | length }}"}]
        json.dump(cfg, open(cfg_path, "w"))
    return path


def _both(path):
    from transformers import AutoTokenizer
    return tokenizer.HfTokenizer(path), AutoTokenizer.from_pretrained(path)


def test_demo_tokenizer_matches_transformers():
    ours, ref = _both(DEMO_TARGET)
    assert ours.eos_token_id == ref.eos_token_id and ours.chat_template is None and not ref.chat_template
    for t in TEXTS:
        ids = ours(t)["input_ids"]
        assert ids == ref(t)["input_ids"] == ours.encode(t, add_special_tokens=False), t
        assert ours.decode(ids) == ref.decode(ids) and text.decode(ours, ids) == text.decode(ref, ids), t
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.convert_tokens_to_ids("<|mask|>") == ref.convert_tokens_to_ids("<|mask|>")


def test_load_hf_tokenizer_needs_no_transformers():
    tok = text.load_hf_tokenizer(DEMO_TARGET)
    assert isinstance(tok, tokenizer.HfTokenizer)
    text.ensure_chat_template(tok)  # the demo's: ChatML
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments":
                                                                                  {"x": 1, "s": "é"}}}]},
             {"role": "tool", "content": "42"}]
    ours, ref = _both(DEMO_TARGET)
    text.ensure_chat_template(ours)
    text.ensure_chat_template(ref)
    for kw in ({}, {"tools": tools}):
        assert text.render_chat(ours, turns, **kw) == text.render_chat(ref, turns, **kw), kw
        assert text.encode_chat(ours, turns, **kw) == text.encode_chat(ref, turns, **kw), kw


@pytest.mark.parametrize("layout", ["jinja", "config_list"])
def test_chat_template_matches_transformers(tmp_path, layout):
    path = _char_tokenizer(str(tmp_path), QWEN_STYLE, as_list=layout == "config_list")
    ours, ref = _both(path)
    assert ours.chat_template == ref.chat_template
    tools = [{"type": "function", "function": {"name": "g", "description": "ï", "parameters": {}}}]
    chats = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"}]},
         {"role": "assistant", "content": "b", "reasoning": "r1"}, {"role": "user", "content": "c"}],
        [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "y", "thinking": "t"}],
    ]
    for chat in chats:
        for kw in ({}, {"enable_thinking": False}, {"enable_thinking": True}, {"tools": tools},
                   {"add_generation_prompt": False}):
            kw = {"add_generation_prompt": True, **kw}
            want = ref.apply_chat_template(chat, tokenize=False, **kw)
            assert ours.apply_chat_template(chat, tokenize=False, **kw) == want, (chat, kw)
            assert ours.apply_chat_template(chat, **kw) == ref(want, add_special_tokens=False)["input_ids"]
    bad = [{"role": "robot", "content": "x"}]
    with pytest.raises(Exception, match="bad role robot") as e:
        ours.apply_chat_template(bad, tokenize=False)
    with pytest.raises(type(e.value), match="bad role robot"):
        ref.apply_chat_template(bad, tokenize=False)


def test_broken_tokenizer_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError) as e:
        text.load_hf_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "cannot load the tokenizer" in str(e.value) and "\n" not in str(e.value)
