"""DDTree tree selection (kernels_pallas.tree_build): the one-program Pallas kernel (interpret mode) vs the jnp
reference (the per-depth top-k scan) — identical trees, ties and -inf included — and its CUDA lowering."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import ops
from kernels_pallas import tree_build as T
from kernels_pallas._common import lower_for_h200
from kernels_pallas._testing import assert_kernel_signature


def inputs(seed, d, k, ties=False, neg_inf=0):
    """Per-depth top-k log-probs (rows sorted descending) and distinct random tokens."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((d, k)).astype(np.float32)
    if ties:  # many exact score ties across slots and depths
        x = np.round(2 * x) / 2
    x = -np.sort(-x, axis=1) - 3.0
    if neg_inf:
        x[:, k - neg_inf:] = -np.inf
    ids = rng.choice(10 ** 6, size=(d, k), replace=False).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(ids)


def test_signature_matches_reference():
    ref = assert_kernel_signature(T.tree_select, T.tree_select_reference)
    assert list(inspect.signature(ops.tree_select).parameters) == ref + ["kernels"]


@pytest.mark.parametrize("d,k,budget,ties,neg_inf", [
    (15, 64, 64, False, 0),   # production shape (D = 15, budget 64)
    (15, 64, 64, True, 0),    # exact ties everywhere
    (6, 32, 32, True, 5),     # ties and -inf (padding nodes)
    (5, 10, 10, False, 0),    # non-power-of-two budget / K / D
    (4, 5, 8, True, 0),       # K < budget (small vocabulary)
    (3, 2, 8, False, 1),      # fewer finite prefixes than the budget
    (1, 16, 16, False, 0),    # a single depth
    (7, 1, 1, False, 0),      # budget 1
])
def test_kernel_matches_reference(d, k, budget, ties, neg_inf):
    lp, ids = inputs(100 * d + k + budget, d, k, ties, neg_inf)
    ref = jax.jit(T.tree_select_reference, static_argnums=2)(lp, ids, budget)
    out = T.tree_select(lp, ids, budget, interpret=True)
    for name, a, b in zip(("tokens", "parents", "depths", "valid"), out, ref):
        assert a.shape == b.shape == (budget,) and a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("budget", [64, 128])
def test_lowers_for_h200(budget):
    S = jax.ShapeDtypeStruct
    text = lower_for_h200(lambda lp, ids: T.tree_select(lp, ids, budget), S((15, budget), jnp.float32),
                          S((15, budget), jnp.int32))
    assert "triton" in text
