"""A GEMM's input norms as one kernel each (kernels_pallas.rms_norm: the RMSNorm (1 + w) and the GDN mixer's gated
RMSNorm, and the residual add + RMSNorm after a GEMM): the Pallas kernels (interpret mode) vs their jnp references on
fresh random inputs (rows not a multiple of 8, K not a power of two, one layer of a stacked weight, also under a
`lax.scan`), the Mosaic GPU GEMM taking their padded rows (`dense_mgpu(rows=)`), `ops.dense`'s dense_mgpu path with
them against the XLA path, a tree verify handing each norm over (`then_norm` / `normed`) bit for bit as without, and
their CUDA lowering for an abstract H200 at the 27B widths."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import dense_mgpu, ops
from kernels_pallas import rms_norm as R
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature

EPS = 1e-6


def _inputs(M, K, L=None, dtype=jnp.bfloat16, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed * 1000 + M * 7 + K))
    x = (3.0 * jax.random.normal(kx, (M, K))).astype(dtype)
    w = (0.1 * jax.random.normal(kw, ((L,) if L else ()) + (K,))).astype(dtype)
    return x, w


def _agree(out, ref, dtype):
    """fp32: the sums of squares in another order (relative 1e-6); bf16: equal, or 1 ulp apart where the fp32 value
    lies next to a rounding boundary (rarely)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.isfinite(out).all()
    if dtype == jnp.float32:
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(out, ref, rtol=2.0 ** -7, atol=0)
        assert np.mean(out != ref) < 0.01, np.mean(out != ref)


def test_signature_matches_reference():
    assert_kernel_signature(R.rms_norm_rows, R.rms_norm_rows_reference)
    assert_kernel_signature(R.gated_rms_norm_rows, R.gated_rms_norm_rows_reference)
    assert_kernel_signature(R.add_rms_norm_rows, R.add_rms_norm_rows_reference)


@pytest.mark.parametrize("S,pdtype,M,K,L", [(3, jnp.float32, 13, 96, 4), (1, jnp.bfloat16, 8, 128, None),
                                            (4, jnp.float32, 65, 320, 2), (2, jnp.float32, 3, 64, None)])
