"""The bf16 wgmma GEMM (kernels_pallas.dense_mgpu) vs its jnp reference (`dense_mgpu_reference` = `dense_reference`
without gate / residual) on the Mosaic GPU interpreter (CPU, fresh random inputs: 1 / 5 / 16 / 65 / 129 / 256 / 300
rows, split-K, a K tail, row tiles, one layer of a stacked weight [L, K, N] — also under a `lax.scan` over layers),
and its CUDA lowering for an abstract H200 at the 27B shapes with a layer operand (no weight slice in the HLO, shared
memory within the limit); the same for the gate|up GEMM with its SwiGLU epilogue (`swiglu_mgpu`) and the model's
MLP on it (`ops.mlp`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import dense_mgpu as km
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature

BF16_ULP = 2.0 ** -7  # spacing of bf16 in [1, 2)


def _inputs(M, K, N, L=None, seed=0):
    """x ~ N(0, 1) [M, K], w ~ N(0, 1/K) [K, N] (or [L, K, N]): outputs ~ N(0, 1); bf16."""
    kx, kw = jax.random.split(jax.random.PRNGKey(seed * 1000 + M * 7 + K + N))
    x = jax.random.normal(kx, (M, K), jnp.float32)
    w = jax.random.normal(kw, ((L,) if L else ()) + (K, N), jnp.float32) * K ** -0.5
    return x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)


def _spacing(v):
    """The bf16 spacing at |v|."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -120)))) * BF16_ULP


def _ulps(a, b):
    """|a - b| in units of the bf16 spacing at max(|a|, |b|) (a, b bf16 values as fp32)."""
    return np.abs(a - b) / _spacing(np.maximum(np.abs(a), np.abs(b)))


def _close(out, ref, max_ulps: float, frac: float) -> np.ndarray:
    """out and ref (bf16 values) of one shape, finite, at most max_ulps apart and apart at all in < frac of the
    places; -> out as fp32."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.isfinite(out).all()
    u = _ulps(out, ref)
    assert u.max() <= max_ulps, u.max()
    assert np.mean(u > 0) < frac, np.mean(u > 0)
    return out


def _check(out, x, w, layer=None):
    """The interpreter's fp32 sums (exact products, summed over the K steps in order; split-K partials added in
    order) against the reference's (XLA's CPU dot, another order): the bf16 results are equal or 1 ulp apart (the
    fp32 sums differ in their last bits; where one lies next to a bf16 rounding boundary the roundings differ),
    and within 0.5 ulp of the exact (float64) product plus the fp32 summation's worst-case error K·2⁻²⁴·Σ|x||w|."""
    out = _close(out, km.dense_mgpu_reference(x, w, layer=layer), 1.0, 0.01)
    w64 = np.asarray(w if layer is None else w[layer], np.float64)
    x64 = np.asarray(x, np.float64)
    exact = x64 @ w64
    bound = 0.5 * _spacing(out) + x64.shape[1] * 2.0 ** -24 * (np.abs(x64) @ np.abs(w64))
    assert np.all(np.abs(out - exact) <= bound), np.max(np.abs(out - exact) / bound)


def test_signature_matches_reference():
    assert_kernel_signature(km.dense_mgpu, km.dense_mgpu_reference)


CASES = [  # M, K, N, L (layers; None: a 2-D weight), config
    (1, 256, 128, None, km.Config(block_n=64, block_k=64, num_stages=2)),  # one row (padded to 8), the ring wraps
    (5, 192, 128, 3, km.Config(block_n=128, block_k=128, num_stages=2)),  # layer 1 of 3, a K tail (zero-filled)
    (16, 512, 192, 2, km.Config(block_n=64, block_k=128, split_k=2, num_stages=2)),  # split-K, 3 column tiles
    (65, 512, 128, None, km.Config(block_n=128, block_k=128, num_stages=3)),  # verify: 65 rows -> n = 72
    (65, 384, 128, 3, km.Config(block_n=64, block_k=64, split_k=3, num_stages=2)),  # split 3 of a stacked weight
    (129, 256, 64, 2, km.Config(block_n=64, block_k=64, split_k=2, num_stages=2)),  # 129 rows -> n = 136
    (256, 256, 64, None, km.Config(block_n=64, block_k=128, num_stages=2)),  # n = 256: one full row tile
    (300, 256, 64, 2, km.Config(block_n=64, block_k=64, num_stages=2, row_tile=128)),  # 3 row tiles, last partial
]


