"""W8A8 block FP8 (kernels_pallas.w8a8): the jnp reference vs a torch emulation of transformers' FP8 forward,
the Pallas-Triton kernel vs the reference (interpret mode, fresh random inputs), the ops dispatch (`ops.pick`),
the configs, and the CUDA lowering for an abstract H200 at the 27B shapes. Weights [N, K] (the checkpoint's
layout), scales [N blocks, K blocks]. The Mosaic GPU kernel: tests/kernel_tests/mgpu/test_w8a8_mgpu.py."""

import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fp8_torch
from kernels_pallas import ops
from kernels_pallas import w8a8 as k
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _inputs(M, K, N, block_in, block_out, dtype=jnp.bfloat16, seed=0):
    """x (a few outlier features, never zeros), fp8 q [N, K] over the whole e4m3 range, positive block scales
    [N blocks, K blocks]."""
    kx, kq, ks, ko = jax.random.split(jax.random.PRNGKey(seed * 1000 + M * 7 + K + N), 4)
    x = jax.random.normal(kx, (M, K), jnp.float32) + 0.1
    x = x * jnp.where(jax.random.uniform(ko, (1, K)) < 0.02, 30.0, 1.0)
    q = jnp.clip(jax.random.normal(kq, (N, K), jnp.float32) * 120, -448, 448).astype(k.FP8)
    scale = jax.random.uniform(ks, (-(-N // block_out), -(-K // block_in)), jnp.float32, 0.5, 2.0) / (120 * K ** 0.5)
    return x.astype(dtype), q, scale


def _t(a):
    a = np.asarray(a)
    if a.dtype == np.dtype(k.FP8):
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.array(a, np.float32))


def _torch_w8a8(x, q, scale, block_in, block_out):
    """The emulation on jax arrays (q and scale in HF's layout already)."""
    y = fp8_torch.w8a8_linear(_t(x).to(torch.bfloat16 if x.dtype == jnp.bfloat16 else torch.float32),
                              _t(q).contiguous(), _t(scale).contiguous(), (block_out, block_in))
    return y.float().numpy()


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_signature_matches_reference():
    assert_kernel_signature(k.w8a8, k.w8a8_reference)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_act_quant_is_transformers(dtype):
    """Bit for bit torch's emulation of `fp8_act_quant_inline`: scale = max|x| / 448, x / max(scale, 1e-12)
    rounded to e4m3; a partial last group, an all-zero group (scale 0, values 0) and huge / tiny rows."""
    x = np.array(_inputs(5, 300, 8, 128, 128, jnp.float32)[0])
    x[1, 128:256] = 0.0
    x[2] *= 1e4
    x[3] *= 1e-6
    x = jnp.asarray(x).astype(dtype)
    xq, s = k.act_quant(x, 128)
    tq, ts = fp8_torch.act_quant(_t(x), 128)
    assert xq.dtype == k.FP8 and xq.shape == (5, 384) and s.shape == (5, 3)
    np.testing.assert_array_equal(np.asarray(xq).view(np.uint8), tq.view(torch.uint8).numpy())
    np.testing.assert_array_equal(np.asarray(s), ts.numpy())
    assert float(s[1, 1]) == 0.0 and not np.asarray(xq[1, 128:256], np.float32).any()
    xq2, s2 = k.act_quant(x, 128, rows=16)  # padded rows: zeros, scale 0
    assert xq2.shape == (16, 384) and not np.asarray(s2[5:]).any()


@pytest.mark.parametrize("M,K,N,bi,bo,dtype", [
    (7, 300, 200, 128, 128, jnp.bfloat16),  # partial input and output blocks
    (65, 256, 96, 64, 32, jnp.bfloat16),
    (3, 200, 72, 32, 24, jnp.float32),  # fp32 activations and output
])
def test_reference_is_transformers(M, K, N, bi, bo, dtype):
    """The jnp reference == the torch emulation of transformers' FP8 forward, up to the fp32 summation order
    inside each block's dot (then one rounding to x's dtype); both far from the weight-only product."""
    x, q, scale = _inputs(M, K, N, bi, bo, dtype)
    ref = np.asarray(k.w8a8_reference(x, q, scale, block_in=bi, block_out=bo), np.float32)
    emu = _torch_w8a8(x, q, scale, bi, bo)
    assert ref.shape == emu.shape == (M, N)
    weight_only = np.asarray(x, np.float64) @ np.asarray(k.dequantize(q, scale, bi, bo), np.float64).T
    if dtype == jnp.float32:
        assert _rel(ref, emu) < 1e-6
    else:  # bf16: equal except where the fp32 sums straddle a rounding boundary (1 ulp)
        assert np.mean(ref != emu) < 0.005 and _rel(ref, emu) < 1e-4
    assert _rel(emu, weight_only) > 10 * max(_rel(ref, emu), 1e-4)  # the activation quantization is visible


CASES = [  # M, K, N, block_in, block_out, kwargs
    (1, 512, 384, 128, 128, {}),  # default: split-K over 4 blocks, one scale per program and block
    (7, 300, 200, 64, 32, dict(block_n=64)),  # partial K and N blocks, BN > block_out: gathered scales
    (65, 320, 200, 64, 16, dict(split_k=5, block_k=32)),  # split-K, 2 K chunks per block, masked rows
    (129, 256, 130, 128, 128, {}),  # 256-row tile
    (300, 192, 96, 64, 48, dict(block_n=32)),  # several 128-row tiles (prefill); BN divides nothing
]


@pytest.mark.parametrize("M,K,N,bi,bo,kw", CASES)
def test_kernel_matches_reference(M, K, N, bi, bo, kw):
    x, q, scale = _inputs(M, K, N, bi, bo, seed=1)
    ref = k.w8a8_reference(x, q, scale, block_in=bi, block_out=bo)
    out = k.w8a8(x, q, scale, block_in=bi, block_out=bo, interpret=True, **kw)
    assert out.shape == ref.shape == (M, N) and out.dtype == jnp.bfloat16
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    # the same fp32 block sums (split-K partials added in order): equal up to the fp32 sum order
    assert np.mean(np.asarray(out, np.float32) != np.asarray(ref, np.float32)) < 0.01
    assert _rel(out, ref) < 1e-3


def test_kernel_padded_scales_and_fp32():
    """Scale rows padded past the input blocks (as the model stores them) and fp32 activations give the same
    values."""
    x, q, scale = _inputs(9, 320, 160, 64, 64, seed=2)
    ref = k.w8a8_reference(x, q, scale, block_in=64, block_out=64)
    padded = jnp.pad(scale, ((0, 0), (0, 27)), constant_values=jnp.nan)
    out = k.w8a8(x, q, padded, block_in=64, block_out=64, interpret=True, split_k=2)
    assert _rel(out, ref) < 1e-3
    np.testing.assert_array_equal(np.asarray(k.w8a8_reference(x, q, padded, block_in=64, block_out=64)),
                                  np.asarray(ref))
    x32 = x.astype(jnp.float32)
    out32 = k.w8a8(x32.reshape(3, 3, 320), q, scale, block_in=64, block_out=64, interpret=True)
    assert out32.shape == (3, 3, 160) and out32.dtype == jnp.float32
    assert _rel(out32.reshape(9, 160), k.w8a8_reference(x32, q, scale, block_in=64, block_out=64)) < 1e-6


def _stacked(L, K, N, block_in, block_out, seed):
    """L layers' fp8 weights [L, N, K] and block scales [L, N blocks, K blocks + 3 padding columns]."""
    qs, ss = zip(*(_inputs(1, K, N, block_in, block_out, seed=seed * 10 + l)[1:] for l in range(L)))
    return jnp.stack(qs), jnp.pad(jnp.stack(ss), ((0, 0), (0, 0), (0, 3)), constant_values=1.0)


@pytest.mark.parametrize("M,K,N,bi,bo,kw", [
    (1, 256, 256, 128, 128, dict(split_k=2)),  # unmasked loads, one scale per program and block
    (7, 300, 200, 64, 32, dict(block_n=64)),  # masked K / N loads, gathered scales
])
def test_kernel_layer_reads_the_stack(M, K, N, bi, bo, kw):
    """layer=l (a scan over stacked layers: the kernel reads layer l of w [L, N, K] / scale [L, ...] in place) ==
    the kernel on the slices w[l], scale[l], bit for bit; the reference likewise."""
    q, scale = _stacked(3, K, N, bi, bo, seed=M + K)
    x = _inputs(M, K, N, bi, bo, seed=4)[0]
    f = functools.partial(k.w8a8, block_in=bi, block_out=bo, interpret=True, **kw)
    for l in (1, 2):
        got = f(x, q, scale, layer=jnp.int32(l))
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(f(x, q[l], scale[l]), np.float32))
        ref = k.w8a8_reference(x, q, scale, layer=jnp.int32(l), block_in=bi, block_out=bo)
        np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(
            k.w8a8_reference(x, q[l], scale[l], block_in=bi, block_out=bo), np.float32))
        assert _rel(got, ref) < 1e-3


