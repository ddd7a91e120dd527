"""Pallas causal prefill attention (kernels_pallas.prefill_attention) vs the jnp reference, and its CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import prefill_attention as pa
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature, attention_inputs, check_attention, rel_err


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
