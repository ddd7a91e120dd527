"""Mosaic GPU tree attention (kernels_pallas.tree_attention_mgpu) vs the jnp reference on the Mosaic GPU
interpreter (CPU), and its CUDA lowering for an abstract H200 at the 27B shapes (SMEM / layout errors)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import tree_attention_mgpu as tm
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, attention_inputs, check_attention, stack_layers


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


@pytest.mark.parametrize("hopper", [True, False])
def test_dispatch(monkeypatch, hopper):
    """ops on a Hopper GPU: "pallas" (and its decode-fusion variants) route bf16 tree and prefill attention of
    >= MGPU_MIN_ROWS rows, or over a cache of >= MGPU_MIN_CACHE rows, to the Mosaic GPU kernels; fewer rows over a
    smaller cache (a decode step at 4K), and what they do not take (fp32), run on the Triton ones. Elsewhere (a CPU:
    interpret mode; other GPUs) everything runs on the Triton kernels."""
    from kernels_pallas import ops, prefill_attention as pa, prefill_attention_mgpu as pm, tree_attention as ta
    calls = []
    monkeypatch.setattr(ops, "_hopper", lambda: hopper)

    def rec(name):
        return lambda *a, **k: calls.append(name) or jnp.zeros_like(a[0])
    for mod, name in ((tm, "mgpu"), (ta, "triton")):
        monkeypatch.setattr(mod, "tree_attention", rec(name))
    monkeypatch.setattr(pm, "prefill_attention", rec("mgpu_prefill"))
    monkeypatch.setattr(pa, "prefill_attention", rec("triton_prefill"))
    big, few = ops.MGPU_MIN_CACHE, ops.MGPU_MIN_ROWS - 1
    for dt in (jnp.bfloat16, jnp.float32):
        for T, S in ((ops.MGPU_MIN_ROWS, 16), (few, big), (few, big - 1)):
            q = jnp.ones((1, T, 4, 64), dt)
            kc = jax.ShapeDtypeStruct((1, 2, S, 64), dt)
            kn = jnp.ones((1, T, 2, 64), dt)
            mask = jnp.ones((1, T, T), bool)
            for kernels in ("pallas:unfused", "pallas"):
                ops.tree_attention(q, kc, kc, jnp.int32(4), kn, kn, mask, kernels)
                ops.prefill_attention(q, kc, kc, jnp.int32(4), kn, kn, kernels)
    mg = ["mgpu", "mgpu_prefill"] * 2 if hopper else ["triton", "triton_prefill"] * 2
    tri = ["triton", "triton_prefill"] * 2
    assert calls == mg + mg + tri + tri * 3


def test_dispatch_with_layer(monkeypatch):
    """ops with stacked caches [L, B, Hkv, S, hd] and layer=: the routing reads the per-layer cache size S (not L's
    shape), and the layer reaches the kernel; the xla path reads the layer."""
    from kernels_pallas import ops, prefill_attention as pa, prefill_attention_mgpu as pm, tree_attention as ta
    calls = []
    monkeypatch.setattr(ops, "_hopper", lambda: True)

    def rec(name):
        return lambda *a, **k: calls.append((name, k["layer"])) or jnp.zeros_like(a[0])
    for mod, name in ((tm, "mgpu"), (ta, "triton")):
        monkeypatch.setattr(mod, "tree_attention", rec(name))
    monkeypatch.setattr(pm, "prefill_attention", rec("mgpu_prefill"))
    monkeypatch.setattr(pa, "prefill_attention", rec("triton_prefill"))
    T, L = ops.MGPU_MIN_ROWS - 1, 3
    q = jnp.ones((1, T, 4, 64), jnp.bfloat16)
    kn = jnp.ones((1, T, 2, 64), jnp.bfloat16)
    mask = jnp.ones((1, T, T), bool)
    for S in (ops.MGPU_MIN_CACHE, ops.MGPU_MIN_CACHE - 1):
        kc = jax.ShapeDtypeStruct((L, 1, 2, S, 64), jnp.bfloat16)
        ops.tree_attention(q, kc, kc, jnp.int32(4), kn, kn, mask, "pallas", layer=2)
        ops.prefill_attention(q, kc, kc, jnp.int32(4), kn, kn, "pallas", layer=2)
    assert calls == [("mgpu", 2), ("mgpu_prefill", 2), ("triton", 2), ("triton_prefill", 2)]
    args = attention_inputs(jax.random.PRNGKey(4), np.random.default_rng(4), 1, 3, 2, 1, 64, 16, 9, n_pad=1)
    kcs, vcs = (stack_layers(jax.random.PRNGKey(5 + i), args[1 + i], L, 1) for i in range(2))
    np.testing.assert_array_equal(ops.tree_attention(args[0], kcs, vcs, *args[3:], layer=1),
                                  tm.tree_attention_reference(*args))
    np.testing.assert_array_equal(ops.prefill_attention(args[0], kcs, vcs, *args[3:6], layer=1),
                                  pa.prefill_attention_reference(*args[:6]))


def test_hopper_is_the_lowering_target():
    from kernels_pallas import ops
    from kernels_pallas._common import abstract_h200
    assert not ops._hopper()  # this CPU
    with abstract_h200():
        assert ops._hopper()


def test_vmap_folds_into_the_batch_axis(monkeypatch):
    """Under jax.vmap (the pool's batched round: a start per slot, caches batched, the new rows' mask shared) the
    kernel runs once over the V·B folded batch rows, nested vmaps included, and each slot's output is its
    reference's."""
    V, B, T, H, Hkv, hd, S = 3, 2, 5, 4, 2, 64, 96
    ks = jax.random.split(jax.random.PRNGKey(5), 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (V, B, T, H, hd), bf)
    kc, vc = (jax.random.normal(k, (V, B, Hkv, S, hd), bf) for k in ks[1:3])
    kn, vn = (jax.random.normal(k, (B, T, Hkv, hd), bf) for k in ks[3:5])
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    starts = jnp.array([[7, 90], [0, 64], [65, 33]], jnp.int32)  # [V, B]
    calls = []
    real = tm._attention
    monkeypatch.setattr(tm, "_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    axes = (0, 0, 0, 0, None, None, None)
    out = jax.vmap(functools.partial(tm.tree_attention, interpret=True), in_axes=axes)(q, kc, vc, starts, kn, vn,
                                                                                        mask)
    assert calls[-1] == (V * B, T, H, hd)  # (custom_vmap also traces the unbatched call for its output type)
    for v in range(V):
        for b in range(B):
            one = (q[v, b:b + 1], kc[v, b:b + 1], vc[v, b:b + 1], starts[v, b], kn[b:b + 1], vn[b:b + 1],
                   mask[b:b + 1])
            check_attention(out[v, b:b + 1], tm.tree_attention_reference, one)
    # nested: vmap over slots of a vmap over V, one scalar start per inner call
    calls.clear()
    inner = jax.vmap(functools.partial(tm.tree_attention, interpret=True), in_axes=(0, 0, 0, 0, None, None, None))
    out2 = jax.vmap(inner, in_axes=(1, 1, 1, 1, None, None, None), out_axes=1)(
        q[:, :, None], kc[:, :, None], vc[:, :, None], starts, kn[:1], vn[:1], mask[:1])
    assert calls[-1] == (V * B, T, H, hd)
    one = (q[2, 1:2], kc[2, 1:2], vc[2, 1:2], starts[2, 1], kn[:1], vn[:1], mask[:1])
    check_attention(out2[2, 1], tm.tree_attention_reference, one)


def test_lowers_for_h200_under_vmap():
    """The pool's 4-slot round at 27B shapes: one Mosaic GPU call over the 4 folded batch rows."""
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    V, T, S = 4, 32, 8192 + 64
    structs = [Sd((V,) + s.shape, s.dtype) for s in _structs(T, S)]
    structs[3] = Sd((V,), jnp.int32)
    txt = lower_for_h200(jax.vmap(tm.tree_attention), *structs)
    assert txt.count("custom_call @mosaic_gpu") == 1
    assert f"tensor<{V * 4}x" in txt  # the folded [V·B·Hkv, rows, hd] query operand


def test_a_kernel_lowered_in_two_programs_has_one_hash():
    """`mgpu_kernel_hash`: the same kernel at the same shapes lowered into two different programs carries one
    `kernel_hash` (jaxlib compiles it once per process; without the fix every lowering's dump-name counter made a
    new hash, so each program compiled its Mosaic GPU kernels again), and a different kernel another one."""
    import re
    from kernels_pallas import prefill_attention_mgpu
    from kernels_pallas._common import lower_for_h200
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    B, T, H, Hkv, hd, Sc = 1, 16, 8, 2, 64, 256
    args = (S((B, T, H, hd), bf), S((B, Hkv, Sc, hd), bf), S((B, Hkv, Sc, hd), bf), S((), jnp.int32),
            S((B, T, Hkv, hd), bf), S((B, T, Hkv, hd), bf), S((B, T, T), jnp.bool_))
    hashes = lambda txt: re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', txt)
    a = hashes(lower_for_h200(lambda *x: tm.tree_attention(*x), *args))
    b = hashes(lower_for_h200(lambda *x: tm.tree_attention(*x) * 2 + tm.tree_attention(*x), *args))
    c = hashes(lower_for_h200(lambda *x: prefill_attention_mgpu.prefill_attention(*x[:6]), *args))
    assert len(a) == 1 and b == a, (a, b)  # (two call sites in one program: one lowering)
    assert len(c) == 1 and c != a


def test_layer_reads_one_layer_of_the_stacked_caches():
    """layer=l on caches stacked over 3 layers, 2 batch rows with their own start (batch row b reads cache row
    l·B + b of the [L·B, ...] view): layer 2 bit for bit the kernel on the layer's caches, layer 0 its reference."""
    B, T, H, Hkv, hd, S, L = 2, 5, 2, 1, 64, 64, 3
    q, kc, vc, _, kn, vn, mask = attention_inputs(jax.random.PRNGKey(6), np.random.default_rng(6), B, T, H, Hkv, hd,
                                                  S, 0, n_pad=1)
    kcs, vcs = (stack_layers(jax.random.PRNGKey(7 + i), x, L, 2) for i, x in enumerate((kc, vc)))
    starts = jnp.array([40, S], jnp.int32)
    f = jax.jit(lambda kc, vc, l: tm.tree_attention(q, kc, vc, starts, kn, vn, mask, layer=l, interpret=True,
                                                    n_split=1))
    np.testing.assert_array_equal(f(kcs, vcs, jnp.int32(2)),
                                  tm.tree_attention(q, kc, vc, starts, kn, vn, mask, interpret=True, n_split=1))
    _per_row(f(kcs, vcs, jnp.int32(0)), (q, kcs[0], vcs[0], starts, kn, vn, mask))


def test_layer_under_vmap_folds_the_layer_rows(monkeypatch):
    """The batched round with stacked caches: jax.vmap over slots (q, caches [V, L, B, ...], start), the layer
    shared: one launch over the V·B folded batch rows and the [V·L·B, ...] view of the caches (no copy), slot v's
    batch row b reading row (v·L + layer)·B + b; shared (unbatched) caches are not broadcast. Each slot's output is
    its reference's."""
    V, L, B, T, H, Hkv, hd, S, layer = 2, 3, 2, 4, 2, 1, 64, 64, 1
    ks = jax.random.split(jax.random.PRNGKey(8), 5)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (V, B, T, H, hd), bf)
    kc, vc = (jax.random.normal(k, (V, L, B, Hkv, S, hd), bf) for k in ks[1:3])
    kn, vn = (jax.random.normal(k, (B, T, Hkv, hd), bf) for k in ks[3:5])
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    starts = jnp.array([[7, 64], [0, 33]], jnp.int32)  # [V, B]
    calls = []
    real = tm._attention
    monkeypatch.setattr(tm, "_attention", lambda *a, **k: calls.append((a[0].shape, a[1].shape, a[4])) or
                        real(*a, **k))
    f = lambda q, kc, vc, st, l: tm.tree_attention(q, kc, vc, st, kn, vn, mask, layer=l, interpret=True)
    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None)))(q, kc, vc, starts, jnp.int32(layer))
    assert calls[-1][:2] == ((V * B, T, H, hd), (V * L * B, Hkv, S, hd))
    for v in range(V):
        for b in range(B):
            one = (q[v, b:b + 1], kc[v, :, b:b + 1], vc[v, :, b:b + 1], starts[v, b], kn[b:b + 1], vn[b:b + 1],
                   mask[b:b + 1])
            check_attention(out[v, b:b + 1], functools.partial(tm.tree_attention_reference, layer=layer), one)
    # shared caches: the [L·B, ...] view as it is, every slot's batch row b at layer·B + b
    calls.clear()
    out = jax.vmap(f, in_axes=(0, None, None, 0, None))(q, kc[0], vc[0], starts, jnp.int32(layer))
    assert calls[-1][1] == (L * B, Hkv, S, hd)
    one = (q[1, 1:], kc[0, :, 1:], vc[0, :, 1:], starts[1, 1], kn[1:], vn[1:], mask[1:])
    check_attention(out[1, 1:], functools.partial(tm.tree_attention_reference, layer=layer), one)


def test_layer_lowers_for_h200():
    """27B shapes, the caches of 16 layers: alone and in the pool's 4-slot round (one Mosaic GPU call over the
    folded [V·L·B, ...] caches)."""
    Sd = jax.ShapeDtypeStruct
    structs = _structs(65, 8192 + 64)
    structs[1:3] = [Sd((16,) + s.shape, s.dtype) for s in structs[1:3]]
    f = lambda *a: tm.tree_attention(*a[:7], layer=a[7])
    assert "mosaic_gpu" in lower_for_h200(f, *structs, Sd((), jnp.int32))
    V = 4
    vs = [Sd((V,) + s.shape, s.dtype) for s in structs]
    vs[3] = Sd((V,), jnp.int32)
    txt = lower_for_h200(jax.vmap(f, in_axes=(0,) * 7 + (None,)), *vs, Sd((), jnp.int32))
    assert txt.count("custom_call @mosaic_gpu") == 1
    assert f"tensor<{V * 16}x4x{8192 + 64}x256xbf16>" in txt  # the [V·L·B, Hkv, S, hd] view of the caches
