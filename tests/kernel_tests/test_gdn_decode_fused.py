"""Fused GDN decode step (kernels_pallas.gdn_decode_fused): the Pallas kernel (interpret mode) vs the jnp
reference, the reference vs the model's own T = 1 path, and the kernel's CUDA lowering for an H200."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas import gdn_decode_fused as F
from kernels_pallas import ops
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, gdn_decode_fused_inputs, rel_err

K = 4
EPS = 1e-6


def dims(hk, hv, dk, dv):
    return dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, conv_kernel=K, eps=EPS)


def fused_inputs(key, B, hk, hv, dk, dv, dtype):
    return gdn_decode_fused_inputs(key, B, hk, hv, dk, dv, K, dtype=dtype)


def test_signature_matches_reference():
    ref = assert_kernel_signature(F.gdn_decode_fused, F.gdn_decode_fused_reference)
    disp = inspect.signature(ops.gdn_decode_fused).parameters
    assert sorted(disp) == sorted(ref + ["kernels"]) and disp["kernels"].default == "xla"
    kw_only = lambda ps: [n for n, p in ps.items() if p.kind == p.KEYWORD_ONLY]
    assert kw_only(disp) == kw_only(inspect.signature(F.gdn_decode_fused_reference).parameters)


@pytest.mark.parametrize("dtype,B,hk,hv,dk,dv,kw", [
    (jnp.float32, 2, 2, 6, 16, 32, {}),
    (jnp.bfloat16, 2, 2, 6, 16, 32, {}),
    (jnp.bfloat16, 1, 2, 6, 32, 32, dict(block_v=16)),  # two state tiles per program
    (jnp.float32, 1, 1, 2, 24, 20, {}),  # head dims padded to powers of two (masked loads)
], ids=["fp32", "bf16", "bf16-bv16", "fp32-padded"])
def test_kernel_matches_reference(dtype, B, hk, hv, dk, dv, kw):
    args = fused_inputs(jax.random.PRNGKey(dk + dv), B, hk, hv, dk, dv, dtype)
    d = dims(hk, hv, dk, dv)
    ref = jax.jit(functools.partial(F.gdn_decode_fused_reference, **d))(*args)
    out = F.gdn_decode_fused(*args, **d, interpret=True, **kw)
    for name, a, b in zip(("o", "conv_state", "state"), out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
    o, conv, state = (np.asarray(x.astype(jnp.float32)) for x in out)
    o_r, conv_r, state_r = (np.asarray(x.astype(jnp.float32)) for x in ref)
    np.testing.assert_array_equal(conv, conv_r)  # a copy: exact
    assert rel_err(state, state_r) < 1e-5
    if dtype == jnp.float32:
        assert rel_err(o, o_r) < 1e-5
    else:  # every rounding reproduced: at most a rare last-bit flip from fp32 summation order
        assert np.mean(o != o_r) < 0.01 and rel_err(o, o_r) < 1e-2


def test_kernel_two_steps_in_place():
    """Outputs fed back (conv and recurrent state), the state donated: the in-place update is right."""
    B, hk, hv, dk, dv = 1, 2, 4, 16, 16
    proj, cs, cw, A_log, dtb, nw, state = fused_inputs(jax.random.PRNGKey(7), B, hk, hv, dk, dv, jnp.float32)
    d = dims(hk, hv, dk, dv)
    ker = jax.jit(functools.partial(F.gdn_decode_fused, **d, interpret=True), donate_argnums=(1, 6))
    ref = jax.jit(functools.partial(F.gdn_decode_fused_reference, **d))
    cs_k, s_k, cs_r, s_r = jnp.array(cs), jnp.array(state), cs, state
    for i in range(2):
        p = proj * (1.0 - 0.5 * i)
        o_k, cs_k, s_k = ker(p, cs_k, cw, A_log, dtb, nw, s_k)
        o_r, cs_r, s_r = ref(p, cs_r, cw, A_log, dtb, nw, s_r)
    np.testing.assert_array_equal(np.asarray(cs_k), np.asarray(cs_r))
    assert rel_err(o_k, o_r) < 1e-5 and rel_err(s_k, s_r) < 1e-5


def stacked_inputs(seed, L, B, hk, hv, dk, dv, dtype):
    """L layers' fresh random caches stacked on a leading layer axis, and one layer's projection row and weights:
    (proj, conv_state [L, ...], conv_w, A_log, dt_bias, norm_w, state [L, ...])."""
    per = [fused_inputs(jax.random.PRNGKey(seed + i), B, hk, hv, dk, dv, dtype) for i in range(L)]
    return (per[0][0], jnp.stack([p[1] for p in per]), *per[0][2:6], jnp.stack([p[6] for p in per]))


def assert_layer_update(out, single, stacked, layer):
    """out (o, conv_state, state) of a layer= call on the stacked caches: layer `layer` bitwise the call on that
    layer's caches (`single`), every other layer untouched."""
    o, conv, state = out
    np.testing.assert_array_equal(np.asarray(o), np.asarray(single[0]))
    for new, one, old in zip((conv, state), single[1:], stacked):
        assert new.shape == old.shape and new.dtype == old.dtype
        np.testing.assert_array_equal(np.asarray(new[layer]), np.asarray(one))
        others = np.arange(old.shape[0]) != layer
        np.testing.assert_array_equal(np.asarray(new)[others], np.asarray(old)[others])


