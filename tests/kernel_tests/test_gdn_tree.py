"""Pallas tree-GDN kernel (kernels_pallas.gdn_tree) vs the jnp reference, and its CUDA lowering."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gdn_tree
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, gdn_inputs, random_tree_mask, rel_err

TOL = 1e-5


def test_signature_matches_reference():
    assert_kernel_signature(gdn_tree.gdn_masked_block, gdn_tree.gdn_masked_block_reference)
    ker = inspect.signature(gdn_tree.gdn_masked_block).parameters
    assert ker["interpret"].kind is inspect.Parameter.KEYWORD_ONLY and ker["interpret"].default is False


@pytest.mark.parametrize("B,N,Hk,Hv,dk,dv,n_pad,kw", [
    (2, 21, 2, 4, 16, 32, 4, dict(block_v=16)),  # tree with padding rows, 2 row blocks, 2 dv tiles
    (1, 37, 1, 3, 24, 20, 0, dict(block_t=32)),  # non power-of-two head dims, 32-row blocks
])
def test_tree_matches_reference(B, N, Hk, Hv, dk, dv, n_pad, kw):
    rng = np.random.default_rng(N)
    mask, valid = random_tree_mask(rng, B, N, n_pad)
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(N), B, N, Hk, Hv, dk, dv, valid=valid)
    out = gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, interpret=True, **kw)
    ref = gdn_tree.gdn_masked_block_reference(q, k, v, g, beta, mask, state)
    for name, a, b in zip(("o", "W", "G"), out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.all(np.isfinite(np.asarray(a))), name
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))


def _shallow_tree(rng, N, max_depth, n_pad=0):
    """Ancestor mask [1,N,N] of a random tree whose root paths have at most max_depth nodes."""
    m, depth = np.zeros((N, N), bool), np.zeros(N, int)
    for i in range(N):
        m[i, i] = True
        if 0 < i < N - n_pad:
            p = int(rng.choice([j for j in range(i) if depth[j] < max_depth - 1 and j < N - n_pad]))
            m[i] |= m[p]
            depth[i] = depth[p] + 1
    return jnp.asarray(m[None]), jnp.asarray((np.arange(N) < N - n_pad)[None])


@pytest.mark.parametrize("N,max_depth,kw", [
    (45, 4, dict(head_block=32)),  # head block + 1 tail block, 2 nilpotent factors
    (40, 6, dict(head_block=64, block_v=16)),  # one head block past N
    (70, 16, {}),  # default head block (64) + 1 tail block
])
def test_max_depth_matches_reference(N, max_depth, kw):
    rng = np.random.default_rng(N)
    mask, valid = _shallow_tree(rng, N, max_depth, n_pad=3)
    assert int(np.asarray(mask).sum(-1).max()) <= max_depth
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(N), 1, N, 1, 2, 16, 16, valid=valid)
    out = gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, interpret=True, max_depth=max_depth, **kw)
    ref = gdn_tree.gdn_masked_block_reference(q, k, v, g, beta, mask, state)
    for name, a, b in zip(("o", "W", "G"), out, ref):
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))


@pytest.mark.parametrize("kw", [dict(head_block=16), dict(head_block=32, block_t=16), dict(head_block=64)])
def test_head_block_sizes_match_reference(kw):
    B, N = 1, 50
    rng = np.random.default_rng(5)
    mask, valid = random_tree_mask(rng, B, N, 2)
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(5), B, N, 1, 2, 16, 16, valid=valid)
    out = gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, interpret=True, **kw)
    ref = gdn_tree.gdn_masked_block_reference(q, k, v, g, beta, mask, state)
    for name, a, b in zip(("o", "W", "G"), out, ref):
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))


def test_bf16x3m_split_products(monkeypatch):
    """The hand bf16x3 path (operands split once into bf16 hi/lo) run in interpret mode: ~1e-5."""
    from kernels_pallas import _common
    monkeypatch.setattr(gdn_tree, "matmul_fns", lambda p, interpret: _common.matmul_fns(p, False))
    B, N = 1, 40
    mask, valid = random_tree_mask(np.random.default_rng(3), B, N, 2)
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(3), B, N, 1, 2, 32, 32, valid=valid)
    out = gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, interpret=True, precision="bf16x3m",
                                    head_block=32)
    ref = gdn_tree.gdn_masked_block_reference(q, k, v, g, beta, mask, state)
    for name, a, b in zip(("o", "W", "G"), out, ref):
        assert rel_err(a, b) < 5e-5, (name, rel_err(a, b))


@pytest.mark.parametrize("N,max_depth,n_pad,kw", [
    (37, None, 3, {}),  # head block 64 past N
    (45, 16, 4, dict(head_block=16, block_v=16)),  # grams read in head + tail blocks (contrib)
    (50, 8, 3, dict(head_block=32, block_v=16)),
])
def test_key_grams_gqa_match_reference(N, max_depth, n_pad, kw):
    """K Kᵀ, Q Kᵀ per key head (one XLA dot, shared by its value heads) with GQA 3, on random trees
    (deep: random parents; shallow: ≤ max_depth nodes per path) with padding rows."""
    rng = np.random.default_rng(N + 1)
    if max_depth:
        mask, valid = _shallow_tree(rng, N, max_depth, n_pad=n_pad)
    else:
        mask, valid = random_tree_mask(rng, 1, N, n_pad)
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(N + 1), 1, N, 2, 6, 16, 32, valid=valid)
    out = gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, interpret=True, **kw)
    ref = gdn_tree.gdn_masked_block_reference(q, k, v, g, beta, mask, state)
    for name, a, b in zip(("o", "W", "G"), out, ref):
        assert a.shape == b.shape and np.all(np.isfinite(np.asarray(a))), name
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))


def test_chain_mask_matches_reference():
    """A chain (lower-triangular mask) is the chunked prefill block."""
    B, N, Hk, Hv, d = 1, 32, 1, 2, 16
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool)), (B, N, N))
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(7), B, N, Hk, Hv, d, d)
    out = gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, interpret=True)
    ref = gdn_tree.gdn_masked_block_reference(q, k, v, g, beta, mask, state)
    for a, b in zip(out, ref):
        assert rel_err(a, b) < TOL


def _stacked_states(seed, L, B, Hv, dk, dv):
    """L layers' fresh random states [L, B, Hv, dk, dv]."""
    return jnp.stack([0.1 * jax.random.normal(jax.random.PRNGKey(seed + i), (B, Hv, dk, dv)) for i in range(L)])


