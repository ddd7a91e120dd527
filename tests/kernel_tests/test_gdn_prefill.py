"""Pallas chunked GDN prefill (kernels_pallas.gdn_prefill) vs the jnp reference, and its CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gdn_prefill
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, gdn_inputs, rel_err


def test_signature_matches_reference():
    assert_kernel_signature(gdn_prefill.gdn_chunked, gdn_prefill.gdn_chunked_reference)


@pytest.mark.parametrize("B,T,Hk,Hv,dk,dv,chunk,kw", [
    (2, 100, 2, 4, 16, 32, 32, dict(block_v=16)),  # 4 chunks, last one padded
    (1, 40, 1, 3, 24, 20, 64, {}),  # one chunk, non power-of-two dims
])
def test_chunked_matches_reference(B, T, Hk, Hv, dk, dv, chunk, kw):
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(T), B, T, Hk, Hv, dk, dv)
    o, s = gdn_prefill.gdn_chunked(q, k, v, g, beta, state, chunk, interpret=True, **kw)
    o_r, s_r = gdn_prefill.gdn_chunked_reference(q, k, v, g, beta, state, chunk)
    assert o.shape == o_r.shape and s.shape == s_r.shape
    assert rel_err(o, o_r) < 1e-5, rel_err(o, o_r)
    assert rel_err(s, s_r) < 1e-5, rel_err(s, s_r)


@pytest.mark.parametrize("T,dk,dv,chunk,kw", [(40, 16, 32, 16, dict(block_v=16)), (20, 24, 20, 64, {})],
                         ids=["3chunks-bv16", "padded"])
def test_layer_of_stacked_state(T, dk, dv, chunk, kw):
    """layer=l (traced; the stack donated: in place) on 3 layers' states stacked [L, ...]: o and the new state of
    layer l bitwise the kernel on state[l], the other layers untouched; the reference's layer= likewise."""
    B, Hk, Hv, L = 2, 1, 2, 3
    q, k, v, g, beta, _ = gdn_inputs(jax.random.PRNGKey(T), B, T, Hk, Hv, dk, dv)
    states = jnp.stack([gdn_inputs(jax.random.PRNGKey(T + 1 + i), B, 1, Hk, Hv, dk, dv)[5] for i in range(L)])
    ker = jax.jit(functools.partial(gdn_prefill.gdn_chunked, chunk=chunk, interpret=True, **kw), donate_argnums=5)
    one = jax.jit(functools.partial(gdn_prefill.gdn_chunked, chunk=chunk, interpret=True, **kw))
    ref = jax.jit(functools.partial(gdn_prefill.gdn_chunked_reference, chunk=chunk))
    others = lambda layer: np.arange(L) != layer
    for layer in (2, 0):
        for f in (ker, ref):
            o, s = f(q, k, v, g, beta, jnp.array(states), layer=jnp.int32(layer))
            o1, s1 = (one if f is ker else ref)(q, k, v, g, beta, states[layer])
            np.testing.assert_array_equal(np.asarray(o), np.asarray(o1))
            np.testing.assert_array_equal(np.asarray(s[layer]), np.asarray(s1))
            np.testing.assert_array_equal(np.asarray(s)[others(layer)], np.asarray(states)[others(layer)])


def test_layer_under_vmap():
    """jax.vmap over slots with the stacked states [V, L, ...] batched and the layer not: each slot's own layer."""
    V, T, L = 2, 20, 2
    q, k, v, g, beta, _ = gdn_inputs(jax.random.PRNGKey(8), V, T, 1, 2, 16, 16)
    states = 0.1 * jax.random.normal(jax.random.PRNGKey(9), (V, L, 1, 2, 16, 16))
    ins = [x[:, None] for x in (q, k, v, g, beta)]  # one batch row per slot
    f = jax.vmap(lambda *a: gdn_prefill.gdn_chunked(*a[:6], 16, layer=a[6], interpret=True),
                 in_axes=(0,) * 6 + (None,))
    o, s = jax.jit(f)(*ins, states, jnp.int32(1))
    for i in range(V):
        o1, s1 = gdn_prefill.gdn_chunked(*(x[i] for x in ins), states[i, 1], 16, interpret=True)
        np.testing.assert_array_equal(np.asarray(o[i]), np.asarray(o1))
        np.testing.assert_array_equal(np.asarray(s[i, 1]), np.asarray(s1))
        np.testing.assert_array_equal(np.asarray(s[i, 0]), np.asarray(states[i, 0]))


def test_lowers_for_h200_with_layer():
    """layer= at 27B shapes (3 stacked layers, a traced layer): one Triton call, the stack aliased to the state
    output, no slice or update of it outside the kernel."""
    S, f, T = jax.ShapeDtypeStruct, jnp.float32, 8192
    structs = [S((1, T, 16, 128), f), S((1, T, 16, 128), f), S((1, T, 48, 128), f), S((1, T, 48), f),
               S((1, T, 48), f), S((3, 1, 48, 128, 128), f), S((), jnp.int32)]
    txt = lower_for_h200(lambda *a: gdn_prefill.gdn_chunked(*a[:6], layer=a[6]), *structs)
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "dynamic_slice" not in txt and "dynamic_update_slice" not in txt
    assert "output_tuple_indices = [1], operand_index = 7" in txt


def test_lowers_for_h200_at_27b_shapes():
    S, f, T = jax.ShapeDtypeStruct, jnp.float32, 8192
    structs = [S((1, T, 16, 128), f), S((1, T, 16, 128), f), S((1, T, 48, 128), f), S((1, T, 48), f),
               S((1, T, 48), f), S((1, 48, 128, 128), f)]
    txt = lower_for_h200(gdn_prefill.gdn_chunked, *structs)
    assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.parametrize("C", [1, 2, 16, 64])
def test_unit_lower_inverse_is_the_inverse(C):
    """The doubling inverse (what replaces the batched triangular solve) against a float64 inverse, on random
    strictly-lower L of several batch axes."""
    from kernels_pallas.gdn_prefill import unit_lower_inverse
    L = np.tril(np.random.default_rng(C).normal(size=(3, 2, C, C)).astype(np.float32) * 0.3, -1)
    inv = np.asarray(unit_lower_inverse(jnp.asarray(L)))
    ref = np.linalg.inv(np.eye(C) + L.astype(np.float64))
    assert np.abs(inv - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())
    assert np.all(np.triu(inv, 1) == 0)

