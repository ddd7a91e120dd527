"""Tests for jaxddtree.speculative.tree (run with JAX_PLATFORMS=cpu)."""

import functools
import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers_sampling import truncated_probs
from jaxddtree.speculative.tree import (PAD_TOKEN, Tree, accept, ancestor_mask, build_tree, check_truncation,
                                        posterior_tokens, top_k_rows, truncate)


# ----------------------------------------------------------------------------- oracles (host)

def build_tree_heap(root, draft_logits_np, budget):
    """Reference best-first heap (DDTree `build_ddtree_tree`), restated from the published algorithm.

    Scores are summed per-depth marginal log-probs over the top-K tokens of each depth,
    K = min(budget, V), depth limit D = rows of draft_logits. Returns (tokens, parents, depths)
    in pop order with the root at index 0.
    """
    logits = np.asarray(draft_logits_np, np.float64)
    d_max, vocab = logits.shape
    k = min(budget, vocab)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    logp = logits - lse[:, None]
    top_id = np.argsort(-logp, axis=-1, kind="stable")[:, :k]  # [D, K]
    top_lp = np.take_along_axis(logp, top_id, axis=-1)         # [D, K]

    tokens, parents, depths = [int(root)], [-1], [0]
    # entry: (-logw, rank tuple, parent index, depth, rank, logw)
    heap = [(-top_lp[0, 0], (0,), 0, 1, 0, top_lp[0, 0])]
    while heap and len(tokens) - 1 < budget:
        _, ranks, parent, depth, rank, logw = heapq.heappop(heap)
        n = len(tokens)
        tokens.append(int(top_id[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        if rank + 1 < k:  # next sibling
            w = logw - top_lp[depth - 1, rank] + top_lp[depth - 1, rank + 1]
            heapq.heappush(heap, (-w, ranks[:-1] + (rank + 1,), parent, depth, rank + 1, w))
        if depth < d_max:  # first child
            w = logw + top_lp[depth, 0]
            heapq.heappush(heap, (-w, ranks + (0,), n, depth + 1, 0, w))
    return np.array(tokens), np.array(parents), np.array(depths)


def token_paths(tokens, parents, valid=None):
    """Token path (depth 1..d) of every valid node, by walking parents on the host."""
    n = len(tokens)
    valid = np.ones(n, bool) if valid is None else valid
    paths = [()]
    for i in range(1, n):
        paths.append(paths[parents[i]] + (int(tokens[i]),) if valid[i] else None)
    return paths


def python_mask(tree):
    t = jax.tree.map(np.asarray, tree)
    n = len(t.tokens)
    m = np.eye(n, dtype=bool)
    for i in range(1, n):
        if t.valid[i]:
            j = t.parents[i]
            while j >= 0:
                m[i, j] = True
                j = t.parents[j]
    return m


def python_walk(tree, posterior):
    """The reference `follow_verified_tree`: walk child maps while the posterior matches."""
    t = jax.tree.map(np.asarray, tree)
    children = [dict() for _ in t.tokens]
    for i in range(1, len(t.tokens)):
        if t.valid[i]:
            children[t.parents[i]][int(t.tokens[i])] = i
    path, cur = [0], 0
    while int(posterior[cur]) in children[cur]:
        cur = children[cur][int(posterior[cur])]
        path.append(cur)
    return path


# ----------------------------------------------------------------------------- jitted fns (one compile per shape)

@functools.partial(jax.jit, static_argnames=("budget", "block"))
def _build(root, logits, budget, block=128):
    tree = build_tree(root, logits, budget, block)
    return tree, ancestor_mask(tree)


_accept = jax.jit(accept)
_mask = jax.jit(ancestor_mask)


def draft_logits(seed, d, v, kind):
    rng = np.random.default_rng(seed)
    if kind == "flat":  # bushy trees
        return (0.5 * rng.standard_normal((d, v))).astype(np.float32)
    # peaky: one strong token per depth -> long chains
    x = rng.standard_normal((d, v)).astype(np.float32)
    x[np.arange(d), rng.integers(0, v, d)] += 8.0
    return x


def check_structure(tree, mask):
    t = jax.tree.map(np.asarray, tree)
    n = len(t.tokens)
    assert t.parents[0] == -1 and t.depths[0] == 0 and t.valid[0]
    assert np.all(t.parents[1:] < np.arange(1, n)) and np.all(t.parents[1:] >= 0)
    v = t.valid
    assert np.all(t.depths[1:][v[1:]] == t.depths[t.parents[1:][v[1:]]] + 1)
    assert np.all(v[t.parents[1:][v[1:]]])  # valid nodes have valid parents
    # valid nodes first, padding after, with the padding convention
    nv = v.sum()
    assert v[:nv].all() and not v[nv:].any()
    assert np.all(t.tokens[~v] == PAD_TOKEN) and np.all(t.parents[~v] == 0)
    assert np.all(t.depths[~v] == 1)
    # siblings carry distinct tokens
    pairs = {(int(p), int(tok)) for p, tok in zip(t.parents[1:][v[1:]], t.tokens[1:][v[1:]])}
    assert len(pairs) == nv - 1
    np.testing.assert_array_equal(np.asarray(mask), python_mask(tree))


# ----------------------------------------------------------------------------- build_tree vs heap

@pytest.mark.parametrize("budget,block", [(1, 128), (2, 128), (3, 128), (7, 128), (16, 128), (64, 128), (128, 128),
                                          (512, 128), (7, 8), (16, 8), (61, 8)])  # block 8: the blocked top-k
@pytest.mark.parametrize("kind", ["peaky", "flat"])
def test_build_tree_matches_heap(budget, block, kind):
    d, v = 15, 1000
    logits = draft_logits(1000 * budget + (kind == "flat"), d, v, kind)
    tree, mask = _build(jnp.int32(7), jnp.asarray(logits), budget, block)
    check_structure(tree, mask)
    t = jax.tree.map(np.asarray, tree)
    assert t.tokens[0] == 7 and t.valid.all() and len(t.tokens) == budget + 1

    h_tok, h_par, h_dep = build_tree_heap(7, logits, budget)
    assert len(h_tok) == budget + 1
    dev_paths = token_paths(t.tokens, t.parents)
    heap_paths = token_paths(h_tok, h_par)
    assert set(dev_paths) == set(heap_paths)
    # parent relation: each node's parent's path (compared through the path -> parent-path maps)
    dev_par = {dev_paths[i]: dev_paths[t.parents[i]] for i in range(1, len(dev_paths))}
    heap_par = {heap_paths[i]: heap_paths[h_par[i]] for i in range(1, len(heap_paths))}
    assert dev_par == heap_par
    assert {p: len(p) for p in dev_paths} == {heap_paths[i]: h_dep[i] for i in range(len(h_dep))}

    # device order: path scores non-increasing (the heap's pop order, up to fp32 rounding)
    x = logits.astype(np.float64)
    lp = x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1))[:, None]
    score = np.array([sum(lp[k, tok] for k, tok in enumerate(p)) for p in dev_paths[1:]])
    assert np.all(np.diff(score) <= 1e-4)
    if kind == "peaky" and budget >= 16:
        assert t.depths.max() >= 8  # long chains exercised
    if kind == "flat" and budget >= 64:
        assert (t.parents == 0).sum() >= 8  # bushy


@pytest.mark.parametrize("shape,k,block", [((3, 1000), 16, 8), ((2, 997), 5, 16), ((4, 300), 7, 4), ((2, 64), 40, 8)])
def test_top_k_rows_equals_lax_top_k(shape, k, block):
    rng = np.random.default_rng(k)
    x = rng.normal(size=shape).astype(np.float32)
    x[0, ::7] = x[0, 3]  # exact ties, across blocks
    x[-1, -3:] = -np.inf
    vals, ids = top_k_rows(jnp.asarray(x), k, block)
    ref_vals, ref_ids = jax.lax.top_k(jnp.asarray(x), k)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(ref_vals))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))


