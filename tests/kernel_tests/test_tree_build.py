"""DDTree tree selection (kernels_pallas.tree_build.tree_select, XLA) against a brute-force enumeration of every
prefix of the per-depth top-K (ties and -inf included), and ops.tree_select on both kernel paths."""

import itertools

import jax
import numpy as np
import pytest

from kernels_pallas import ops
from kernels_pallas import tree_build as T


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
    return x, ids


def brute_force(lp, ids, budget):
    """Every prefix (r_1..r_d) of token ranks, scored by its summed log-prob (float32 in the order the scan adds),
    ordered by (score desc, depth asc, then the rank tuple) -> the best `budget` as (score, depth) pairs and the
    token path of each."""
    d_max, k = lp.shape
    nodes = []
    for d in range(1, d_max + 1):
        for ranks in itertools.product(range(k), repeat=d):
            s = np.float32(0)
            for j, r in enumerate(ranks):
                s = np.float32(s + lp[j, r])
            if s > -np.inf:
                nodes.append((-float(s), d, ranks))
    nodes.sort()
    return nodes[:budget]


@pytest.mark.parametrize("d,k,budget,ties,neg_inf", [
    (3, 4, 8, False, 0), (3, 4, 20, True, 0), (4, 3, 16, False, 1), (2, 5, 6, True, 2), (1, 4, 6, False, 0),  # (K <= budget: build_tree passes the top-min(budget, V))
    (3, 2, 30, False, 0),  # fewer prefixes (14) than the budget: padding nodes
])
def test_matches_brute_force(d, k, budget, ties, neg_inf):
    lp, ids = inputs(100 * d + k + budget, d, k, ties, neg_inf)
    tokens, parents, depths, valid = (np.asarray(a) for a in jax.jit(T.tree_select, static_argnums=2)(lp, ids, budget))
    best = brute_force(lp, ids, budget)
    n = len(best)
    assert valid.tolist() == [True] * n + [False] * (budget - n)
    assert (tokens[n:] == T.PAD_TOKEN).all() and (parents[n:] == 0).all() and (depths[n:] == 1).all()
    # each node's path of tokens, rebuilt from the parents (node 0 = the root)
    paths = []
    for i in range(n):
        path, j = [], i + 1
        while j:
            path.append(int(tokens[j - 1]))
            assert parents[j - 1] < j
            j = int(parents[j - 1])
        paths.append(tuple(reversed(path)))
    assert [len(p) for p in paths] == depths[:n].tolist()
    # the same multiset of (score, depth) as the brute force, in the same order; the same nodes where no tie
    score = lambda p: float(sum(np.float32(lp[j, list(ids[j]).index(t)]) for j, t in enumerate(p)))
    np.testing.assert_allclose([score(p) for p in paths], [-s for s, _, _ in best], rtol=0, atol=1e-5)
    assert [len(p) for p in paths] == [dd for _, dd, _ in best]
    if not ties:
        assert paths == [tuple(int(ids[j, r]) for j, r in enumerate(rk)) for _, _, rk in best]


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_ops_entry_is_the_xla_selection(kernels):
    lp, ids = inputs(3, 15, 63)
    ref = T.tree_select(lp, ids, 63)
    out = ops.tree_select(lp, ids, 63, kernels=kernels)
    for a, b in zip(out, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