@pytest.mark.parametrize("dtype,kw", [(jnp.float32, {}), (jnp.bfloat16, dict(block_v=16))], ids=["fp32", "bf16-bv16"])
def test_kernel_layer_of_stacked_caches(dtype, kw):
    """layer=l on the caches of 3 layers stacked [L, ...] (l traced, the stacks donated: in place) is the kernel on
    layer l's caches, the other layers untouched; the reference's layer= likewise."""
    B, hk, hv, dk, dv, L = 2, 2, 6, 16, 32, 3
    proj, cs, cw, A_log, dtb, nw, state = stacked_inputs(30, L, B, hk, hv, dk, dv, dtype)
    d = dims(hk, hv, dk, dv)
    ker = jax.jit(functools.partial(F.gdn_decode_fused, **d, interpret=True, **kw), donate_argnums=(1, 6))
    one = jax.jit(functools.partial(F.gdn_decode_fused, **d, interpret=True, **kw))
    ref = jax.jit(functools.partial(F.gdn_decode_fused_reference, **d))
    for layer in (2, 0):
        single = one(proj, cs[layer], cw, A_log, dtb, nw, state[layer])
        got = ker(proj, jnp.array(cs), cw, A_log, dtb, nw, jnp.array(state), layer=jnp.int32(layer))
        assert_layer_update(got, single, (cs, state), layer)
        r_single = ref(proj, cs[layer], cw, A_log, dtb, nw, state[layer])
        assert_layer_update(ref(proj, cs, cw, A_log, dtb, nw, state, layer=jnp.int32(layer)), r_single, (cs, state),
                            layer)


def test_kernel_layer_under_vmap():
    """jax.vmap over slots (batched serving) with the stacked caches [V, L, ...] batched and the layer not: each
    slot's result is the kernel on its own caches' layer; the projection partials [S, B, P] come in too."""
    B, hk, hv, dk, dv, L, V = 1, 1, 2, 16, 16, 2, 2
    slots = [stacked_inputs(40 + 10 * v, L, B, hk, hv, dk, dv, jnp.bfloat16) for v in range(V)]
    parts = 0.5 * jax.random.normal(jax.random.PRNGKey(41), (V, 2) + slots[0][0].shape, jnp.float32)
    cs, state = jnp.stack([s[1] for s in slots]), jnp.stack([s[6] for s in slots])
    _, _, cw, A_log, dtb, nw, _ = slots[0]
    d = dims(hk, hv, dk, dv)
    f = jax.jit(jax.vmap(lambda p, c, s, layer: F.gdn_decode_fused(p, c, cw, A_log, dtb, nw, s, **d, layer=layer,
                                                                   interpret=True), in_axes=(0, 0, 0, None)))
    got = f(parts, cs, state, jnp.int32(1))
    for v in range(V):
        single = F.gdn_decode_fused(parts[v], cs[v, 1], cw, A_log, dtb, nw, state[v, 1], **d, interpret=True)
        assert_layer_update([x[v] for x in got], single, (cs[v], state[v]), 1)