def test_add_kernel_matches_reference(S, pdtype, M, K, L):
    """The GEMM's partials summed in order and rounded, the residual added and rounded (the new residual stream,
    bit for bit), then the norm of that sum; a partials' sum near a rounding boundary would show a double rounding."""
    kp, kb, kw = jax.random.split(jax.random.PRNGKey(S * 100 + M), 3)
    parts = (2.0 * jax.random.normal(kp, (S, M, K))).astype(pdtype)
    base = (3.0 * jax.random.normal(kb, (M, K))).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(kw, ((L,) if L else ()) + (K,))).astype(jnp.bfloat16)
    layer = None if L is None else jnp.int32(L - 1)
    x, h = R.add_rms_norm_rows(parts, base, w, eps=EPS, layer=layer, interpret=True)
    rx, rh = R.add_rms_norm_rows_reference(parts, base, w, eps=EPS, layer=layer)
    assert x.shape == (M, K) and h.shape == (R.rows_out(M, 8), K) and x.dtype == h.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(rx, np.float32))
    _agree(h, rh, jnp.bfloat16)
    assert not np.asarray(h[M:]).any()
    plain = (base.astype(jnp.float32) + parts.astype(jnp.float32).sum(0)).astype(jnp.bfloat16)  # one rounding
    assert S == 1 or np.mean(np.asarray(plain != x)) > 0  # the two roundings are what it computes
    _agree(R.rms_norm_rows_reference(x, w, eps=EPS, layer=layer), h, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("M,K,L,rows_to", [(65, 320, None, 8), (3, 64, 4, 8), (16, 200, 3, 8), (5, 96, None, 1)])
def test_kernel_matches_reference(dtype, M, K, L, rows_to):
    x, w = _inputs(M, K, L, dtype)
    layer = None if L is None else jnp.int32(L - 1)
    out = R.rms_norm_rows(x, w, eps=EPS, layer=layer, rows_to=rows_to, interpret=True)
    ref = R.rms_norm_rows_reference(x, w, eps=EPS, layer=layer, rows_to=rows_to)
    assert out.shape == (R.rows_out(M, rows_to), K) and out.dtype == x.dtype
    _agree(out, ref, dtype)
    assert not np.asarray(out[M:]).any()  # the padding rows: zeros
    if L is not None:  # the layer read is the one named: another layer's weight gives other values
        other = R.rms_norm_rows_reference(x, w, eps=EPS, layer=jnp.int32(0), rows_to=rows_to)
        assert np.asarray(jnp.abs(other.astype(jnp.float32) - out.astype(jnp.float32))).max() > 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("M,H,E,L,zoff", [(65, 6, 32, 4, 0), (3, 2, 16, None, 0), (16, 3, 64, 2, 0),
                                          (9, 2, 32, 3, 40)])
def test_gated_kernel_matches_reference(dtype, M, H, E, L, zoff):
    """The GDN core's fp32 output rounded to the activations' dtype, normalised per head, gated by silu(z); z read
    at a column offset of wider rows (the fused input projection) too."""
    kx, kz, kw = jax.random.split(jax.random.PRNGKey(M * 31 + H * 7 + E), 3)
    x = 2.0 * jax.random.normal(kx, (M, H * E))  # fp32, as the core writes it
    zr = (2.0 * jax.random.normal(kz, (M, zoff + H * E + (24 if zoff else 0)))).astype(dtype)
    z = zr[:, zoff:zoff + H * E]
    w = (1.0 + 0.1 * jax.random.normal(kw, ((L,) if L else ()) + (E,))).astype(dtype)
    layer = None if L is None else jnp.int32(L - 1)
    out = R.gated_rms_norm_rows(x, zr, w, eps=EPS, layer=layer, z_offset=zoff, interpret=True)
    ref = R.gated_rms_norm_rows_reference(x, z, w, eps=EPS, layer=layer)
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(
        R.gated_rms_norm_rows_reference(x, zr, w, eps=EPS, layer=layer, z_offset=zoff), np.float32))
    assert out.shape == (R.rows_out(M, 8), H * E) and out.dtype == z.dtype
    _agree(out, ref, dtype)
    assert not np.asarray(out[M:]).any()
    if L is not None:
        other = R.gated_rms_norm_rows_reference(x, z, w, eps=EPS, layer=jnp.int32(0))
        assert np.asarray(jnp.abs(other.astype(jnp.float32) - out.astype(jnp.float32))).max() > 0


def test_scan_over_layers():
    """Under a lax.scan over layers, with the stack and the traced index: each layer's own norm."""
    L, M, K = 3, 9, 128
    x, w = _inputs(M, K, L, jnp.float32)

    def body(c, layer):
        return c, R.rms_norm_rows(x, w, eps=EPS, layer=layer, interpret=True)
    _, ys = jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32))
    for i in range(L):
        _agree(ys[i], R.rms_norm_rows_reference(x, w[i], eps=EPS), jnp.float32)


def test_dense_mgpu_takes_the_padded_rows():
    """dense_mgpu(x [R, K], rows=M): the product of the first M rows only, [M, N] (the interpreter: the same values
    as the unpadded call)."""
    M, K, N = 13, 128, 128
    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (M, K)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (K, N)) * K ** -0.5).astype(jnp.bfloat16)
    xp = jnp.concatenate([x, jnp.full((16 - M, K), 7.0, x.dtype)])  # whatever the rows past M hold
    got = dense_mgpu.dense_mgpu(xp, w, rows=M, interpret=True)
    assert got.shape == (M, N)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(dense_mgpu.dense_mgpu(x, w, interpret=True), np.float32))
    np.testing.assert_array_equal(np.asarray(dense_mgpu.dense_mgpu_reference(xp, w, rows=M), np.float32),
                                  np.asarray(dense_mgpu.dense_mgpu_reference(x, w), np.float32))


