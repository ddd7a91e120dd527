"""Mosaic GPU causal prefill attention (kernels_pallas.prefill_attention_mgpu: the tree kernel's causal mode) vs
the jnp reference on the Mosaic GPU interpreter (CPU), and its CUDA lowering for an abstract H200 (27B shapes)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import prefill_attention_mgpu as pm
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, attention_inputs, check_attention, stack_layers


def test_signature_matches_reference():
    assert_kernel_signature(pm.prefill_attention, pm.prefill_attention_reference)


@pytest.mark.parametrize("B,T,H,Hkv,S,start,kw", [
    # G = 2: 200 rows in 2 row blocks; row block 1's first warpgroup (tokens 64..95) sees new-row block 0
    # whole (unmasked), the rest masked; a partial prefix block at the end of the cache; 2 splits
    (1, 100, 2, 1, 130, 129, dict(n_split=2)),
    (2, 40, 4, 2, 64, 0, {}),  # empty prefix, batch 2, G = 2: 80 rows (the second warpgroup 16 of them)
])
def test_prefill_matches_reference(B, T, H, Hkv, S, start, kw):
    q, kc, vc, st, kn, vn, _ = attention_inputs(jax.random.PRNGKey(T + S), None, B, T, H, Hkv, 64, S, start)
    args = (q, kc, vc, st, kn, vn)
    check_attention(pm.prefill_attention(*args, interpret=True, **kw), pm.prefill_attention_reference, args)


@pytest.mark.parametrize("T,S", [(1024, 131072 + 4096), (4096, 131072 + 4096), (2048, 32768)])
def test_lowers_for_h200_at_27b_shapes(T, S):
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    structs = [Sd((1, T, 24, 256), bf), Sd((1, 4, S, 256), bf), Sd((1, 4, S, 256), bf), Sd((), jnp.int32),
               Sd((1, T, 4, 256), bf), Sd((1, T, 4, 256), bf)]
    assert "mosaic_gpu" in lower_for_h200(pm.prefill_attention, *structs)


def test_vmap_folds_into_the_batch_axis():
    """Grouped prefill (jax.vmap over the joining prompts' caches, one start each): one launch over the folded
    rows, each prompt's output its reference's."""
    V, T, H, Hkv, S = 2, 40, 4, 2, 64
    ins = [attention_inputs(jax.random.PRNGKey(v), None, 1, T, H, Hkv, 64, S, 0) for v in range(V)]
    q, kc, vc, _, kn, vn = (jnp.stack([x[i] for x in ins]) for i in (0, 1, 2, 3, 4, 5))
    starts = jnp.array([0, 24], jnp.int32)
    out = jax.vmap(lambda *a: pm.prefill_attention(*a, interpret=True))(q, kc, vc, starts, kn, vn)
    for v in range(V):
        args = (q[v], kc[v], vc[v], starts[v], kn[v], vn[v])
        check_attention(out[v], pm.prefill_attention_reference, args)


def test_layer_under_vmap():
    """Grouped prefill over stacked caches: jax.vmap over the prompts (q, caches [V, L, B, ...], start), the layer
    shared: each prompt's output is its reference's on its caches' layer."""
    V, L, T, H, Hkv, S, layer = 2, 3, 24, 4, 2, 64, 2
    ins = [attention_inputs(jax.random.PRNGKey(10 + v), None, 1, T, H, Hkv, 64, S, 0) for v in range(V)]
    q, kc, vc, kn, vn = (jnp.stack([x[i] for x in ins]) for i in (0, 1, 2, 4, 5))
    kc, vc = (stack_layers(jax.random.PRNGKey(20 + i), x, L, layer).swapaxes(0, 1) for i, x in enumerate((kc, vc)))
    starts = jnp.array([40, 17], jnp.int32)
    f = lambda q, kc, vc, st, kn, vn, l: pm.prefill_attention(q, kc, vc, st, kn, vn, layer=l, interpret=True)
    out = jax.jit(jax.vmap(f, in_axes=(0,) * 6 + (None,)))(q, kc, vc, starts, kn, vn, jnp.int32(layer))
    for v in range(V):
        args = (q[v], kc[v], vc[v], starts[v], kn[v], vn[v])
        check_attention(out[v], functools.partial(pm.prefill_attention_reference, layer=layer), args)


def test_layer_lowers_for_h200():
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    T, S = 2048, 32768
    structs = [Sd((1, T, 24, 256), bf), Sd((16, 1, 4, S, 256), bf), Sd((16, 1, 4, S, 256), bf), Sd((), jnp.int32),
               Sd((1, T, 4, 256), bf), Sd((1, T, 4, 256), bf), Sd((), jnp.int32)]
    assert "mosaic_gpu" in lower_for_h200(lambda *a: pm.prefill_attention(*a[:6], layer=a[6]), *structs)