@pytest.mark.parametrize("dk,dv,kw", [(16, 32, dict(block_v=16)), (24, 20, {})], ids=["bv16", "padded"])
def test_layer_of_stacked_state(dk, dv, kw):
    """layer=l (traced) on 3 layers' states stacked [L, ...]: bitwise the kernel on state[l] (each dv tile reads its
    own columns of layer l); the reference's layer= likewise."""
    B, N, Hk, Hv, L = 2, 21, 1, 2, 3
    mask, valid = random_tree_mask(np.random.default_rng(1), B, N, 2)
    q, k, v, g, beta, _ = gdn_inputs(jax.random.PRNGKey(1), B, N, Hk, Hv, dk, dv, valid=valid)
    states = _stacked_states(2, L, B, Hv, dk, dv)
    f = jax.jit(functools.partial(gdn_tree.gdn_masked_block, interpret=True, **kw))
    ref = jax.jit(gdn_tree.gdn_masked_block_reference)
    for layer in (2, 0):
        got, one = f(q, k, v, g, beta, mask, states, layer=jnp.int32(layer)), f(q, k, v, g, beta, mask, states[layer])
        r_got, r_one = ref(q, k, v, g, beta, mask, states, layer=jnp.int32(layer)), ref(q, k, v, g, beta, mask,
                                                                                        states[layer])
        for a, b, ra, rb in zip(got, one, r_got, r_one):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(ra), np.asarray(rb))
            assert rel_err(a, rb) < TOL


def test_layer_under_vmap():
    """jax.vmap over slots with the stacked states [V, L, ...] batched and the layer not: each slot reads its own
    states' layer."""
    V, N, L = 2, 16, 2
    mask, valid = random_tree_mask(np.random.default_rng(3), V, N, 2)
    q, k, v, g, beta, _ = gdn_inputs(jax.random.PRNGKey(3), V, N, 1, 2, 16, 16, valid=valid)
    states = _stacked_states(4, L * V, 1, 2, 16, 16).reshape(V, L, 1, 2, 16, 16)
    ins = [x[:, None] for x in (q, k, v, g, beta, mask)]  # one batch row per slot
    f = jax.vmap(lambda *a: gdn_tree.gdn_masked_block(*a[:7], layer=a[7], interpret=True), in_axes=(0,) * 7 + (None,))
    got = jax.jit(f)(*ins, states, jnp.int32(1))
    for s in range(V):
        one = gdn_tree.gdn_masked_block(*(x[s] for x in ins), states[s, 1], interpret=True)
        for a, b in zip(got, one):
            np.testing.assert_array_equal(np.asarray(a[s]), np.asarray(b))


