"""The GDN tree kernel under jax.vmap (the pool's batched round: the slots become a grid axis), on the interpreter
and lowered for an abstract H200."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gdn_tree
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import gdn_inputs, random_tree_mask, rel_err
from tests.kernel_tests.test_gdn_tree import TOL, _structs


def _slots(S, N, Hk=2, Hv=4, d=16, n_pad=2, seed=0):
    """S slots' trees (each its own state, tree and padding rows), stacked on a leading axis."""
    rng = np.random.default_rng(seed)
    per = []
    for s in range(S):
        mask, valid = random_tree_mask(rng, 1, N, n_pad)
        q, k, v, g, beta, state = gdn_inputs(jax.random.PRNGKey(seed * 100 + s), 1, N, Hk, Hv, d, d, valid=valid)
        per.append((q, k, v, g, beta, mask, state))
    return tuple(jnp.stack([p[i] for p in per]) for i in range(7))


def _assert_each_slot(out, args):
    """out (o, W, G) of a vmapped call over args stacked by slot: each slot's is its own tree's (the reference)."""
    for s in range(args[0].shape[0]):
        ref = gdn_tree.gdn_masked_block_reference(*(x[s] for x in args))
        for name, a, b in zip(("o", "W", "G"), out, ref):
            assert a[s].shape == b.shape, name
            assert rel_err(a[s], b) < TOL, (s, name, rel_err(a[s], b))


def _pallas_rows(f, *args):
    """Per gdn_tree_block launch in f's jaxpr: (rows N of its tree, its operands' leading batch shape)."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                found.append((e.invars[2].aval.shape[-3], e.invars[2].aval.shape[:-3]))
            for p in e.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr"):
                        walk(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


@pytest.mark.parametrize("S,N", [(4, 32), (3, 21), (16, 8)])
def test_vmapped_slots_match_reference(S, N):
    """jax.vmap over slots (the pool's batched round, each slot its own tree and state): each slot's o / W / G are
    its own tree's, whatever the others hold; one launch, the slots a grid axis."""
    args = _slots(S, N, seed=S + N)
    f = jax.vmap(functools.partial(gdn_tree.gdn_masked_block, interpret=True))
    _assert_each_slot(f(*args), args)
    (rows, lead), = _pallas_rows(f, *args)
    assert (rows, lead) == (N, (S, 1)), (rows, lead)


def test_vmapped_slots_nested_and_shared_operands():
    """Two vmapped axes (2 x 2 slots of 16 nodes); an unbatched operand (one mask for every slot)."""
    S, N = 4, 16
    args = _slots(S, N, seed=9)
    kernel = functools.partial(gdn_tree.gdn_masked_block, interpret=True)
    nested = tuple(x.reshape((2, 2) + x.shape[1:]) for x in args)
    out = jax.vmap(jax.vmap(kernel))(*nested)
    _assert_each_slot([a.reshape((S,) + a.shape[2:]) for a in out], args)
    one_mask = args[:5] + (jnp.broadcast_to(args[5][:1], args[5].shape),) + args[6:]
    shared = jax.vmap(kernel, in_axes=(0, 0, 0, 0, 0, None, 0))(*args[:5], args[5][0], args[6])
    _assert_each_slot(shared, one_mask)


@pytest.mark.parametrize("S,N", [(4, 32), (8, 16)])
def test_vmapped_slots_lower_for_h200_at_27b_shapes(S, N):
    f = jax.vmap(gdn_tree.gdn_masked_block)
    structs = [jax.ShapeDtypeStruct((S,) + x.shape, x.dtype) for x in _structs(N=N)]
    txt = lower_for_h200(f, *structs)
    assert "triton" in txt