@pytest.mark.parametrize("M,K,N,L,cfg", CASES)
def test_kernel_matches_reference(M, K, N, L, cfg):
    x, w = _inputs(M, K, N, L, seed=1)
    layer = None if L is None else jnp.int32(L // 2)
    out = km.dense_mgpu(x, w, layer=layer, config=cfg, interpret=True)
    assert out.shape == (M, N) and out.dtype == jnp.bfloat16
    _check(out, x, w, layer)


@pytest.mark.parametrize("split", [1, 3])
def test_partials_sum_to_the_product(split):
    """partials=True: the split-K partial sums unsummed, [S, rows, N] fp32 (S = 1: y itself in bf16), whose in-order
    sum (`numerics.sum_partials`) is the kernel's y; the reference's one partial is its y."""
    from kernels_pallas.numerics import sum_partials
    M, K, N, L = 13, 384, 128, 2
    x, w = _inputs(M, K, N, L, seed=4)
    xp = jnp.pad(x, ((0, 3), (0, 0)))
    cfg = km.Config(block_n=64, block_k=64, split_k=split, num_stages=2)
    y = km.dense_mgpu(xp, w, layer=jnp.int32(1), rows=M, config=cfg, interpret=True)
    p = km.dense_mgpu(xp, w, layer=jnp.int32(1), rows=M, config=cfg, interpret=True, partials=True)
    assert p.shape == (split, M, N) and p.dtype == (jnp.bfloat16 if split == 1 else jnp.float32)
    np.testing.assert_array_equal(np.asarray(sum_partials(p, jnp.bfloat16), np.float32), np.asarray(y, np.float32))
    r = km.dense_mgpu_reference(xp, w, layer=jnp.int32(1), rows=M, partials=True)
    assert r.shape == (1, M, N)
    np.testing.assert_array_equal(np.asarray(r[0], np.float32),
                                  np.asarray(km.dense_mgpu_reference(xp, w, layer=jnp.int32(1), rows=M), np.float32))


def test_default_config_and_leading_axes():
    x, w = _inputs(12, 256, 128, L=2, seed=2)
    out = km.dense_mgpu(x.reshape(3, 4, 256), w, layer=jnp.int32(1), interpret=True)
    assert out.shape == (3, 4, 128) and out.dtype == jnp.bfloat16
    _check(out.reshape(12, 128), x, w, 1)


def test_scan_over_layers():
    """A `lax.scan` over the layer index with the whole stack closed over (the model's issue-40 layout): each
    step reads its own layer."""
    L, M, K, N = 3, 8, 128, 64
    x, w = _inputs(M, K, N, L, seed=3)
    cfg = km.Config(block_n=64, block_k=64, num_stages=2)

    def body(c, layer):
        return c, km.dense_mgpu(x, w, layer=layer, config=cfg, interpret=True)

    _, ys = jax.lax.scan(body, 0, jnp.arange(L, dtype=jnp.int32))
    for i in range(L):
        _check(ys[i], x, w, i)


def test_refuses_what_it_cannot_take():
    assert km.supports(65, 5120, 34816) is None
    assert "N = 5100" in km.supports(65, 5120, 5100)
    assert "K = 5000" in km.supports(65, 5000, 5120)
    assert "dtypes" in km.supports(65, 5120, 5120, jnp.float32)
    x, w = _inputs(8, 256, 192)
    with pytest.raises(ValueError, match="block_n 128 must"):
        jax.eval_shape(functools.partial(km.dense_mgpu, config=km.Config(block_n=128)), x, w)
    with pytest.raises(ValueError, match="shared memory"):
        jax.eval_shape(functools.partial(km.dense_mgpu, config=km.Config(block_n=256, block_k=256, num_stages=4)),
                       *_inputs(8, 1024, 256))


SHAPES_27B = {"w_in": (5120, 16384), "w_out|wo": (6144, 5120), "w_gate_up": (5120, 34816),
              "w_down": (17408, 5120), "attn_w_qkv": (5120, 14336)}


@pytest.mark.parametrize("M", [16, 65, 129, 256, 2048])
def test_lowers_for_h200_at_27b_shapes(M):
    """Every 27B projection, as one layer of a 16-layer stack (a scan group's) with a traced layer, lowers for
    CUDA (an abstract H200) at verify / batched / prefill row counts, with a default config whose shared memory
    fits (Mosaic's lowering does not check it); the stack enters the kernel whole (no slice of it in the HLO)."""
    S = jax.ShapeDtypeStruct
    f = lambda x, w, layer: km.dense_mgpu(x, w, layer=layer)
    for name, (K, N) in SHAPES_27B.items():
        p = km.plan(M, K, N)
        assert p["smem"] <= km.SMEM_LIMIT, (name, M, p)
        txt = lower_for_h200(f, S((M, K), jnp.bfloat16), S((16, K, N), jnp.bfloat16), S((), jnp.int32))
        assert "mosaic_gpu" in txt, (name, M)
        assert "dynamic_slice" not in txt and "16x" + f"{K}x{N}xbf16" in txt, (name, M)


def test_default_configs_fit():
    """The rule's configs at the 27B shapes and the sweep's table (kernels_pallas/dense_mgpu_configs.json, when
    present) are ones the kernel takes."""
    for M in (2, 16, 65, 129, 256, 512, 4096):
        for K, N in SHAPES_27B.values():
            c = km.default_config(M, K, N)
            assert km._fits(c, M, K, N), (M, K, N, c)
    for key, c in km.CONFIGS.items():
        Mc, K, N = (int(v[2:] if v[0] == "M" else v[1:]) for v in key.split(":"))
        assert isinstance(c, km.Config) and km._fits(c, Mc, K, N), key


# ------------------------------------------------------------------ the gate|up GEMM with its SwiGLU epilogue
def _swiglu_check(out, x, w, layer=None):
    """swiglu_mgpu vs its reference: the two halves' bf16 sums equal or 1 ulp apart (as `_check`), so silu(gate) ·
    up within 2 ulps of the reference (rarely more than 0: a flipped rounding of gate or up moves the product by
    its spacing at most, the silu's rounding in between adding one more), exactly equal in most places."""
    _close(out, km.swiglu_mgpu_reference(x, w, layer=layer), 2.0, 0.02)


def test_swiglu_signature_matches_reference():
    assert_kernel_signature(km.swiglu_mgpu, km.swiglu_mgpu_reference)


SWIGLU_CASES = [  # R (a multiple of 8), K, F, L, config
    (72, 256, 128, 3, km.Config(block_n=128, block_k=64, num_stages=2)),  # verify's 65 rows as 72, layer 1 of 3
    (16, 192, 64, None, km.Config(block_n=128, block_k=128, num_stages=3)),  # a K tail, a 2-D weight
    (136, 128, 192, 2, None),  # 129 rows as 136, the default config, 3 column tiles per half
    (8, 512, 64, 2, km.Config(block_n=128, block_k=64, split_k=2, num_stages=2)),  # split-K: dense_mgpu + XLA
]


@pytest.mark.parametrize("R,K,F,L,cfg", SWIGLU_CASES)
def test_swiglu_kernel_matches_reference(R, K, F, L, cfg):
    x, w = _inputs(R, K, 2 * F, L, seed=4)
    x = (2.0 * x.astype(jnp.float32)).astype(jnp.bfloat16)  # gate values across silu's curve
    layer = None if L is None else jnp.int32(L // 2)
    out = km.swiglu_mgpu(x, w, layer=layer, config=cfg, interpret=True)
    assert out.shape == (R, F) and out.dtype == jnp.bfloat16
    _swiglu_check(out, x, w, layer)


def test_swiglu_refuses_and_falls_back():
    assert km.swiglu_supports(72, 5120, 34816) is None
    assert "rows" in km.swiglu_supports(65, 5120, 34816) and "rows" in km.swiglu_supports(256, 5120, 34816)
    assert "F = 96" in km.swiglu_supports(72, 5120, 192)
    x, w = _inputs(65, 128, 128, seed=5)  # 65 rows: dense_mgpu (its own pad), then XLA's SwiGLU
    out = km.swiglu_mgpu(x, w, interpret=True)
    assert out.shape == (65, 64)
    _swiglu_check(out, x, w)


@pytest.mark.parametrize("R", [72, 136])
def test_swiglu_lowers_for_h200_at_27b_shapes(R):
    """The 27B MLP's gate|up (one layer of a 16-layer stack, a traced layer) at the verify's 72 rows and two slots'
    136: one Mosaic GPU kernel, the stack read whole, shared memory within the limit."""
    S = jax.ShapeDtypeStruct
    K, N = SHAPES_27B["w_gate_up"]
    cfg = km.swiglu_config(R, K, N)
    assert km._swiglu_smem(R, cfg) <= km.SMEM_LIMIT and km.swiglu_supports(R, K, N) is None
    txt = lower_for_h200(lambda x, w, l: km.swiglu_mgpu(x, w, layer=l), S((R, K), jnp.bfloat16),
                         S((16, K, N), jnp.bfloat16), S((), jnp.int32))
    assert txt.count("mosaic_gpu") >= 1 and "dynamic_slice" not in txt and f"16x{K}x{N}xbf16" in txt


def test_ops_mlp_swiglu_in_the_gemm(monkeypatch):
    """The model's MLP (`ops.mlp`, called where `ops.swiglu_fuses`) on the dense_mgpu path (a Hopper GPU's verify;
    here the interpreters) with stacked weights (`ops.Layer`s): the norm kernel, the SwiGLU GEMM and the down GEMM
    with nothing between them, against the XLA path (bf16: the GEMMs' sums in another order); a decode step's one
    row keeps the old path; under jax.vmap (a batched round's slots, folded) too."""
    from kernels_pallas import ops
    from kernels_pallas import rms_norm as R
    monkeypatch.setattr(ops, "_hopper", lambda: True)
    monkeypatch.setattr(km, "dense_mgpu", functools.partial(km.dense_mgpu, interpret=True))
    monkeypatch.setattr(km, "swiglu_mgpu", functools.partial(km.swiglu_mgpu, interpret=True))
    monkeypatch.setattr(R, "rms_norm_rows", functools.partial(R.rms_norm_rows, interpret=True))
    L, T, D, F = 3, 13, 128, 192
    kx, kg, kd, kn, kr = jax.random.split(jax.random.PRNGKey(7), 5)
    x = (2.0 * jax.random.normal(kx, (1, T, D))).astype(jnp.bfloat16)
    wgu = (jax.random.normal(kg, (L, D, 2, F)) * D ** -0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(kd, (L, F, D)) * F ** -0.5).astype(jnp.bfloat16)
    nw = (0.1 * jax.random.normal(kn, (L, D))).astype(jnp.bfloat16)
    res = jax.random.normal(kr, (1, T, D)).astype(jnp.bfloat16)
    layer = jnp.int32(2)
    Lw = lambda a: ops.Layer(a, layer)  # noqa: E731

    def run(kernels, x_, r_):
        return ops.mlp(x_, Lw(wgu), Lw(wd), kernels, norm=(Lw(nw), 1e-6), residual=r_)

    def old(x_, r_):  # the model's MLP on XLA: dense, SwiGLU, dense
        from kernels_pallas.numerics import swiglu
        gu = ops.dense("btd,dgf->btgf", x_, Lw(wgu), "xla", norm=(Lw(nw), 1e-6))
        return ops.dense("btf,fd->btd", swiglu(gu[..., 0, :], gu[..., 1, :], x_.dtype), Lw(wd), "xla",
                         residual=r_)
    assert ops.swiglu_fuses(x, Lw(wgu), Lw(wd), "pallas") and not ops.swiglu_fuses(x, Lw(wgu), Lw(wd), "xla")
    assert not ops.swiglu_fuses(x, Lw(wgu), Lw(wd), "pallas:split_mlp")  # the A/B variant: dense, SwiGLU, dense
    S = jax.ShapeDtypeStruct  # the 27B MLP: a decode step's one row stays on the GEMVs, the verify's 65 fuse
    w27 = [ops.Layer(S((16, 5120, 2, 17408), jnp.bfloat16), layer),
           ops.Layer(S((16, 17408, 5120), jnp.bfloat16), layer)]
    x27 = jnp.zeros((1, 65, 5120), jnp.bfloat16)
    assert ops.swiglu_fuses(x27, *w27, "pallas") and not ops.swiglu_fuses(x27[:, :1], *w27, "pallas")
    assert not ops.swiglu_fuses(x, wgu[1], wd[1], "pallas")  # no stack: XLA's GEMMs
    jaxpr = str(jax.make_jaxpr(functools.partial(run, "pallas"))(x, res))
    assert "name=swiglu_mgpu" in jaxpr and "dynamic_slice" not in jaxpr
    a, c = np.asarray(run("pallas", x, res), np.float32), np.asarray(old(x, res), np.float32)
    assert a.shape == (1, T, D) and run("pallas", x, res).dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(run("xla", x, res), np.float32), c)
    np.testing.assert_allclose(a, c, rtol=2.0 ** -6, atol=2.0 ** -6)
    assert np.mean(a != c) < 0.05
    xs, rs = jnp.stack([x, x[:, ::-1]]), jnp.stack([res, res[:, ::-1]])
    v = np.asarray(jax.vmap(functools.partial(run, "pallas"))(xs, rs), np.float32)
    np.testing.assert_allclose(v[0], a, rtol=2.0 ** -6, atol=2.0 ** -6)
    np.testing.assert_allclose(v[1], np.asarray(old(x[:, ::-1], res[:, ::-1]), np.float32), rtol=2.0 ** -6,
                               atol=2.0 ** -6)