@pytest.mark.parametrize("v,budget,d,expected", [(5, 64, 3, 64), (3, 64, 2, 12), (2, 16, 1, 2)])
def test_build_tree_small_vocab(v, budget, d, expected):
    logits = draft_logits(v + d, d, v, "flat")
    tree, mask = _build(jnp.int32(1), jnp.asarray(logits), budget)
    check_structure(tree, mask)
    t = jax.tree.map(np.asarray, tree)
    h_tok, h_par, _ = build_tree_heap(1, logits, budget)
    assert len(h_tok) - 1 == expected == t.valid.sum() - 1
    dev_paths = [p for p in token_paths(t.tokens, t.parents, t.valid) if p is not None]
    assert set(dev_paths) == set(token_paths(h_tok, h_par))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_build_tree_ties(seed):
    # integer logits -> many exact score ties: node sets may legitimately differ from the heap's,
    # but the tree stays prefix-closed/topological and the multiset of scores is the same top-B.
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 3, (5, 6)).astype(np.float32)
    tree, mask = _build(jnp.int32(0), jnp.asarray(logits), 50)
    check_structure(tree, mask)
    t = jax.tree.map(np.asarray, tree)
    h_tok, h_par, _ = build_tree_heap(0, logits, 50)
    x = logits.astype(np.float64)
    lp = x - np.log(np.exp(x).sum(-1))[:, None]

    def scores(paths):
        return sorted(round(sum(lp[k, tok] for k, tok in enumerate(p)), 4) for p in paths[1:])

    assert scores(token_paths(t.tokens, t.parents)) == scores(token_paths(h_tok, h_par))


