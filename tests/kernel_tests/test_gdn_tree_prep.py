"""The GDN tree verify's inputs as one kernel (kernels_pallas.gdn_tree_prep): the Pallas kernel (interpret mode) vs
its jnp reference on fresh random inputs (conv taps from the conv state and the projection, padded head dims, a
node count not a power of two, one layer of stacked caches / parameters), the tree block kernel taking its grams,
the model's tree verify with the kernel (variant "pallas:tree_prep") against the default Pallas path, and its CUDA
lowering for an abstract H200 at the 27B widths."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gdn_reference, gdn_tree, ops
from kernels_pallas import gdn_tree_prep as P
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, rel_err

K = 4


def dims(hk, hv, dk, dv):
    return dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)


def prep_inputs(seed, B, T, hk, hv, dk, dv, dtype, L=None, pad_cols=0):
    """proj [B, T, P] (P with pad_cols zero columns past b | a), conv state, random predecessors (rows of
    concat(conv_state, x): the state's K-1 rows and earlier nodes), conv_w, A_log, dt_bias (stacks with L)."""
    cd = 2 * hk * dk + hv * dv
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    lead = (L,) if L else ()
    proj = jax.random.normal(ks[0], (B, T, cd + hv * dv + 2 * hv))
    proj = jnp.pad(proj, ((0, 0), (0, 0), (0, pad_cols))).astype(dtype)
    conv_state = jax.random.normal(ks[1], (*lead, B, K - 1, cd)).astype(dtype)
    hi = (K - 1) + jnp.arange(T)[None, :, None]  # node t may read any row before itself
    src = (jax.random.uniform(ks[2], (B, T, K - 1)) * hi).astype(jnp.int32)
    conv_w = (0.5 * jax.random.normal(ks[3], (*lead, K, cd))).astype(dtype)
    A_log = jnp.log(jax.random.uniform(ks[4], (*lead, hv), minval=1, maxval=16)).astype(dtype)
    dt_bias = jax.random.uniform(ks[5], (*lead, hv), minval=-1, maxval=1).astype(dtype)
    return proj, conv_state, src, conv_w, A_log, dt_bias


def test_signature_matches_reference():
    assert_kernel_signature(P.gdn_tree_prep, P.gdn_tree_prep_reference)


@pytest.mark.parametrize("dtype,B,T,hk,hv,dk,dv,L", [
    (jnp.float32, 2, 21, 2, 4, 16, 32, None),
    (jnp.bfloat16, 1, 33, 2, 6, 32, 16, 3),  # a stacked layer: conv state and parameters read at layer 1
    (jnp.float32, 1, 9, 1, 2, 24, 20, None),  # head dims padded to powers of two (masked columns)
], ids=["fp32", "bf16-stacked", "fp32-padded"])
def test_kernel_matches_reference(dtype, B, T, hk, hv, dk, dv, L):
    args = prep_inputs(T + dk, B, T, hk, hv, dk, dv, dtype, L, pad_cols=64)
    kw = dict(dims(hk, hv, dk, dv), layer=None if L is None else jnp.int32(1))
    out = P.gdn_tree_prep(*args, **kw, interpret=True)
    ref = jax.jit(functools.partial(P.gdn_tree_prep_reference, **dims(hk, hv, dk, dv)))(
        *args, layer=kw["layer"])
    for name, a, b in zip(("q", "k", "v", "g", "beta", "grams"), out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32, (name, a.shape, b.shape)
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(a).all() and np.abs(b).max() > 0, name
        if name in ("v", "beta"):  # one rounding to the activations' dtype each: equal (fp32 sums in the same order)
            assert np.mean(a != b) < 0.01 and rel_err(a, b) < 1e-2, (name, np.mean(a != b))
        else:
            assert rel_err(a, b) < (1e-5 if dtype == jnp.float32 else 1e-2), (name, rel_err(a, b))
    if L is not None:  # another layer's parameters and state give other values
        other = P.gdn_tree_prep_reference(*args, **dims(hk, hv, dk, dv), layer=jnp.int32(0))
        assert rel_err(np.asarray(out[2]), np.asarray(other[2])) > 1e-2


def test_tree_block_takes_the_grams():
    """gdn_masked_block(grams=) (kernel and reference) gives what it gives forming the grams itself."""
    B, T, hk, hv, dk, dv = 1, 20, 2, 4, 16, 16
    q, k, v, g, beta, grams = P.gdn_tree_prep_reference(*prep_inputs(3, B, T, hk, hv, dk, dv, jnp.float32),
                                                        **dims(hk, hv, dk, dv))
    parent = jnp.maximum(jnp.arange(T) - 1 - (jnp.arange(T) % 3 == 0), -1)  # a branching tree
    anc = np.eye(T, dtype=bool)
    for i in range(T):
        if parent[i] >= 0:
            anc[i] |= anc[int(parent[i])]
    mask = jnp.asarray(anc)[None]
    state = 0.1 * jax.random.normal(jax.random.PRNGKey(9), (B, hv, dk, dv))
    want = gdn_reference.gdn_masked_block(q, k, v, g, beta, mask, state)
    for got in (gdn_reference.gdn_masked_block(q, k, v, g, beta, mask, state, grams=grams),
                gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, grams=grams, interpret=True)):
        for a, b in zip(got, want):
            assert rel_err(np.asarray(a), np.asarray(b)) < 1e-5
    # the grams are used: other grams, another result
    bad = gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, grams=grams * 0.5, interpret=True)
    assert rel_err(np.asarray(bad[0]), np.asarray(want[0])) > 1e-3


