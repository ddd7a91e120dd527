"""Attention decode-step prologue (kernels_pallas.attention_decode): the Pallas kernel (interpret mode) vs the jnp
reference (bitwise in bf16), the model's decode path vs its general sequence path, and the kernel's CUDA lowering
for an H200 at 27B shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernels_pallas import attention_decode as A
from kernels_pallas import ops
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, rel_err

EPS = 1e-6


def prep_inputs(key, B, h, hkv, hd, rd, S, dtype):
    """(qkv row, q_norm, k_norm, cos, sin, k_cache, v_cache) as the model produces them (never zeros)."""
    ks = jax.random.split(key, 6)
    qkv = (2.0 * jax.random.normal(ks[0], (B, (2 * h + 2 * hkv) * hd))).astype(dtype)
    qn = (0.1 * jax.random.normal(ks[1], (hd,))).astype(dtype)
    kn = (0.1 * jax.random.normal(ks[2], (hd,))).astype(dtype)
    ang = jax.random.uniform(ks[3], (B, rd), minval=0.0, maxval=100.0)
    kc = jax.random.normal(ks[4], (B, hkv, S, hd)).astype(dtype)
    vc = jax.random.normal(ks[5], (B, hkv, S, hd)).astype(dtype)
    return qkv, qn, kn, jnp.cos(ang).astype(dtype), jnp.sin(ang).astype(dtype), kc, vc


def test_signature_matches_reference():
    assert_kernel_signature(A.decode_attention_prep, A.decode_attention_prep_reference)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("B,h,hkv,hd,rd,start", [(1, 4, 2, 32, 8, 5), (2, 3, 1, 16, 16, 0), (1, 2, 2, 64, 16, 15)])
def test_kernel_matches_reference(dtype, B, h, hkv, hd, rd, start):
    S = 16
    args = prep_inputs(jax.random.PRNGKey(B * 100 + hd + rd), B, h, hkv, hd, rd, S, dtype)
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    ref = jax.jit(functools.partial(A.decode_attention_prep_reference, **d))(*args, jnp.int32(start))
    out = A.decode_attention_prep(*args, jnp.int32(start), interpret=True, **d)
    names = ("q", "sgate", "k", "v", "k_cache", "v_cache")
    for name, a, b in zip(names, out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if dtype == jnp.bfloat16:  # the same roundings: bit for bit
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                          err_msg=name)
        else:  # fp32: the norms' sums of squares in another order
            assert rel_err(a, b) < 1e-6, name
    kc, vc = args[5], args[6]
    others = np.arange(S) != start
    np.testing.assert_array_equal(np.asarray(out[4])[:, :, others], np.asarray(kc)[:, :, others])  # one row written
    np.testing.assert_array_equal(np.asarray(out[5])[:, :, start], np.asarray(out[3]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_model_decode_path_matches_sequence_path(dtype):
    """Attention.decode (T = 1: projection + norm, `ops.attention_decode_prep`, attention over the updated cache,
    o_proj + gate + residual; here the references) against the general path on a T = 4 sequence pass whose
    first token is the same (padding after it): output row, and the cache row written."""
    from jaxddtree.model import layout as L
    from jaxddtree.model.attention import Attention
    from jaxddtree.model.cache import KVCache
    from jaxddtree.model.config import TextConfig

    D, B, S, start = 64, 1, 16, 6
    cfg = TextConfig(vocab_size=32, hidden_size=D, intermediate_size=96, num_hidden_layers=1,
                     layer_types=("full_attention",), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rope_theta=1e4, partial_rotary_factor=0.5, linear_num_key_heads=1, linear_num_value_heads=1,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=EPS)
    m = Attention(cfg, dtype, nnx.Rngs(4))
    ks = jax.random.split(jax.random.PRNGKey(9), 4)
    x = jax.random.normal(ks[0], (B, 1, D)).astype(dtype)
    cache = KVCache(k=jax.random.normal(ks[1], (B, 2, S, 16)).astype(dtype),
                    v=jax.random.normal(ks[2], (B, 2, S, 16)).astype(dtype))
    norm = ((0.1 * jax.random.normal(ks[3], (D,))).astype(dtype), EPS)

    @functools.partial(jax.jit, static_argnames="t")
    def step(x, cache, t):
        xt = jnp.concatenate([x, jnp.ones((B, t - 1, D), x.dtype)], axis=1)
        y, new, _ = m(xt, cache, L.sequence(start, t, 4, num_valid=1, batch=B), norm=norm, residual=xt)
        return y[:, :1], new

    (y1, c1), (y4, c4) = step(x, cache, 1), step(x, cache, 4)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2  # (the projections' sums differ with the row count)
    assert rel_err(y1.astype(jnp.float32), y4.astype(jnp.float32)) < tol
    for a, b in ((c1.k, c4.k), (c1.v, c4.v)):
        assert rel_err(a[:, :, :start + 1].astype(jnp.float32), b[:, :, :start + 1].astype(jnp.float32)) < tol


def test_ops_dispatch():
    args = prep_inputs(jax.random.PRNGKey(2), 1, 2, 1, 16, 8, 8, jnp.bfloat16)
    d = dict(num_heads=2, num_kv_heads=1, head_dim=16, eps=EPS)
    ref = A.decode_attention_prep_reference(*args, jnp.int32(3), **d)
    for a, b in zip(ops.attention_decode_prep(*args, jnp.int32(3), "xla", **d), ref):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    with pytest.raises(ValueError):
        ops.attention_decode_prep(*args, jnp.int32(3), "cuda", **d)


def test_lowers_for_h200_at_27b_shapes():
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    h, hkv, hd, rd, L = 24, 4, 256, 64, 4096 + 1024
    f = functools.partial(A.decode_attention_prep, num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    txt = lower_for_h200(f, S((1, (2 * h + 2 * hkv) * hd), bf), S((hd,), bf), S((hd,), bf), S((1, rd), bf),
                         S((1, rd), bf), S((1, hkv, L, hd), bf), S((1, hkv, L, hd), bf), S((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


def test_kernel_from_projection_partials():
    """qkv as its GEMV's unsummed split-K partials [S, B, C] (fp32): summed in order and rounded in the kernel —
    bitwise the kernel on the summed row and the reference on the partials; lowers at 27B shapes."""
    from kernels_pallas.numerics import sum_partials
    B, h, hkv, hd, rd, S = 1, 4, 2, 32, 8, 16
    args = prep_inputs(jax.random.PRNGKey(31), B, h, hkv, hd, rd, S, jnp.bfloat16)
    parts = jax.random.normal(jax.random.PRNGKey(32), (4,) + args[0].shape, jnp.float32)
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    st = jnp.int32(3)
    got = A.decode_attention_prep(parts, *args[1:], st, interpret=True, **d)
    on_row = A.decode_attention_prep(sum_partials(parts, jnp.bfloat16), *args[1:], st, interpret=True, **d)
    ref = jax.jit(functools.partial(A.decode_attention_prep_reference, **d))(parts, *args[1:], st)
    for a, b, c in zip(got, on_row, ref):
        assert a.dtype == b.dtype == c.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(c.astype(jnp.float32)))
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    h, hkv, hd, rd, L = 24, 4, 256, 64, 4096 + 1024
    f = functools.partial(A.decode_attention_prep, num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    txt = lower_for_h200(f, Sd((4, 1, (2 * h + 2 * hkv) * hd), jnp.float32), Sd((hd,), bf), Sd((hd,), bf),
                         Sd((1, rd), bf), Sd((1, rd), bf), Sd((1, hkv, L, hd), bf), Sd((1, hkv, L, hd), bf),
                         Sd((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt


def _stacked_inputs(key, L, B, h, hkv, hd, rd, S):
    """prep_inputs with the caches stacked over L layers [L, B, Hkv, S, hd] (every layer different)."""
    args = prep_inputs(key, B, h, hkv, hd, rd, S, jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (L, B, hkv, S, hd)).astype(jnp.bfloat16) for k in jax.random.split(key, 2))
    return args[:5], kc, vc


def _assert_same(got, want):
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_layer_writes_one_layer_of_the_stacked_caches():
    """layer=l on caches stacked over L = 3 layers: q / sgate / k / v and layer l of the returned stacks are the
    call's on caches[l] (kernel and reference), the other layers untouched."""
    L, B, h, hkv, hd, rd, S, start = 3, 2, 4, 2, 32, 8, 16, 9
    row, kc, vc = _stacked_inputs(jax.random.PRNGKey(41), L, B, h, hkv, hd, rd, S)
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    kernel = jax.jit(lambda kc, vc, st, l: A.decode_attention_prep(*row, kc, vc, st, layer=l, interpret=True, **d))
    ref = jax.jit(lambda kc, vc, st, l: A.decode_attention_prep_reference(*row, kc, vc, st, layer=l, **d))
    for l in (0, 2):
        one = A.decode_attention_prep(*row, kc[l], vc[l], jnp.int32(start), interpret=True, **d)
        for out in (kernel(kc, vc, jnp.int32(start), jnp.int32(l)), ref(kc, vc, jnp.int32(start), jnp.int32(l))):
            assert out[4].shape == kc.shape and out[5].shape == vc.shape
            _assert_same(out[:4] + (out[4][l], out[5][l]), one)
            others = np.arange(L) != l
            np.testing.assert_array_equal(np.asarray(out[4])[others], np.asarray(kc)[others])
            np.testing.assert_array_equal(np.asarray(out[5])[others], np.asarray(vc)[others])