def test_lowers_for_h200_with_layer():
    """layer= at 27B shapes (3 stacked layers): one Triton call with both stacks aliased to its outputs, and the
    q/k conv rows written back by one dynamic_update_slice."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    hk, hv, dk, dv, L = 16, 48, 128, 128, 3
    cd = 2 * hk * dk + hv * dv
    structs = [S((4, 1, cd + hv * dv + 2 * hv), jnp.float32), S((L, 1, K - 1, cd), bf), S((K, cd), bf),
               S((hv,), bf), S((hv,), bf), S((dv,), bf), S((L, 1, hv, dk, dv), jnp.float32), S((), jnp.int32)]
    f = lambda *a: F.gdn_decode_fused(*a[:7], **dims(hk, hv, dk, dv), layer=a[7])
    txt = lower_for_h200(f, *structs)
    assert txt.count("__gpu$xla.gpu.triton") == 1 and txt.count("dynamic_update_slice") == 1
    for out, operand in ((1, 2), (2, 7)):  # the conv and recurrent stacks (the layer is operand 0)
        assert f"output_tuple_indices = [{out}], operand_index = {operand}" in txt


def stacked_params(seed, L, B, hk, hv, dk, dv, dtype):
    """L layers' small parameters stacked: (conv_w [L, K, conv_dim], A_log [L, Hv], dt_bias [L, Hv], norm_w [L, dv])."""
    per = [fused_inputs(jax.random.PRNGKey(seed + 100 + i), B, hk, hv, dk, dv, dtype)[2:6] for i in range(L)]
    return tuple(jnp.stack([p[i] for p in per]) for i in range(4))


@pytest.mark.parametrize("dtype,kw", [(jnp.float32, {}), (jnp.bfloat16, dict(block_v=16))], ids=["fp32", "bf16-bv16"])
@pytest.mark.parametrize("which", [(0, 1, 2, 3), (0, 3)], ids=["all", "conv+norm"])
def test_kernel_layer_of_stacked_small_params(dtype, kw, which):
    """layer=l with conv_w / A_log / dt_bias / norm_w stacked [L, ...] too (all, or some: per-layer ones mixed in)
    is bitwise the kernel on layer l's caches and parameters; the reference's layer= likewise; in vmap over slots."""
    B, hk, hv, dk, dv, L = 2, 2, 6, 16, 32, 3
    proj, cs, cw, A_log, dtb, nw, state = stacked_inputs(50, L, B, hk, hv, dk, dv, dtype)
    stacks = stacked_params(50, L, B, hk, hv, dk, dv, dtype)
    d = dims(hk, hv, dk, dv)
    ker = jax.jit(functools.partial(F.gdn_decode_fused, **d, interpret=True, **kw), donate_argnums=(1, 6))
    one = jax.jit(functools.partial(F.gdn_decode_fused, **d, interpret=True, **kw))
    ref = jax.jit(functools.partial(F.gdn_decode_fused_reference, **d))
    for layer in (2, 1):
        small = [stacks[i] if i in which else (cw, A_log, dtb, nw)[i] for i in range(4)]
        small_l = [stacks[i][layer] if i in which else (cw, A_log, dtb, nw)[i] for i in range(4)]
        single = one(proj, cs[layer], *small_l, state[layer])
        got = ker(proj, jnp.array(cs), *small, jnp.array(state), layer=jnp.int32(layer))
        assert_layer_update(got, single, (cs, state), layer)
        r_single = ref(proj, cs[layer], *small_l, state[layer])
        assert_layer_update(ref(proj, cs, *small, state, layer=jnp.int32(layer)), r_single, (cs, state), layer)
    V = 2  # slots: the caches batched, the parameters' stacks and the layer not
    cs_v, s_v = jnp.stack([cs, cs * 0.5]), jnp.stack([state, state * 2.0])
    f = jax.jit(jax.vmap(lambda c, s, layer: one(proj, c, *stacks, s, layer=layer), in_axes=(0, 0, None)))
    got = f(cs_v, s_v, jnp.int32(1))
    for v in range(V):
        single = one(proj, cs_v[v, 1], *(a[1] for a in stacks), s_v[v, 1])
        assert_layer_update([x[v] for x in got], single, (cs_v[v], s_v[v]), 1)


