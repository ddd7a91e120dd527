"""The W8A8 projection on fp8 wgmma (kernels_pallas.w8a8_mgpu) vs its jnp reference (`w8a8.w8a8_reference`) on
the Mosaic GPU interpreter (CPU, fresh random inputs: partial input blocks, 1 / 7 / 16 / 65 / 129 rows, split-K,
several row tiles), and its CUDA lowering for an abstract H200 at the 27B shapes with the configs it picks (shared
memory within the limit)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import w8a8 as k
from kernels_pallas import w8a8_mgpu as km
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature


def _inputs(M, K, N, block_out=128, seed=0, dtype=jnp.bfloat16):
    """x with a few outlier features (never zeros), fp8 w [N, K] over the whole e4m3 range, scales [N blocks, K
    blocks] padded as the model stores them."""
    kx, kw, ks, ko = jax.random.split(jax.random.PRNGKey(seed * 1000 + M * 7 + K + N), 4)
    x = jax.random.normal(kx, (M, K), jnp.float32) + 0.1
    x = x * jnp.where(jax.random.uniform(ko, (1, K)) < 0.02, 30.0, 1.0)
    w = jnp.clip(jax.random.normal(kw, (N, K), jnp.float32) * 120, -448, 448).astype(k.FP8)
    s = jax.random.uniform(ks, (-(-N // block_out), -(-K // 128)), jnp.float32, 0.5, 2.0) / (120 * K ** 0.5)
    return x.astype(dtype), w, km.pad_scale(s)


def test_signature_matches_reference():
    assert_kernel_signature(km.w8a8_mgpu, k.w8a8_reference)


# the interpreter's wgmma is an exact fp32 dot and the promotion is the reference's product order: only the
# split-K partials' sum order differs, so the bf16 outputs are equal or 1 ulp apart
CASES = [  # M, K, N, block_out, config
    (1, 384, 128, 128, km.Config(block_n=128, split_k=1, num_stages=2)),  # decode: one row, the ring wraps
    (7, 304, 128, 128, km.Config(block_n=64, split_k=1, num_stages=2)),  # a partial input block (K tail)
    (16, 512, 192, 64, km.Config(block_n=64, split_k=2, num_stages=2)),  # split-K, three 64-row weight tiles
    (65, 256, 128, 128, km.Config(block_n=64, split_k=1, num_stages=3)),  # verify: 65 rows -> n = 72
    (129, 256, 64, 64, km.Config(block_n=64, split_k=2, num_stages=2)),  # 129 rows -> n = 136, split-K
    (300, 256, 64, 128, km.Config(block_n=64, split_k=1, num_stages=2, row_tile=128)),  # 3 row tiles, last partial
    (5, 784, 128, 128, km.Config(block_n=128, num_stages=2, k_per_step=3)),  # 3 blocks per step, a K tail, ring wraps
    (65, 1024, 128, 64, km.Config(block_n=64, split_k=2, num_stages=2, k_per_step=2)),  # 2 per step, split-K
]


@pytest.mark.parametrize("M,K,N,bo,cfg", CASES)
def test_kernel_matches_reference(M, K, N, bo, cfg):
    x, w, s = _inputs(M, K, N, bo, seed=1)
    ref = np.asarray(k.w8a8_reference(x, w, s, block_in=128, block_out=bo), np.float32)
    out = km.w8a8_mgpu(x, w, s, block_out=bo, config=cfg, interpret=True)
    assert out.shape == (M, N) and out.dtype == jnp.bfloat16
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    differ = np.mean(out != ref)
    if km.plan(M, K, N, bo, cfg)["split_k"] == 1:
        assert differ == 0, differ  # the same fp32 sums in the same order
    else:
        assert differ < 0.01, differ
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-3


def test_fp32_activations_and_leading_axes():
    x, w, s = _inputs(6, 256, 128, seed=2, dtype=jnp.float32)
    out = km.w8a8_mgpu(x.reshape(2, 3, 256), w, s, config=km.Config(block_n=64, num_stages=2), interpret=True)
    assert out.shape == (2, 3, 128) and out.dtype == jnp.float32
    ref = k.w8a8_reference(x, w, s, block_in=128, block_out=128)
    # fp32 output: the in-block dots' fp32 summation order shows in the last bits
    np.testing.assert_allclose(np.asarray(out).reshape(6, 128), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("M,K,N,bo,cfg", [CASES[1], CASES[2]])
def test_layer_reads_the_stack(M, K, N, bo, cfg):
    """layer=l (a scan over stacked layers: the kernel reads layer l of w [L, N, K] / scale [L, Nb, C] in place)
    == the kernel on the slices w[l], scale[l], bit for bit (a K tail; split-K over three weight tiles)."""
    ws, ss = zip(*(_inputs(1, K, N, bo, seed=10 + l)[1:] for l in range(3)))
    w, s = jnp.stack(ws), jnp.stack(ss)
    x = _inputs(M, K, N, bo, seed=3)[0]
    f = functools.partial(km.w8a8_mgpu, block_out=bo, config=cfg, interpret=True)
    for l in (0, 2):
        np.testing.assert_array_equal(np.asarray(f(x, w, s, layer=jnp.int32(l)), np.float32),
                                      np.asarray(f(x, w[l], s[l]), np.float32))
    assert km.pad_scale(s) is s  # the model's padded scale stack: read as it is, no copy


def test_refuses_what_it_cannot_take():
    assert km.supports(1, 5120, 5120, 128, 128) is None
    assert "input block" in km.supports(1, 5120, 5120, 64, 128)
    assert "output block" in km.supports(1, 5120, 5120, 128, 24)
    assert "N = 5100" in km.supports(1, 5120, 5100, 128, 128)
    assert "K = 5000" in km.supports(1, 5000, 5120, 128, 128)
    x, w, s = _inputs(1, 256, 128)
    with pytest.raises(ValueError, match="block_n 128 must"):
        jax.eval_shape(functools.partial(km.w8a8_mgpu, block_out=64, config=km.Config(block_n=128)), x, w,
                       km.pad_scale(jnp.ones((2, 2))))


SHAPES_27B = {"w_in": (5120, 16384), "w_out|wo": (6144, 5120), "w_gate_up": (5120, 34816),
              "w_down": (17408, 5120), "attn_w_qkv": (5120, 14336)}


def test_lowers_for_h200_at_27b_shapes():
    """Every 27B projection at decode / chain / verify / prefill row counts lowers for CUDA (an abstract H200),
    with a default config whose shared memory fits (Mosaic's lowering does not check it)."""
    S = jax.ShapeDtypeStruct
    for M in (1, 16, 65, 129, 2048):
        for name, (K, N) in SHAPES_27B.items():
            p = km.plan(M, K, N)
            assert p["smem"] <= km.SMEM_LIMIT, (name, M, p)
            txt = lower_for_h200(km.w8a8_mgpu, S((M, K), jnp.bfloat16), S((N, K), k.FP8),
                                 S((N // 128, km.scale_cols(K // 128)), jnp.float32))
            assert "mosaic_gpu" in txt, (name, M)


def test_layer_lowers_for_h200_without_a_slice():
    """With layer the custom call takes the whole stacks (no dynamic slice, which XLA would copy) at a 27B shape,
    decode and verify rows."""
    S = jax.ShapeDtypeStruct
    K, N = SHAPES_27B["w_down"]
    C = km.scale_cols(K // 128)
    for M in (1, 65):
        txt = lower_for_h200(lambda x, w, s, l: km.w8a8_mgpu(x, w, s, layer=l), S((M, K), jnp.bfloat16),
                             S((16, N, K), k.FP8), S((16, N // 128, C), jnp.float32), S((), jnp.int32))
        assert "mosaic_gpu" in txt and f"tensor<16x{N}x{K}xf8E4M3FN>" in txt and "dynamic_slice" not in txt, M


def test_config_table_entries_fit():
    """The sweep's table (kernels_pallas/w8a8_mgpu_configs.json) holds configs the kernel takes at their shapes."""
    for key, c in km.CONFIGS.items():
        Mc, K, N = (int(v[1:] if v[0] != "M" else v[2:]) for v in key.split(":"))
        assert isinstance(c, km.Config) and N % c.block_n == 0 and 128 % c.block_n == 0, key
        assert km.smem_bytes(Mc, c, km.scale_cols(-(-K // 128)), 4) <= km.SMEM_LIMIT, key
