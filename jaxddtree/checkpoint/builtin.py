"""The embedded default model pair: what `scripts/generate.py` runs when no `--target` is given.

`load()` returns the trained demo pair shipped in `demo/` (a 1.4 M-parameter Qwen3.6-style hybrid target
trained on the Python standard library's source with a 2048-token BPE tokenizer, and a DFlash drafter trained
on that target's own greedy continuations; see demo/README.md and NOTES.md "Demo pair training"). If `demo/`
is absent (an installed package without the repo), or with `load_random()`, it falls back to the random pair:

    built-in random demo model: output is noise

Random pair, built in code, no files: a small random Qwen3.5/3.6-style hybrid target (4 layers,
[GDN, GDN, GDN, attention], hidden 64), a matching random DFlash drafter (2 layers, block size 8, fed by
target layers 1 and 3) and a byte-level "tokenizer" (UTF-8 bytes are token ids 0..255). The weights are
random, so the text is noise and the drafter's proposals are rarely accepted; the pair exists to exercise
the whole pipeline (prefill, drafting, tree build, tree verify, commit, streaming) quickly on a CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

LABEL = "built-in random demo model: output is noise (the trained demo pair in demo/ was not found)"
DEFAULT_PROMPT = "The quick brown fox"
DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "demo")
DEMO_LABEL = ("built-in demo pair (demo/): a tiny hybrid target trained on Python stdlib source + its DFlash "
              "drafter; expect Python-flavoured, repetitive text")
DEMO_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "

BYTES = 256
MASK_ID = 256  # the drafter's mask token (never produced by encode; decodes to nothing)
VOCAB = 257


class ByteTokenizer:
    """UTF-8 bytes <-> token ids 0..255. Ids >= 256 (the mask token) decode to nothing."""

    eos_token_id = None
    chat_template = None
    vocab_size = VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, **_: Any) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < BYTES).decode("utf-8", errors="replace")


def target_config():
    from jaxddtree.model.config import ATTENTION, GDN, TextConfig
    return TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=(GDN, GDN, GDN, ATTENTION),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=2048, eos_token_ids=())


def drafter_config():
    from jaxddtree.model.drafter_config import DrafterConfig
    return DrafterConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        rms_norm_eps=1e-6, rope_theta=10000.0, block_size=8, target_layer_ids=(1, 3), mask_token_id=MASK_ID,
        vocab_size=VOCAB, num_target_layers=4, layer_windows=(None, None))


def random_drafter_params(cfg, dtype, seed: int):
    """Random `DrafterParams` in the JAX layout (see jaxddtree.model.drafter.DrafterLayer for the shapes)."""
    import jax.numpy as jnp
    from jaxddtree.model.drafter import DrafterLayer, DrafterParams

    rng = np.random.default_rng(seed)
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv, nT = cfg.num_heads, cfg.num_kv_heads, cfg.num_target_features

    def w(shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(fan_in), dtype)

    def norm(n):
        return jnp.asarray(1.0 + 0.1 * rng.standard_normal(n), dtype)

    layers = tuple(DrafterLayer(
        attn_norm=norm(H), w_qkv=w((H, (nh + 2 * nkv) * hd), H),
        wo=w((nh, hd, H), nh * hd), q_norm=norm(hd), k_norm=norm(hd), mlp_norm=norm(H),
        w_gate_up=w((H, 2, I), H), w_down=w((I, H), I)) for _ in range(cfg.num_layers))
    return DrafterParams(fc=w((nT * H, H), nT * H), hidden_norm=norm(H), layers=layers, norm=norm(H))


def random_target_params(cfg, seed: int) -> dict[tuple, np.ndarray]:
    """{param path: fp32 numpy array} for every target parameter, drawn with numpy (the same scales as the
    modules' own random init in jaxddtree.model.qwen35, without compiling one RNG kernel per parameter shape)."""
    from flax import nnx

    import jax.numpy as jnp
    from jaxddtree.model.qwen35 import Qwen35

    rng = np.random.default_rng(seed)
    abstract = nnx.eval_shape(lambda: Qwen35(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    params = {}

    def walk(d, prefix=()):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, prefix + (k,))
            else:
                params[prefix + (k,)] = draw(prefix + (k,), tuple(v.shape))

    def draw(path, shape):
        name = path[-1]
        normal = lambda: rng.standard_normal(shape)
        if name == "dt_bias":
            x = rng.uniform(-1.0, 1.0, shape)
        elif name == "A_log":
            x = np.log(rng.uniform(1.0, 16.0, shape))
        elif path[-2:] == ("mixer", "norm"):  # GDN gated norm: plain weight
            x = 1.0 + 0.1 * normal()
        elif "norm" in name or (len(path) > 1 and "norm" in str(path[-2])):  # (1 + w) RMSNorms, q/k norms
            x = 0.1 * normal()
        elif name == "embed":
            x = normal()
        else:  # projections: std 1/sqrt(fan_in)
            fan_in = int(np.prod(shape[:-1])) if name in ("wo", "w_out") else shape[0]
            x = normal() / np.sqrt(fan_in)
        return x.astype(np.float32)

    walk(nnx.to_pure_dict(nnx.split(abstract)[1]))
    return params


@dataclasses.dataclass
class BuiltinModel:
    target: Any  # jaxddtree.Target
    drafter: Any  # jaxddtree.Drafter
    tokenizer: ByteTokenizer
    label: str = LABEL
    default_prompt: str = DEFAULT_PROMPT


def demo_dirs() -> tuple[str, str] | None:
    """The trained demo pair's (target, drafter) directories in demo/, or None when they are absent."""
    dirs = os.path.join(DEMO_DIR, "target"), os.path.join(DEMO_DIR, "drafter")
    return dirs if all(os.path.isdir(d) for d in dirs) else None


def load(dtype: str = "float32", seed: int = 0) -> BuiltinModel:
    """The trained demo pair from demo/ when present, else the random pair."""
    if demo_dirs() is None:
        return load_random(dtype, seed)
    target_dir, drafter_dir = demo_dirs()
    from jaxddtree.checkpoint.load import load_drafter, load_target
    from transformers import AutoTokenizer

    target = load_target(target_dir, dtype=dtype)
    drafter = load_drafter(drafter_dir, target, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(target_dir)
    return BuiltinModel(target=target, drafter=drafter, tokenizer=tok, label=DEMO_LABEL, default_prompt=DEMO_PROMPT)


def load_random(dtype: str = "float32", seed: int = 0) -> BuiltinModel:
    """Build the random demo pair (deterministic for a given seed)."""
    import jax.numpy as jnp
    from jaxddtree.model.drafter import Drafter, check_compatible
    from jaxddtree.checkpoint.params import target_from_params
    from jaxddtree.model.target import as_dtype

    cfg = target_config()
    dt = as_dtype(dtype)
    params = {p: jnp.asarray(v, dt) for p, v in random_target_params(cfg, seed).items()}
    target = target_from_params(cfg, params, dt, source="builtin")
    dcfg = drafter_config()
    check_compatible(dcfg, target, source="built-in drafter")
    drafter = Drafter(config=dcfg, params=random_drafter_params(dcfg, as_dtype(dtype), seed + 1), path="builtin")
    return BuiltinModel(target=target, drafter=drafter, tokenizer=ByteTokenizer())
