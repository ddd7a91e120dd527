"""Pallas GDN decode step (kernels_pallas.gdn_decode) vs the jnp reference, and its CUDA lowering."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gdn_decode
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import gdn_inputs, rel_err


def test_signature_matches_reference():
    ref = list(inspect.signature(gdn_decode.gdn_step_reference).parameters)
    ker = inspect.signature(gdn_decode.gdn_step).parameters
    assert list(ker)[:len(ref)] == ref and ker["interpret"].default is False


@pytest.mark.parametrize("B,Hk,Hv,dk,dv,kw", [(2, 2, 6, 16, 32, dict(block_v=16)), (1, 1, 2, 24, 20, {})])
def test_step_matches_reference(B, Hk, Hv, dk, dv, kw):
    q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(dk), B, 1, Hk, Hv, dk, dv)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    ref = gdn_decode.gdn_step_reference(*args)
    out = gdn_decode.gdn_step(*args, interpret=True, **kw)
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        assert rel_err(a, b) < 1e-5
    # three steps in a row (state fed back)
    s_k, s_r = state, state
    for i in range(3):
        a_i = (q[:, 0] * (i + 1), k[:, 0], v[:, 0] - i, g[:, 0], beta[:, 0])
        o_k, s_k = gdn_decode.gdn_step(*a_i, s_k, interpret=True, **kw)
        o_r, s_r = gdn_decode.gdn_step_reference(*a_i, s_r)
    assert rel_err(o_k, o_r) < 1e-5 and rel_err(s_k, s_r) < 1e-5


def test_lowers_for_h200_at_27b_shapes():
    S, f = jax.ShapeDtypeStruct, jnp.float32
    structs = [S((1, 16, 128), f), S((1, 16, 128), f), S((1, 48, 128), f), S((1, 48), f), S((1, 48), f),
               S((1, 48, 128, 128), f)]
    txt = lower_for_h200(gdn_decode.gdn_step, *structs)
    assert "__gpu$xla.gpu.triton" in txt