def _structs(B=1, N=65, Hk=16, Hv=48, dk=128, dv=128):
    S, f = jax.ShapeDtypeStruct, jnp.float32
    return [S((B, N, Hk, dk), f), S((B, N, Hk, dk), f), S((B, N, Hv, dv), f), S((B, N, Hv), f),
            S((B, N, Hv), f), S((B, N, N), jnp.bool_), S((B, Hv, dk, dv), f)]


@pytest.mark.parametrize("N,kw", [(65, {}), (128, {}), (65, dict(max_depth=16)),
                                  (65, dict(head_block=128, max_depth=16, num_warps=8)),
                                  (65, dict(precision="bf16x3", head_block=16)),
                                  (65, dict(precision="tf32", block_v=32)), (65, dict(precision="tf32x3m")),
                                  (65, dict(precision="mixed")),
                                  (65, dict(block_v=32)), (65, dict(block_v=128)), (65, dict(precision="tf32")),
                                  (65, dict(head_block=64)), (128, dict(head_block=64))])
def test_lowers_for_h200_at_27b_shapes(N, kw):
    txt = lower_for_h200(functools.partial(gdn_tree.gdn_masked_block, **kw), *_structs(N=N))
    assert "__gpu$xla.gpu.triton" in txt



def test_lowers_for_h200_with_layer():
    """layer= at 27B shapes: the stacked state [3, ...] and a traced layer, one Triton call, no slice of the stack."""
    structs = _structs()
    structs[6] = jax.ShapeDtypeStruct((3,) + structs[6].shape, structs[6].dtype)
    f = lambda *a: gdn_tree.gdn_masked_block(*a[:7], layer=a[7])
    txt = lower_for_h200(f, *structs, jax.ShapeDtypeStruct((), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "dynamic_slice" not in txt


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tree_conv_gathers_apart_as_from_the_concatenation(dtype):
    """`gdn_reference.tree_conv` of a tree (random parents, taps reaching above the root into the conv state): its
    taps, gathered from the conv state and the new rows apart (no concatenation in its jaxpr), give the conv over
    taps gathered from their concatenation, bit for bit; a sequence has no gather."""
    from kernels_pallas import gdn_reference
    from kernels_pallas.numerics import rounded, silu32
    from jaxddtree.model import layout as layout_lib
    rng = np.random.default_rng(3)
    N, C, K = 23, 48, 4
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, N)], np.int32)
    lay = layout_lib.tree(jnp.int32(9), jnp.asarray(parents), K, batch=2)
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    cs = jax.random.normal(ks[0], (2, K - 1, C)).astype(dtype)
    x = jax.random.normal(ks[1], (2, N, C)).astype(dtype)
    w = (0.5 * jax.random.normal(ks[2], (K, C))).astype(dtype)
    src = np.asarray(lay.conv_src)
    assert (src < K - 1).any() and (src >= K - 1).any()
    a = gdn_reference.tree_conv(cs, x, lay.conv_src, w)
    assert "concatenate" not in str(jax.make_jaxpr(gdn_reference.tree_conv)(cs, x, lay.conv_src, w))
    rows = np.concatenate([np.asarray(cs, np.float32), np.asarray(x, np.float32)], axis=1)  # [B, K-1+N, C]
    taps = jnp.asarray(np.stack([rows[b][src[b]] for b in range(2)]))  # [B, N, K-1, C]
    wf = w.astype(jnp.float32)
    acc = taps[:, :, 0] * wf[0]
    for s in range(1, K - 1):
        acc = acc + taps[:, :, s] * wf[s]
    acc = acc + x.astype(jnp.float32) * wf[-1]
    want = rounded(silu32(rounded(acc, dtype)), dtype)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(a, np.float32) - np.asarray(gdn_reference.tree_conv(cs[:, ::-1], x, lay.conv_src, w),
                                                          np.float32)).max() > 0  # the state's rows matter
    seq = layout_lib.sequence(0, N, K, batch=2)
    np.testing.assert_array_equal(np.asarray(gdn_reference.tree_conv(cs, x, None, w), np.float32),
                                  np.asarray(gdn_reference.tree_conv(cs, x, seq.conv_src, w), np.float32))
