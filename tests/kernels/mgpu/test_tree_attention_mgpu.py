"""Mosaic GPU tree attention (kernels_pallas.tree_attention_mgpu) vs the jnp reference on the Mosaic GPU
interpreter (CPU), and its CUDA lowering for an abstract H200 at the 27B shapes (SMEM / layout errors)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import tree_attention_mgpu as tm
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, attention_inputs, check_attention


@pytest.fixture(autouse=True)
def _reset_interpreter():
    """The interpreter keeps global state that an exception leaves behind (its docstring)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    gpu_callbacks.reset_gpu_interpret_mode_state()
    yield


def test_signature_matches_reference():
    assert_kernel_signature(tm.tree_attention, tm.tree_attention_reference)


def _per_row(out, args):
    """check_attention per batch row (the reference takes one scalar start)."""
    q, kc, vc, starts, kn, vn, mask = args
    for b in range(q.shape[0]):
        one = (q[b:b + 1], kc[b:b + 1], vc[b:b + 1], starts[b], kn[b:b + 1], vn[b:b + 1], mask[b:b + 1])
        check_attention(out[b:b + 1], tm.tree_attention_reference, one)


def test_per_batch_start_full_cache_and_empty_prefix():
    """start [B] = (S, 0): row 0 attends to its whole cache (100 = 64 + 36: the partial block's window is
    clamped inside the cache, its first 28 keys masked), row 1 to its tree only; 10 query rows (the second
    compute warpgroup idles), 1 split: row 0's 3 steps wrap the 2-stage ring."""
    B, T, H, Hkv, hd, S = 2, 5, 2, 1, 64, 100
    q, kc, vc, _, kn, vn, mask = attention_inputs(jax.random.PRNGKey(1), np.random.default_rng(1), B, T, H, Hkv,
                                                  hd, S, 0, n_pad=2)
    args = (q, kc, vc, jnp.array([S, 0], jnp.int32), kn, vn, mask)
    _per_row(tm.tree_attention(*args, interpret=True, n_split=1), args)


