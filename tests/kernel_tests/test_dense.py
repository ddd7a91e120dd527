"""Pallas dense GEMV / skinny GEMM (kernels_pallas.dense) vs the jnp reference, and its CUDA lowering."""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import dense as dn
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gemv", os.path.join(ROOT, "benchmarks", "bench_gemv.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(M, K, N, dtype=jnp.bfloat16, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed * 1000 + M * 7 + K + N))
    x = jax.random.normal(kx, (M, K), jnp.float32) + 0.1  # never zeros
    w = jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5
    return x.astype(dtype), w.astype(dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_signature_matches_reference():
    assert_kernel_signature(dn.dense, dn.dense_reference)


CASES = [
    (1, 512, 384, {}),  # default: split-K
    (1, 512, 384, dict(split_k=1)),
    (1, 512, 384, dict(block_n=128, block_k=32)),
    (1, 512, 384, dict(block_n=256, block_k=16, split_k=4)),
    (1, 512, 384, dict(block_n=256, block_k=64)),
    (1, 300, 96, dict(block_k=32, split_k=4)),  # K and N not multiples of the blocks
    (1, 320, 200, dict(block_n=64, block_k=64, split_k=3)),
    (65, 320, 200, dict(block_n=64, block_k=64, split_k=3)),
    (65, 256, 384, {}),
    (17, 128, 128, {}),
    (16, 256, 256, dict(split_k=2, block_k=64)),  # M = Mp: unmasked path
    (129, 192, 160, dict(block_n=128, block_k=64)),
]


@pytest.mark.parametrize("M,K,N,kw", CASES)
def test_dense_matches_reference_bf16(M, K, N, kw):
    x, w = _inputs(M, K, N)
    ref = dn.dense_reference(x, w)
    out = dn.dense(x, w, interpret=True, **kw)
    assert out.shape == ref.shape and out.dtype == jnp.bfloat16
    exact = np.dot(np.asarray(x, np.float32), np.asarray(w, np.float32))
    assert _rel(out, ref) < 1e-2
    assert _rel(out, exact) < 1e-2


def test_dense_leading_dims():
    x, w = _inputs(6, 256, 128)
    x3 = x.reshape(2, 3, 256)
    out = dn.dense(x3, w, interpret=True)
    assert out.shape == (2, 3, 128)
    assert _rel(out.reshape(6, 128), dn.dense_reference(x, w)) < 1e-2


@pytest.mark.parametrize("kw", [{}, dict(block_k=32, split_k=2)])
def test_dense_fp32_exactish(kw):
    x, w = _inputs(1, 384, 200, dtype=jnp.float32, seed=1)
    out = dn.dense(x, w, interpret=True, **kw)
    exact = np.dot(np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert out.dtype == jnp.float32 and _rel(out, exact) < 1e-5


@pytest.mark.parametrize("M,K,N,kw", [
    (1, 300, 96, dict(block_k=32, split_k=4)),  # K and N not multiples of the blocks: masked loads
    (65, 320, 200, dict(block_n=64, block_k=64, split_k=3)),
    (1, 256, 256, dict(split_k=1)),  # unmasked loads
])
def test_dense_layer_reads_the_stack(M, K, N, kw):
    """layer=l (a scan over stacked layers: the kernel reads layer l of w [L, K, N] in place) == the kernel on the
    slice w[l] bit for bit, with the gate / residual and unreduced partials too; the reference likewise."""
    L = 3
    w = jnp.stack([_inputs(1, K, N, seed=10 + l)[1] for l in range(L)])
    x, _, _, g, r = _parts(M, K, N, M + K)
    f = functools.partial(dn.dense, interpret=True, **kw)
    for l in (1, 2):
        lay = jnp.int32(l)
        np.testing.assert_array_equal(_bits(f(x, w, layer=lay)), _bits(f(x, w[l])))
        np.testing.assert_array_equal(_bits(dn.dense_reference(x, w, layer=lay)), _bits(dn.dense_reference(x, w[l])))
        assert _rel(f(x, w, layer=lay), dn.dense_reference(x, w[l])) < 1e-2
    np.testing.assert_array_equal(_bits(f(x, w, g, r, layer=lay)), _bits(f(x, w[l], g, r)))
    np.testing.assert_array_equal(_bits(f(x, w, layer=lay, reduce=False)), _bits(f(x, w[l], reduce=False)))


def test_dense_layer_lowers_for_h200_without_a_slice():
    """With layer the custom call takes the whole stack (no dynamic slice, which XLA would copy) at a 27B shape."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    txt = lower_for_h200(lambda x, w, l: dn.dense(x, w, layer=l), S((1, 5120), bf), S((4, 5120, 34816), bf),
                         S((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt and "tensor<4x5120x34816xbf16>" in txt and "dynamic_slice" not in txt


def test_default_config_sane():
    for M in (1, 17, 65, 129):
        for K, N in _bench().SHAPES.values():
            c = dn.default_config(M, K, N)
            nprog = -(-N // c["block_n"]) * c["split_k"]
            assert c["split_k"] * M * N * 4 <= K * N * 2 // 4 or c["split_k"] == 1
            assert nprog >= dn.N_SM or c["split_k"] * 2 > min(-(-K // c["block_k"]), K // (16 * M))


def test_lowers_for_h200_at_27b_shapes_all_sweep_variants():
    b = _bench()
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    n = 0
    for M in (1, 17, 65, 129):
        for name, (K, N) in b.SHAPES.items():
            vs = b.variants_for(M, K, N) if M in (1, 65) else {"default": {}}
            for vname, kw in vs.items():
                txt = lower_for_h200(functools.partial(dn.dense, **kw), S((M, K), bf), S((K, N), bf))
                assert "__gpu$xla.gpu.triton" in txt, (name, M, vname)
                n += 1
    assert n > 50


@pytest.mark.parametrize("spec,xs,ws", [
    ("btd,dc->btc", (1, 1, 64), (64, 96)),
    ("btd,dhe->bthe", (1, 3, 64), (64, 4, 16)),
    ("btd,dh->bth", (1, 5, 64), (64, 6)),
    ("btd,dgf->btgf", (1, 1, 64), (64, 2, 48)),  # the fused MLP gate|up
    ("bthe,hed->btd", (1, 2, 4, 16), (4, 16, 64)),
])
def test_ops_dense_dispatch_matches_einsum(monkeypatch, spec, xs, ws):
    """kernels_pallas.ops.dense flattens each projection spec onto the Pallas kernel (interpret mode here; the
    GEMV's domain widened to these shapes)."""
    from kernels_pallas import ops
    monkeypatch.setattr(ops, "pick", functools.partial(ops.pick, gemv_rows=128, gemv_cols=1))
    calls = []
    kernel = dn.dense
    monkeypatch.setattr(dn, "dense", lambda x2, w2, *a: calls.append((x2.shape, w2.shape)) or kernel(x2, w2, *a,
                                                                                                  interpret=True))
    kx, kw = jax.random.split(jax.random.PRNGKey(len(spec)))
    x = (jax.random.normal(kx, xs) + 0.1).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, ws) * 0.2).astype(jnp.bfloat16)
    got = ops.dense(spec, x, w, "pallas")
    ref = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    assert got.shape == ref.shape and got.dtype == jnp.bfloat16
    assert len(calls) == 1 and calls[0][0][1] == calls[0][1][0]  # the kernel ran on the flattened problem
    # rounded once to bf16: equal to the rounded fp32 sum up to summation order (XLA's einsum: the same sum)
    assert _rel(got, ref.astype(jnp.bfloat16)) < 1e-2
    assert _rel(ops.dense(spec, x, w, "xla"), ref.astype(jnp.bfloat16)) < 1e-6


def test_ops_dense_dispatch_rule():
    """Only single-token passes with wide outputs take the Pallas GEMV (the H200 sweep's winners)."""
    from kernels_pallas import ops
    calls = []
    x1 = jnp.ones((1, 1, 64), jnp.bfloat16)
    orig = dn.dense
    try:
        dn.dense = lambda x2, w2, *a: calls.append(x2.shape) or orig(x2, w2, *a, interpret=True)
        ops.dense("btd,dc->btc", x1, jnp.ones((64, 4096), jnp.bfloat16), "pallas")  # decode, wide: Pallas
        ops.dense("btd,dc->btc", x1, jnp.ones((64, 1024), jnp.bfloat16), "pallas")  # narrow: XLA
        ops.dense("btd,dc->btc", jnp.ones((1, 2, 64), jnp.bfloat16), jnp.ones((64, 4096), jnp.bfloat16),
                  "pallas")  # two rows: XLA
        ops.dense("btd,dc->btc", x1, jnp.ones((64, 4096), jnp.bfloat16), "xla")
        ops.dense("btd,dc->btc", x1.astype(jnp.float32), jnp.ones((64, 4096), jnp.float32), "pallas")  # fp32: XLA
    finally:
        dn.dense = orig
    assert calls == [(1, 64)]


# ---------------------------------------------------------------- decode-step prologue / epilogue (gate, residual)

def _parts(M, K, N, seed):
    """x, w, norm weight, gate, residual (bf16, never zeros)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = (3.0 * jax.random.normal(ks[0], (M, K)) + 0.1).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (K, N)) * K ** -0.5).astype(jnp.bfloat16)
    nw = (0.1 * jax.random.normal(ks[2], (K,))).astype(jnp.bfloat16)
    g = jax.random.uniform(ks[3], (M, K), minval=0.05, maxval=1.0).astype(jnp.bfloat16)
    r = jax.random.normal(ks[4], (M, N)).astype(jnp.bfloat16)
    return x, w, nw, g, r


def _bits(a):
    return np.asarray(jnp.asarray(a).view(jnp.uint16) if a.dtype == jnp.bfloat16 else a)


FUSED_CASES = [
    (1, 320, 200, dict(block_n=64, block_k=64, split_k=3)),  # masks on K and N, split-K: residual after
    (1, 512, 384, dict(split_k=1)),  # residual in the kernel's epilogue
    (1, 512, 384, {}),
    (3, 256, 128, dict(split_k=2, block_k=64)),
]


@pytest.mark.parametrize("M,K,N,kw", FUSED_CASES)
def test_residual_fused_equals_unfused_bitwise(M, K, N, kw):
    """dense → residual in one call == the plain GEMV, then the rounded residual add, bit for bit."""
    x, w, _, _, r = _parts(M, K, N, K + N + M)
    fused = dn.dense(x, w, None, r, interpret=True, **kw)
    plain = dn.dense(x, w, interpret=True, **kw)
    unfused = dn.rounded(dn.f32(r) + dn.f32(plain), r.dtype)
    assert fused.dtype == jnp.bfloat16 and fused.shape == (M, N)
    np.testing.assert_array_equal(_bits(fused), _bits(unfused))
    assert _rel(fused, dn.dense_reference(x, w, None, r)) < 1e-2


@pytest.mark.parametrize("M,K,N,kw", FUSED_CASES[:2])
def test_gate_fused_equals_unfused_bitwise(M, K, N, kw):
    x, w, _, g, r = _parts(M, K, N, 7)
    fused = dn.dense(x, w, gate=g, residual=r, interpret=True, **kw)
    plain = dn.dense(dn.rounded(dn.f32(x) * dn.f32(g), x.dtype), w, interpret=True, **kw)
    np.testing.assert_array_equal(_bits(fused), _bits(dn.rounded(dn.f32(r) + dn.f32(plain), r.dtype)))
    assert _rel(fused, dn.dense_reference(x, w, gate=g, residual=r)) < 1e-2


def test_gate_residual_fp32_exactish():
    x, w, _, g, r = (a.astype(jnp.float32) for a in _parts(1, 384, 200, 3))
    out = dn.dense(x, w, g, r, interpret=True, block_k=32, split_k=2)
    ref = dn.dense_reference(x, w, g, r)
    assert out.dtype == jnp.float32 and _rel(out, ref) < 1e-6


def test_fused_lowers_for_h200_at_27b_shapes():
    """The decode step's calls at 27B shapes: the plain GEMV (after the norm) → GDN in-proj / attention qkv / MLP
    gate|up / lm_head, gate + residual → o_proj, residual → GDN out_proj / MLP down."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    D = 5120
    for K, N, kind in [(D, 16480, "plain"), (D, 14336, "plain"), (D, 34816, "plain"), (D, 248320, "plain"),
                       (6144, D, "gate"), (6144, D, "res"), (17408, D, "res")]:
        x, w = S((1, K), bf), S((K, N), bf)
        if kind == "plain":
            f, args = dn.dense, (x, w)
        elif kind == "gate":
            f, args = (lambda x, w, g, r: dn.dense(x, w, gate=g, residual=r)), (x, w, S((1, K), bf), S((1, N), bf))
        else:
            f, args = (lambda x, w, r: dn.dense(x, w, residual=r)), (x, w, S((1, N), bf))
        assert "__gpu$xla.gpu.triton" in lower_for_h200(f, *args), (K, N, kind)
    # split = 1 (residual in the kernel)
    txt = lower_for_h200(lambda x, w, r: dn.dense(x, w, residual=r, split_k=1),
                         S((1, D), bf), S((D, 8192), bf), S((1, 8192), bf))
    assert "__gpu$xla.gpu.triton" in txt


def test_ops_dense_parts_fused_and_unfused(monkeypatch):
    """ops.dense with norm / gate / residual: the Pallas path (kernels="pallas": the norm, then one kernel call with
    the gate / residual; the benchmark variant "pallas:unfused": the parts as jnp ops around the plain kernel) and
    the XLA path give the same values."""
    from kernels_pallas import ops
    monkeypatch.setattr(ops, "pick", functools.partial(ops.pick, gemv_cols=1))
    calls = []
    kernel = dn.dense
    monkeypatch.setattr(dn, "dense", lambda x2, w2, *a: calls.append(len(a)) or kernel(x2, w2, *a, interpret=True))
    x, w, nw, g, r = _parts(1, 64, 96, 5)
    x3, r3, g3 = x.reshape(1, 1, 64), r.reshape(1, 1, 96), g.reshape(1, 1, 64)
    for parts in (dict(norm=(nw, 1e-6), residual=r3), dict(gate=g3, residual=r3)):
        outs = []
        for kernels in ("pallas", "pallas:unfused"):
            outs.append(ops.dense("btd,dc->btc", x3, w, kernels, **parts))
        xla = ops.dense("btd,dc->btc", x3, w, "xla", **parts)
        np.testing.assert_array_equal(_bits(outs[0]), _bits(outs[1]))
        assert outs[0].dtype == jnp.bfloat16 and _rel(outs[0], xla) < 1e-2
    assert calls == [2, 0, 2, 0]  # fused: x, w + gate, residual; unfused: the plain GEMV


def test_unreduced_partials_lowering():
    """reduce=False (`ops.decode_row`: the split-K partials for a consumer kernel) lowers at 27B widths."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    txt = lower_for_h200(lambda x, w: dn.dense(x, w, reduce=False), S((1, 5120), bf), S((5120, 34816), bf))
    assert "__gpu$xla.gpu.triton" in txt


# ---------------------------------------------------------------- ops.Layer: one layer of a stack (a scan over layers)

def test_layer_is_the_layers_view():
    """ops.Layer: the layer's shape / dtype / ndim, get() the slice, [...] itself (also through nnx.Param)."""
    from flax import nnx

    from kernels_pallas import ops
    stack = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 16, 8)).astype(jnp.bfloat16)
    lay = ops.Layer(stack, jnp.int32(2))
    assert lay.shape == (4, 16, 8) and lay.dtype == jnp.bfloat16 and lay.ndim == 3 and lay[...] is lay
    np.testing.assert_array_equal(_bits(lay.get()), _bits(stack[2]))
    p = nnx.Param(lay)[...]
    assert isinstance(p, ops.Layer) and p.stacked is stack and p.index is lay.index
    with pytest.raises(TypeError, match="only"):
        lay[0]


