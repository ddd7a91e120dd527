"""FP8 (block-wise e4m3, transformers' fine-grained FP8 format) target checkpoints on CPU.

The tests quantize a tiny random transformers model themselves (per block: scale = 448 / max|w|, q =
clamp(w * scale) in float8_e4m3fn, `weight_scale_inv` = 1 / scale, as transformers' `Fp8Quantize`, plus
partial edge blocks), write the FP8 checkpoint (config `quantization_config`, `weight` fp8 +
`weight_scale_inv`) and, as the reference, the same checkpoint dequantized to fp32 (plain layout):

  * loading keeps fp8 weights + block scales on device (`Fp8Weight`), in_proj_b/a as the bf16 tail of
    GDN `w_in`, and modules left out by `modules_to_not_convert` plain;
  * the model computes transformers' FP8 forward (W8A8: `activation_scheme: "dynamic"`): fp32 and bf16 logits
    (prefill and decode steps) match transformers' model on the dequantized weights with every FP8Linear run
    as the torch emulation of its W8A8 kernel (tests/fp8_torch.py), for blocks that do not divide the
    matrices, bf16 and fp32 scales, a fused parameter with a plain part in the middle; parameters dequantize
    to exactly the reference checkpoint's weights (compact scale grids);
  * DDTree == DFlash == AR tokens at T = 0 on the fp8 target;
  * malformed checkpoints (missing scale, wrong scale shape, unknown fmt, scale on a plain weight) give
    a CheckpointError naming the tensor;
  * `python -m convert` keeps fp8 + scales and restores them (same parameters, same tokens);
  * kernels="pallas": the W8A8 Pallas kernel (interpret mode) inside the model matches kernels="xla" (its
    jnp reference).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil

import numpy as np
import pytest
import torch

import fp8_torch
import hf_models
import jaxddtree
from jaxddtree.checkpoint.params import CheckpointError
from jaxddtree.model.fp8 import Fp8Weight
from kernels_pallas.w8a8_mgpu import scale_cols

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def quantize(w: torch.Tensor, bo: int, bi: int, scale_dtype=torch.float32):
    """[out, in] fp32 -> (fp8 [out, in], weight_scale_inv [ceil(out/bo), ceil(in/bi)] in scale_dtype,
    the dequantized fp32 weight)."""
    out, inn = w.shape
    nbo, nbi = -(-out // bo), -(-inn // bi)
    pad = torch.zeros(nbo * bo, nbi * bi)
    pad[:out, :inn] = w
    r = pad.reshape(nbo, bo, nbi, bi)
    max_abs = r.abs().amax(dim=(1, 3))
    inv = torch.where(max_abs > 0, max_abs / FP8_MAX, torch.ones_like(max_abs)).to(scale_dtype)
    scale = 1.0 / inv.float()
    q = torch.clamp(r * scale[:, None, :, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(nbo * bo, nbi * bi)[:out, :inn].contiguous()
    s = inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inn]
    return q, inv, q.float() * s


def default_skip(name: str) -> bool:
    """Not quantized in the Qwen3.6 FP8 release (per issue 17): lm_head, in_proj_a/b (and every non-linear
    tensor)."""
    return name == "lm_head.weight" or "in_proj_a" in name or "in_proj_b" in name


def write_fp8_pair(model, root: str, block=(32, 24), scale_dtype=torch.float32, not_convert=(),
                   skip=default_skip, fmt="e4m3"):
    """Write `root/fp8` (FP8 checkpoint) and `root/ref` (the same weights dequantized, fp32). Linear
    weights (2-D, not embed/conv) are quantized unless `skip(name)` or their module is in `not_convert`."""
    ref_dir, fp8_dir = os.path.join(root, "ref"), os.path.join(root, "fp8")
    hf_models.save_text_only(model, ref_dir)
    from safetensors.torch import save_file
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    fp8_sd, ref_sd = {}, {}
    for name, w in sd.items():
        module = name.rsplit(".", 1)[0]
        linear = name.endswith(".weight") and w.ndim == 2 and "embed_tokens" not in name
        if linear and not skip(name) and module not in not_convert:
            q, inv, deq = quantize(w, *block, scale_dtype)
            fp8_sd[name], fp8_sd[module + ".weight_scale_inv"] = q, inv
            ref_sd[name] = deq
        else:
            fp8_sd[name] = w.to(torch.bfloat16) if linear else w  # plain projections in bf16, as released
            ref_sd[name] = fp8_sd[name].float()
    for f in os.listdir(ref_dir):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(ref_dir, f))
    save_file(ref_sd, os.path.join(ref_dir, "model.safetensors"))
    os.makedirs(fp8_dir)
    save_file(fp8_sd, os.path.join(fp8_dir, "model.safetensors"))
    with open(os.path.join(ref_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": fmt, "activation_scheme": "dynamic",
                                  "weight_block_size": list(block),
                                  "modules_to_not_convert": sorted(set(not_convert) | {"lm_head"})}
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return fp8_dir, ref_dir


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """Qwen-like: 32x24 blocks (partial edge blocks everywhere), bf16 scales, lm_head / in_proj_a|b plain,
    layer 1's down_proj left out by modules_to_not_convert."""
    root = str(tmp_path_factory.mktemp("fp8_released"))
    return write_fp8_pair(hf_models.causal_lm(0), root, block=(32, 24), scale_dtype=torch.bfloat16,
                          not_convert=("model.layers.1.mlp.down_proj",))