def test_ops_dense_mgpu_path_with_the_norm_kernel(monkeypatch):
    """`ops.dense` on the dense_mgpu path (a Hopper GPU's verify; here the interpreters) with a stacked weight and a
    stacked norm weight (`ops.Layer`s, as the model's scan passes them): the norm kernel reads the norm weight's
    stack (no slice of it in the program) and matches the XLA path (bf16: the GEMM's sums in another order); under
    jax.vmap (a batched round's slots) too."""
    monkeypatch.setattr(ops, "_hopper", lambda: True)
    monkeypatch.setattr(dense_mgpu, "dense_mgpu", functools.partial(dense_mgpu.dense_mgpu, interpret=True))
    monkeypatch.setattr(R, "rms_norm_rows", functools.partial(R.rms_norm_rows, interpret=True))
    monkeypatch.setattr(R, "gated_rms_norm_rows", functools.partial(R.gated_rms_norm_rows, interpret=True))
    L, T, K, N = 3, 13, 128, 192
    kx, kw, kn, kr = jax.random.split(jax.random.PRNGKey(5), 4)
    x = (2.0 * jax.random.normal(kx, (1, T, K))).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (L, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    nw = (0.1 * jax.random.normal(kn, (L, K))).astype(jnp.bfloat16)
    res = jax.random.normal(kr, (1, T, N)).astype(jnp.bfloat16)
    layer = jnp.int32(1)

    def run(kernels, x_, r_):
        return ops.dense("btd,dc->btc", x_, ops.Layer(w, layer), kernels, norm=(ops.Layer(nw, layer), EPS),
                         residual=r_)
    assert ops.pick("bf16", T, N, "pallas", depth=K, stacked=True).kernel == "dense_mgpu"
    for kernels, norm_kernel in (("pallas", True), ("xla", False)):
        jaxpr = str(jax.make_jaxpr(functools.partial(run, kernels))(x, res))
        assert ("rms_norm_rows" in jaxpr) == norm_kernel and ("dynamic_slice" in jaxpr) != norm_kernel, kernels
    a, c = (np.asarray(run(k, x, res), np.float32) for k in ("pallas", "xla"))
    assert a.shape == (1, T, N)
    np.testing.assert_allclose(a, c, rtol=2.0 ** -6, atol=2.0 ** -6)
    assert np.mean(a != c) < 0.05
    # the GDN out projection: the gated norm of the core's fp32 output with z, then the GEMM
    E, H = 32, K // 32
    o = 2.0 * jax.random.normal(kx, (1, T, H, E))
    zg = (2.0 * jax.random.normal(kn, (1, T, H, E))).astype(jnp.bfloat16)
    gw = (1.0 + 0.1 * jax.random.normal(kr, (L, E))).astype(jnp.bfloat16)
    wo = (jax.random.normal(kw, (L, H, E, N)) * K ** -0.5).astype(jnp.bfloat16)

    def run_out(kernels):
        return ops.dense("bthe,hed->btd", o, ops.Layer(wo, layer), kernels, residual=res,
                         gated_norm=(zg, ops.Layer(gw, layer), EPS))
    jaxpr = str(jax.make_jaxpr(functools.partial(run_out, "pallas"))())
    assert "gated_rms_norm_rows" in jaxpr and "dynamic_slice" not in jaxpr
    g, gx = np.asarray(run_out("pallas"), np.float32), np.asarray(run_out("xla"), np.float32)
    assert g.shape == (1, T, N) and run_out("pallas").dtype == jnp.bfloat16
    np.testing.assert_allclose(g, gx, rtol=2.0 ** -6, atol=2.0 ** -6)
    assert np.mean(g != gx) < 0.05
    # z as columns [64, 64 + H·E) of wider rows (the GDN's fused projection, read in place): the same values
    zrows = jnp.concatenate([x[..., :64], zg.reshape(1, T, H * E), x[..., :32]], axis=-1)
    for kernels, want in (("pallas", g), ("xla", gx)):
        got = ops.dense("bthe,hed->btd", o, ops.Layer(wo, layer), kernels, residual=res,
                        gated_norm=(zrows, ops.Layer(gw, layer), EPS, 64))
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=kernels)
    xs, rs = jnp.stack([x, x[:, ::-1]]), jnp.stack([res, res[:, ::-1]])
    v = np.asarray(jax.vmap(functools.partial(run, "pallas"))(xs, rs), np.float32)
    np.testing.assert_allclose(v[0], a, rtol=2.0 ** -6, atol=2.0 ** -6)
    np.testing.assert_allclose(v[1], np.asarray(run("xla", x[:, ::-1], res[:, ::-1]), np.float32),
                               rtol=2.0 ** -6, atol=2.0 ** -6)


