"""A GEMM's input norms as one kernel each (kernels_pallas.rms_norm: the RMSNorm (1 + w) and the GDN mixer's gated
RMSNorm): the Pallas kernels (interpret mode) vs their jnp references on fresh random inputs (rows not a multiple of 8,
K not a power of two, one layer of a stacked weight, also under a `lax.scan`), the Mosaic GPU GEMM taking their padded
rows (`dense_mgpu(rows=)`), `ops.dense`'s dense_mgpu path with them against the XLA path, and their CUDA lowering for
an abstract H200 at the 27B widths."""

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
@pytest.mark.parametrize("M,H,E,L", [(65, 6, 32, 4), (3, 2, 16, None), (16, 3, 64, 2)])
def test_gated_kernel_matches_reference(dtype, M, H, E, L):
    """The GDN core's fp32 output rounded to the activations' dtype, normalised per head, gated by silu(z)."""
    kx, kz, kw = jax.random.split(jax.random.PRNGKey(M * 31 + H * 7 + E), 3)
    x = 2.0 * jax.random.normal(kx, (M, H * E))  # fp32, as the core writes it
    z = (2.0 * jax.random.normal(kz, (M, H * E))).astype(dtype)
    w = (1.0 + 0.1 * jax.random.normal(kw, ((L,) if L else ()) + (E,))).astype(dtype)
    layer = None if L is None else jnp.int32(L - 1)
    out = R.gated_rms_norm_rows(x, z, w, eps=EPS, layer=layer, interpret=True)
    ref = R.gated_rms_norm_rows_reference(x, z, w, eps=EPS, layer=layer)
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
    xs, rs = jnp.stack([x, x[:, ::-1]]), jnp.stack([res, res[:, ::-1]])
    v = np.asarray(jax.vmap(functools.partial(run, "pallas"))(xs, rs), np.float32)
    np.testing.assert_allclose(v[0], a, rtol=2.0 ** -6, atol=2.0 ** -6)
    np.testing.assert_allclose(v[1], np.asarray(run("xla", x[:, ::-1], res[:, ::-1]), np.float32),
                               rtol=2.0 ** -6, atol=2.0 ** -6)


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
