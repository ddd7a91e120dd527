"""Every Pallas kernel picks tiles that fit the H200's shared memory (232448 bytes per program) for the dtype it
gets, at Qwen3.6-27B widths, in fp32 and bf16: the estimate each kernel uses to choose its tiles is <= the limit,
and (where the `triton` package is installed) Triton's own allocation for the lowered kernel is <= that estimate.
Before these choices, fp32 at 27B widths asked for 295424 bytes (the flash-attention kernels) and failed to launch.
Also: the shrunken tiles compute the same function (interpret mode, fp32), and a call whose kernel has no fitting
tile runs the jnp reference with one log line."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import (_common, attention_decode, dense, gdn_decode_fused, gdn_prefill, gdn_tree, ops,
                            prefill_attention, tree_attention)
from kernels_pallas._testing import attention_inputs, check_attention, gdn_inputs, rel_err

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
LIMIT = 232448
# Qwen3.6-27B widths (benchmarks/bench.py QWEN36_27B) and the DFlash drafter's attention
H, HKV, HD, S = 24, 4, 256, 4096 + 64
HK, HV, DK, DV = 16, 48, 128, 128
D, F, V = 5120, 17408, 248320
CD = 2 * HK * DK + HV * DV
DTYPES = [f32, bf16]
Sd = jax.ShapeDtypeStruct


def _attn_structs(T, h, hkv, hd, dt, mask=True):
    s = [Sd((1, T, h, hd), dt), Sd((1, hkv, S, hd), dt), Sd((1, hkv, S, hd), dt), Sd((), i32),
         Sd((1, T, hkv, hd), dt), Sd((1, T, hkv, hd), dt)]
    return s + [Sd((1, T, T), jnp.bool_)] if mask else s


def _gdn_structs(N, tree):
    s = [Sd((1, N, HK, DK), f32), Sd((1, N, HK, DK), f32), Sd((1, N, HV, DV), f32), Sd((1, N, HV), f32),
         Sd((1, N, HV), f32)]
    return s + ([Sd((1, N, N), jnp.bool_)] if tree else []) + [Sd((1, HV, DK, DV), f32)]


def cases(dt):
    """(name, estimate of the config the kernel picks, kernel fn, its input structs) at 27B widths."""
    out = []
    for T, h, hkv, hd in ((1, H, HKV, HD), (16, 32, 8, 128), (65, H, HKV, HD), (257, H, HKV, HD)):
        est = tree_attention.plan(T, h, hkv, hd, S, dt)["smem"]
        out.append((f"tree_attention T={T}", est, tree_attention.tree_attention, _attn_structs(T, h, hkv, hd, dt)))
    for T in (16, 1000, 2048):
        est = prefill_attention.plan(T, H, HKV, HD, S, dt)["smem"]
        out.append((f"prefill_attention T={T}", est, prefill_attention.prefill_attention,
                    _attn_structs(T, H, HKV, HD, dt, mask=False)))
    for M, K, N in ((1, D, 14336), (1, F, D), (1, D, V), (65, D, 14336), (129, D, 14336)):
        est = dense.fit_config(dense.default_config(M, K, N), M, K, dt, dt)["smem"]
        out.append((f"dense M={M} K={K} N={N}", est, dense.dense, [Sd((M, K), dt), Sd((K, N), dt)]))
    est = dense.fit_config(dense.default_config(1, D, 14336), 1, D, dt, dt)["smem"]
    out.append(("dense residual", est, lambda x, w, r: dense.dense(x, w, residual=r),
                [Sd((1, D), dt), Sd((D, 14336), dt), Sd((1, 14336), dt)]))
    est = gdn_decode_fused.smem_bytes(DV, 4)
    fn = functools.partial(gdn_decode_fused.gdn_decode_fused, num_k_heads=HK, num_v_heads=HV, head_k_dim=DK,
                           head_v_dim=DV, conv_kernel=4, eps=1e-6)
    out.append(("gdn_decode_fused", est, fn, [Sd((1, CD + HV * DV + 2 * HV), dt), Sd((1, 3, CD), dt), Sd((4, CD), dt),
                                              Sd((HV,), dt), Sd((HV,), dt), Sd((DV,), dt), Sd((1, HV, DK, DV), f32)]))
    for T in (16, 1000):  # every dtype runs in fp32 inside: the same plan
        est = gdn_prefill.plan(min(64, max(16, 1 << (min(64, T) - 1).bit_length())), DK, DV)["smem"]
        out.append((f"gdn_prefill T={T}", est, gdn_prefill.gdn_chunked, _gdn_structs(T, False)))
    for N in (17, 65, 257):
        out.append((f"gdn_tree N={N}", gdn_tree.plan(N, DK, DV)["smem"], gdn_tree.gdn_masked_block, _gdn_structs(N, True)))
    fn = functools.partial(attention_decode.decode_attention_prep, num_heads=H, num_kv_heads=HKV, head_dim=HD, eps=1e-6)
    out.append(("attention_decode", attention_decode.smem_bytes(4), fn,
                [Sd((1, (2 * H + 2 * HKV) * HD), dt), Sd((HD,), dt), Sd((HD,), dt), Sd((1, 64), dt), Sd((1, 64), dt),
                 Sd((1, HKV, S, HD), dt), Sd((1, HKV, S, HD), dt), Sd((), i32)]))
    return out


@pytest.mark.parametrize("dt", DTYPES, ids=["fp32", "bf16"])
def test_chosen_tiles_fit_at_27b_widths(dt):
    over = [(name, est) for name, est, _, _ in cases(dt) if not 0 < est <= LIMIT]
    assert not over, over


def test_fp32_defaults_explain_the_h200_error():
    """The 128 x 64 fp32 flash tiles at hd 256 are the H200's "requested 295424, available: 232448"; fp32 now
    shrinks the key block, bf16 keeps the tuned defaults."""
    assert prefill_attention.plan(16, H, HKV, HD, S, f32, limit=10 ** 9)["smem"] == 295424
    assert _common.SMEM_LIMIT == LIMIT
    assert prefill_attention.plan(16, H, HKV, HD, S, f32)["block_k"] < 64
    assert tree_attention.plan(65, H, HKV, HD, S, bf16)["block_m"] == 128
    assert tree_attention.plan(65, H, HKV, HD, S, bf16)["block_k"] == 64
    assert prefill_attention.plan(1000, H, HKV, HD, S, bf16)["block_k"] == 64
    assert dense.fit_config(dense.default_config(1, D, V), 1, D, bf16, bf16)["num_stages"] == 3


@pytest.mark.parametrize("dt", DTYPES, ids=["fp32", "bf16"])
def test_triton_allocation_within_estimate(dt):
    """Triton's own shared-memory allocation (the installed `triton` package's passes on the lowered kernels): <=
    each kernel's estimate, so the estimate is an upper bound, and <= the H200's limit."""
    pytest.importorskip("triton")
    from kernels_pallas._testing import triton_shared_bytes
    bad = []
    for name, est, fn, structs in cases(dt):
        got = triton_shared_bytes(fn, *structs)
        assert got, name
        for kname, b in got:
            if b > est or b > LIMIT:
                bad.append((name, kname, b, est))
    assert not bad, bad


def test_shrunken_tiles_match_reference_fp32():
    """Interpret mode, fp32: a shared-memory limit small enough to force smaller blocks; same results."""
    args = attention_inputs(jax.random.PRNGKey(1), np.random.default_rng(1), 1, 11, 4, 2, 16, 100, 37, dtype=f32,
                            n_pad=2)
    small = 20000
    default = tree_attention.plan(11, 4, 2, 16, 100, f32)
    shrunk = tree_attention.plan(11, 4, 2, 16, 100, f32, limit=small)
    assert (shrunk["block_m"], shrunk["block_k"]) != (default["block_m"], default["block_k"])
    assert shrunk["smem"] <= small
    check_attention(tree_attention.tree_attention(*args, interpret=True, smem_limit=small),
                    tree_attention.tree_attention_reference, args)
    pargs = attention_inputs(jax.random.PRNGKey(2), None, 1, 40, 4, 2, 16, 96, 30, dtype=f32)[:6]
    assert prefill_attention.plan(40, 4, 2, 16, 96, f32, limit=small)["block_k"] < 64
    out = prefill_attention.prefill_attention(*pargs, interpret=True, smem_limit=small)
    assert rel_err(out, prefill_attention.prefill_attention_reference(*pargs)) < 1e-5
    x = jax.random.normal(jax.random.PRNGKey(3), (3, 256), f32)
    w = jax.random.normal(jax.random.PRNGKey(4), (256, 96), f32)
    lim = 40000
    cfg = dense.fit_config(dense.default_config(3, 256, 96), 3, 256, f32, f32, limit=lim)
    assert cfg["smem"] <= lim and cfg["block_k"] < dense.default_config(3, 256, 96)["block_k"]
    assert rel_err(dense.dense(x, w, interpret=True, smem_limit=lim), x @ w) < 1e-5
    q, k, v, g, beta, st = gdn_inputs(jax.random.PRNGKey(5), 1, 40, 2, 4, 32, 64)
    cfg = gdn_prefill.plan(64, 32, 64, limit=70000)
    assert cfg["block_v"] < 64 and cfg["smem"] <= 70000
    o, s1 = gdn_prefill.gdn_chunked(q, k, v, g, beta, st, interpret=True, smem_limit=70000)
    ro, rs = gdn_prefill.gdn_chunked_reference(q, k, v, g, beta, st)
    assert rel_err(o, ro) < 1e-5 and rel_err(s1, rs) < 1e-5


def test_no_fitting_tile_falls_back_with_one_line(monkeypatch, caplog):
    """ops: a kernel with no tile under the limit -> the jnp reference, one plain log line per process and kernel."""
    monkeypatch.setattr(_common, "SMEM_LIMIT", 64)
    monkeypatch.setattr(_common, "_NOTED", set())
    args = attention_inputs(jax.random.PRNGKey(7), np.random.default_rng(7), 1, 7, 4, 2, 16, 48, 20, dtype=f32)
    with pytest.raises(_common.SharedMemoryError):
        tree_attention.plan(7, 4, 2, 16, 48, f32)
    with caplog.at_level(logging.WARNING, logger="kernels_pallas"):
        out = jax.jit(lambda *a: ops.tree_attention(*a, kernels="pallas"))(*args)
        out2 = ops.tree_attention(*args, kernels="pallas")
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(tree_attention.tree_attention_reference(*args)))
    assert rel_err(out, tree_attention.tree_attention_reference(*args)) < 1e-6
    recs = [r for r in caplog.records if r.name == "kernels_pallas"]
    assert len(recs) == 1, [r.getMessage() for r in recs]
    msg = recs[0].getMessage()
    assert "\n" not in msg and "tree_attention" in msg and "xla" in msg, msg