@pytest.mark.parametrize("spec,xs,ws", [
    ("btd,dc->btc", (1, 1, 64), (64, 96)),
    ("bthe,hed->btd", (1, 1, 4, 16), (4, 16, 64)),  # K over two axes: the stack reshaped to [L, K, N]
])
def test_ops_layer_weight_is_its_slice(monkeypatch, spec, xs, ws):
    """ops.dense / decode_row with an ops.Layer weight == with the plain slice, bit for bit: "xla" (XLA's einsum on
    the slice) and "pallas" (the GEMV, its domain widened, gets the whole stack and layer=; gate / residual
    fused), under vmap over slots too (the Layer unbatched: one call on all slots' rows)."""
    from kernels_pallas import ops
    monkeypatch.setattr(ops, "pick", functools.partial(ops.pick, gemv_rows=8, gemv_cols=1))
    calls = []
    kernel = dn.dense
    monkeypatch.setattr(dn, "dense", lambda x2, w2, *a, **k: calls.append((x2.shape, w2.shape, "layer" in k)) or
                        kernel(x2, w2, *a, **{**k, "interpret": True}))
    L, l, B = 3, 1, 2
    ks = jax.random.split(jax.random.PRNGKey(len(spec)), 4)
    stack = (0.2 * jax.random.normal(ks[0], (L,) + ws)).astype(jnp.bfloat16)
    lay, w = ops.Layer(stack, jnp.int32(l)), stack[l]
    x = (jax.random.normal(ks[1], (B,) + xs) + 0.1).astype(jnp.bfloat16)
    g = jax.random.uniform(ks[2], (B,) + xs, minval=0.05, maxval=1.0).astype(jnp.bfloat16)
    r = jax.random.normal(ks[3], (B,) + xs[:2] + ws[-1:]).astype(jnp.bfloat16)
    K, N = int(np.prod(ws[:-1])), ws[-1]
    for kernels in ("pallas", "xla"):
        f = lambda w, x, g, r: ops.dense(spec, x, w, kernels, gate=g, residual=r)  # noqa: E731
        np.testing.assert_array_equal(_bits(f(lay, x[0], g[0], r[0])), _bits(f(w, x[0], g[0], r[0])))
        np.testing.assert_array_equal(_bits(jax.vmap(functools.partial(f, lay))(x, g, r)),
                                      _bits(jax.vmap(functools.partial(f, w))(x, g, r)))
    assert {c[1] for c in calls if c[2]} == {(L, K, N)} and ((B, K), (L, K, N), True) in calls, calls
    if len(xs) == 3:  # decode_row: the GEMV's unsummed partials
        calls.clear()
        row = lambda w, x: ops.decode_row(x, w, "pallas")  # noqa: E731
        np.testing.assert_array_equal(_bits(row(lay, x[0])), _bits(row(w, x[0])))
        np.testing.assert_array_equal(_bits(jax.vmap(functools.partial(row, lay))(x)),
                                      _bits(jax.vmap(functools.partial(row, w))(x)))
        assert ((1, K), (L, K, N), True) in calls
        # in a scan over the layers (the index traced), vmapped over slots
        _, ys = jax.lax.scan(lambda c, i: (c, jax.vmap(functools.partial(row, ops.Layer(stack, i)))(x)), 0,
                             jnp.arange(L, dtype=jnp.int32))
        np.testing.assert_array_equal(_bits(ys[l]), _bits(jax.vmap(functools.partial(row, w))(x)))


def test_ops_layer_lowers_for_h200_without_a_slice():
    """ops.decode_row / dense of a Layer weight at a 27B shape on the Pallas path: the GEMV gets the whole stack
    (no dynamic slice, which XLA would copy)."""
    from kernels_pallas import ops
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    txt = lower_for_h200(lambda x, w, l: ops.decode_row(x, ops.Layer(w, l), "pallas"), S((1, 1, 5120), bf),
                         S((4, 5120, 34816), bf), S((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt and "tensor<4x5120x34816xbf16>" in txt and "dynamic_slice" not in txt
    txt = lower_for_h200(lambda x, w, r, l: ops.dense("btd,dc->btc", x, ops.Layer(w, l), "pallas", residual=r),
                         S((1, 1, 17408), bf), S((4, 17408, 5120), bf), S((1, 1, 5120), bf), S((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt and "tensor<4x17408x5120xbf16>" in txt and "dynamic_slice" not in txt