def test_lowers_for_h200_with_stacked_small_params():
    """layer= with the small parameters stacked (27B shapes): they reach the one Triton call whole — no slice of
    them outside the kernel (XLA would materialise each as its own copy kernel)."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    hk, hv, dk, dv, L = 16, 48, 128, 128, 3
    cd = 2 * hk * dk + hv * dv
    structs = [S((4, 1, cd + hv * dv + 2 * hv), jnp.float32), S((L, 1, K - 1, cd), bf), S((L, K, cd), bf),
               S((L, hv), bf), S((L, hv), bf), S((L, dv), bf), S((L, 1, hv, dk, dv), jnp.float32), S((), jnp.int32)]
    f = lambda *a: F.gdn_decode_fused(*a[:7], **dims(hk, hv, dk, dv), layer=a[7])
    txt = lower_for_h200(f, *structs)
    assert txt.count("__gpu$xla.gpu.triton") == 1 and txt.count("dynamic_update_slice") == 1
    assert "dynamic_slice" not in txt.replace("dynamic_update_slice", "")
    for out, operand in ((1, 2), (2, 7)):
        assert f"output_tuple_indices = [{out}], operand_index = {operand}" in txt


def test_model_scan_passes_stacked_small_params():
    """The scanned model's decode step: the GDN layer's conv / A_log / dt_bias / norm reach the fused op as the
    layer group's stacks with the caches' layer (`qwen35.layer_view`: `ops.Layer` views), not as slices; so do the
    input / post RMSNorm weights (`rms_norm.rms_norm_rows` reads them from the stack on the verify's GEMMs)."""
    from kernels_pallas import gdn_reference
    from jaxddtree.model.qwen35 import layer_view
    from kernels_pallas.ops import Layer

    st = {"input_norm": {"weight": jnp.ones((2, 4))}, "mixer": {"norm": jnp.ones((2, 8)), "conv": jnp.ones((2, 4, 8)),
          "A_log": jnp.ones((2, 3)), "dt_bias": jnp.ones((2, 3)), "q_norm": jnp.ones((2, 8))},
          "post_norm": {"weight": jnp.ones((2, 4))}}
    v = layer_view(st, jnp.int32(1))
    # (q_norm: attention_decode_prep reads it from the stack too)
    assert all(isinstance(v["mixer"][n], Layer) for n in ("norm", "conv", "A_log", "dt_bias", "q_norm"))
    assert all(isinstance(a, Layer) for a in (v["input_norm"]["weight"], v["post_norm"]["weight"]))
    seen = []
    real = gdn_reference.gdn_decode_fused

    def spy(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, **kw):
        seen.append((conv_state.ndim, conv_w.ndim, A_log.ndim, dt_bias.ndim, norm_w.ndim, kw.get("layer") is None))
        return real(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, **kw)

    from jaxddtree.model import layout as Lay
    from jaxddtree.model.cache import init_cache
    from jaxddtree.model.config import ATTENTION, GDN, TextConfig
    from jaxddtree.model.qwen35 import Qwen35
    cfg = TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     layer_types=(GDN, ATTENTION) * 2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     rope_theta=1e4, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=K,
                     max_position_embeddings=64)
    m = Qwen35(cfg, jnp.float32, nnx.Rngs(0))
    cache = init_cache(cfg, 16, jnp.float32)
    import unittest.mock as mock
    with mock.patch.object(gdn_reference, "gdn_decode_fused", spy):
        m(jnp.zeros((1, 1), jnp.int32), cache, Lay.sequence(3, 1, K, num_valid=1, batch=1))
    assert seen[0] == (4, 3, 2, 2, 2, False), seen  # (then the reference's own call on the layer's slices)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_model_decode_step(dtype):
    """The model's decode step (T = 1: one `ops.gdn_decode_fused` on the fused projection row, here the
    reference) against the same token through the model's other path: a T = 8 sequence pass with one real
    token (conv over the state rows, the chunked WY form with padding, the gated norm). Output row and both
    caches must agree to rounding. (The decode step against transformers: tests/test_model.py.)"""
    from jaxddtree.model import layout as L
    from jaxddtree.model.cache import GDNState
    from jaxddtree.model.config import TextConfig
    from jaxddtree.model.gated_deltanet import GatedDeltaNet

    hk, hv, dk, dv, D, B = 2, 6, 16, 32, 64, 1
    cfg = TextConfig(vocab_size=32, hidden_size=D, intermediate_size=96, num_hidden_layers=1,
                     layer_types=("linear_attention",), num_attention_heads=2, num_key_value_heads=1,
                     head_dim=16, rope_theta=1e4, partial_rotary_factor=0.25, linear_num_key_heads=hk,
                     linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv,
                     linear_conv_kernel_dim=K, rms_norm_eps=EPS)
    m = GatedDeltaNet(cfg, dtype, nnx.Rngs(3))
    ks = jax.random.split(jax.random.PRNGKey(11), 3)
    x = jax.random.normal(ks[0], (B, 1, D)).astype(dtype)
    cache = GDNState(conv=jax.random.normal(ks[1], (B, K - 1, cfg.conv_dim)).astype(dtype),
                     recurrent=0.1 * jax.random.normal(ks[2], (B, hv, dk, dv), jnp.float32))

    @functools.partial(jax.jit, static_argnames="t")
    def step(x, cache, t):
        xt = jnp.concatenate([x, jnp.ones((B, t - 1, D), x.dtype)], axis=1)  # padding rows: no effect
        y, new, _ = m(xt, cache, L.sequence(5, t, K, num_valid=1, batch=B))
        return y[:, :1], new

    (y1, c1), (y8, c8) = step(x, cache, 1), step(x, cache, 8)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # (the projection's sums differ with the row count: not bitwise)
    assert rel_err(c1.conv, c8.conv) < tol  # the same rows, shifted
    assert rel_err(c1.recurrent, c8.recurrent) < tol
    assert rel_err(y1, y8) < tol