def test_layer_lowers_for_h200_without_a_slice():
    """With layer the custom call takes the whole stack (no dynamic slice, which XLA would copy) at a 27B shape."""
    S = jax.ShapeDtypeStruct
    K, N = SHAPES_27B["w_gate_up"]
    txt = lower_for_h200(lambda x, w, s, l: k.w8a8(x, w, s, layer=l), S((16, K), jnp.bfloat16),
                         S((4, N, K), k.FP8), S((4, N // 128, 64), jnp.float32), S((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt and f"tensor<4x{N}x{K}xf8E4M3FN>" in txt and "dynamic_slice" not in txt


def test_default_config_fits():
    for bi in (128, 64, 32, 16):
        for M in (1, 7, 16, 65, 129, 256, 4096):
            for K, N in ((5120, 16384), (17408, 5120), (300, 200)):
                c = k.plan(M, K, N, bi, 128)
                assert bi % c["block_k"] == 0 and c["block_k"] >= 16 and k.is_pow2(c["block_n"])
                assert c["smem_bytes"] <= k.SMEM_BYTES and (-(-K // bi)) % c["split_k"] == 0
                assert c["block_m"] >= min(M, 128) and c["block_m"] <= 256
    assert not k.applies(24) and k.applies(48) and k.applies(16) and not k.applies(8)


@pytest.mark.parametrize("spec,xs,qs,tail", [
    ("btd,dc->btc", (1, 1, 64), (64, 96), 6),  # GDN w_in with its plain b|a tail
    ("btd,dgf->btgf", (1, 3, 64), (64, 2, 48), 0),  # the fused MLP gate|up
    ("bthe,hed->btd", (1, 2, 4, 16), (4, 16, 64), 0),  # wo / w_out: K over two axes
])
def test_ops_dense_w8a8(monkeypatch, spec, xs, qs, tail):
    """`ops.pick` chooses the Pallas kernel for kernels="pallas" (the jnp reference for "xla" and for input
    blocks no power-of-two chunk ≥ 16 divides); both give the W8A8 product of the flattened problem."""
    calls = []
    kernel = k.w8a8
    monkeypatch.setattr(k, "w8a8", lambda x2, q2, s2, **kw: calls.append(x2.shape) or
                        kernel(x2, q2, s2, interpret=True, **kw))
    bi, bo = 32, 16
    (xs_, ws_), out = spec.split("->")[0].split(","), spec.split("->")[1]
    nc = len(set(xs_) & set(ws_) - set(out))
    K, N = int(np.prod(qs[:nc])), int(np.prod(qs[nc:]))
    kx, kq, ks, kt = jax.random.split(jax.random.PRNGKey(len(spec)), 4)
    x = (jax.random.normal(kx, xs) + 0.1).astype(jnp.bfloat16)
    q = (jax.random.normal(kq, (N, K)) * 100).astype(k.FP8)  # [N, K]: the logical weight is qs
    scale = jax.random.uniform(ks, (-(-N // bo), K // bi), jnp.float32, 0.5, 2.0) / 100
    t = (jax.random.normal(kt, (K, tail)) * 0.2).astype(jnp.bfloat16) if tail else None
    rows = int(np.prod(xs[:len(xs) - nc]))
    fmt = ops.weight_format(x.dtype, q.dtype)
    assert fmt == "w8a8" and ops.weight_format(x.dtype, jnp.bfloat16) == "bf16"
    assert ops.pick(fmt, rows, N, "pallas", block_in=bi).kernel == "w8a8"
    assert ops.pick(fmt, rows, N, "xla", block_in=bi).kernel == "w8a8_ref"
    assert ops.pick(fmt, rows, N, "pallas", block_in=24).kernel == "w8a8_ref"
    ref = k.w8a8_reference(x.reshape(rows, K), q, scale, block_in=bi, block_out=bo)
    if t is not None:
        ref = jnp.concatenate([ref.astype(jnp.float32), jnp.dot(x.reshape(rows, K), t,
                                                                preferred_element_type=jnp.float32)], -1)
    ref = ref.astype(jnp.bfloat16)  # `dense` rounds once to x's dtype (the tail's fp32 product too)
    for kernels in ("pallas", "xla"):
        shape = qs[:-1] + (qs[-1] + tail,)
        got = ops.dense(spec, x, q, kernels, fp8=ops.Fp8(scale, t, bi, bo, shape))
        assert got.dtype == jnp.bfloat16 and got.shape == xs[:len(xs) - nc] + qs[nc:-1] + (qs[-1] + tail,)
        assert _rel(got.reshape(rows, -1), ref) < 1e-3
    assert calls == [(rows, K)]


def test_ops_dense_w8a8_layer(monkeypatch):
    """ops.dense / decode_row of an FP8 weight whose q, scale and tail are ops.Layers (one layer of stacks: a scan
    over layers) == of the plain slices, bit for bit, on "pallas" (the Triton kernel gets the stacks and layer=)
    and "xla" (the reference), under vmap over slots too; `linear.dense` of an Fp8Weight with a Layer q and the
    plain scale / tail stacks likewise."""
    from jaxddtree.model import linear
    from jaxddtree.model.fp8 import Fp8Weight
    calls = []
    kernel = k.w8a8
    monkeypatch.setattr(k, "w8a8", lambda x2, q2, s2, **kw: calls.append((x2.shape, q2.shape, "layer" in kw)) or
                        kernel(x2, q2, s2, interpret=True, **kw))
    L, l, B, K, N, tail, bi, bo = 3, 2, 2, 64, 96, 6, 32, 16
    q, scale = _stacked(L, K, N, bi, bo, seed=5)
    t = (0.2 * jax.random.normal(jax.random.PRNGKey(6), (L, K, tail))).astype(jnp.bfloat16)
    x = (jax.random.normal(jax.random.PRNGKey(7), (B, 1, 1, K)) + 0.1).astype(jnp.bfloat16)
    idx = jnp.int32(l)
    lay = (ops.Layer(q, idx), ops.Fp8(ops.Layer(scale, idx), ops.Layer(t, idx), bi, bo, (K, N + tail)))
    plain = (q[l], ops.Fp8(scale[l], t[l], bi, bo, (K, N + tail)))
    for kernels in ("pallas", "xla"):
        f = lambda w, x: ops.dense("btd,dc->btc", x, w[0], kernels, fp8=w[1])  # noqa: E731
        np.testing.assert_array_equal(np.asarray(f(lay, x[0]), np.float32), np.asarray(f(plain, x[0]), np.float32))
        np.testing.assert_array_equal(np.asarray(jax.vmap(functools.partial(f, lay))(x), np.float32),
                                      np.asarray(jax.vmap(functools.partial(f, plain))(x), np.float32))
    row = ops.decode_row(x[0], lay[0], "pallas", fp8=lay[1])
    np.testing.assert_array_equal(np.asarray(row, np.float32),
                                  np.asarray(ops.decode_row(x[0], plain[0], "pallas", fp8=plain[1]), np.float32))
    assert {c[1] for c in calls if c[2]} == {(L, N, K)} and ((B, K), (L, N, K), True) in calls, calls
    w = Fp8Weight(q=ops.Layer(q, idx), scale=scale, tail=t, block_in=bi, block_out=bo, shape=(K, N + tail))
    np.testing.assert_array_equal(np.asarray(linear.dense("btd,dc->btc", x[0], w, "pallas"), np.float32),
                                  np.asarray(ops.dense("btd,dc->btc", x[0], plain[0], "pallas", fp8=plain[1]),
                                             np.float32))
    with pytest.raises(TypeError, match="all Layers"):
        ops.dense("btd,dc->btc", x[0], lay[0], "pallas", fp8=plain[1])


# 27B fp8 projections as (K, N) (fp8 rows; GDN w_in's plain b|a tail runs beside the kernel)
SHAPES_27B = {"w_in": (5120, 16384), "w_out|wo": (6144, 5120), "w_gate_up": (5120, 34816),
              "w_down": (17408, 5120), "attn_w_qkv": (5120, 14336)}


def test_lowers_for_h200_at_27b_shapes():
    """The Triton kernel (the fallback off Hopper) lowers at the 27B shapes, masked loads and gathered scales too."""
    S = jax.ShapeDtypeStruct
    n = 0
    for M in (1, 16, 65, 129, 600):
        for name, (K, N) in SHAPES_27B.items():
            f = functools.partial(k.w8a8, block_in=128, block_out=128)
            txt = lower_for_h200(f, S((M, K), jnp.bfloat16), S((N, K), k.FP8), S((N // 128, K // 128), jnp.float32))
            assert "__gpu$xla.gpu.triton" in txt, (name, M)
            n += 1
    # masked fp8 loads (K and N not multiples of the blocks), gathered scales
    txt = lower_for_h200(functools.partial(k.w8a8, block_in=128, block_out=32, block_n=64),
                         S((3, 5000), jnp.bfloat16), S((5100, 5000), k.FP8), S((160, 40), jnp.float32))
    assert "__gpu$xla.gpu.triton" in txt and n == 25


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gemv_fp8", os.path.join(ROOT, "benchmarks",
                                                                                 "bench_gemv_fp8.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_ops_layer_lowers_for_h200_on_fp8_wgmma_without_a_slice():
    """ops.dense of a Layer FP8 weight at a 27B shape on a Hopper GPU: the Mosaic GPU kernel gets the whole stacks
    (no dynamic slice, which XLA would copy)."""
    from kernels_pallas import w8a8_mgpu as km
    S = jax.ShapeDtypeStruct
    K, N = SHAPES_27B["w_in"]
    C = km.scale_cols(K // 128)
    f = lambda x, q, s, l: ops.dense("btd,dc->btc", x, ops.Layer(q, l), "pallas",  # noqa: E731
                                     fp8=ops.Fp8(ops.Layer(s, l), None, 128, 128, (K, N)))
    txt = lower_for_h200(f, S((1, 1, K), jnp.bfloat16), S((4, N, K), k.FP8), S((4, N // 128, C), jnp.float32),
                         S((), jnp.int32))
    assert "mosaic_gpu" in txt and f"tensor<4x{N}x{K}xf8E4M3FN>" in txt and "dynamic_slice" not in txt


def test_bench_shapes_are_the_models():
    assert _bench().SHAPES_27B == SHAPES_27B
