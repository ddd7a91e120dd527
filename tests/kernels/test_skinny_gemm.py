"""Skinny-GEMM Mosaic GPU kernel (kernels_pallas.skinny_gemm) vs its jnp reference in the Mosaic GPU interpreter,
and its CUDA lowering against an abstract H200 at the 27B shapes."""

import functools
import importlib.util
import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import skinny_gemm as sg
from kernels_pallas._common import lower_for_h200

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
C = sg.SkinnyConfig
WS = functools.partial(C, warp_specialized=True)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_skinny", os.path.join(ROOT, "benchmarks", "bench_skinny.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(M, K, N, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed * 1000 + M * 7 + K + N))
    x = jax.random.normal(kx, (M, K), jnp.float32) + 0.1  # never zeros
    w = jax.random.normal(kw, (K, N), jnp.float32) * K ** -0.5
    return x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _check(M, K, N, cfg, seed=0):
    x, w = _inputs(M, K, N, seed)
    out = sg.skinny_gemm(x, w, cfg, interpret=True)
    ref = sg.skinny_gemm_reference(x, w)
    assert out.shape == (M, N) and out.dtype == jnp.bfloat16
    exact = np.dot(np.asarray(x, np.float32), np.asarray(w, np.float32))
    # one bf16 rounding of the fp32 sum: equal to the reference up to summation order
    assert _rel(out, ref) < 2e-3, _rel(out, ref)
    assert _rel(out, exact) < 5e-3, _rel(out, exact)


def test_signature_matches_reference():
    ref = list(inspect.signature(sg.skinny_gemm_reference).parameters)
    ker = inspect.signature(sg.skinny_gemm).parameters
    assert list(ker)[:len(ref)] == ref == ["x", "w", "config"]
    assert ker["interpret"].default is False and ker["config"].default is None


CASES = [
    # M, K, N, config (None = default_config)
    (17, 256, 192, None),  # tree of 17: rows padded to 24
    (65, 320, 160, C(block_n=64, block_k=32, stages=3, split_k=3)),  # split-K, K and N tails, 64 B swizzle
    (129, 128, 128, None),
    (257, 128, 96, C(block_n=64, block_k=64, stages=2, split_k=2)),  # two row chunks (wgmma n ≤ 256), N tail
    (33, 200, 112, None),  # K % 64 != 0 (x padded), N % 32 != 0 (32 B swizzle), N < block_n
    (65, 256, 160, C(block_n=128, stages=2, epilogue="yT")),  # y^T from the kernel, XLA transposes
    (129, 320, 192, C(block_n=64, block_k=64, stages=2, split_k=2, epilogue="yT")),
]
WS_CASES = [
    (17, 256, 192, WS(block_n=64, stages=2)),
    (65, 320, 160, WS(wgs=2, block_n=64, block_k=32, stages=3, split_k=3)),
    (40, 256, 256, WS(cluster=2, block_n=64, stages=2)),  # x multicast to 2 CTAs
    (129, 256, 320, WS(wgs=2, cluster=2, block_n=64, stages=2, split_k=2)),  # 320 = 2.5 CTA stripes
    (65, 128, 256, WS(wgs=2, block_n=128, stages=2, epilogue="yT")),
]


@pytest.mark.parametrize("M,K,N,cfg", CASES)
def test_plain_pipeline_matches_reference(M, K, N, cfg):
    _check(M, K, N, cfg)


@pytest.mark.parametrize("M,K,N,cfg", WS_CASES)
def test_warp_specialized_matches_reference(M, K, N, cfg):
    _check(M, K, N, cfg, seed=1)


def test_leading_dims_and_triton_fallback():
    x, w = _inputs(18, 256, 128, seed=2)
    out = sg.skinny_gemm(x.reshape(2, 9, 256), w, interpret=True)
    assert out.shape == (2, 9, 128)
    assert _rel(out.reshape(18, 128), sg.skinny_gemm_reference(x, w)) < 2e-3
    tri = sg.skinny_gemm(x, w, C(backend="triton", triton=(("block_n", 64), ("block_k", 64))), interpret=True)
    assert tri.dtype == jnp.bfloat16 and _rel(tri, sg.skinny_gemm_reference(x, w)) < 2e-3


def test_rejects_what_it_cannot_do():
    x, w = _inputs(17, 64, 100)
    with pytest.raises(ValueError, match="unsupported shape"):  # N % 16 != 0
        sg.skinny_gemm(x, w, interpret=True)
    x, w = _inputs(17, 64, 128)
    with pytest.raises(ValueError, match="bf16"):
        sg.skinny_gemm(x.astype(jnp.float32), w, interpret=True)
    x2, w2 = _inputs(17, 4096, 256)
    with pytest.raises(ValueError, match="SMEM"):  # 12 stages of a 64 x 256 w tile
        sg.skinny_gemm(x2, w2, C(block_n=256, stages=12), interpret=True)
    with pytest.raises(ValueError, match="warp_specialized"):
        sg.skinny_gemm(x, w, C(cluster=2), interpret=True)
    assert sg.supports(17, 5120, 16480) and not sg.supports(513, 5120, 16480) and not sg.supports(17, 5124, 64)


def test_default_config_sane():
    for M in (17, 33, 65, 129, 257):
        for K, N in _bench().SHAPES_27B.values():
            c = sg.default_config(M, K, N)
            assert c.block_n % 64 == 0 and c.block_k % 16 == 0 and c.stages >= 2 and c.split_k >= 1
            assert sg.smem_bytes(M, c, 4 if c.split_k > 1 else 2) <= sg.SMEM_BYTES
            chunks, Mc = sg._rows(M)
            assert Mc <= 256 and c.block_n * chunks * Mc <= sg._ACC_ELEMS or c.block_n == 64


@pytest.mark.parametrize("M", [17, 65, 129, 257])
def test_lowers_for_h200_at_27b_shapes(M):
    """Every 27B weight shape with the default config (Mosaic GPU custom call; SMEM, TMA and layout checks)."""
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for name, (K, N) in _bench().SHAPES_27B.items():
        txt = lower_for_h200(sg.skinny_gemm, S((M, K), bf), S((K, N), bf))
        assert "mosaic_gpu" in txt, (name, M)


@pytest.mark.parametrize("M,name", [(65, "gdn_in_proj"), (129, "mlp_down")])
def test_lowers_for_h200_sweep_variants(M, name):
    """One config of each kind bench_skinny.py sweeps (plain / warp-specialized, wgs, cluster multicast, split-K,
    block_k) lowers: the GDN in-projection has N % 64 != 0 (64 B swizzle), the MLP down projection splits K."""
    b = _bench()
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    K, N = b.SHAPES_27B[name]
    kinds = {}
    for vname, cfg in b.variants_for(M, K, N).items():
        if cfg is not None and cfg.backend == "mosaic":
            kinds.setdefault((cfg.warp_specialized, cfg.wgs, cfg.cluster, cfg.split_k > 1, cfg.block_k,
                              cfg.epilogue), cfg)
    assert len(kinds) >= 4
    for cfg in kinds.values():
        txt = lower_for_h200(functools.partial(sg.skinny_gemm, config=cfg), S((M, K), bf), S((K, N), bf))
        assert "mosaic_gpu" in txt, (name, M, cfg)


def test_lowers_odd_shapes():
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    for M, K, N, cfg in CASES + WS_CASES:
        txt = lower_for_h200(functools.partial(sg.skinny_gemm, config=cfg), S((M, K), bf), S((K, N), bf))
        assert "mosaic_gpu" in txt, (M, K, N, cfg)