@pytest.fixture(scope="module")
def everything(tmp_path_factory):
    """16x16 blocks, fp32 scales, every projection fp8 (lm_head, in_proj_a|b too) except layer 3's
    k_proj: a plain part in the middle of the fused w_qkv (dequantized on load)."""
    root = str(tmp_path_factory.mktemp("fp8_all"))
    return write_fp8_pair(hf_models.causal_lm(0), root, block=(16, 16), skip=lambda n: False,
                          not_convert=("model.layers.3.self_attn.k_proj",))


def test_layout_released(released):
    fp8_dir, _ = released
    t = jaxddtree.load_target(fp8_dir, "float32")
    m = t.module()
    assert t.dtype == np.float32
    w_in = m.layers[0].mixer.w_in[...]  # GDN layer: qkv|z fp8, b|a the plain tail
    assert isinstance(w_in, Fp8Weight) and w_in.q.dtype == np.dtype("float8_e4m3fn")
    cfg = t.config
    hv = cfg.linear_num_value_heads
    assert w_in.tail is not None and w_in.tail.shape == (cfg.hidden_size, 2 * hv)
    assert w_in.shape == (cfg.hidden_size, cfg.conv_dim + hv * cfg.linear_value_head_dim + 2 * hv)
    n_in = cfg.conv_dim + hv * cfg.linear_value_head_dim
    assert 32 % w_in.block_out == 0  # compact: a divisor of the 32-row output blocks
    # q in the checkpoint's layout [N, K]; scales [N blocks, K blocks padded to 128-byte rows]
    assert w_in.q.shape == (n_in, cfg.hidden_size)
    assert w_in.scale.shape == (-(-n_in // w_in.block_out), scale_cols(-(-cfg.hidden_size // 24)))
    gu = m.layers[0].mlp.w_gate_up[...]
    assert isinstance(gu, Fp8Weight) and 32 % gu.block_out == 0
    assert gu.scale.shape == (-(-2 * cfg.intermediate_size // gu.block_out), scale_cols(-(-cfg.hidden_size // 24)))
    wo = m.layers[3].mixer.wo[...]
    assert isinstance(wo, Fp8Weight) and wo.nc == 2 and wo.shape == (4, 16, cfg.hidden_size)
    assert not isinstance(m.layers[1].mlp.w_down[...], Fp8Weight)  # modules_to_not_convert
    assert not isinstance(m.lm_head[...], Fp8Weight)
    assert m.embed[...].dtype == np.float32


def _logits(jx, target, ids, steps):
    cache = target.init_cache(jx.MAX_LEN)
    lg, cache, _ = jx.prefill(target, cache, ids)
    out = [lg]
    tok = int(np.argmax(lg[-1]))
    for _ in range(steps):
        l1, cache = jx.decode(target, cache, tok)
        out.append(l1[None])
        tok = int(np.argmax(l1))
    return np.concatenate(out)


# fused parameters with a plain part in the middle are dequantized on load (jaxddtree/checkpoint/hf_target.py):
# their fp8 parts then run as plain projections of the dequantized weights
DEQUANTIZED_ON_LOAD = {"everything": ("model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.v_proj")}


def transformers_fp8(fp8_dir, ref_dir, dtype, skip=()):
    """transformers' model on the dequantized weights with every FP8Linear of the FP8 checkpoint (fp8
    `weight` + `weight_scale_inv`) running the torch emulation of its W8A8 forward."""
    from safetensors.torch import load_file
    with open(os.path.join(fp8_dir, "config.json")) as f:
        block = tuple(json.load(f)["quantization_config"]["weight_block_size"])
    if dtype == torch.bfloat16:
        model = hf_models.from_pretrained_bf16(ref_dir)
    else:
        model = hf_models.Qwen3_5ForCausalLM.from_pretrained(ref_dir, dtype=dtype, attn_implementation="eager").eval()
    patched = fp8_torch.patch_fp8_linears(model, load_file(os.path.join(fp8_dir, "model.safetensors")), block, skip)
    assert len(patched) > 10
    return model


def _compare_with_transformers(jx, which, fp8_dir, ref_dir, dtype, ids, steps=3):
    """Per position (the prompt, then `steps` greedy decode steps; transformers run over the same tokens):
    max|ours - transformers' FP8 forward| and max|the weight-only model - it|, over max|logits|."""
    name = str(dtype).split(".")[-1]
    ours = _logits(jx, jaxddtree.load_target(fp8_dir, name), ids, steps)
    toks = list(ids) + [int(np.argmax(ours[len(ids) - 1 + i])) for i in range(steps)]
    ref = hf_models.hf_logits(transformers_fp8(fp8_dir, ref_dir, dtype, DEQUANTIZED_ON_LOAD.get(which, ())),
                              [toks])[0][:len(ours)]
    weight_only = _logits(jx, jaxddtree.load_target(ref_dir, name), np.asarray(toks), 0)
    scale = np.abs(ref).max()
    return (np.abs(ours - ref).max(axis=-1) / scale, np.abs(weight_only - ref).max(axis=-1) / scale)


def _check_w8a8_errors(err, err_weight_only, typical, worst):
    """Two fp32 implementations of W8A8 agree to fp32 rounding except where an activation lands on an e4m3
    rounding boundary: then one element moves by an e4m3 step (6 %) and its layer's outputs by up to ~1 % (the
    lm_head's input: that position's logits). So: typical positions within `typical`, a few flips within
    `worst`, and the weight-only product (no activation quantization) far off everywhere."""
    print(f"max per position: {np.array2string(err, precision=1)}; weight-only median {np.median(err_weight_only):.3g}")
    assert np.median(err) <= typical and np.mean(err > 10 * typical) <= 0.25 and err.max() <= worst, err
    assert np.median(err_weight_only) > 30 * max(np.median(err), typical)


@pytest.mark.parametrize("which", ["released", "everything"])
def test_logits_match_transformers_fp8(which, request, jx):
    """fp32 compute: W8A8 in fp32 (x quantized from fp32, fp32 outputs), prefill and decode steps. Measured:
    released max 3e-7 over all positions; everything median 1e-7, a flip of 1e-2 (its lm_head is fp8)."""
    fp8_dir, ref_dir = request.getfixturevalue(which)
    ids = np.random.RandomState(0).randint(0, 96, 21)
    _check_w8a8_errors(*_compare_with_transformers(jx, which, fp8_dir, ref_dir, torch.float32, ids), 1e-6, 3e-2)


def test_bf16_compute_matches_transformers_fp8(pow2_blocks, jx):
    """`dtype` is the compute dtype: in bf16 the fp8 target computes what transformers' FP8 model does in bf16
    (bf16 activations quantized per token, bf16 outputs, transformers' bf16 roundings elsewhere)."""
    fp8_dir, ref_dir = pow2_blocks
    ids = np.random.RandomState(2).randint(0, 96, 21)
    _check_w8a8_errors(*_compare_with_transformers(jx, "pow2", fp8_dir, ref_dir, torch.bfloat16, ids, steps=1),
                       1e-6, 5e-2)  # measured: equal at every position


def test_dequantize_matches_reference_weights(everything):
    """Every parameter, fp8 or not, dequantizes to exactly the reference checkpoint's array."""
    import jax
    fp8_dir, ref_dir = everything
    a = jaxddtree.load_target(fp8_dir, "float32").module()
    b = jaxddtree.load_target(ref_dir, "float32").module()
    from flax import nnx
    sa = nnx.to_pure_dict(nnx.state(a))
    sb = nnx.to_pure_dict(nnx.state(b))
    fa = jax.tree.leaves(sa, is_leaf=lambda x: isinstance(x, Fp8Weight))
    fb = jax.tree.leaves(sb)
    assert len(fa) == len(fb)
    n_fp8 = 0
    for x, y in zip(fa, fb):
        if isinstance(x, Fp8Weight):
            n_fp8 += 1
            x = x.dequantize(np.float32)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert n_fp8 > 10


def test_generate_lossless(everything):
    """The all-fp8 variant: the drafter also reads the target's fp8 lm_head (dequantized)."""
    import helpers_dflash
    fp8_dir, _ = everything
    target = jaxddtree.load_target(fp8_dir, "float32")
    ddir = os.path.join(os.path.dirname(fp8_dir), "drafter")
    cfg = helpers_dflash.tiny_config(hidden=64, vocab=97, mask_token_id=96, num_target_layers=4,
                                     target_layer_ids=(1, 2), block_size=8)
    helpers_dflash.write_checkpoint(ddir, cfg, helpers_dflash.random_weights(cfg, seed=1))
    drafter = jaxddtree.load_drafter(ddir, target, "float32")
    prompt = np.random.RandomState(1).randint(0, 96, 20).tolist()
    runs = {m: jaxddtree.generate(target, prompt, drafter=drafter, method=m, tree_budget=16,
                                  max_new_tokens=24).tokens for m in ("ar", "dflash", "ddtree")}
    assert len(runs["ar"]) == 24
    assert runs["ddtree"] == runs["ar"] and runs["dflash"] == runs["ar"]


def test_quantize_is_the_checkpoint_scheme():
    """`fp8.quantize` (the drafter's bf16 weights made FP8) stores what transformers' quantizer (the torch emulation
    above) stores: the same e4m3 values and scales, for blocks that do not divide the matrix; a 3-D weight with two
    contracted axes is its [N, K] matrix; dequantized it is within e4m3's rounding of the weight."""
    from jaxddtree.model import fp8 as fp8_lib
    w = torch.randn(70, 45) * torch.linspace(0.01, 3, 45)  # [in, out] in the model's layout (K first)
    w[:, :16] = 0  # an all-zero block (scale 1)
    q_ref, inv_ref, deq_ref = quantize(w.T.contiguous(), 32, 32)
    got = fp8_lib.quantize(w.numpy(), 1, block=32)
    assert got.shape == (70, 45) and got.q.shape == (45, 70)
    np.testing.assert_array_equal(np.asarray(got.q).astype(np.float32), q_ref.float().numpy())
    np.testing.assert_array_equal(np.asarray(got.scale)[:, :inv_ref.shape[1]], inv_ref.numpy())
    np.testing.assert_array_equal(np.asarray(got.dequantize()), deq_ref.T.numpy())
    w3 = np.random.RandomState(0).randn(4, 8, 40).astype(np.float32)  # [nh, hd, H]: K = 32 contracted
    got3 = fp8_lib.quantize(w3, 2, block=16)
    assert got3.q.shape == (40, 32) and got3.dequantize().shape == (4, 8, 40)
    np.testing.assert_allclose(np.asarray(got3.dequantize()), w3, rtol=2 ** -4, atol=np.abs(w3).max() / 448 * 2 ** -3)


def test_fp8_drafter_lossless(everything):
    """`Drafter.to_fp8`: the drafter's projections as FP8 W8A8 (fc and every layer's), its output unchanged: DDTree
    and DFlash tokens == AR's at T = 0 with drafts it proposes from FP8 weights."""
    import helpers_dflash
    from jaxddtree.model.fp8 import Fp8Weight
    fp8_dir, ref_dir = everything
    target = jaxddtree.load_target(ref_dir, "float32")
    ddir = os.path.join(os.path.dirname(fp8_dir), "drafter_bf")
    cfg = helpers_dflash.tiny_config(hidden=64, vocab=97, mask_token_id=96, num_target_layers=4,
                                     target_layer_ids=(1, 2), block_size=8)
    helpers_dflash.write_checkpoint(ddir, cfg, helpers_dflash.random_weights(cfg, seed=2))
    plain = jaxddtree.load_drafter(ddir, target, "float32")
    drafter = plain.to_fp8(block=16)
    assert drafter.fp8 and not plain.fp8
    assert all(isinstance(w, Fp8Weight) for lp in drafter.params.layers
               for w in (lp.w_qkv, lp.wo, lp.w_gate_up, lp.w_down))
    prompt = np.random.RandomState(3).randint(0, 96, 20).tolist()
    ar = jaxddtree.generate(target, prompt, method="ar", max_new_tokens=24).tokens
    runs = {m: jaxddtree.generate(target, prompt, drafter=drafter, method=m, tree_budget=16,
                                  max_new_tokens=24) for m in ("dflash", "ddtree")}
    assert all(g.tokens == ar for g in runs.values())
    # the drafts differ from the plain drafter's only by FP8 rounding: its first draft logits are close
    import jax
    import jax.numpy as jnp
    from jaxddtree.model.drafter import draft_logits
    feats = jnp.asarray(np.random.RandomState(4).randn(1, 8, 2 * 64).astype(np.float32))
    args = (feats, jnp.int32(5), jnp.asarray([7], jnp.int32), target.embedding, target.lm_head)
    logits = jax.jit(draft_logits, static_argnums=1)  # (one program each, not hundreds of eager ops)
    a, _ = logits(plain.params, plain.config, plain.init_cache(1, 64), *args)
    b, _ = logits(drafter.params, drafter.config, drafter.init_cache(1, 64), *args)
    assert 0 < float(jnp.max(jnp.abs(a - b))) < 0.1 * float(jnp.max(jnp.abs(a)))


# ---------------------------------------------------------------------------------------- malformed
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(d, fn):
    from safetensors.torch import load_file, save_file
    f = os.path.join(d, "model.safetensors")
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


NAME = "model.layers.0.mlp.up_proj.weight_scale_inv"


@pytest.mark.parametrize("case,match", [
    ("missing_scale", r"'model\.layers\.0\.mlp\.up_proj\.weight' has no 'model\.layers\.0\.mlp\.up_proj\."
                      r"weight_scale_inv'"),
    ("scale_shape", r"'model\.layers\.0\.mlp\.up_proj\.weight_scale_inv' has shape \(3, 2\), expected \(3, 3\)"),
    ("unknown_fmt", r"fmt 'e5m2' is not supported"),
    ("scale_on_plain", r"'model\.layers\.0\.linear_attn\.in_proj_b\.weight_scale_inv' scales"),
    ("no_config", r"FP8 scale, but config\.json has no fp8 quantization_config"),
    ("static", r"activation_scheme 'static' is not supported"),
])
def test_malformed(released, tmp_path, case, match):
    d = _copy(released[0], str(tmp_path / case))
    if case == "missing_scale":
        _edit_tensors(d, lambda sd: sd.pop(NAME))
    elif case == "scale_shape":
        _edit_tensors(d, lambda sd: sd.__setitem__(NAME, sd[NAME][:, :2].contiguous()))
    elif case == "unknown_fmt":
        hf_models.edit_config(d, lambda c: c["quantization_config"].__setitem__("fmt", "e5m2"))
    elif case == "scale_on_plain":
        _edit_tensors(d, lambda sd: sd.__setitem__("model.layers.0.linear_attn.in_proj_b.weight_scale_inv",
                                                   torch.ones(1, 3)))
    elif case == "no_config":
        hf_models.edit_config(d, lambda c: c.pop("quantization_config"))
    elif case == "static":
        hf_models.edit_config(d, lambda c: c["quantization_config"].__setitem__("activation_scheme", "static"))
    with pytest.raises(CheckpointError, match=match):
        jaxddtree.load_target(d, "float32")


def test_convert_roundtrip(released, tmp_path):
    """`python -m convert` (its `convert`) keeps the fp8 weights + block scales (+ the bf16 tail): the restored
    target has the same parameters, bit for bit, as loading the FP8 directory, read by the direct reader,
    and generates the same tokens."""
    import jax
    from flax import nnx
    from jaxddtree.checkpoint import orbax_format
    from jaxddtree.checkpoint.convert import convert
    out = str(tmp_path / "conv")
    meta = convert(released[0], out, dtype="float32")
    a0 = jaxddtree.load_target(released[0], "float32").module()
    w_in0 = a0.layers[0].mixer.w_in[...]
    assert meta["fp8"]["layers.0.mixer.w_in"] == {"block_in": 24, "block_out": w_in0.block_out,
                                                  "shape": list(w_in0.shape)}
    assert meta["fp8"]["layers.3.mixer.wo"] == {"block_in": 24, "block_out": 32,
                                                "shape": list(a0.layers[3].mixer.wo[...].shape)}
    assert "layers.1.mlp.w_down" not in meta["fp8"]  # modules_to_not_convert: plain
    a, b = jaxddtree.load_target(out, "float32"), jaxddtree.load_target(released[0], "float32")
    assert orbax_format.last_restore["reader"] == "direct"
    sa, sb = (nnx.to_pure_dict(nnx.state(t.module())) for t in (a, b))
    assert jax.tree.structure(sa) == jax.tree.structure(sb)
    w_in = a.module().layers[0].mixer.w_in[...]
    assert isinstance(w_in, Fp8Weight) and w_in.q.dtype == np.dtype("float8_e4m3fn") and w_in.tail is not None
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    prompt = np.random.RandomState(5).randint(0, 96, 12).tolist()
    ga, gb = (jaxddtree.generate(t, prompt, method="ar", max_new_tokens=12).tokens for t in (a, b))
    assert ga == gb and len(ga) == 12


def test_convert_refuses_fp8_drafter(released, tmp_path):
    from jaxddtree.checkpoint.convert import ConvertError, convert
    with pytest.raises(ConvertError, match="quantized checkpoints \\(quant_method 'fp8'\\) are not supported "
                                           "for a drafter") as e:
        convert(released[0], str(tmp_path / "out"), kind="drafter")
    assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "out")


def test_layout_everything(everything):
    t = jaxddtree.load_target(everything[0], "bfloat16")
    m = t.module()
    assert t.dtype == np.dtype("bfloat16")
    w_in = m.layers[0].mixer.w_in[...]
    assert isinstance(w_in, Fp8Weight) and w_in.tail is None  # in_proj_b|a fp8 too
    assert isinstance(m.lm_head[...], Fp8Weight) and m.lm_head[...].shape == (64, 97)
    assert t.lm_head.dtype == np.dtype("float8_e4m3fn")  # the drafter dequantizes it (`.astype`)
    assert isinstance(m.layers[3].mlp.w_gate_up[...], Fp8Weight)
    qkv = m.layers[3].mixer.w_qkv[...]  # fp8 | plain | fp8: dequantized on load, in the compute dtype
    assert not isinstance(qkv, Fp8Weight) and qkv.dtype == np.dtype("bfloat16")


def test_wrapper_sharded(released, tmp_path):
    """The multimodal wrapper layout (`model.language_model.*`, quantization_config inside text_config),
    sharded with an index: the same parameters as the text-only FP8 checkpoint."""
    import jax
    from flax import nnx
    from safetensors.torch import load_file, save_file
    fp8_dir = released[0]
    sd = load_file(os.path.join(fp8_dir, "model.safetensors"))
    with open(os.path.join(fp8_dir, "config.json")) as f:
        text = json.load(f)
    d = str(tmp_path / "wrapper")
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                   "text_config": text}, f)
    names = sorted(sd)
    weight_map = {}
    for s, chunk in enumerate((names[::2], names[1::2])):  # a weight and its scale often in different shards
        fname = f"model-0000{s + 1}-of-00002.safetensors"
        out = {}
        for n in chunk:
            new = n if n == "lm_head.weight" else "model.language_model." + n[len("model."):]
            out[new] = sd[n]
            weight_map[new] = fname
        save_file(out, os.path.join(d, fname))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    a = nnx.to_pure_dict(nnx.state(jaxddtree.load_target(d, "float32").module()))
    b = nnx.to_pure_dict(nnx.state(jaxddtree.load_target(fp8_dir, "float32").module()))
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_fp8_without_config(released, tmp_path):
    d = _copy(released[0], str(tmp_path / "noconf"))
    hf_models.edit_config(d, lambda c: c.pop("quantization_config"))
    _edit_tensors(d, lambda sd: [sd.pop(k) for k in [k for k in sd if k.endswith("_scale_inv")]])
    with pytest.raises(CheckpointError, match=r"tensor '.*\.weight' is fp8, but config\.json has no fp8 "
                                              r"quantization_config"):
        jaxddtree.load_target(d, "float32")


@pytest.fixture(scope="module")
def pow2_blocks(tmp_path_factory):
    """The bf16 comparison model (hidden 128) with 24x32 blocks: input blocks the fp8 kernel can tile (BK
    divides 32), partial output blocks, bf16 scales, lm_head / in_proj_a|b plain (w_in's bf16 tail)."""
    root = str(tmp_path_factory.mktemp("fp8_pow2"))
    return write_fp8_pair(hf_models.causal_lm_bf16(), root, block=(24, 32), scale_dtype=torch.bfloat16)


def test_pallas_fp8_kernel_in_model(pow2_blocks, jx, monkeypatch):
    """kernels="pallas" runs every fp8 projection (prefill of 21 rows, decode GEMVs, w_in with its bf16 tail)
    on the W8A8 kernel (interpret mode; the other kernels stay on their references here): bf16 logits match
    kernels="xla" (the kernel's jnp reference: the same function) up to fp32 summation order."""
    import dataclasses
    from kernels_pallas import ops
    from kernels_pallas import w8a8
    fp8_dir, ref_dir = pow2_blocks
    ids = np.random.RandomState(4).randint(0, 96, 21)
    target = jaxddtree.load_target(fp8_dir, "bfloat16")
    xla = _logits(jx, target, ids, 2)
    weight_only = _logits(jx, jaxddtree.load_target(ref_dir, "bfloat16"), ids, 2)
    calls = []
    kernel = w8a8.w8a8
    monkeypatch.setattr(w8a8, "w8a8", lambda x, q, s, **kw: calls.append(x.shape) or
                        kernel(x, q, s, interpret=True, **kw))

    def on_reference(f):
        def g(*a, **k):
            b = inspect.signature(f).bind(*a, **k)
            b.arguments["kernels"] = "xla"
            return f(*b.args, **b.kwargs)
        return g
    for name in ("tree_attention", "prefill_attention", "gdn_chunked", "gdn_masked_block", "gdn_decode_fused",
                 "attention_decode_prep"):
        monkeypatch.setattr(ops, name, on_reference(getattr(ops, name)))
    pallas = _logits(jx, dataclasses.replace(target, kernels="pallas"), ids, 2)
    # traced per jit (prefill; decode once or twice): 4 layers x 4 fp8 projections (w_in | w_qkv, w_out | wo,
    # w_gate_up, w_down) per trace, with 21 rows and with 1
    assert len(calls) % 16 == 0 and len(calls) >= 32 and sorted({c[0] for c in calls}) == [1, 21]
    e, e_wo = hf_models.rel_err(pallas, xla), hf_models.rel_err(weight_only, xla)
    print(f"pallas vs xla {e:.3g}; weight-only vs xla {e_wo:.3g}")
    assert e <= 1e-2 and e < 0.2 * e_wo


def test_compact_scales():
    """The compact grid is exact: the widest divisor of the block whose row groups are constant."""
    from jaxddtree.model.fp8 import compact_scales
    rs = np.random.RandomState(0)
    parts = [np.repeat(rs.rand(-(-n // 8), 3).astype(np.float32), 8, axis=0)[:n]  # 8-row blocks
             for n in (24, 20, 13)]
    rows = np.concatenate(parts, axis=0)  # part boundaries at 24 and 44: groups of 4 never straddle
    c, g = compact_scales(rows, 8)
    assert g == 4 and c.shape == (-(-57 // 4), 3)
    np.testing.assert_array_equal(np.repeat(c, g, axis=0)[:57], rows)
    c, g = compact_scales(np.concatenate(parts[:2], axis=0), 8)
    assert g == 8  # one boundary (24): 8-wide groups fit; the last group past the end is padded
    c, g = compact_scales(np.repeat(rs.rand(3, 2), 128, axis=0)[:300], 128)
    assert g == 128 and c.shape == (3, 2)
    assert compact_scales(rs.rand(5, 2), 128)[1] == 1


@pytest.mark.parametrize("version", [3, 4])
def test_older_fp8_formats_load(released, tmp_path, version):
    """A target converted before format_version 5 loads, exactly (same dequantized weights, same greedy tokens as
    the FP8 directory): version 4 stored q in the model's layout [K.., N..] and the compact scales as [K blocks,
    N blocks]; version 3 one scale per output column [K blocks, *output axes] (no block_out). Both are
    transposed (and compacted) on load."""
    import shutil as sh
    import orbax.checkpoint.experimental.v1 as ocp
    from jaxddtree.checkpoint import orbax_format
    from jaxddtree.checkpoint.convert import convert
    new = str(tmp_path / "v5")
    meta = convert(released[0], new, dtype="float32")
    old = tmp_path / f"v{version}"
    old.mkdir()
    flat = orbax_format.from_tree(ocp.load(os.path.join(new, "params")))
    t5 = jaxddtree.load_target(new, "float32").module()
    n = 0
    for p, info in meta["fp8"].items():
        path = tuple(int(k) if k.isdigit() else k for k in p.split("."))
        w = t5
        for k in path:
            w = w[k] if isinstance(k, int) else getattr(w, k)
        w = w[...]
        N, K = w.q.shape
        qshape = w.shape if w.tail is None else w.shape[:-1] + (w.shape[-1] - w.tail.shape[-1],)
        flat[path + ("q",)] = np.asarray(w.q).T.reshape(qshape)
        nb = -(-K // w.block_in)
        sc = np.asarray(w.scale)[:, :nb].T  # [K blocks, N blocks]
        if version == 3:
            sc = np.repeat(sc, w.block_out, axis=1)[:, :N].reshape((nb,) + qshape[w.nc:])
        flat[path + ("scale",)] = sc
        info.clear()
        info.update({"block_in": w.block_in, "nc": w.nc} | ({"block_out": w.block_out} if version == 4 else {}))
        n += 1
    assert n > 10
    writer = orbax_format.PartialWriter(str(old / "params"), 1 << 30)
    for p, x in flat.items():
        writer.add(p, np.asarray(x))
    writer.finalize()
    sh.copy(os.path.join(new, "config.json"), old / "config.json")
    extra = {k: v for k, v in meta.items() if k not in ("format", "format_version", "kind", "dtype", "params",
                                                          "orbax_checkpoint", "dst", "seconds")}
    m = orbax_format.write_marker(str(old), "target", "float32", **extra)
    m["format_version"] = version
    with open(old / orbax_format.MARKER, "w") as f:
        json.dump(m, f)
    a, b = jaxddtree.load_target(str(old), "float32"), jaxddtree.load_target(released[0], "float32")
    import jax
    from flax import nnx
    fa, fb = (jax.tree.leaves(nnx.to_pure_dict(nnx.state(t.module())), is_leaf=lambda x: isinstance(x, Fp8Weight))
              for t in (a, b))
    for x, y in zip(fa, fb):
        if isinstance(x, Fp8Weight):
            assert x.q.shape == y.q.shape and x.scale.shape == y.scale.shape and x.shape == y.shape
            x, y = x.dequantize(), y.dequantize()
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    prompt = np.random.RandomState(6).randint(0, 96, 12).tolist()
    ga, gb = (jaxddtree.generate(t, prompt, method="ar", max_new_tokens=8).tokens for t in (a, b))
    assert ga == gb


@pytest.mark.parametrize("method,budget", [("ar", 0), ("ddtree", 15)])
def test_fp8_rounds_lower_for_h200_on_fp8_wgmma(method, budget):
    """A random fp8 target (128-aligned smoke shapes, 128x128 blocks) with kernels="pallas": the AR step and the
    DDTree round lower for an abstract H200 with every fp8 projection on the Mosaic GPU fp8-wgmma kernel (decode
    rows and the verify's tree rows): no Triton W8A8 kernel is left in the program."""
    import dataclasses
    import functools
    import sys
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench
    from jaxddtree.model.config import text_config_from_dict
    from jaxddtree.model.drafter_config import DrafterConfig
    from jaxddtree.model.target import random_target
    from jaxddtree.speculative import loop as loop_lib
    from kernels_pallas._common import lower_for_h200
    raw, dfl = dict(bench.QWEN36_27B), dict(bench.DFLASH_27B)
    raw.update(bench.SMOKE_TARGET, hidden_size=128, intermediate_size=256)
    dfl.update(bench.SMOKE_DFLASH, hidden_size=128)
    target = random_target(text_config_from_dict(raw, where="smoke"), "bfloat16", weights="fp8")
    dcfg = DrafterConfig(**dfl)
    drafter = bench.random_drafter(dcfg, jnp.bfloat16)
    plan = dataclasses.replace(bench.make_plan(target, dcfg, method, budget), kernels="pallas")
    state = jax.eval_shape(lambda: bench.loop_state(target, drafter, plan, 64, 64))
    d = dcfg if method != "ar" else None
    f = functools.partial(loop_lib.run_rounds, graphdef=target.graphdef, treedef=target.treedef, dcfg=d, plan=plan,
                          chunk=1)
    txt = lower_for_h200(f, target.leaves, drafter.params if d else None, state,
                         jax.ShapeDtypeStruct((1,), jnp.int32))
    assert "w8a8_fp8_dot" not in txt  # the Triton W8A8 kernel
    assert txt.count("custom_call @mosaic_gpu") >= 4  # the fp8 projection shapes (identical calls share a function)