def test_ops_dispatch():
    B, hk, hv, dk, dv = 1, 1, 2, 16, 16
    args = fused_inputs(jax.random.PRNGKey(5), B, hk, hv, dk, dv, jnp.float32)
    d = dims(hk, hv, dk, dv)
    ref = jax.jit(functools.partial(F.gdn_decode_fused_reference, **d))(*args)
    for a, b in zip(jax.jit(functools.partial(ops.gdn_decode_fused, **d, kernels="xla"))(*args), ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stacked = (args[1][None], args[6][None])  # layer= passed through: one stacked layer
    got = jax.jit(functools.partial(ops.gdn_decode_fused, **d, kernels="xla"))(args[0], stacked[0], *args[2:6],
                                                                                stacked[1], layer=jnp.int32(0))
    for a, b in zip(got, (ref[0], ref[1][None], ref[2][None])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError):
        ops.gdn_decode_fused(*args, **d, kernels="cuda")


@pytest.mark.parametrize("kw", [{}, dict(block_v=32, num_warps=4)])
def test_lowers_for_h200_at_27b_shapes(kw):
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    hk, hv, dk, dv = 16, 48, 128, 128
    cd = 2 * hk * dk + hv * dv  # 10240
    structs = [S((1, cd + hv * dv + 2 * hv), bf), S((1, K - 1, cd), bf), S((K, cd), bf), S((hv,), bf),
               S((hv,), bf), S((dv,), bf), S((1, hv, dk, dv), jnp.float32)]
    f = functools.partial(F.gdn_decode_fused, **dims(hk, hv, dk, dv), **kw)
    txt = lower_for_h200(f, *structs)
    assert "__gpu$xla.gpu.triton" in txt and txt.count("__gpu$xla.gpu.triton") == 1


def test_lowers_for_h200_padded_head_dims():
    S, f32 = jax.ShapeDtypeStruct, jnp.float32
    hk, hv, dk, dv = 1, 2, 24, 20
    cd = 2 * hk * dk + hv * dv
    structs = [S((2, cd + hv * dv + 2 * hv), f32), S((2, K - 1, cd), f32), S((K, cd), f32), S((hv,), f32),
               S((hv,), f32), S((dv,), f32), S((2, hv, dk, dv), f32)]
    assert "__gpu$xla.gpu.triton" in lower_for_h200(functools.partial(F.gdn_decode_fused, **dims(hk, hv, dk, dv)),
                                                     *structs)


def test_kernel_from_projection_partials():
    """proj as its GEMV's unsummed split-K partials [S, B, P] (fp32): the kernel sums them in order and rounds
    (numerics.sum_partials) — bitwise the kernel on the summed row, and the reference on the partials."""
    from kernels_pallas.numerics import sum_partials
    B, hk, hv, dk, dv = 1, 2, 6, 16, 32
    args = fused_inputs(jax.random.PRNGKey(21), B, hk, hv, dk, dv, jnp.bfloat16)
    parts = 0.5 * jax.random.normal(jax.random.PRNGKey(22), (3,) + args[0].shape, jnp.float32)
    d = dims(hk, hv, dk, dv)
    got = F.gdn_decode_fused(parts, *args[1:], interpret=True, **d)
    on_row = F.gdn_decode_fused(sum_partials(parts, jnp.bfloat16), *args[1:], interpret=True, **d)
    ref = jax.jit(functools.partial(F.gdn_decode_fused_reference, **d))(parts, *args[1:])
    for a, b, c in zip(got, on_row, ref):
        assert a.dtype == b.dtype == c.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(c.astype(jnp.float32)))
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    hk, hv, dk, dv = 16, 48, 128, 128
    cd = 2 * hk * dk + hv * dv
    txt = lower_for_h200(functools.partial(F.gdn_decode_fused, **dims(hk, hv, dk, dv)),
                         S((4, 1, cd + hv * dv + 2 * hv), jnp.float32), S((1, K - 1, cd), bf), S((K, cd), bf),
                         S((hv,), bf), S((hv,), bf), S((dv,), bf), S((1, hv, dk, dv), jnp.float32))
    assert "__gpu$xla.gpu.triton" in txt