def test_neg_inf_logits_become_padding():
    logits = np.zeros((2, 4), np.float32)
    logits[:, 2:] = -np.inf  # two tokens per depth with probability 0
    tree, mask = _build(jnp.int32(0), jnp.asarray(logits), 8)
    check_structure(tree, mask)
    assert int(tree.valid.sum()) == 1 + 2 + 4


# ----------------------------------------------------------------------------- ancestor mask

def test_ancestor_mask_hand_built():
    # root -> 1 -> 2 -> 4 ; root -> 3 ; 5, 6 padding
    tree = Tree.from_parents([9, 1, 2, 3, 4, 0, 0], [-1, 0, 1, 0, 2, 0, 0],
                             valid=[1, 1, 1, 1, 1, 0, 0], max_depth=3)
    m = np.asarray(_mask(tree))
    np.testing.assert_array_equal(m, python_mask(tree))
    assert m[4].tolist() == [1, 1, 1, 0, 1, 0, 0]
    assert m[5].tolist() == [0, 0, 0, 0, 0, 1, 0] and not m[:5, 5:].any()


def test_ancestor_mask_deep_chain():
    n = 40  # depth 39 > max_depth steps of 2**k must still cover it
    tree = Tree.from_parents(np.arange(n), np.arange(-1, n - 1))
    np.testing.assert_array_equal(np.asarray(_mask(tree)), np.tril(np.ones((n, n), bool)))


# ----------------------------------------------------------------------------- accept

def check_accept(tree, posterior, expected_len=None):
    posterior = np.asarray(posterior, np.int32)
    acc = jax.tree.map(np.asarray, _accept(tree, jnp.asarray(posterior)))
    walk = python_walk(tree, posterior)
    if expected_len is not None:
        assert len(walk) == expected_len
    assert acc.leaf == walk[-1] and acc.num_accepted == len(walk)
    assert acc.bonus == posterior[walk[-1]]
    d = tree.max_depth
    assert acc.path.shape == (d + 1,)
    assert acc.path[:len(walk)].tolist() == walk
    assert np.all(acc.path[len(walk):] == walk[-1])
    return acc


def chain_tree(n=16):
    return Tree.from_parents(100 + np.arange(n), np.arange(-1, n - 1), max_depth=n - 1)


