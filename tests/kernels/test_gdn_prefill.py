"""Pallas chunked GDN prefill (kernels_pallas.gdn_prefill) vs the jnp reference, and its CUDA lowering."""


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