def _interpreters(monkeypatch):
    """The Pallas path of a Hopper GPU's verify on this CPU: dense_mgpu chosen, every kernel in its interpreter."""
    from kernels_pallas import dense as gemv, gdn_tree, tree_attention as ta
    monkeypatch.setattr(ops, "_hopper", lambda: True)
    monkeypatch.setattr(ops, "_mgpu_attention", lambda *a, **k: False)  # (the Triton tree attention, interpreted)
    for mod, name in ((dense_mgpu, "dense_mgpu"), (dense_mgpu, "swiglu_mgpu"), (R, "rms_norm_rows"),
                      (R, "gated_rms_norm_rows"), (R, "add_rms_norm_rows"), (gdn_tree, "gdn_masked_block"),
                      (ta, "tree_attention"), (gemv, "dense")):
        monkeypatch.setattr(mod, name, functools.partial(getattr(mod, name), interpret=True))


def test_ops_then_norm_hands_the_norm_over(monkeypatch):
    """`ops.dense` / `ops.mlp` with then_norm return (y, the next input norm's rows) and take them as `normed`: on the
    dense_mgpu path (kernels="pallas") one add + norm kernel after the GEMM (no rms_norm_rows before the next GEMM),
    bit for bit the values without then_norm (XLA's sum, then rms_norm_rows) and of XLA's ops here; under jax.vmap (a
    batched round's folded slots) each slot's values."""
    _interpreters(monkeypatch)
    L, T, K, N, F = 3, 13, 128, 192, 256
    ks = jax.random.split(jax.random.PRNGKey(5), 7)
    x = (2.0 * jax.random.normal(ks[0], (1, T, K))).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (L, K, N)) * K ** -0.5).astype(jnp.bfloat16)
    nw, tw = ((0.1 * jax.random.normal(k, (L, d))).astype(jnp.bfloat16) for k, d in ((ks[2], K), (ks[3], N)))
    res = jax.random.normal(ks[4], (1, T, N)).astype(jnp.bfloat16)
    wgu = (jax.random.normal(ks[5], (L, N, 2, F)) * N ** -0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[6], (L, F, N)) * F ** -0.5).astype(jnp.bfloat16)
    Lw = lambda a: ops.Layer(a, jnp.int32(1))  # noqa: E731

    def run(kernels, x_, r_):
        y, h = ops.dense("btd,dc->btc", x_, Lw(w), kernels, norm=(Lw(nw), EPS), residual=r_,
                         then_norm=(Lw(tw), EPS))
        z, hz = ops.mlp(y, Lw(wgu), Lw(wd), kernels, norm=(Lw(tw), EPS), residual=y, normed=h,
                        then_norm=(Lw(tw), EPS))
        return y, h, z, hz

    def apart(x_, r_):  # the same without then_norm: each sum in XLA, each norm its own rms_norm_rows
        y = ops.dense("btd,dc->btc", x_, Lw(w), "pallas", norm=(Lw(nw), EPS), residual=r_)
        z = ops.mlp(y, Lw(wgu), Lw(wd), "pallas", norm=(Lw(tw), EPS), residual=y)
        nrm = lambda a: R.rms_norm_rows(a[0], tw, eps=EPS, layer=jnp.int32(1), interpret=True)  # noqa: E731
        return y, nrm(y), z, nrm(z)
    jaxpr = str(jax.make_jaxpr(functools.partial(run, "pallas"))(x, res))
    assert jaxpr.count("name=add_rms_norm_rows") >= 2 and "dynamic_slice" not in jaxpr
    assert "add_rms_norm_rows" not in str(jax.make_jaxpr(apart)(x, res))
    got = run("pallas", x, res)
    assert [a.shape for a in got] == [(1, T, N), (16, N), (1, T, N), (16, N)]
    for other, want in (("apart", apart(x, res)), ("xla", run("xla", x, res))):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=other)
    np.testing.assert_array_equal(np.asarray(got[1][:T], np.float32),
                                  np.asarray(R.rms_norm_rows_reference(got[0][0], tw[1], eps=EPS), np.float32)[:T])
    xs, rs = jnp.stack([x, x[:, ::-1]]), jnp.stack([res, res[:, ::-1]])
    v = jax.vmap(functools.partial(run, "pallas"))(xs, rs)
    for i, one in enumerate((got, run("pallas", x[:, ::-1], res[:, ::-1]))):
        for a, b in zip(v, one):
            np.testing.assert_array_equal(np.asarray(a[i], np.float32), np.asarray(b, np.float32))