@pytest.mark.parametrize("length", [1, 2, 8, 16])
def test_accept_chain(length):
    tree = chain_tree(16)  # node i has token 100 + i
    post = np.full(16, 5)
    post[:length - 1] = 100 + np.arange(1, length)  # posterior[i] = token of node i+1
    check_accept(tree, post, length)


@pytest.mark.parametrize("hit", [None, 1, 5, 15])
def test_accept_star(hit):
    tree = Tree.from_parents(np.arange(16) + 50, [-1] + [0] * 15, max_depth=15)
    post = np.zeros(16, np.int32)
    post[0] = 50 + hit if hit else 3
    check_accept(tree, post, 2 if hit else 1)


@pytest.mark.parametrize("length", [1, 2, 8, 16])
def test_accept_bushy(length):
    # a DDTree-built tree (peaky logits: deep chains plus branches); steer the posterior
    # along a path to a node at depth length-1, with random posteriors elsewhere
    logits = draft_logits(3, 15, 50, "peaky")
    tree, _ = _build(jnp.int32(0), jnp.asarray(logits), 64)
    t = jax.tree.map(np.asarray, tree)
    rng = np.random.default_rng(length)
    post = rng.integers(0, 50, 65).astype(np.int32)
    if length > 1:
        target = int(np.flatnonzero(t.depths == length - 1)[0])
        j = target
        while j > 0:
            post[t.parents[j]] = t.tokens[j]
            j = t.parents[j]
        post[target] = 50  # out of vocabulary: stop there
    else:
        post[0] = 50
    acc = check_accept(tree, post, length)
    if length > 1:
        assert acc.leaf == target


def test_accept_random_posteriors():
    logits = draft_logits(11, 15, 8, "flat")
    tree, _ = _build(jnp.int32(0), jnp.asarray(logits), 64)
    rng = np.random.default_rng(0)
    lens = [int(check_accept(tree, rng.integers(0, 8, 65)).num_accepted) for _ in range(30)]
    assert max(lens) >= 3 and min(lens) >= 1


def test_padding_never_accepted():
    # node 3 is padding; hand it a token the posterior matches: still never accepted
    tree = Tree.from_parents([9, 1, 2, 0], [-1, 0, 1, 0], valid=[1, 1, 1, 0], max_depth=2)
    tree = Tree(tree.tokens.at[3].set(7), tree.parents, tree.depths, tree.valid, tree.max_depth)
    acc = _accept(tree, jnp.array([7, 3, 3, 3]))
    assert int(acc.leaf) == 0 and int(acc.num_accepted) == 1 and int(acc.bonus) == 7
    # default padding token -1 against a (impossible) -1 posterior
    tree = Tree.from_parents([9, 1, 2, 0], [-1, 0, 1, 0], valid=[1, 1, 1, 0], max_depth=2)
    acc = _accept(tree, jnp.array([-1, 2, 3, 3]))
    assert int(acc.leaf) == 0


# ----------------------------------------------------------------------------- posterior tokens

def test_posterior_greedy():
    logits = jax.random.normal(jax.random.key(0), (9, 33))
    want = np.argmax(np.asarray(logits), -1)
    key = jax.random.key(1)
    np.testing.assert_array_equal(posterior_tokens(logits, 0.0, key), want)
    f = jax.jit(posterior_tokens)  # traced temperature
    np.testing.assert_array_equal(f(logits, jnp.float32(0.0), key), want)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_posterior_sampling_frequencies(temperature):
    n, v, s = 4, 6, 20000
    logits = jax.random.normal(jax.random.key(0), (n, v)) * 1.5
    keys = jax.random.split(jax.random.key(42), s)
    f = jax.jit(jax.vmap(posterior_tokens, in_axes=(None, None, 0)))
    samples = np.asarray(f(logits, jnp.float32(temperature), keys))  # [S, N] (traced T)
    probs = np.asarray(jax.nn.softmax(logits / temperature, -1))
    freq = np.stack([np.bincount(samples[:, i], minlength=v) / s for i in range(n)])
    np.testing.assert_allclose(freq, probs, atol=0.015)
    # nodes sample independently: joint of nodes 0 and 1 ~ product of marginals
    joint = np.histogram2d(samples[:, 0], samples[:, 1], bins=[np.arange(v + 1)] * 2)[0] / s
    np.testing.assert_allclose(joint, np.outer(freq[0], freq[1]), atol=0.01)
    # static temperature gives the same draws as the traced one
    g = jax.jit(jax.vmap(lambda l, k: posterior_tokens(l, temperature, k), in_axes=(None, 0)))
    np.testing.assert_array_equal(np.asarray(g(logits, keys[:200])), samples[:200])


