"""Pallas tree attention (kernels_pallas.tree_attention) vs the jnp reference, and its CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import tree_attention as ta
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, attention_inputs, check_attention, rel_err, stacked_slots


def test_signature_matches_reference():
    assert_kernel_signature(ta.tree_attention, ta.tree_attention_reference)


@pytest.mark.parametrize("B,T,H,Hkv,hd,S,start,dtype,kw", [
    (2, 11, 4, 2, 16, 100, 37, jnp.float32, {}),  # tree verify (padding rows), cache not a block multiple
    (1, 9, 6, 2, 24, 128, 0, jnp.float32, dict(n_split=3)),  # empty prefix, non power-of-two head dim
    (1, 13, 6, 2, 32, 192, 150, jnp.bfloat16, dict(block_k=32, block_m=16)),  # bf16, several blocks
    (1, 21, 4, 1, 16, 256, 200, jnp.float32, dict(block_k=16, block_m=32, n_split=5)),  # tree rows split
    (1, 21, 4, 1, 16, 256, 200, jnp.float32, dict(block_k=16, n_split=40)),  # more splits than blocks
    # R = 38 rows: a 32-row block + a 16-row tail tile, grid with the row blocks innermost; prefix 45
    (1, 19, 4, 2, 16, 80, 45, jnp.float32, dict(block_k=16, block_m=32, n_split=3, rows_last=True)),
    (1, 19, 4, 2, 32, 80, 45, jnp.bfloat16, dict(block_k=16, block_m=32, n_split=2)),
    (1, 19, 4, 2, 16, 80, 45, jnp.float32, dict(block_k=16, block_m=32, tail=False)),
])
def test_tree_matches_reference(B, T, H, Hkv, hd, S, start, dtype, kw):
    args = attention_inputs(jax.random.PRNGKey(T + S), np.random.default_rng(T), B, T, H, Hkv, hd, S, start,
                            dtype=dtype, n_pad=2)
    out = ta.tree_attention(*args, interpret=True, **kw)
    check_attention(out, ta.tree_attention_reference, args)


def test_decode_matches_reference():
    """T = 1 (one new token, attends to the prefix and itself)."""
    args = attention_inputs(jax.random.PRNGKey(3), None, 1, 1, 6, 2, 32, 64, 64, dtype=jnp.float32)
    out = ta.tree_attention(*args, interpret=True)
    assert rel_err(out, ta.tree_attention_reference(*args)) < 1e-5


def _structs(T, N, S):
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    return [Sd((1, T, 24, 256), bf), Sd((1, 4, S, 256), bf), Sd((1, 4, S, 256), bf), Sd((), jnp.int32),
            Sd((1, N, 4, 256), bf), Sd((1, N, 4, 256), bf), Sd((1, T, N), jnp.bool_)]


@pytest.mark.parametrize("T,N,S,kw", [(65, 65, 4096 + 64, {}), (1, 1, 8192, {}), (128, 128, 32768, {}),
                                      (65, 65, 4096 + 64, dict(block_m=64, num_warps=4)),
                                      (65, 65, 4096 + 64, dict(block_m=128, num_stages=2, n_split=8)),
                                      # the bench sweep (benchmarks/bench_kernels.py)
                                      (65, 65, 4096 + 64, dict(num_stages=1)),
                                      (65, 65, 4096 + 64, dict(n_split=6)), (65, 65, 4096 + 64, dict(n_split=12)),
                                      (65, 65, 4096 + 64, dict(block_k=32, num_stages=3)),
                                      (65, 65, 4096 + 64, dict(block_m=64, block_k=32, num_warps=4, num_stages=3,
                                                               n_split=9)),
                                      (1, 1, 8192, dict(num_stages=1)),
                                      (65, 65, 131072, {}), (65, 65, 131072, dict(tail=False)),
                                      (65, 65, 131072, dict(rows_last=False, n_split=16)),
                                      (65, 65, 131072, dict(block_m=64, num_warps=4, block_k=64, n_split=5)),
                                      (65, 65, 4096 + 8, dict(block_k=128, num_stages=1))])
def test_lowers_for_h200_at_27b_shapes(T, N, S, kw):
    txt = lower_for_h200(functools.partial(ta.tree_attention, **kw), *_structs(T, N, S))
    assert "__gpu$xla.gpu.triton" in txt


@pytest.mark.parametrize("S", [4096 + 2048 + 256, 131072 + 8192])
def test_lowers_for_h200_at_the_drafters_shapes(S):
    """The DFlash drafter's full-attention layer (27B drafter: 32 q / 8 kv heads, hd 128) over its context cache:
    16 block rows against the committed rows + the 16 block keys, all visible."""
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    structs = [Sd((1, 16, 32, 128), bf), Sd((1, 8, S, 128), bf), Sd((1, 8, S, 128), bf), Sd((), jnp.int32),
               Sd((1, 16, 8, 128), bf), Sd((1, 16, 8, 128), bf), Sd((1, 16, 16), jnp.bool_)]
    assert "__gpu$xla.gpu.triton" in lower_for_h200(ta.tree_attention, *structs)


def _layer_args(seed, V=None):
    """Tiny tree-attention inputs (fp32, 3 key blocks of 16 with a partial one) and the caches stacked over 3
    layers with them at layer 1 (V: V slots of them, the caches [V, L, B, ...])."""
    one = lambda s: attention_inputs(jax.random.PRNGKey(s), np.random.default_rng(s), 1, 5, 4, 2, 16, 40, 21 + s % 7,
                                     dtype=jnp.float32, n_pad=1)
    return stacked_slots(one, seed, V, layer=1)


def test_layer_reads_one_layer_of_the_stacked_caches():
    """layer=1 on caches stacked over 3 layers: the kernel's output on the layer's caches, bit for bit, and the
    reference's; layer=0 reads another layer."""
    args, kc, vc = _layer_args(7)
    q, _, _, st, kn, vn, mask = args
    kw = dict(interpret=True, block_k=16, n_split=2)
    f = jax.jit(lambda kc, vc, l: ta.tree_attention(q, kc, vc, st, kn, vn, mask, layer=l, **kw))
    out = f(kc, vc, jnp.int32(1))
    np.testing.assert_array_equal(out, ta.tree_attention(*args, **kw))
    check_attention(out, functools.partial(ta.tree_attention_reference, layer=1), (q, kc, vc, st, kn, vn, mask))
    other = (q, kc[0], vc[0], st, kn, vn, mask)
    np.testing.assert_array_equal(f(kc, vc, jnp.int32(0)), ta.tree_attention(*other, **kw))


def test_layer_under_vmap():
    """The batched round: jax.vmap over slots (q, stacked caches [V, L, B, ...], start, new rows, mask), the layer
    shared: each slot's output is the unbatched call's."""
    V = 2
    args, kc, vc = _layer_args(11, V)
    q, _, _, st, kn, vn, mask = args
    kw = dict(interpret=True, block_k=16, n_split=2)
    f = lambda q, kc, vc, st, kn, vn, mask, l: ta.tree_attention(q, kc, vc, st, kn, vn, mask, layer=l, **kw)
    out = jax.jit(jax.vmap(f, in_axes=(0,) * 7 + (None,)))(q, kc, vc, st, kn, vn, mask, jnp.int32(1))
    for v in range(V):
        np.testing.assert_array_equal(out[v], ta.tree_attention(*(a[v] for a in args), **kw))


def test_layer_lowers_for_h200_at_27b_shapes():
    Sd = jax.ShapeDtypeStruct
    structs = _structs(65, 65, 4096 + 64)
    structs[1:3] = [Sd((16,) + s.shape, s.dtype) for s in structs[1:3]]
    txt = lower_for_h200(lambda *a: ta.tree_attention(*a[:7], layer=a[7]), *structs, Sd((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt
