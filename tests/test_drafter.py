"""DFlash drafter: JAX vs an independent torch reference (fp32), config/loader errors, jit + donation."""

import copy
import json
import os
import types

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddtree.checkpoint.hf_drafter import load_drafter_params
from jaxddtree.checkpoint.load import load_drafter
from jaxddtree.model.drafter import DraftCache, DrafterConfig, build_target_layer_ids, drafter_forward, init_draft_cache
from helpers_dflash import random_weights, tiny_config, write_checkpoint

H, N_TARGET_LAYERS, VOCAB = 64, 6, 101


def make_target(hidden=H, layers=N_TARGET_LAYERS, vocab=VOCAB, seed=1):
    rng = np.random.default_rng(seed)
    return types.SimpleNamespace(
        config=types.SimpleNamespace(hidden_size=hidden, num_hidden_layers=layers, vocab_size=vocab),
        embedding=rng.standard_normal((vocab, hidden)).astype(np.float32),
        lm_head=(rng.standard_normal((hidden, vocab)) / np.sqrt(hidden)).astype(np.float32))


CONFIGS = {
    # block 8 > window 6; 3 layers: sliding, full, sliding; GQA 4/2.
    "b8": tiny_config(block_size=8, layers=3, heads=4, kv_heads=2, target_layer_ids=(1, 3)),
    # block 16 > window 6 (right-side window masking inside the block), GQA 4/1, 3 target layers.
    "b16": tiny_config(block_size=16, layers=2, heads=4, kv_heads=1, target_layer_ids=(0, 2, 5),
                       layer_types=["full_attention", "sliding_attention"], rope_theta=1e6),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def ckpt(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    return write_checkpoint(str(tmp_path_factory.mktemp(request.param)), cfg, random_weights(cfg, seed=3))


@pytest.fixture(scope="module")
def ckpt_b8(tmp_path_factory):
    cfg = CONFIGS["b8"]
    return write_checkpoint(str(tmp_path_factory.mktemp("b8only")), cfg, random_weights(cfg, seed=4))


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# (static C of the JAX call, real rows): prompt first, then 1..5 accepted rows per round.
ROUNDS = [(12, 7), (6, 1), (6, 5), (6, 3), (6, 2), (6, 5), (6, 4)]


def test_matches_torch_reference(ckpt):
    torch = pytest.importorskip("torch")
    from dflash_reference_torch import TorchDFlashReference

    target = make_target()
    drafter = load_drafter(ckpt, target, dtype="float32")
    ref = TorchDFlashReference(ckpt)
    cfg = drafter.config
    B, nTH = 2, cfg.num_target_features * H
    cache = drafter.init_cache(B, max_len=48)
    rng = np.random.default_rng(7)
    emb_t, lm_t = torch.from_numpy(target.embedding), torch.from_numpy(target.lm_head)
    errs = []
    for C, n in ROUNDS:
        real = rng.standard_normal((B, n, nTH)).astype(np.float32)
        pad = 50.0 * rng.standard_normal((B, C - n, nTH)).astype(np.float32)  # garbage padding rows
        root = rng.integers(0, VOCAB, size=B)
        got, cache = drafter.logits(cache, np.concatenate([real, pad], 1), n, jnp.asarray(root, jnp.int32),
                                    target.embedding, target.lm_head)
        want = ref.logits(torch.from_numpy(real), torch.from_numpy(root), emb_t, lm_t).numpy()
        assert got.shape == (B, cfg.block_size - 1, VOCAB) and got.dtype == jnp.float32
        errs.append(rel_err(got, want))
        assert int(cache.length) == ref.cache_len
        for i in range(cfg.num_layers):  # cached context K/V (post k_norm + RoPE) match too
            L = ref.cache_len
            assert rel_err(cache.k[i][:, :, :L], ref.k_cache[i].numpy()) <= 1e-5
            assert rel_err(cache.v[i][:, :, :L], ref.v_cache[i].numpy()) <= 1e-5
    assert ref.cache_len > 2 * max(w for w in cfg.layer_windows if w)  # context outgrew the sliding window
    print(f"{os.path.basename(ckpt)}: per-round logits max rel err {['%.1e' % e for e in errs]}")
    assert max(errs) <= 1e-5, errs


def test_jit_donates_cache(ckpt_b8):
    drafter = load_drafter(ckpt_b8, make_target(), dtype="float32")
    cfg = drafter.config
    fwd = jax.jit(drafter_forward, static_argnums=(1,), donate_argnames=("cache",))
    cache = init_draft_cache(cfg, 1, 32, jnp.float32)
    th = jnp.ones((1, 4, cfg.num_target_features * H), jnp.float32)
    blk = jnp.ones((1, cfg.block_size, H), jnp.float32)
    assert "tf.aliasing_output" in fwd.lower(drafter.params, cfg, cache, th, jnp.int32(3), blk).as_text()
    old = cache.k[0]
    h, cache = fwd(drafter.params, cfg, cache, th, jnp.int32(3), blk)
    assert old.is_deleted() and h.shape == (1, cfg.block_size, H) and int(cache.length) == 3
    n_compiled = fwd._cache_size()
    h2, cache = fwd(drafter.params, cfg, cache, th, jnp.int32(2), blk)  # traced num_ctx: no recompile
    assert int(cache.length) == 5 and fwd._cache_size() == n_compiled and np.isfinite(np.asarray(h2)).all()


def test_bfloat16_close_to_fp32(ckpt_b8):
    target = make_target()
    out = {}
    for dt in ("float32", "bfloat16"):
        d = load_drafter(ckpt_b8, target, dtype=dt)
        assert d.params.layers[0].w_qkv.dtype == jnp.dtype(dt)
        cache = d.init_cache(1, 32)
        th = np.random.default_rng(0).standard_normal((1, 5, d.config.num_target_features * H), np.float32)
        out[dt], cache = d.logits(cache, th, 5, jnp.array([3]), target.embedding, target.lm_head)
        assert cache.k[0].dtype == jnp.dtype(dt)
    assert rel_err(out["bfloat16"], out["float32"]) < 0.1


def test_sharded_prefixed_checkpoint_loads_same(tmp_path):
    cfg = CONFIGS["b8"]
    w = random_weights(cfg, seed=5)
    a = load_drafter_params(write_checkpoint(str(tmp_path / "a"), cfg, w), DrafterConfig.from_dict(cfg), "float32")
    b_path = write_checkpoint(str(tmp_path / "b"), cfg, {"model." + k: v for k, v in w.items()}, shards=3)
    b = load_drafter_params(b_path, DrafterConfig.from_dict(cfg), "float32")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    # layout: w_qkv [H, (nh + 2 nkv) hd] = [q_proj | k_proj | v_proj] columns, head-major;
    # w_gate_up [H, 2, I] = [gate | up]
    nq, nkv = cfg["num_attention_heads"] * 16, cfg["num_key_value_heads"] * 16
    np.testing.assert_array_equal(a.layers[1].w_qkv[:, 2 * 16 + 5], w["layers.1.self_attn.q_proj.weight"][2 * 16 + 5])
    np.testing.assert_array_equal(a.layers[1].w_qkv[:, nq + 7], w["layers.1.self_attn.k_proj.weight"][7])
    np.testing.assert_array_equal(a.layers[1].w_qkv[:, nq + nkv + 3], w["layers.1.self_attn.v_proj.weight"][3])
    np.testing.assert_array_equal(a.layers[0].w_gate_up[:, 1, 4], w["layers.0.mlp.up_proj.weight"][4])
    np.testing.assert_array_equal(a.layers[0].wo[3, 7], w["layers.0.self_attn.o_proj.weight"][:, 3 * 16 + 7])


# ------------------------------------------------------------------------------------------ config / errors
def test_build_target_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(36, 1) == [18]
    d = tiny_config(layers=3)
    del d["dflash_config"]["target_layer_ids"]
    assert DrafterConfig.from_dict(d).target_layer_ids == tuple(build_target_layer_ids(N_TARGET_LAYERS, 3))


def test_config_fields():
    c = DrafterConfig.from_dict(tiny_config(layers=3, rope_theta=None, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7}))
    assert c.rope_theta == 1e7 and c.layer_windows == (6, None, 6) and c.block_size == 8
    c = DrafterConfig.from_dict(tiny_config(layers=3, use_sliding_window=False))  # HF: window off
    assert c.layer_windows == (None, None, None)
    d = tiny_config(layers=2, max_window_layers=1)
    del d["layer_types"]  # Qwen3Config rule: sliding iff use_sliding_window and i >= max_window_layers
    c = DrafterConfig.from_dict(d)
    assert c.layer_windows == (None, 6)


@pytest.mark.parametrize("change, exc, match", [
    ({"attention_bias": True}, ValueError, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, NotImplementedError, "yarn"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, NotImplementedError, "linear"),
    ({"dflash_config": {"target_layer_ids": [1, 3]}}, ValueError, "mask_token_id"),
    ({"layer_types": ["full_attention"]}, ValueError, "layer_types"),
    ({"num_attention_heads": 3}, ValueError, "num_key_value_heads"),
    ({"block_size": 1}, ValueError, "block_size"),
    ({"dflash_config": {"mask_token_id": 100, "target_layer_ids": [1, 9]}}, ValueError, "num_target_layers"),
    ({"hidden_act": "gelu"}, ValueError, "hidden_act"),
])
def test_config_errors(change, exc, match):
    d = tiny_config(layers=3)
    d.update(change)
    with pytest.raises(exc, match=match):
        DrafterConfig.from_dict(d)


def _write(tmp_path, mutate_weights=None, cfg=None):
    cfg = copy.deepcopy(cfg or CONFIGS["b8"])
    w = random_weights(cfg, seed=0)
    if mutate_weights:
        mutate_weights(w)
    return write_checkpoint(str(tmp_path), cfg, w)


def test_missing_tensor(tmp_path):
    p = _write(tmp_path, lambda w: w.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*layers\.1\.self_attn\.k_norm\.weight"):
        load_drafter(p, make_target(), dtype="float32")


def test_wrong_shape(tmp_path):
    p = _write(tmp_path, lambda w: w.update({"layers.2.mlp.up_proj.weight": np.zeros((95, H), np.float32)}))
    with pytest.raises(ValueError, match=r"'layers\.2\.mlp\.up_proj\.weight' in .*model\.safetensors has shape "
                                         r"\(95, 64\), expected \(96, 64\)"):
        load_drafter(p, make_target(), dtype="float32")


@pytest.mark.parametrize("name", ["embed_tokens.weight", "layers.3.input_layernorm.weight",
                                  "layers.0.self_attn.q_proj.bias"])
def test_unexpected_tensor(tmp_path, name):
    p = _write(tmp_path, lambda w: w.update({name: np.zeros((H,), np.float32)}))
    with pytest.raises(ValueError, match=rf"unexpected tensor '{name}' in .*model\.safetensors"):
        load_drafter(p, make_target(), dtype="float32")


@pytest.mark.parametrize("target_kw, match", [
    ({"hidden": 32}, r"hidden_size=64 != target hidden_size=32"),
    ({"layers": 3}, r"target_layer_ids \[1, 3\] include \[3\], but the target has only 3 layers"),
    ({"layers": 8}, r"num_target_layers=6 != target num_hidden_layers=8"),
    ({"vocab": 200}, r"vocab_size=101 != target vocab_size=200"),
])
def test_incompatible_target(tmp_path, target_kw, match):
    p = _write(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_drafter(p, make_target(**target_kw), dtype="float32")


def test_mask_token_outside_target_vocab(tmp_path):
    cfg = tiny_config(layers=3)
    del cfg["vocab_size"]
    p = _write(tmp_path, cfg=cfg)
    with pytest.raises(ValueError, match=r"mask_token_id=100 >= target vocab_size=50"):
        load_drafter(p, make_target(vocab=50), dtype="float32")


def test_no_checkpoint(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(CONFIGS["b8"], f)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(str(tmp_path), make_target())


def test_qwen36_27b_config_shapes():
    """The published Qwen3.6-27B drafter config (as transcribed in docs/reference_algorithm.md §1.5) parses and
    traces at full size (abstract shapes only)."""
    d = tiny_config(hidden=5120, layers=5, heads=32, kv_heads=8, head_dim=128, intermediate=17408, block_size=16,
                    target_layer_ids=(1, 16, 31, 46, 61), num_target_layers=64, window=2048, vocab=248320,
                    mask_token_id=248070, rope_theta=1e7,
                    layer_types=["sliding_attention"] * 4 + ["full_attention"])
    cfg = DrafterConfig.from_dict(d)
    assert cfg.layer_windows == (2048,) * 4 + (None,) and cfg.num_target_features == 5
    target = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=5120, num_hidden_layers=64,
                                                                vocab_size=248320))
    from jaxddtree.checkpoint.hf_drafter import _GLOBAL, _LAYER, stacked_shape
    from jaxddtree.model.drafter import DrafterLayer, DrafterParams, check_compatible, draft_logits
    check_compatible(cfg, target)
    # abstract params with the loader's layouts (shape of transform(zeros(stacked torch shape)))
    def spec(table, field):
        parts, tf = table[field]
        return field, jax.ShapeDtypeStruct(tf(np.zeros(stacked_shape(parts, cfg), np.int8), cfg).shape, jnp.bfloat16)
    params = DrafterParams(layers=tuple(DrafterLayer(**dict(spec(_LAYER, k) for k in _LAYER)) for _ in range(5)),
                           **dict(spec(_GLOBAL, k) for k in _GLOBAL))
    assert params.layers[0].w_qkv.shape == (5120, 6144) and params.layers[0].wo.shape == (32, 128, 5120)
    assert params.layers[0].w_gate_up.shape == (5120, 2, 17408)
    cache = jax.eval_shape(lambda: init_draft_cache(cfg, 1, 4096, jnp.bfloat16))
    S = jax.ShapeDtypeStruct
    logits, new_cache = jax.eval_shape(
        lambda p, c, th, n, r, e, l: draft_logits(p, cfg, c, th, n, r, e, l), params, cache,
        S((1, 16, 5 * 5120), jnp.bfloat16), S((), jnp.int32), S((1,), jnp.int32),
        S((248320, 5120), jnp.bfloat16), S((5120, 248320), jnp.bfloat16))
    assert logits.shape == (1, 15, 248320) and logits.dtype == jnp.float32
    assert new_cache.k[0].shape == (1, 8, 4096, 128)


def test_pallas_full_attention_layers_match_xla(ckpt, monkeypatch):
    """kernels="pallas": the full-attention layers read the committed rows through the tree-attention kernel
    (interpret mode here), the window layers a window-sized slice; the logits and caches match the xla path
    (which scores the whole capacity) over rounds whose context outgrows the window."""
    from kernels_pallas import ops
    from kernels_pallas import tree_attention as ta
    from jaxddtree.model.drafter import draft_logits
    calls = []
    monkeypatch.setattr(ops, "tree_attention", lambda q, kc, vc, start, kn, vn, mask, kernels:
                        calls.append(q.shape) or ta.tree_attention(q, kc, vc, start, kn, vn, mask, interpret=True))
    target = make_target()
    drafter = load_drafter(ckpt, target, dtype="float32")
    cfg = drafter.config
    nTH = cfg.num_target_features * H
    caches = {k: drafter.init_cache(1, 48) for k in ("xla", "pallas")}
    rng = np.random.default_rng(3)
    for C, n in ROUNDS:
        th = rng.standard_normal((1, C, nTH)).astype(np.float32)
        root = jnp.asarray(rng.integers(0, VOCAB, size=1), jnp.int32)
        out = {}
        for k in ("xla", "pallas"):
            out[k], caches[k] = draft_logits(drafter.params, cfg, caches[k], jnp.asarray(th), n, root,
                                             jnp.asarray(target.embedding), jnp.asarray(target.lm_head), k)
        assert rel_err(out["pallas"], out["xla"]) <= 1e-5
    n_full = sum(w is None for w in cfg.layer_windows)
    assert len(calls) == n_full * len(ROUNDS) and n_full >= 1
    for a, b in zip(caches["pallas"].k, caches["xla"].k):
        assert rel_err(a, b) <= 1e-6