def test_tree_verify_with_the_adds_in_the_norms(monkeypatch):
    """A bf16 tree verify (2 layer groups of 3 GDN + 1 attention, widths the Mosaic GPU GEMMs take) on the Pallas
    path: per group 7 add + norm kernels (each mixer's output into its MLP's norm, each MLP's into the next layer's
    input norm, the group's first input norm staying `rms_norm_rows`); logits, taps and stashes bit for bit those of
    the same verify with every residual add in XLA and every norm its own kernel (`ops.add_norm_fuses` off)."""
    _interpreters(monkeypatch)
    from jaxddtree.model import layout as layout_lib, target as target_lib
    from jaxddtree.model.config import TextConfig
    cfg = TextConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=8,
                     layer_types=("linear_attention",) * 3 + ("full_attention",), num_attention_heads=2,
                     num_key_value_heads=1, head_dim=64, rope_theta=1e4, partial_rotary_factor=0.25,
                     linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
                     linear_value_head_dim=64, linear_conv_kernel_dim=4)
    cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types * 2)
    target = target_lib.random_target(cfg, dtype="bfloat16", seed=3)
    model = target.module()
    cache = model(jnp.arange(1, 9, dtype=jnp.int32)[None] * 7 % 128, target.init_cache(64),
                  layout_lib.sequence(0, 8, 4), logits="none")[1]
    parents = jnp.array([-1, 0, 1, 2, 0, 4, 5, 1, 7, 3, 9, 10, 2], jnp.int32)
    tokens = (jnp.arange(13, dtype=jnp.int32)[None] * 11 + 3) % 128
    calls = []
    monkeypatch.setattr(R, "add_rms_norm_rows", functools.partial(
        lambda f, *a, **k: calls.append(1) or f(*a, **k), R.add_rms_norm_rows))

    def verify():
        lay = layout_lib.tree(cache.length, parents, 4, kernels="pallas")
        return jax.jit(lambda t, c: model(t, c, lay, feature_layers=(1, 4, 6)))(tokens, cache)
    a = verify()
    assert len(calls) == 7  # the scan's body: one group
    monkeypatch.setattr(ops, "add_norm_fuses", lambda kernels: False)
    b = verify()
    assert len(calls) == 7
    for u, v in zip(jax.tree.leaves((a[0], a[2], a[3])), jax.tree.leaves((b[0], b[2], b[3]))):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def test_lowers_for_h200_at_27b_width():
    S = jax.ShapeDtypeStruct
    f = functools.partial(R.rms_norm_rows, eps=EPS)
    txt = lower_for_h200(lambda x, w, l: f(x, w, layer=l), S((65, 5120), jnp.bfloat16), S((16, 5120), jnp.bfloat16),
                         S((), jnp.int32))
    assert "rms_norm_rows" in txt
    assert "dynamic_slice" not in txt  # the stacked weight read in place


def test_gated_lowers_for_h200_at_27b_width():
    S = jax.ShapeDtypeStruct
    f = functools.partial(R.gated_rms_norm_rows, eps=EPS)
    txt = lower_for_h200(lambda x, z, w, l: f(x, z, w, layer=l), S((65, 6144), jnp.float32),
                         S((65, 6144), jnp.bfloat16), S((16, 128), jnp.bfloat16), S((), jnp.int32))
    assert "gated_rms_norm_rows" in txt and "dynamic_slice" not in txt


@pytest.mark.parametrize("S,pdtype", [(4, jnp.float32), (1, jnp.bfloat16)])
def test_add_lowers_for_h200_at_27b_width(S, pdtype):
    S_ = jax.ShapeDtypeStruct
    f = functools.partial(R.add_rms_norm_rows, eps=EPS)
    txt = lower_for_h200(lambda p, b, w, l: f(p, b, w, layer=l), S_((S, 65, 5120), pdtype),
                         S_((65, 5120), jnp.bfloat16), S_((16, 5120), jnp.bfloat16), S_((), jnp.int32))
    assert "add_rms_norm_rows" in txt and "dynamic_slice" not in txt