def test_posterior_top_k_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2))
    keys = jax.random.split(jax.random.key(3), 4000)
    f = jax.jit(jax.vmap(lambda k, tk, tp: posterior_tokens(logits, 1.0, k, top_k=tk, top_p=tp),
                         in_axes=(0, None, None)), static_argnums=(1, 2))
    s = np.asarray(f(keys, 2, None))
    assert set(np.unique(s)) <= {0, 1}
    assert abs((s == 0).mean() - 0.5 / 0.8) < 0.03
    s = np.asarray(f(keys, None, 0.7))  # 0.5 < 0.7 -> keep {0, 1}
    assert set(np.unique(s)) == {0, 1}
    s = np.asarray(f(keys, None, 0.85))  # 0.8 < 0.85 -> keep {0, 1, 2}
    assert set(np.unique(s)) == {0, 1, 2}


# (top_k, top_p, min_p): each alone, together, and edge values (a 1-token nucleus, min_p near 1, top_k >= V)
TRUNCATIONS = [(0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.6, 0.0), (0, 1.0, 0.2), (5, 0.9, 0.05), (2, 0.3, 0.5),
               (0, 1e-6, 0.0), (0, 1.0, 0.999), (1000, 1.0, 0.0), (1, 1.0, 0.0)]


@pytest.mark.parametrize("method", ["sort", "bisect"])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_truncate_matches_host_definition(temperature, method):
    """One jit with traced values for every setting; the kept set equals the host restatement's."""
    logits = jax.random.normal(jax.random.key(5), (16, 40)) * 2.0
    logits = logits.at[3].set(jnp.round(logits[3]))  # a row of ties
    logits = logits.at[4].set(-jnp.abs(logits[4]) - 50.0)  # negative logits only
    traces = []

    @jax.jit
    def kept(z, k, p, m):
        traces.append(1)
        return jnp.isfinite(truncate(z / temperature, k, p, m, method=method))

    for k, p, m in TRUNCATIONS:
        got = np.asarray(kept(logits, jnp.int32(k), jnp.float32(p), jnp.float32(m)))
        want = truncated_probs(np.asarray(logits), temperature, k, p, m) > 0
        np.testing.assert_array_equal(got, want, err_msg=str((k, p, m)))
        assert got.sum(-1).min() >= 1
    assert len(traces) == 1
    # each control really truncates here, and the nucleus is the smallest set reaching top_p
    q = truncated_probs(np.asarray(logits), temperature, 0, 0.6, 0.0)
    full = np.asarray(jax.nn.softmax(logits / temperature, -1), np.float64)
    mass = np.where(q > 0, full, 0).sum(-1)
    smallest = np.where(q > 0, full, np.inf).min(-1)
    untied = np.arange(16) != 3  # with ties at the boundary the set may be larger than the smallest
    assert (mass >= 0.6 - 1e-6).all() and (mass - smallest < 0.6)[untied].all()