@pytest.mark.parametrize("grams", [True, False])
def test_lowers_for_h200_at_27b(grams):
    """27B widths (Hk 16, Hv 48, 128-dim heads, K 4), 65 nodes (DDTree(64)), bf16, stacked caches and parameters."""
    hk, hv, dk, dv, T, L = 16, 48, 128, 128, 65, 16
    cd = 2 * hk * dk + hv * dv
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    structs = (S((1, T, 16512), bf), S((L, 1, K - 1, cd), bf), S((1, T, K - 1), jnp.int32), S((L, K, cd), bf),
               S((L, hv), bf), S((L, hv), bf), S((), jnp.int32))
    text = lower_for_h200(lambda *a: P.gdn_tree_prep(*a[:-1], **dims(hk, hv, dk, dv), layer=a[-1], grams=grams),
                          *structs)
    assert "gdn_tree_prep" in text


def _interpret(monkeypatch, module, name, calls):
    fn = getattr(module, name)

    def run(*a, **k):
        calls.append(name)
        return fn(*a, **{**k, "interpret": True})
    monkeypatch.setattr(module, name, run)


def test_model_tree_verify_with_the_kernel(monkeypatch):
    """A tiny fp32 model's tree verify (`api.score_tree`: 4 groups of GDN + attention scanned, a branching tree of
    12 nodes, key heads of 8 dims padded to 16) with kernels="pallas:tree_prep" gives the logits of kernels="pallas"
    (the interpreters on the CPU) and of "xla"; the prep kernel runs once per GDN layer's trace."""
    import dataclasses
    from jaxddtree.api import score_tree
    from jaxddtree.model.config import ATTENTION, GDN, TextConfig
    from jaxddtree.model.target import random_target
    from kernels_pallas import gdn_prefill, prefill_attention, tree_attention
    calls = []
    for mod, name in ((tree_attention, "tree_attention"), (prefill_attention, "prefill_attention"),
                      (gdn_prefill, "gdn_chunked"), (gdn_tree, "gdn_masked_block"), (P, "gdn_tree_prep")):
        _interpret(monkeypatch, mod, name, calls)
    cfg = TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                     layer_types=(GDN, ATTENTION) * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rope_theta=1e4, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                     max_position_embeddings=512)
    target = random_target(cfg, "float32", seed=3)
    ids = np.random.default_rng(0).integers(0, 95, 11)
    parents = [-1, 0, 1, 1, 0, 4, 2, 6, 7, 3, 9, 5]
    toks = [int(t) for t in np.random.default_rng(1).integers(0, 95, len(parents))]
    out = {k: score_tree(dataclasses.replace(target, kernels=k), ids, toks, parents)
           for k in ("xla", "pallas", "pallas:tree_prep")}
    assert calls.count("gdn_tree_prep") >= 1 and "gdn_masked_block" in calls
    assert rel_err(out["pallas:tree_prep"], out["pallas"]) < 1e-5, rel_err(out["pallas:tree_prep"], out["pallas"])
    assert rel_err(out["pallas:tree_prep"], out["xla"]) < 1e-5


def test_vmapped_slots():
    """Under jax.vmap (a batched round's slots, each with its own tree and conv state): each slot's own result."""
    B, T, hk, hv, dk, dv = 1, 12, 2, 4, 16, 16
    slots = [prep_inputs(s, B, T, hk, hv, dk, dv, jnp.float32) for s in (11, 12)]
    proj, cs, src = (jnp.stack([a[i] for a in slots]) for i in range(3))
    params = slots[0][3:]
    f = functools.partial(P.gdn_tree_prep, **dims(hk, hv, dk, dv), interpret=True)
    got = jax.vmap(lambda p, c, s: f(p, c, s, *params))(proj, cs, src)
    for i, a in enumerate(slots):
        want = P.gdn_tree_prep_reference(*a[:3], *params, **dims(hk, hv, dk, dv))
        for x, y in zip(got, want):
            assert rel_err(np.asarray(x[i]), np.asarray(y)) < 1e-5


@pytest.mark.parametrize("L", [None, 3])
def test_without_grams(L):
    """grams=False (a program per q head and per k head, no grams): the same q, k, v, g, beta, and None."""
    B, T, hk, hv, dk, dv = 2, 19, 2, 4, 16, 32
    args = prep_inputs(40 + T, B, T, hk, hv, dk, dv, jnp.float32, L)
    kw = dict(dims(hk, hv, dk, dv), layer=None if L is None else jnp.int32(2))
    got = P.gdn_tree_prep(*args, **kw, grams=False, interpret=True)
    ref = P.gdn_tree_prep_reference(*args, **kw, grams=False)
    assert got[5] is None and ref[5] is None
    full = P.gdn_tree_prep_reference(*args, **kw)
    for name, a, b, c in zip(("q", "k", "v", "g", "beta"), got, ref, full):
        assert rel_err(np.asarray(a), np.asarray(b)) < 1e-5, name
        np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
