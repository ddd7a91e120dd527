"""Pallas causal prefill attention (kernels_pallas.prefill_attention) vs the jnp reference, and its CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import prefill_attention as pa
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, attention_inputs, check_attention, rel_err, stacked_slots


def test_signature_matches_reference():
    assert_kernel_signature(pa.prefill_attention, pa.prefill_attention_reference)


def test_reference_is_the_causal_tree_reference():
    args = attention_inputs(jax.random.PRNGKey(0), None, 1, 5, 4, 2, 16, 12, 7, dtype=jnp.float32)
    tril = jnp.tril(jnp.ones((5, 5), bool))[None]
    np.testing.assert_array_equal(pa.prefill_attention_reference(*args[:6]),
                                  pa.tree_attention_reference(*args[:6], tril))


@pytest.mark.parametrize("B,T,H,Hkv,hd,S,start,dtype,kw", [
    # prefix not a block multiple, chunk not a block multiple, rows of a token across row blocks (G = 3)
    (2, 11, 6, 2, 16, 100, 37, jnp.float32, dict(block_m=16, block_k=16)),
    (1, 32, 6, 2, 24, 70, 0, jnp.float32, dict(block_m=32, block_k=16)),  # empty prefix, whole new blocks
    (1, 24, 4, 1, 32, 90, 53, jnp.bfloat16, dict(block_m=32, block_k=16)),  # bf16
    (1, 7, 4, 2, 16, 256, 200, jnp.float32, dict(block_k=16, n_split=5)),  # short chunk: key splits
    (1, 7, 4, 2, 16, 64, 48, jnp.float32, dict(block_k=16, n_split=40)),  # more splits than blocks
])
def test_prefill_matches_reference(B, T, H, Hkv, hd, S, start, dtype, kw):
    args = attention_inputs(jax.random.PRNGKey(T + S), None, B, T, H, Hkv, hd, S, start, dtype=dtype)[:6]
    out = pa.prefill_attention(*args, interpret=True, **kw)
    check_attention(out, pa.prefill_attention_reference, args)


def _structs(T, S):
    Sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    return [Sd((1, T, 24, 256), bf), Sd((1, 4, S, 256), bf), Sd((1, 4, S, 256), bf), Sd((), jnp.int32),
            Sd((1, T, 4, 256), bf), Sd((1, T, 4, 256), bf)]


@pytest.mark.parametrize("T,S,kw", [(2048, 32768, {}), (1000, 8192 + 8, {}), (64, 131072, {}),
                                    # the bench sweep (benchmarks/bench_kernels.py, section prefill_attn)
                                    (2048, 32768, dict(block_k=32, num_stages=3)),
                                    (2048, 32768, dict(block_m=64, num_warps=4)),
                                    (2048, 32768, dict(block_k=128, num_stages=1))])
def test_lowers_for_h200_at_27b_shapes(T, S, kw):
    txt = lower_for_h200(functools.partial(pa.prefill_attention, **kw), *_structs(T, S))
    assert "__gpu$xla.gpu.triton" in txt


def _layer_args(seed, V=None):
    """Tiny prefill inputs (fp32, 16-key blocks with a partial prefix one) and the caches stacked over 3 layers
    with them at layer 2 (V: V slots of them, the caches [V, L, B, ...])."""
    one = lambda s: attention_inputs(jax.random.PRNGKey(s), None, 1, 7, 4, 2, 16, 40, 19 + s % 5,
                                     dtype=jnp.float32)[:6]
    return stacked_slots(one, seed, V, layer=2)


def test_layer_reads_one_layer_of_the_stacked_caches():
    """layer=2 on caches stacked over 3 layers: the kernel's output on the layer's caches, bit for bit, and the
    reference's; layer=0 reads another layer."""
    args, kc, vc = _layer_args(3)
    q, _, _, st, kn, vn = args
    kw = dict(interpret=True, block_k=16, n_split=2)
    f = jax.jit(lambda kc, vc, l: pa.prefill_attention(q, kc, vc, st, kn, vn, layer=l, **kw))
    out = f(kc, vc, jnp.int32(2))
    np.testing.assert_array_equal(out, pa.prefill_attention(*args, **kw))
    check_attention(out, functools.partial(pa.prefill_attention_reference, layer=2), (q, kc, vc, st, kn, vn))
    np.testing.assert_array_equal(f(kc, vc, jnp.int32(0)), pa.prefill_attention(q, kc[0], vc[0], st, kn, vn, **kw))


def test_layer_under_vmap():
    """Grouped prefill: jax.vmap over prompts (q, stacked caches [V, L, B, ...], start, new rows), the layer
    shared: each prompt's output is the unbatched call's."""
    V = 2
    args, kc, vc = _layer_args(5, V)
    q, _, _, st, kn, vn = args
    kw = dict(interpret=True, block_k=16)
    f = lambda q, kc, vc, st, kn, vn, l: pa.prefill_attention(q, kc, vc, st, kn, vn, layer=l, **kw)
    out = jax.jit(jax.vmap(f, in_axes=(0,) * 6 + (None,)))(q, kc, vc, st, kn, vn, jnp.int32(2))
    for v in range(V):
        np.testing.assert_array_equal(out[v], pa.prefill_attention(*(a[v] for a in args), **kw))


def test_layer_lowers_for_h200_at_27b_shapes():
    Sd = jax.ShapeDtypeStruct
    structs = _structs(2048, 32768)
    structs[1:3] = [Sd((16,) + s.shape, s.dtype) for s in structs[1:3]]
    txt = lower_for_h200(lambda *a: pa.prefill_attention(*a[:6], layer=a[6]), *structs, Sd((), jnp.int32))
    assert "__gpu$xla.gpu.triton" in txt