@pytest.mark.parametrize("method", ["sort", "bisect"])
def test_truncate_ties_kept(method):
    z = jnp.asarray([[3.0, 1.0, 2.0, 2.0, -0.0, 2.0, 0.0]])
    kept = lambda *a: np.isfinite(np.asarray(truncate(z, *a, method=method)))
    assert kept(2).tolist() == [[True, False, True, True, False, True, False]]
    assert kept(1).sum() == 1 and kept(6).sum() == 7  # -0.0 ties +0.0
    np.testing.assert_array_equal(kept(2), truncated_probs(z, 1.0, 2) > 0)


def test_truncate_methods_agree_on_a_large_vocabulary():
    logits = jax.random.normal(jax.random.key(2), (6, 5000)) * 3.0
    f = jax.jit(lambda z, k, p, m, method: truncate(z, k, p, m, method=method), static_argnames="method")
    for k, p, m in [(20, 0.95, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.01), (300, 0.9, 0.001)]:
        a = np.isfinite(np.asarray(f(logits, k, p, m, "sort")))
        b = np.isfinite(np.asarray(f(logits, k, p, m, "bisect")))
        np.testing.assert_array_equal(a, b)
        assert (a.sum(-1) < 5000).all()


@pytest.mark.parametrize("k,p,m", [(3, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.3), (4, 0.8, 0.1)])
def test_posterior_truncated_frequencies(k, p, m):
    """Samples (traced temperature and truncation) follow the renormalised truncated distribution."""
    n, v, s = 3, 7, 20000
    logits = jax.random.normal(jax.random.key(1), (n, v)) * 1.5
    keys = jax.random.split(jax.random.key(9), s)
    f = jax.jit(jax.vmap(posterior_tokens, in_axes=(None, None, 0, None, None, None)))
    samples = np.asarray(f(logits, jnp.float32(0.8), keys, jnp.int32(k), jnp.float32(p), jnp.float32(m)))
    want = truncated_probs(np.asarray(logits), 0.8, k, p, m)
    freq = np.stack([np.bincount(samples[:, i], minlength=v) / s for i in range(n)])
    assert (freq[want == 0] == 0).all()
    assert (want == 0).any()  # the setting removes tokens
    np.testing.assert_allclose(freq, want, atol=0.015)
    # greedy ignores the truncation
    np.testing.assert_array_equal(f(logits, jnp.float32(0.0), keys[:2], jnp.int32(k), jnp.float32(p),
                                    jnp.float32(m))[0], np.argmax(np.asarray(logits), -1))


@pytest.mark.parametrize("args,match", [
    ((-1, 1.0, 0.0), "top_k must be an integer >= 0"), ((1.5, 1.0, 0.0), "top_k must be an integer"),
    ((True, 1.0, 0.0), "top_k must be an integer"), ((0, 0.0, 0.0), r"top_p must be in \(0, 1\]"),
    ((0, 1.5, 0.0), "top_p must be in"), ((0, float("nan"), 0.0), "top_p must be in"),
    ((0, 1.0, 1.0), r"min_p must be in \[0, 1\)"), ((0, 1.0, -0.1), "min_p must be in"),
    ((0, "x", 0.0), "must be numbers"),
])
def test_check_truncation(args, match):
    with pytest.raises(ValueError, match=match):
        check_truncation(*args)
    assert check_truncation(np.int64(3), 1, 0) == (3, 1.0, 0.0)


# ----------------------------------------------------------------------------- jit: compile once

def test_jit_compiles_once():
    traces = []

    @functools.partial(jax.jit, static_argnames="budget")
    def round_fn(root, logits, posterior, budget):
        traces.append(1)
        tree = build_tree(root, logits, budget)
        return tree, accept(tree, posterior)

    for seed in range(4):
        logits = draft_logits(seed, 15, 100, "peaky")
        post = np.random.default_rng(seed).integers(0, 100, 33).astype(np.int32)
        tree, acc = round_fn(jnp.int32(seed), jnp.asarray(logits), jnp.asarray(post), budget=32)
        assert int(tree.tokens[0]) == seed
        walk = python_walk(tree, post)
        assert int(acc.leaf) == walk[-1]
    assert len(traces) == 1
    assert round_fn._cache_size() == 1
