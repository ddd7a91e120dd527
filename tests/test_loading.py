"""Loading HF checkpoints: both layouts (multimodal wrapper, text-only), single-file and sharded, give the
same parameters and logits; broken checkpoints and configs fail with `ConfigError` / `CheckpointError`
whose message names the offending field, parameter, tensor or file."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hf_models
import jaxddtree
from jaxddtree import CheckpointError, ConfigError, load_config, load_target
from jaxddtree.checkpoint import hf_target
from hf_models import rel_err

INDEX = "model.safetensors.index.json"
WRAP = "model.language_model."


@pytest.fixture(scope="module")
def ckpts(zoo, tmp_path_factory):
    """The base model saved four ways."""
    hf = zoo.hf("base")
    root = tmp_path_factory.mktemp("layouts")
    out = {"text_single": zoo.path("base")}
    out["text_sharded"] = hf_models.save_text_only(hf, str(root / "text_sharded"), max_shard_size="20KB")
    out["wrapper_sharded"] = hf_models.save_wrapper(hf, str(root / "wrapper"))  # + vision + mtp.* extras
    return out


@pytest.fixture
def copy_ckpt(ckpts, tmp_path):
    """A fresh, writable copy of one of the saved checkpoints."""
    def make(layout):
        dst = str(tmp_path / layout)
        shutil.copytree(ckpts[layout], dst)
        return dst
    return make


def _shard_of(path, name):
    with open(os.path.join(path, INDEX)) as f:
        return json.load(f)["weight_map"][name]


def _rewrite(file, fn):
    """Apply fn to the {name: array} dict of one safetensors file and write it back."""
    tensors = load_file(file)
    tensors = fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _edit_index(path, fn):
    p = os.path.join(path, INDEX)
    with open(p) as f:
        idx = json.load(f)
    fn(idx["weight_map"])
    with open(p, "w") as f:
        json.dump(idx, f)


# ----------------------------------------------------------------------------- good checkpoints

def test_all_layouts_give_identical_params_and_logits(ckpts, hf_base):
    """Wrapper (sharded, index, vision tower and mtp.* extras skipped), text-only single file and text-only
    sharded load bit-identical parameters and logits; the logits match transformers (rel <= 1e-4)."""
    ids = np.random.RandomState(21).randint(0, 97, size=77)
    targets = {k: load_target(p, "float32") for k, p in ckpts.items()}
    ref_t = targets["text_single"]
    logits = {k: jaxddtree.score(t, ids) for k, t in targets.items()}
    for k, t in targets.items():
        assert t.config == ref_t.config, k
        assert len(t.leaves) == len(ref_t.leaves)
        for a, b in zip(t.leaves, ref_t.leaves):
            assert a.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(logits[k], logits["text_single"])
    err = rel_err(logits["wrapper_sharded"], hf_models.hf_logits(hf_base, ids[None])[0])
    print(f"\nlayouts {sorted(ckpts)}: identical; vs transformers rel err {err:.2e}")
    assert err <= 1e-4


def test_load_config_both_layouts_identical(ckpts):
    cfgs = {k: load_config(p) for k, p in ckpts.items()}
    assert cfgs["wrapper_sharded"] == cfgs["text_single"] == cfgs["text_sharded"]
    c = cfgs["text_single"]
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert c.rotary_dim == 4 and c.conv_dim == 2 * 2 * 8 + 4 * 12
    # load_config also accepts the config.json path itself
    assert load_config(os.path.join(ckpts["wrapper_sharded"], "config.json")) == c


def test_bf16_load_casts_every_parameter(ckpts, zoo):
    t32 = zoo.target("base")
    t16 = load_target(ckpts["wrapper_sharded"], "bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in t16.leaves)
    for a, b in zip(t16.leaves, t32.leaves):
        a = np.asarray(a)
        if a.shape != b.shape:  # bf16 stacked w_in: padded with zero columns (target.pad_projection_columns)
            assert a.shape[:-1] == b.shape[:-1] and a.shape[-1] % 64 == 0 and not a[..., b.shape[-1]:].any()
            a = a[..., :b.shape[-1]]
        np.testing.assert_array_equal(a, np.asarray(b.astype(jnp.bfloat16)))


def test_progress_bar(ckpts, zoo, capsys):
    """progress=True: a tqdm bar on stderr that counts the tensors up to its total (a bar without a total
    once crashed `load_target`: such a bar has no truth value); the parameters are unchanged."""
    path = ckpts["wrapper_sharded"]
    t = load_target(path, "float32", progress=True)
    n = len(hf_target.plan_tensors(t.config, path))
    err = capsys.readouterr().err
    assert f"{n}/{n}" in err and "100%" in err and "loading wrapper" in err, err
    for a, b in zip(t.leaves, zoo.target("base").leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _pure(target):
    """The target's parameters per layer (the checkpoints' layout: {"layers": {i: ...}, ...})."""
    import jax
    from flax import nnx
    from jaxddtree.model.qwen35 import per_layer_pure
    return per_layer_pure(target.config, nnx.to_pure_dict(jax.tree.unflatten(target.treedef, target.leaves)))


def test_fused_projections_are_the_hf_tensors(ckpts):
    """Same-input projections load as one matrix each (GDN w_in, MLP w_gate_up, attention w_qkv) whose column
    blocks are exactly the individual HF tensors, transposed (and reshaped to the model's head axes)."""
    path = ckpts["text_single"]
    c = load_config(path)
    hf = load_file(os.path.join(path, "model.safetensors"))
    pure = _pure(load_target(path, "float32"))
    D, F = c.hidden_size, c.intermediate_size
    H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    Hv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    eq = np.testing.assert_array_equal
    for i, t in enumerate(c.layer_types):
        L, p = pure["layers"][i], f"model.layers.{i}."
        gu = np.asarray(L["mlp"]["w_gate_up"])
        assert gu.shape == (D, 2, F)
        eq(gu[:, 0], hf[p + "mlp.gate_proj.weight"].T)
        eq(gu[:, 1], hf[p + "mlp.up_proj.weight"].T)
        m = L["mixer"]
        if t == "full_attention":
            w = np.asarray(m["w_qkv"])
            assert w.shape == (D, H * 2 * hd + 2 * Hkv * hd) and set(m) == {"w_qkv", "wo", "q_norm", "k_norm"}
            q, k, v = np.split(w, [H * 2 * hd, (H * 2 + Hkv) * hd], axis=1)
            eq(q.reshape(D, H, 2 * hd), hf[p + "self_attn.q_proj.weight"].T.reshape(D, H, 2 * hd))
            eq(k, hf[p + "self_attn.k_proj.weight"].T)
            eq(v, hf[p + "self_attn.v_proj.weight"].T)
        else:
            w = np.asarray(m["w_in"])
            assert w.shape == (D, c.conv_dim + Hv * dv + 2 * Hv)
            assert not {"w_qkv", "w_z", "w_b", "w_a"} & set(m)
            qkv, z, b, a = np.split(w, [c.conv_dim, c.conv_dim + Hv * dv, c.conv_dim + Hv * dv + Hv], axis=1)
            g = p + "linear_attn."
            eq(qkv, hf[g + "in_proj_qkv.weight"].T)
            eq(z.reshape(D, Hv, dv), hf[g + "in_proj_z.weight"].T.reshape(D, Hv, dv))
            eq(b, hf[g + "in_proj_b.weight"].T)
            eq(a, hf[g + "in_proj_a.weight"].T)


def test_training_export_splits_fused_params_back(ckpts):
    """`target_hf_tensors` (the trainer's HF export) splits the fused parameters back: exporting a loaded
    checkpoint gives back its tensors, names, shapes and values."""
    from jaxddtree.training import train as tr
    path = ckpts["text_single"]
    t = load_target(path, "float32")
    params = tr.leaves_to_dict(t.leaves)
    out = tr.target_hf_tensors(t.config, t.graphdef, t.treedef, params)
    hf = load_file(os.path.join(path, "model.safetensors"))
    assert set(out) == set(hf)
    for k, v in hf.items():
        assert out[k].shape == v.shape and out[k].flags.c_contiguous, k
        np.testing.assert_array_equal(out[k], v, err_msg=k)


# ----------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("layout", ["text_single", "wrapper_sharded"])
def test_wrong_model_type(copy_ckpt, layout):
    path = copy_ckpt(layout)
    hf_models.edit_config(path, lambda c: c.update(model_type="qwen3_next"))
    with pytest.raises(ConfigError, match=r"model_type 'qwen3_next'") as e:
        load_target(path, "float32")
    assert "config.json" in str(e.value)


def test_wrong_text_config_model_type_in_wrapper(copy_ckpt):
    path = copy_ckpt("wrapper_sharded")
    hf_models.edit_config(path, lambda c: c["text_config"].update(model_type="llama"))
    with pytest.raises(ConfigError, match=r"text_config\.model_type is 'llama'"):
        load_config(path)


BAD_CONFIG = {
    "rope_yarn": (lambda t: t["rope_parameters"].update(rope_type="yarn", factor=4.0), r"rope_type 'yarn'"),
    "gelu": (lambda t: t.update(hidden_act="gelu"), r"hidden_act 'gelu'"),
    "attention_bias": (lambda t: t.update(attention_bias=True), r"attention_bias"),
    "sliding_layer": (lambda t: t.update(layer_types=["linear_attention", "sliding_attention",
                                                      "linear_attention", "full_attention"]),
                      r"layer type 'sliding_attention'"),
    "layer_types_length": (lambda t: t.update(layer_types=["full_attention"] * 3),
                           r"layer_types has 3 entries for num_hidden_layers=4"),
    "gqa_ratio": (lambda t: t.update(num_key_value_heads=3), r"num_attention_heads \(4\).*num_key_value_heads \(3\)"),
    "gva_ratio": (lambda t: t.update(linear_num_value_heads=3), r"linear_num_value_heads \(3\)"),
    "missing_vocab": (lambda t: t.pop("vocab_size"), r"'vocab_size' is missing"),
    "rotary_odd": (lambda t: t["rope_parameters"].update(partial_rotary_factor=0.1875), r"rotary dim"),
}


@pytest.mark.parametrize("layout", ["text_single", "wrapper_sharded"])
@pytest.mark.parametrize("case", sorted(BAD_CONFIG))
def test_unsupported_config_value(copy_ckpt, layout, case):
    """Each unsupported value is a ConfigError naming the field (and text_config in the wrapper)."""
    fn, pattern = BAD_CONFIG[case]
    path = copy_ckpt(layout)
    hf_models.edit_config(path, lambda c: fn(c["text_config"] if layout.startswith("wrapper") else c))
    with pytest.raises(ConfigError, match=pattern) as e:
        load_target(path, "float32")
    assert "config.json" in str(e.value)
    if layout.startswith("wrapper"):
        assert "text_config" in str(e.value)


def test_tied_embeddings_rejected(copy_ckpt):
    path = copy_ckpt("text_single")
    hf_models.edit_config(path, lambda c: c.update(tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        load_config(path)


def test_missing_or_broken_config(tmp_path, copy_ckpt):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path))
    path = copy_ckpt("text_single")
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_target(path, "float32")


# ----------------------------------------------------------------------------- checkpoint errors

def test_missing_tensor_in_wrapper_shard(copy_ckpt):
    """A tensor deleted from its shard and from the index: the error names the parameter."""
    path = copy_ckpt("wrapper_sharded")
    name = WRAP + "layers.1.linear_attn.conv1d.weight"
    _rewrite(os.path.join(path, _shard_of(path, name)), lambda t: {k: v for k, v in t.items() if k != name})
    _edit_index(path, lambda wm: wm.pop(name))
    with pytest.raises(CheckpointError, match=r"parameter layers\.1\.mixer\.conv") as e:
        load_target(path, "float32")
    assert "(1 missing in all)" in str(e.value)


def test_missing_tensor_in_single_file(copy_ckpt):
    path = copy_ckpt("text_single")
    name = "model.layers.3.self_attn.k_norm.weight"
    _rewrite(os.path.join(path, "model.safetensors"), lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"parameter layers\.3\.mixer\.k_norm"):
        load_target(path, "float32")


@pytest.mark.parametrize("layout", ["text_single", "wrapper_sharded"])
@pytest.mark.parametrize("part,param,where", [
    ("layers.1.linear_attn.in_proj_b.weight", "layers.1.mixer.w_in", "part 3 of 4"),
    ("layers.3.self_attn.v_proj.weight", "layers.3.mixer.w_qkv", "part 3 of 3"),
    ("layers.2.mlp.gate_proj.weight", "layers.2.mlp.w_gate_up", "part 1 of 2"),
])
def test_missing_part_of_fused_parameter(copy_ckpt, layout, part, param, where):
    """One HF tensor of a fused parameter missing: the error names that tensor (with the checkpoint's
    prefix), the fused parameter and which part of it is unfilled."""
    path = copy_ckpt(layout)
    name = (WRAP if layout.startswith("wrapper") else "model.") + part
    if layout.startswith("wrapper"):
        _rewrite(os.path.join(path, _shard_of(path, name)), lambda t: {k: v for k, v in t.items() if k != name})
        _edit_index(path, lambda wm: wm.pop(name))
    else:
        _rewrite(os.path.join(path, "model.safetensors"), lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError) as e:
        load_target(path, "float32")
    msg = str(e.value)
    assert f"lacks tensor '{name}'" in msg and f"parameter {param}," in msg and where in msg, msg
    assert "(1 missing in all)" in msg


@pytest.mark.parametrize("part,param", [
    ("layers.0.linear_attn.in_proj_z.weight", "layers.0.mixer.w_in"),
    ("layers.3.self_attn.q_proj.weight", "layers.3.mixer.w_qkv"),
    ("layers.1.mlp.up_proj.weight", "layers.1.mlp.w_gate_up"),
])
def test_duplicated_part_of_fused_parameter(copy_ckpt, part, param):
    """The same part of a fused parameter provided twice (under both prefixes): rejected by name."""
    path = copy_ckpt("text_single")
    _rewrite(os.path.join(path, "model.safetensors"),
             lambda t: {**t, WRAP + part: t["model." + part].copy()})
    with pytest.raises(CheckpointError, match="already provided") as e:
        load_target(path, "float32")
    msg = str(e.value)
    assert "model." + part in msg and WRAP + part in msg and f"parameter {param}," in msg, msg


def test_tensor_listed_in_index_but_absent_from_shard(copy_ckpt):
    """The index says the shard has it, the shard does not: the error names the tensor and the file."""
    path = copy_ckpt("wrapper_sharded")
    name = WRAP + "layers.0.linear_attn.A_log"
    shard = _shard_of(path, name)
    _rewrite(os.path.join(path, shard), lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError) as e:
        load_target(path, "float32")
    assert name in str(e.value) and shard in str(e.value)


@pytest.mark.parametrize("layout", ["text_single", "wrapper_sharded"])
def test_wrong_shape(copy_ckpt, layout):
    """One tensor rewritten with a wrong shape: the error names the tensor and its file."""
    path = copy_ckpt(layout)
    prefix = WRAP if layout.startswith("wrapper") else "model."
    name = prefix + "layers.3.self_attn.k_proj.weight"
    file = _shard_of(path, name) if layout.startswith("wrapper") else "model.safetensors"

    def shrink(t):
        t[name] = t[name][:-1]  # [Hkv*hd - 1, D]
        return t
    _rewrite(os.path.join(path, file), shrink)
    with pytest.raises(CheckpointError, match=r"has shape \(31, 64\), expected \(32, 64\)") as e:
        load_target(path, "float32")
    assert name in str(e.value) and file in str(e.value)


EXTRA = {
    "unknown_name": ("model.layers.0.linear_attn.extra_bias", r"unexpected tensor"),
    "unknown_prefix": ("decoder.layers.0.mlp.up_proj.weight", r"unexpected tensor"),
    "gdn_tensor_on_attention_layer": ("model.layers.3.linear_attn.A_log",
                                      r"belongs to a linear_attention layer.*layer_types\[3\] is full_attention"),
    "layer_out_of_range": ("model.layers.9.mlp.up_proj.weight", r"layer 9.*4 layers"),
    "duplicate_of_wrapper_name": (WRAP + "norm.weight", r"already provided"),
}


@pytest.mark.parametrize("case", sorted(EXTRA))
def test_unexpected_extra_tensor(copy_ckpt, case):
    """An extra tensor that maps to nothing (or to the wrong layer, or twice) is rejected by name."""
    name, pattern = EXTRA[case]
    path = copy_ckpt("text_single")
    _rewrite(os.path.join(path, "model.safetensors"),
             lambda t: {**t, name: np.zeros((4,), np.float32)})
    with pytest.raises(CheckpointError, match=pattern) as e:
        load_target(path, "float32")
    assert name in str(e.value)


def test_skipped_extras_are_ignored(copy_ckpt, ckpts):
    """mtp.* and visual tensors in a text-only file are skipped (not 'unexpected')."""
    path = copy_ckpt("text_single")
    _rewrite(os.path.join(path, "model.safetensors"),
             lambda t: {**t, "mtp.fc.weight": np.ones((2, 2), np.float32),
                        "model.visual.patch_embed.weight": np.ones((3,), np.float32)})
    a, b = load_target(path, "float32"), load_target(ckpts["text_single"], "float32")
    for x, y in zip(a.leaves, b.leaves):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("layout", ["text_single", "wrapper_sharded"])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_shard(copy_ckpt, layout, damage):
    """A truncated or overwritten shard is a CheckpointError naming the file."""
    path = copy_ckpt(layout)
    file = (_shard_of(path, WRAP + "layers.2.linear_attn.in_proj_qkv.weight") if layout.startswith("wrapper")
            else "model.safetensors")
    full = os.path.join(path, file)
    size = os.path.getsize(full)
    if damage == "truncated":
        with open(full, "r+b") as f:
            f.truncate(size // 2)
    else:
        with open(full, "wb") as f:
            f.write(b"\xff" * 64)
    with pytest.raises(CheckpointError) as e:
        load_target(path, "float32")
    assert file in str(e.value)


def test_missing_shard_file(copy_ckpt):
    path = copy_ckpt("wrapper_sharded")
    shard = _shard_of(path, WRAP + "embed_tokens.weight")
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match="missing shard") as e:
        load_target(path, "float32")
    assert shard in str(e.value)


@pytest.mark.parametrize("content", ["{not json", "[]", '{"metadata": {}}', '{"weight_map": [1, 2]}'])
def test_unreadable_index(copy_ckpt, content):
    path = copy_ckpt("text_sharded")
    with open(os.path.join(path, INDEX), "w") as f:
        f.write(content)
    with pytest.raises(CheckpointError, match=INDEX.replace(".", r"\.") + ": unreadable index"):
        load_target(path, "float32")


def test_not_a_checkpoint_directory(tmp_path, copy_ckpt):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_target(str(tmp_path / "nope"), "float32")
    path = copy_ckpt("text_single")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_target(path, "float32")


def test_unsupported_dtype(ckpts):
    with pytest.raises(ValueError, match="float16"):
        load_target(ckpts["text_single"], "float16")