def test_two_row_blocks_tail_split_no_reads_past_start_no_races():
    """T = 40, G = 4: 160 rows = a full row block + a light one (its second warpgroup idle), 2 tree blocks of 64
    keys; prefix 70 over 3 splits for the full block, 1 split (3 steps: the ring wraps) for the light one; no
    ping-pong. Cache rows from 128 on (past the block holding row start - 1) are NaN: the output stays finite
    and right, so no later block is read. The interpreter's race detector sees every SMEM slot released (its
    barrier) before the TMA refills it."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mi
    from jax.experimental.pallas import mosaic_gpu as plgpu
    B, T, H, Hkv, hd, S, start = 1, 40, 4, 1, 64, 256, 70
    args = attention_inputs(jax.random.PRNGKey(2), np.random.default_rng(2), B, T, H, Hkv, hd, S, start, n_pad=3)
    q, kc, vc, st, kn, vn, mask = args
    ok = (jnp.arange(S) < 128)[None, None, :, None]
    cfg = tm.plan(T, H, Hkv, hd, S, T, n_split=3, tail_split=1)
    assert (cfg["n_main_rb"], cfg["n_ctas"]) == (1, 4)
    out = tm.tree_attention(q, jnp.where(ok, kc, jnp.nan), jnp.where(ok, vc, jnp.nan), st, kn, vn, mask,
                            interpret=plgpu.InterpretGPUParams(detect_races=True), n_split=3, tail_split=1,
                            pingpong=False)
    assert not mi.get_races().races_found
    check_attention(out, tm.tree_attention_reference, args)


def test_128_key_blocks_3_stages_empty_split():
    """block_k 128 x 3 stages (head dim 64), start 200 = a whole block + a partial one, 4 splits for 3 units
    (split 2 empty: it writes lse = -inf)."""
    args = attention_inputs(jax.random.PRNGKey(3), np.random.default_rng(3), 1, 16, 4, 1, 64, 400, 200, n_pad=2)
    out = tm.tree_attention(*args, interpret=True, block_k=128, num_stages=3, n_split=4)
    check_attention(out, tm.tree_attention_reference, args)


def test_refuses_what_it_cannot_take():
    Sd = jax.ShapeDtypeStruct

    def structs(dtype, hd, H=4, hkv=2):
        return [Sd((1, 4, H, hd), dtype), Sd((1, hkv, 64, hd), dtype), Sd((1, hkv, 64, hd), dtype), Sd((), jnp.int32),
                Sd((1, 4, hkv, hd), dtype), Sd((1, 4, hkv, hd), dtype), Sd((1, 4, 4), jnp.bool_)]

    f32 = structs(jnp.float32, 64)
    assert not tm.supports(f32[0], f32[1])
    with pytest.raises(ValueError, match="bf16 or fp16 only"):
        jax.eval_shape(tm.tree_attention, *f32)
    with pytest.raises(ValueError, match="head dim 48"):
        jax.eval_shape(tm.tree_attention, *structs(jnp.bfloat16, 48))
    good = structs(jnp.bfloat16, 256, 24, 4)
    assert tm.supports(good[0], good[1])
    jax.eval_shape(tm.tree_attention, *good)
    with pytest.raises(ValueError, match="shared memory"):
        jax.eval_shape(functools.partial(tm.tree_attention, num_stages=3), *good)


def _structs(T, S, B=1, per_batch=False):
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    return [Sd((B, T, 24, 256), bf), Sd((B, 4, S, 256), bf), Sd((B, 4, S, 256), bf),
            Sd((B,) if per_batch else (), jnp.int32), Sd((B, T, 4, 256), bf), Sd((B, T, 4, 256), bf),
            Sd((B, T, T), jnp.bool_)]


@pytest.mark.parametrize("T,S,kw", [
    (65, 131072 + 128, {}), (128, 131072 + 128, {}), (16, 4096 + 64, {}), (32, 32768 + 64, {}),
    (64, 4096 + 64, dict(n_split=16, pingpong=False)), (65, 4096 + 64, dict(num_stages=1)),
])
def test_lowers_for_h200_at_27b_shapes(T, S, kw):
    cfg = tm.plan(T, 24, 4, 256, S, T, block_k=kw.get("block_k", 64), num_stages=kw.get("num_stages", 2))
    assert cfg["smem"] <= tm.SMEM_LIMIT
    txt = lower_for_h200(functools.partial(tm.tree_attention, **kw), *_structs(T, S))
    assert "mosaic_gpu" in txt


def test_lowers_for_h200_batched_per_batch_start():
    assert "mosaic_gpu" in lower_for_h200(tm.tree_attention, *_structs(65, 8192, B=2, per_batch=True))


def test_lowering_catches_shared_memory_overflow(monkeypatch):
    """The abstract lowering is what catches tiles past the H200's shared memory (3 stages of 64 x 256 K and V
    tiles): with the kernel's own check lifted, Mosaic GPU refuses the kernel."""
    monkeypatch.setattr(tm, "SMEM_LIMIT", 1 << 30)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower_for_h200(functools.partial(tm.tree_attention, num_stages=3), *_structs(65, 8192))


def test_dispatch_variant(monkeypatch):
    """ops: the benchmark variant "pallas:mgpu_attention" routes bf16 tree / prefill attention to the Mosaic GPU
    kernels and everything they do not take (fp32) to the Triton ones; "pallas" never reaches them."""
    from kernels_pallas import ops, prefill_attention as pa, prefill_attention_mgpu as pm, tree_attention as ta
    calls = []

    def rec(name):
        return lambda *a, **k: calls.append(name) or jnp.zeros_like(a[0])
    for mod, name in ((tm, "mgpu"), (ta, "triton")):
        monkeypatch.setattr(mod, "tree_attention", rec(name))
    monkeypatch.setattr(pm, "prefill_attention", rec("mgpu_prefill"))
    monkeypatch.setattr(pa, "prefill_attention", rec("triton_prefill"))
    for dt in (jnp.bfloat16, jnp.float32):
        q = jnp.ones((1, 3, 4, 64), dt)
        kc = jnp.ones((1, 2, 16, 64), dt)
        kn = jnp.ones((1, 3, 2, 64), dt)
        mask = jnp.ones((1, 3, 3), bool)
        for kernels in ("pallas:mgpu_attention", "pallas"):
            ops.tree_attention(q, kc, kc, jnp.int32(4), kn, kn, mask, kernels)
            ops.prefill_attention(q, kc, kc, jnp.int32(4), kn, kn, kernels)
    assert calls == ["mgpu", "mgpu_prefill", "triton", "triton_prefill"] + ["triton", "triton_prefill"] * 2
    assert ops.is_pallas("pallas:mgpu_attention") and not ops.is_pallas("xla")