def test_layer_under_vmap():
    """The batched round: jax.vmap over slots (projection row, stacked caches [V, L, B, ...], start), the layer
    shared: each slot's results are the unbatched call's."""
    V, L, B, h, hkv, hd, rd, S = 2, 2, 1, 2, 1, 16, 8, 8
    row, kc, vc = _stacked_inputs(jax.random.PRNGKey(42), L, V * B, h, hkv, hd, rd, S)
    qkv = row[0].reshape(V, B, -1)
    kc, vc = (x.reshape(L, V, B, hkv, S, hd).swapaxes(0, 1) for x in (kc, vc))
    starts = jnp.array([3, 6], jnp.int32)
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)

    def f(qkv, kc, vc, st, l):
        return A.decode_attention_prep(qkv, *row[1:3], row[3][:B], row[4][:B], kc, vc, st, layer=l, interpret=True,
                                       **d)

    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None)))(qkv, kc, vc, starts, jnp.int32(1))
    for v in range(V):
        _assert_same([x[v] for x in out], f(qkv[v], kc[v], vc[v], starts[v], jnp.int32(1)))


def test_layer_lowers_for_h200_at_27b_shapes():
    """The stacked caches of 16 attention layers (4K context), written in place: the custom call aliases them."""
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    h, hkv, hd, rd, Lc, L = 24, 4, 256, 64, 4096 + 1024, 16
    f = functools.partial(A.decode_attention_prep, num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    txt = lower_for_h200(lambda *a: f(*a[:8], layer=a[8]), Sd((1, (2 * h + 2 * hkv) * hd), bf), Sd((hd,), bf),
                         Sd((hd,), bf), Sd((1, rd), bf), Sd((1, rd), bf), Sd((L, 1, hkv, Lc, hd), bf),
                         Sd((L, 1, hkv, Lc, hd), bf), Sd((), jnp.int32), Sd((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt
    assert "output_operand_aliases" in txt


def test_ops_passes_the_layer():
    """ops.attention_decode_prep(layer=l): the reference's stacked-cache write on the xla path; on the pallas path
    the kernel, lowered for an H200 with the caches of 3 layers."""
    L, B, h, hkv, hd, rd, S = 3, 1, 2, 1, 16, 8, 8
    row, kc, vc = _stacked_inputs(jax.random.PRNGKey(43), L, B, h, hkv, hd, rd, S)
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    st, l = jnp.int32(5), jnp.int32(1)
    _assert_same(ops.attention_decode_prep(*row, kc, vc, st, "xla", layer=l, **d),
                 A.decode_attention_prep_reference(*row, kc, vc, st, layer=l, **d))
    Sd = jax.ShapeDtypeStruct
    structs = [Sd(x.shape, x.dtype) for x in (*row, kc, vc)] + [Sd((), jnp.int32)] * 2
    txt = lower_for_h200(lambda *a: ops.attention_decode_prep(*a[:8], "pallas", layer=a[8], **d), *structs)
    assert "__gpu$xla.gpu.triton" in txt


def _stacked_norms(key, L, hd):
    """q_norm / k_norm stacked over L layers [L, hd] (every layer different), bf16."""
    return tuple((0.1 * jax.random.normal(k, (L, hd))).astype(jnp.bfloat16) for k in jax.random.split(key, 2))


def test_stacked_norms_read_at_the_layer():
    """With layer, q_norm / k_norm stacked [L, hd] (both, or one of them) are read at row `layer`: bitwise the call
    with that layer's [hd] norms (kernel and reference)."""
    L, B, h, hkv, hd, rd, S, start = 3, 2, 4, 2, 32, 8, 16, 9
    row, kc, vc = _stacked_inputs(jax.random.PRNGKey(44), L, B, h, hkv, hd, rd, S)
    qn, kn = _stacked_norms(jax.random.PRNGKey(45), L, hd)
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    kernel = jax.jit(lambda qn, kn, st, l: A.decode_attention_prep(row[0], qn, kn, *row[3:], kc, vc, st, layer=l,
                                                                   interpret=True, **d))
    ref = jax.jit(lambda qn, kn, st, l: A.decode_attention_prep_reference(row[0], qn, kn, *row[3:], kc, vc, st,
                                                                          layer=l, **d))
    st = jnp.int32(start)
    for l in (0, 2):
        li = jnp.int32(l)
        want = A.decode_attention_prep(row[0], qn[l], kn[l], *row[3:], kc, vc, st, layer=li, interpret=True, **d)
        for norms in ((qn, kn), (qn, kn[l]), (qn[l], kn)):
            _assert_same(kernel(*norms, st, li), want)
            _assert_same(ref(*norms, st, li), want)
    with pytest.raises(AssertionError):  # stacked norms need the layer
        A.decode_attention_prep(row[0], qn, kn, *row[3:], kc[0], vc[0], st, interpret=True, **d)


def test_stacked_norms_under_vmap():
    """The batched round with stacked norms (shared, not batched) and the layer shared: each slot's results are the
    unbatched call's with the layer's norms."""
    V, L, B, h, hkv, hd, rd, S = 2, 2, 1, 2, 1, 16, 8, 8
    row, kc, vc = _stacked_inputs(jax.random.PRNGKey(46), L, V * B, h, hkv, hd, rd, S)
    qn, kn = _stacked_norms(jax.random.PRNGKey(47), L, hd)
    qkv = row[0].reshape(V, B, -1)
    kc, vc = (x.reshape(L, V, B, hkv, S, hd).swapaxes(0, 1) for x in (kc, vc))
    starts = jnp.array([3, 6], jnp.int32)
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)

    def f(qkv, qn, kn, kc, vc, st, l):
        return A.decode_attention_prep(qkv, qn, kn, row[3][:B], row[4][:B], kc, vc, st, layer=l, interpret=True, **d)

    out = jax.jit(jax.vmap(f, in_axes=(0, None, None, 0, 0, 0, None)))(qkv, qn, kn, kc, vc, starts, jnp.int32(1))
    for v in range(V):
        _assert_same([x[v] for x in out], f(qkv[v], qn[1], kn[1], kc[v], vc[v], starts[v], jnp.int32(1)))


def test_stacked_norms_lower_for_h200_without_a_slice():
    """At 27B shapes (16 attention layers): the custom call takes the norms' whole stacks [16, hd] — no dynamic
    slice outside it (XLA would copy each into a kernel of its own) — directly and through ops (pallas)."""
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    h, hkv, hd, rd, Lc, L = 24, 4, 256, 64, 4096 + 1024, 16
    d = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, eps=EPS)
    structs = (Sd((1, (2 * h + 2 * hkv) * hd), bf), Sd((L, hd), bf), Sd((L, hd), bf), Sd((1, rd), bf),
               Sd((1, rd), bf), Sd((L, 1, hkv, Lc, hd), bf), Sd((L, 1, hkv, Lc, hd), bf), Sd((), jnp.int32),
               Sd((), jnp.int32))
    for f in (lambda *a: A.decode_attention_prep(*a[:8], layer=a[8], **d),
              lambda *a: ops.attention_decode_prep(*a[:8], "pallas", layer=a[8], **d)):
        txt = lower_for_h200(f, *structs)
        assert txt.count("__gpu$xla.gpu.triton") == 1 and "dynamic_slice" not in txt
        assert f"tensor<{L}x{hd}xbf16>" in txt and "output_operand_aliases" in txt



def _attention_stack():
    """(cfg, two Attention layers (bf16), their stack_modules) at small shapes."""
    from jaxddtree.model.attention import Attention
    from jaxddtree.model.config import TextConfig
    from jaxddtree.model.qwen35 import stack_modules
    cfg = TextConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     layer_types=("full_attention",), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rope_theta=1e4, partial_rotary_factor=0.5, linear_num_key_heads=1, linear_num_value_heads=1,
                     linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=EPS)
    mods = [Attention(cfg, jnp.bfloat16, nnx.Rngs(s)) for s in (5, 6)]
    return cfg, mods, stack_modules(mods)


def _scan(stacked, x, kc, vc, layout):
    """Each layer of `stacked` in a lax.scan as the model runs it (`layer_view` params: q_norm / k_norm too are
    `ops.Layer` views; the caches as Layer views of their stacks) -> (outputs [L, ...], the cache stacks)."""
    from jaxddtree.model.cache import KVCache
    from jaxddtree.model.qwen35 import layer_view
    graphdef, state = nnx.split(stacked)

    def body(carry, g):
        m = nnx.merge(graphdef, layer_view(state, g))
        assert isinstance(m.q_norm[...], ops.Layer) and isinstance(m.k_norm[...], ops.Layer)
        y, c, _ = m(x, KVCache(k=ops.Layer(carry[0], g), v=ops.Layer(carry[1], g)), layout)
        return (c.k.stacked, c.v.stacked), y

    (kc, vc), ys = jax.lax.scan(body, (kc, vc), jnp.arange(kc.shape[0], dtype=jnp.int32))
    return ys, kc, vc


@pytest.mark.parametrize("T", [1, 3])
def test_scanned_layers_with_norm_views_match_plain_layers(T):
    """Attention layers in a scan (`layer_view`: the norms as Layer views, passed stacked to the decode prep at
    T = 1, sliced in XLA on the sequence path): bitwise each plain per-layer module on its own cache (xla)."""
    from jaxddtree.model import layout as Lo
    from jaxddtree.model.cache import KVCache
    cfg, mods, stacked = _attention_stack()
    B, S, start = 1, 16, 5
    ks = jax.random.split(jax.random.PRNGKey(48), 3)
    x = jax.random.normal(ks[0], (B, T, 64)).astype(jnp.bfloat16)
    kc, vc = (jax.random.normal(k, (2, B, 2, S, 16)).astype(jnp.bfloat16) for k in ks[1:])
    layout = Lo.sequence(start, T, 4, batch=B)
    ys, kc2, vc2 = _scan(stacked, x, kc, vc, layout)
    for l, m in enumerate(mods):
        y, c, _ = m(x, KVCache(k=kc[l], v=vc[l]), layout)
        _assert_same((ys[l], kc2[l], vc2[l]), (y, c.k, c.v))


def test_scanned_decode_lowers_for_h200_without_norm_slices():
    """The scanned decode step (pallas) lowered for an H200: the norms' stacks [L, hd] reach the prep kernel whole
    — no dynamic slice of them outside it."""
    from jaxddtree.model import layout as Lo
    cfg, _, stacked = _attention_stack()
    graphdef, state = nnx.split(stacked)
    Sd, B, S = jax.ShapeDtypeStruct, 1, 16
    layout = Lo.sequence(jnp.int32(5), 1, 4, batch=B, kernels="pallas")

    def f(state, x, kc, vc):
        return _scan(nnx.merge(graphdef, state), x, kc, vc, layout)

    structs = jax.tree.map(lambda a: Sd(a.shape, a.dtype), state)
    txt = lower_for_h200(f, structs, Sd((B, 1, 64), jnp.bfloat16), Sd((2, B, 2, S, 16), jnp.bfloat16),
                         Sd((2, B, 2, S, 16), jnp.bfloat16))
    assert "__gpu$xla.gpu.triton" in txt and "tensor<2x16xbf16>" in txt
    sliced = [ln for ln in txt.splitlines() if "dynamic_slice" in ln and "tensor<2x16xbf16>" in ln]
    assert not sliced, sliced
