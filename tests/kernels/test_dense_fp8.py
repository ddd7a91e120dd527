"""Weight-only fp8 GEMV / skinny GEMM (kernels_pallas.dense_fp8) vs its jnp reference, the ops dispatch, and
its CUDA lowering at 27B shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import dense_fp8 as df
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature


def _inputs(M, K, N, block_in, seed=0):
    """bf16 x, random fp8 q (full e4m3 range), per-block positive scales; never zeros."""
    kx, kq, ks = jax.random.split(jax.random.PRNGKey(seed * 1000 + M * 7 + K + N), 3)
    x = (jax.random.normal(kx, (M, K), jnp.float32) + 0.1).astype(jnp.bfloat16)
    q = jnp.clip(jax.random.normal(kq, (K, N), jnp.float32) * 120, -448, 448).astype(df.FP8)
    scale = jax.random.uniform(ks, (-(-K // block_in), N), jnp.float32, 0.5, 2.0) / (120 * K ** 0.5)
    return x, q, scale


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _exact(x, q, scale, block_in):
    return np.asarray(x, np.float64) @ np.asarray(df.dequantize(q, scale, block_in), np.float64)


def test_signature_matches_reference():
    assert_kernel_signature(df.dense_fp8, df.dense_fp8_reference)


CASES = [  # M, K, N, block_in, kwargs
    (1, 512, 384, 128, {}),  # default: BK = block_in, split-K
    (1, 512, 384, 128, dict(block_k=32, split_k=1)),  # 4 chunks per scale block
    (1, 300, 96, 64, dict(split_k=4)),  # K (partial last block) and N not multiples of the blocks
    (3, 320, 200, 32, dict(block_n=64, split_k=3)),
    (65, 320, 200, 64, dict(block_n=64, block_k=64)),
    (16, 256, 256, 128, dict(split_k=2, block_k=64)),  # M = Mp: unmasked path
    (256, 160, 128, 16, {}),  # the largest M; the smallest block
    (1, 512, 384, 128, dict(mode="f16")),  # the f16 probe
    (65, 320, 200, 64, dict(mode="f16", block_n=64, block_k=32, split_k=2)),  # masked rows / columns / K
]


@pytest.mark.parametrize("M,K,N,block_in,kw", CASES)
def test_matches_reference(M, K, N, block_in, kw):
    x, q, scale = _inputs(M, K, N, block_in)
    ref = df.dense_fp8_reference(x, q, scale, block_in=block_in)
    out = df.dense_fp8(x, q, scale, block_in=block_in, interpret=True, **kw)
    assert out.shape == ref.shape == (M, N) and out.dtype == jnp.bfloat16
    exact = _exact(x, q, scale, block_in)
    assert _rel(out, ref) < 4e-3  # both one bf16 rounding of (nearly) the same fp32 sum
    assert _rel(out, exact) < 4e-3 and _rel(ref, exact) < 4e-3


def test_leading_dims():
    x, q, scale = _inputs(6, 256, 128, 128)
    out = df.dense_fp8(x.reshape(2, 3, 256), q, scale, interpret=True)
    assert out.shape == (2, 3, 128)
    assert _rel(out.reshape(6, 128), df.dense_fp8_reference(x, q, scale)) < 4e-3


def test_default_config_block_k_divides_block_in():
    for block_in in (128, 64, 48, 16):
        for M in (1, 65):
            bk = df.default_config(M, 5120, 5120, block_in)["block_k"]
            assert block_in % bk == 0 and bk >= 16


# 27B fp8 projections [K, N] (fp8 columns; GDN w_in's plain b|a tail runs beside the kernel)
SHAPES_27B = {"w_in": (5120, 16384), "w_out|wo": (6144, 5120), "w_gate_up": (5120, 34816),
              "w_down": (17408, 5120), "attn_w_qkv": (5120, 14336)}


def test_lowers_for_h200_at_27b_shapes():
    S = jax.ShapeDtypeStruct
    n = 0
    for M in (1, 65, 256):
        for name, (K, N) in SHAPES_27B.items():
            f = functools.partial(df.dense_fp8, block_in=128)
            txt = lower_for_h200(f, S((M, K), jnp.bfloat16), S((K, N), df.FP8), S((K // 128, N), jnp.float32))
            assert "__gpu$xla.gpu.triton" in txt, (name, M)
            n += 1
    # masked fp8 loads (K and N not multiples of the blocks) lower too
    txt = lower_for_h200(functools.partial(df.dense_fp8, block_in=128, block_n=128),
                         S((3, 5000), jnp.bfloat16), S((5000, 5100), df.FP8), S((40, 5100), jnp.float32))
    assert "__gpu$xla.gpu.triton" in txt and n == 15


@pytest.mark.parametrize("spec,xs,qs,tail", [
    ("btd,dc->btc", (1, 1, 64), (64, 96), 6),  # GDN w_in with its plain b|a tail
    ("btd,dgf->btgf", (1, 3, 64), (64, 2, 48), 0),  # the fused MLP gate|up
    ("bthe,hed->btd", (1, 2, 4, 16), (4, 16, 64), 0),  # wo / w_out: K over two axes
])
def test_ops_dense_fp8_matches_dequantized_einsum(monkeypatch, spec, xs, qs, tail):
    from kernels_pallas import ops
    calls = []
    kernel = df.dense_fp8
    monkeypatch.setattr(df, "dense_fp8", lambda x2, q2, s2, block_in: calls.append((x2.shape, q2.shape)) or
                        kernel(x2, q2, s2, block_in=block_in, interpret=True))
    block_in = 32
    (xs_, ws_), out = spec.split("->")[0].split(","), spec.split("->")[1]
    nc = len(set(xs_) & set(ws_) - set(out))
    K = int(np.prod(qs[:nc]))
    kx, kq, ks, kt = jax.random.split(jax.random.PRNGKey(len(spec)), 4)
    x = (jax.random.normal(kx, xs) + 0.1).astype(jnp.bfloat16)
    q = (jax.random.normal(kq, qs) * 100).astype(df.FP8)
    scale = jax.random.uniform(ks, (K // block_in,) + qs[nc:], jnp.float32, 0.5, 2.0) / 100
    t = (jax.random.normal(kt, (K, tail)) * 0.2).astype(jnp.bfloat16) if tail else None
    assert ops.dense_fp8_applies(spec, x, q, block_in, "pallas")
    assert not ops.dense_fp8_applies(spec, x, q, block_in, "xla")
    assert not ops.dense_fp8_applies(spec, x.astype(jnp.float32), q, block_in, "pallas")
    assert not ops.dense_fp8_applies(spec, x, q, 24, "pallas")  # no BK >= 16 divides 24-row blocks
    got = ops.dense_fp8(spec, x, q, scale, t, block_in)
    w = df.dequantize(q.reshape(K, -1), scale.reshape(K // block_in, -1), block_in).reshape(qs)
    if t is not None:
        w = jnp.concatenate([w, t.astype(jnp.float32)], axis=-1)
    ref = jnp.einsum(spec, x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    assert len(calls) == 1 and calls[0][0] == (int(np.prod(xs[:len(xs) - nc])), K)
    assert _rel(got, ref) < 4e-3


def test_ops_dense_fp8_rows_rule():
    from kernels_pallas import ops
    q = jnp.ones((64, 256), df.FP8)
    assert ops.dense_fp8_applies("btd,dc->btc", jnp.ones((1, 256, 64), jnp.bfloat16), q, 128, "pallas")
    assert not ops.dense_fp8_applies("btd,dc->btc", jnp.ones((1, 257, 64), jnp.bfloat16), q, 128, "pallas")


def test_sweep_variants_lower_for_h200():
    """Every variant of benchmarks/bench_gemv_fp8.py lowers (at the w_down shape: the longest K)."""
    import importlib.util
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("bench_gemv_fp8", os.path.join(root, "benchmarks", "bench_gemv_fp8.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.SHAPES_27B == SHAPES_27B
    S = jax.ShapeDtypeStruct
    K, N = SHAPES_27B["w_down"]
    for M in (1, 65):
        for name, kw in bench.variants_for(M).items():
            f = functools.partial(df.dense_fp8, block_in=128, **kw)
            txt = lower_for_h200(f, S((M, K), jnp.bfloat16), S((K, N), df.FP8), S((K // 128, N), jnp.float32))
            assert "__gpu$xla.gpu.triton" in txt, (M, name)
