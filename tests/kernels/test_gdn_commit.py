"""GDN commit (kernels_pallas.gdn_commit): the Pallas kernel (interpret mode) vs the jnp reference on random stashes
and paths, and the kernel's CUDA lowering at 27B shapes for an H200."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gdn_commit as G
from kernels_pallas import ops
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, rel_err


def commit_inputs(seed, B, N, Hk, Hv, dk, dv, C, K, P, dtype):
    """Random state / conv rows / stash (never zeros) and root paths: increasing node indices from 0, padded
    with the leaf past path_len (as `accept` returns them)."""
    rng = np.random.default_rng(seed)
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    k = jax.random.normal(ks[0], (B, N, Hk, dk))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    W = jax.random.normal(ks[1], (B, N, Hv, dv))
    g = -2.0 * jax.random.uniform(ks[2], (B, N, Hv), minval=1e-3, maxval=1.0)
    x = jax.random.normal(ks[3], (B, N, C)).astype(dtype)
    state = 0.1 * jax.random.normal(ks[4], (B, Hv, dk, dv))
    conv = jax.random.normal(ks[5], (B, K - 1, C)).astype(dtype)
    n = rng.integers(1, P + 1, B)
    path = np.zeros((B, P), np.int32)
    for b in range(B):
        nodes = np.sort(rng.choice(np.arange(1, N), size=n[b] - 1, replace=False))
        row = np.concatenate([[0], nodes])
        path[b] = np.concatenate([row, np.full(P - n[b], row[-1])])
    return state, conv, k, W, g, x, jnp.asarray(path), jnp.asarray(n.astype(np.int32))


def test_signature_matches_reference():
    ref = assert_kernel_signature(G.gdn_commit, G.gdn_commit_reference)
    assert list(inspect.signature(ops.gdn_commit).parameters) == ref + ["kernels"]


@pytest.mark.parametrize("B,N,Hk,Hv,dk,dv,C,K,P,dtype,bv", [
    (2, 9, 2, 4, 16, 32, 192, 4, 5, jnp.bfloat16, 16),  # GDN-like conv width, P not a power of two, 2 column blocks
    (1, 20, 1, 2, 32, 16, 200, 4, 16, jnp.float32, 64),  # conv blocks partly masked, full-length path possible
    (3, 6, 2, 6, 16, 16, 96, 3, 4, jnp.bfloat16, 64),    # K = 3
])
def test_kernel_matches_reference(B, N, Hk, Hv, dk, dv, C, K, P, dtype, bv):
    args = commit_inputs(B + N + P, B, N, Hk, Hv, dk, dv, C, K, P, dtype)
    ref_s, ref_c = jax.jit(G.gdn_commit_reference)(*args)
    s, c = G.gdn_commit(*args, block_v=bv, interpret=True)
    assert s.shape == ref_s.shape and s.dtype == ref_s.dtype and c.shape == ref_c.shape and c.dtype == ref_c.dtype
    np.testing.assert_array_equal(np.asarray(c.astype(jnp.float32)), np.asarray(ref_c.astype(jnp.float32)))
    assert rel_err(np.asarray(s), np.asarray(ref_s)) < 1e-6


def test_lowers_for_h200():
    """27B GDN shapes: Hk 16, Hv 48, dk = dv = 128, conv_dim 10240, K 4; a 65-node tree, paths of 16."""
    S = jax.ShapeDtypeStruct
    B, N, P, C = 1, 65, 16, 10240
    text = lower_for_h200(G.gdn_commit, S((B, 48, 128, 128), jnp.float32), S((B, 3, C), jnp.bfloat16),
                          S((B, N, 16, 128), jnp.float32), S((B, N, 48, 128), jnp.float32),
                          S((B, N, 48), jnp.float32), S((B, N, C), jnp.bfloat16), S((B, P), jnp.int32),
                          S((B,), jnp.int32))
    assert "triton" in text
