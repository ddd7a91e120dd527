"""DDTree draft tree: device-side construction, ancestor mask, posterior sampling and acceptance.

Everything here is pure `jax.numpy`/`lax`, jit-able, static-shaped and free of host syncs.

Shape letters: N = 1 + budget tree nodes (static), B = budget, D = draft depth (rows of the draft
logits, 15 in production), V = vocabulary, K = min(B, V) top tokens kept per depth.

Tree conventions (see `Tree`):
  * node 0 is the root (the last committed token); nodes 1..N-1 are drafted tokens;
  * `parents[0] = -1`, `parents[i] < i` (topological order), `depths[i] = depths[parents[i]] + 1`;
  * valid nodes come first, in order of non-increasing draft score (ties: shallower first);
  * padding nodes (unused budget) have `valid = False`, `tokens = -1` (equals no posterior token),
    `parents = 0`, `depths = 1`; their ancestor-mask row is self-only and they are nobody's ancestor,
    and `accept` never accepts them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxddtree.model import layout as layout_lib
from kernels_pallas import ops

PAD_TOKEN = -1
GREEDY_EPS = 1e-5  # temperatures below this are greedy (same threshold as the reference `sample`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    tokens: jax.Array   # [N] int32, tokens[0] = root token, padding = -1
    parents: jax.Array  # [N] int32, parents[0] = -1, parents[i] < i; padding -> 0
    depths: jax.Array   # [N] int32, depths[0] = 0; padding -> 1
    valid: jax.Array    # [N] bool, valid[0] = True
    max_depth: int = dataclasses.field(metadata=dict(static=True))  # D: static bound on depths

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @staticmethod
    def from_parents(tokens, parents, valid=None, max_depth=None) -> "Tree":
        """Host-side helper (numpy) for hand-built trees: computes depths from `parents`.

        Invalid nodes are normalised to the padding convention (token -1, parent 0, depth 1).
        """
        tokens = np.asarray(tokens, np.int32).copy()
        parents = np.asarray(parents, np.int32).copy()
        n = tokens.shape[0]
        valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool).copy()
        valid[0] = True
        parents[0] = -1
        tokens[~valid] = PAD_TOKEN
        parents[1:][~valid[1:]] = 0
        depths = np.zeros(n, np.int32)
        for i in range(1, n):
            assert 0 <= parents[i] < i, "parents must satisfy 0 <= parents[i] < i"
            assert not valid[i] or valid[parents[i]], "a valid node needs a valid parent"
            depths[i] = depths[parents[i]] + 1 if valid[i] else 1
        if max_depth is None:
            max_depth = int(depths[valid].max(initial=0))
        return Tree(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(depths),
                    jnp.asarray(valid), max_depth=int(max_depth))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Acceptance:
    leaf: jax.Array          # [] int32, index of the deepest accepted node (0 = root only)
    num_accepted: jax.Array  # [] int32, depths[leaf] + 1 = tokens committed (root included)
    path: jax.Array          # [D+1] int32, root->leaf node indices; entries past depths[leaf] = leaf
    bonus: jax.Array         # [] int32, posterior[leaf]: next round's root token


def top_k_rows(x: jax.Array, k: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, k)` over the last axis of x [R, V], without a top-k over the whole row when V is large.

    The k largest entries of a row lie in the k blocks (of `block` consecutive entries) with the largest
    maxima, so: block maxima [R, V/block] -> top-k blocks -> top-k of their k*block entries, taken in index
    order (ties resolve towards the lower index, as `lax.top_k`). Falls back to `lax.top_k` when the row
    has fewer than 2k blocks."""
    R, V = x.shape
    nb = -(-V // block)
    if nb < 2 * k:
        return jax.lax.top_k(x, k)
    xp = jnp.pad(x, ((0, 0), (0, nb * block - V)), constant_values=-jnp.inf).reshape(R, nb, block)
    _, best = jax.lax.top_k(xp.max(axis=-1), k)  # [R, k] block ids
    best = jnp.sort(best, axis=-1)  # index order
    cand = jnp.take_along_axis(xp, best[:, :, None], axis=1).reshape(R, k * block)  # [R, k*block]
    vals, pos = jax.lax.top_k(cand, k)
    ids = (best[:, :, None] * block + jnp.arange(block, dtype=best.dtype)).reshape(R, k * block)
    return vals, jnp.take_along_axis(ids, pos, axis=1).astype(jnp.int32)


def build_tree(root_token, draft_logits, budget: int, topk_block: int = 128, kernels: str = "xla", ids=None) -> Tree:
    """Exact device version of the reference best-first heap (`build_ddtree_tree`).

    Returns the `budget` prefixes with the highest summed draft log-probability (per-depth
    log_softmax in fp32, top-K tokens per depth, K = min(budget, V)), ordered by (score desc,
    depth asc) so that parents precede children. If fewer than `budget` prefixes exist (V**1 + ... +
    V**D < budget) or some have log-prob -inf, the remaining slots are padding nodes.

    root_token: [] int; draft_logits: [D, V] (depth d+1 marginals in row d); budget: static int;
    topk_block: block size of the per-depth top-K (`top_k_rows`); kernels: "xla" | "pallas" for the
    selection from the per-depth top-K (`kernels_pallas.tree_build`: the same trees, one kernel).
    ids [Vp] (optional): draft_logits are a draft vocabulary's columns [D, Vp] (`draft_vocab.subset_logits`, -inf
    on padding columns) and ids maps a column to its token id: the top-K runs over the Vp columns, so the tree is
    the one of the full-vocabulary logits with -inf outside the subset (the ids are sorted: ties order alike).
    """
    d_max, vocab = draft_logits.shape
    k = min(int(budget), vocab)

    # log_softmax of the K best tokens only (jax.nn.log_softmax's formula: x - max - log Σ exp(x - max)),
    # all depths at once
    x = draft_logits.astype(jnp.float32)                                     # [D, V]
    m = jnp.max(x, axis=-1, keepdims=True)
    lse = jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True))
    top_x, top_id = top_k_rows(x, k, topk_block)                           # [D, K] sorted desc
    top_lp = (top_x - m) - lse
    if ids is not None:
        top_id = jnp.take(ids, top_id, axis=0)
    tokens, parents, depths, valid = ops.tree_select(top_lp, top_id, int(budget), kernels=kernels)  # [B] each

    root = jnp.asarray(root_token, jnp.int32).reshape(1)
    return Tree(
        tokens=jnp.concatenate([root, tokens]),
        parents=jnp.concatenate([jnp.full((1,), -1, jnp.int32), parents]),
        depths=jnp.concatenate([jnp.zeros((1,), jnp.int32), depths]),
        valid=jnp.concatenate([jnp.ones((1,), bool), valid]),
        max_depth=d_max,
    )


def ancestor_mask(tree: Tree) -> jax.Array:
    """M [N, N] bool: M[i, j] iff j == i or j is an ancestor of i. Padding rows/columns: self only."""
    return layout_lib.ancestor_mask(tree.parents, tree.valid, tree.max_depth)


def check_truncation(top_k=0, top_p=1.0, min_p=0.0) -> tuple[int, float, float]:
    """(top_k, top_p, min_p) as (int, float, float), or ValueError (one line) for a value outside its range:
    top_k an integer >= 0 (0 = off), 0 < top_p <= 1 (1 = off), 0 <= min_p < 1 (0 = off)."""
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    try:
        top_p, min_p = float(top_p), float(min_p)
    except (TypeError, ValueError):
        raise ValueError(f"top_p and min_p must be numbers, got {top_p!r} and {min_p!r}") from None
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not 0 <= min_p < 1:
        raise ValueError(f"min_p must be in [0, 1) (0 = off), got {min_p}")
    return int(top_k), top_p, min_p


def truncates(top_k=0, top_p=1.0, min_p=0.0) -> bool:
    """Whether these (checked) values remove any token at all."""
    return top_k > 0 or top_p < 1 or min_p > 0


def truncate(z, top_k=0, top_p=1.0, min_p=0.0, method: str = "bisect") -> jax.Array:
    """Scaled logits z [N, V] (logits / T) -> z with every token outside the truncated set at -inf.

    The kept set of a row, in descending order of z (= of the probabilities p = softmax(z)):
      * top_k > 0: the k most probable tokens;
      * top_p < 1: the smallest prefix whose mass is >= top_p (a token is kept iff the mass of the tokens
        before it is < top_p; mass of the full softmax, before any other truncation);
      * min_p > 0: the tokens with p >= min_p * p_max;
    the intersection of the three (each is a prefix of the order, so it is the shortest of them; never empty:
    the most probable token always stays). Ties: every token whose z equals the last kept token's is kept too
    (as vLLM's top-k), so the set never depends on how a sort orders equal values. Sampling from the result is
    sampling from the renormalised truncated distribution. The values may be Python numbers or traced scalars
    (one compilation for all of them); they must be valid (`check_truncation`).

    method: "bisect" (default: no sort. The kept set is {z >= v}, v the smallest value u such that fewer than
    top_k tokens have z > u and their mass is below top_p, raised to the logit of min_p * p_max; v is found exactly
    by a 32-step bisection over the float32 order, each step one fused pass over the row) or "sort" (the
    reference: one sort of each row, the definition above step by step). The two agree up to float rounding of
    the mass sums (tests/test_tree.py; benchmarks/bench_sampling.py times both).
    """
    z = z.astype(jnp.float32)
    if method == "bisect":
        return _truncate_bisect(z, top_k, top_p, min_p)
    if method != "sort":
        raise ValueError(f"method must be 'sort' or 'bisect', got {method!r}")
    V = z.shape[-1]
    zs = jnp.sort(z, axis=-1)[:, ::-1]                                      # [N, V] descending
    p = jnp.exp(zs - zs[:, :1])
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    before = jnp.cumsum(p, axis=-1) - p                                     # mass of the better tokens
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    min_p = jnp.asarray(min_p, jnp.float32)
    rank = jnp.arange(V, dtype=jnp.int32)[None]
    keep = (rank < jnp.where(top_k > 0, top_k, V)) \
        & ((before < top_p) | (top_p >= 1)) \
        & (zs >= zs[:, :1] + jnp.log(min_p))                                # p >= min_p p_max, in log space
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)         # [N, 1]
    thresh = jnp.take_along_axis(zs, n_keep - 1, axis=-1)                   # the last kept value
    return jnp.where(z >= thresh, z, -jnp.inf)


def _order_keys(z):
    """float32 [..] -> uint32 keys in the same order (-0.0 counted as +0.0)."""
    b = jax.lax.bitcast_convert_type(jnp.where(z == 0, jnp.float32(0), z), jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(1 << 31))


def _truncate_bisect(z, top_k, top_p, min_p):
    V = z.shape[-1]
    zmax = jnp.max(z, axis=-1, keepdims=True)
    p = jnp.exp(z - zmax)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    keys = _order_keys(z)                                                     # [N, V]
    k = jnp.asarray(top_k, jnp.int32)
    k = jnp.where(k > 0, k, V)
    top_p = jnp.asarray(top_p, jnp.float32)

    def ok(u):  # [N] threshold keys -> [N] bool: few enough and light enough tokens above u (monotone in u)
        above = keys > u[:, None]
        count = jnp.sum(above, axis=-1)
        mass = jnp.sum(jnp.where(above, p, 0), axis=-1)
        return (count < k) & ((mass < top_p) | (top_p >= 1))

    def step(_, lh):  # invariant: ok(hi); the answer lies in [lo, hi]
        lo, hi = lh
        mid = lo + (hi - lo) // 2
        good = ok(mid)
        return jnp.where(good, lo, mid + 1), jnp.where(good, mid, hi)

    n = z.shape[0]
    lo, hi = jax.lax.fori_loop(0, 32, step, (jnp.zeros((n,), jnp.uint32), jnp.max(keys, axis=-1)))
    floor = _order_keys(zmax[:, 0] + jnp.log(jnp.asarray(min_p, jnp.float32)))  # p >= min_p p_max
    thresh = jnp.maximum(hi, floor)
    return jnp.where(keys >= thresh[:, None], z, -jnp.inf)


def posterior_tokens(logits, temperature, key, top_k=None, top_p=None, min_p=None) -> jax.Array:
    """[N, V] target logits -> [N] int32 posterior token per node.

    Greedy (argmax) when temperature < 1e-5; otherwise one independent sample per node from
    softmax(logits / T), truncated by `truncate` when any of top_k / top_p / min_p is given (None: that
    control off; all None: no truncation and none of its cost). `temperature` and the truncation values may be Python
    numbers (the greedy branch chosen at trace time) or traced scalars. Truncation never removes the argmax, so
    greedy decoding ignores it.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [N]
    if isinstance(temperature, (int, float)) and temperature < GREEDY_EPS:
        return greedy
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), GREEDY_EPS)
    z = logits / t  # [N, V]
    if top_k is not None or top_p is not None or min_p is not None:
        z = truncate(z, 0 if top_k is None else top_k, 1.0 if top_p is None else top_p,
                     0.0 if min_p is None else min_p)
    sample = jax.random.categorical(key, z, axis=-1).astype(jnp.int32)  # [N], rows independent
    if isinstance(temperature, (int, float)):
        return sample
    return jnp.where(jnp.asarray(temperature) < GREEDY_EPS, greedy, sample)


GREEDY, SAMPLED, TRUNCATED = 0, 1, 2  # the sampling classes (`sampling_mode`)


def sampling_mode(temperature, top_k, top_p, min_p) -> jax.Array:
    """The sampling class of (traced) settings as an int32: GREEDY (temperature < GREEDY_EPS), SAMPLED (no
    truncation: top_k 0, top_p 1, min_p 0) or TRUNCATED."""
    trunc = (jnp.asarray(top_k) > 0) | (jnp.asarray(top_p) < 1) | (jnp.asarray(min_p) > 0)
    return jnp.where(jnp.asarray(temperature) < GREEDY_EPS, GREEDY,
                     jnp.where(trunc, TRUNCATED, SAMPLED)).astype(jnp.int32)


def posterior_by_mode(logits, mode, temperature, key, top_k, top_p, min_p) -> jax.Array:
    """`posterior_tokens` with the sampling class as data: a `lax.switch` on `mode` (GREEDY / SAMPLED /
    TRUNCATED), so one compiled program serves every request while a greedy one pays for no sampling and an untruncated
    one for no truncation (keep `mode` unbatched under vmap: a batched index would compute every branch). A Python
    int mode picks the branch at trace time. Under vmap with an unbatched mode, per-slot settings stay data: a
    slot at temperature 0 in a SAMPLED round takes the argmax, an untruncating one in a TRUNCATED round keeps all."""
    branches = [lambda: posterior_tokens(logits, 0.0, key),
                lambda: posterior_tokens(logits, temperature, key),
                lambda: posterior_tokens(logits, temperature, key, top_k, top_p, min_p)]
    if isinstance(mode, int):
        return branches[mode]()
    return jax.lax.switch(mode, branches)


def accept(tree: Tree, posterior, mask=None) -> Acceptance:
    """Accepted root->leaf path for posterior tokens [N] (one per node). `mask`: optional
    precomputed ancestor_mask(tree).

    Node j >= 1 is good iff valid and tokens[j] == posterior[parents[j]]; the root is good.
    ok_i = no non-good node among i and its ancestors; siblings carry distinct tokens, so the ok
    nodes form one chain and the leaf is the deepest of them.
    """
    m = ancestor_mask(tree) if mask is None else mask           # [N, N]
    n = tree.num_nodes
    idx = jnp.arange(n, dtype=jnp.int32)
    posterior = posterior.astype(jnp.int32)
    parent_post = posterior[jnp.maximum(tree.parents, 0)]        # [N] posterior at the parent
    good = (idx == 0) | (tree.valid & (tree.tokens == parent_post))
    ok = ~jnp.any(m & ~good[None, :], axis=-1)                  # [N]: sum_j M[i,j](1-good_j) == 0
    leaf = jnp.argmax(jnp.where(ok, tree.depths, -1)).astype(jnp.int32)
    # path[d] = the node at depth d on the leaf's ancestor row; leaf for d > depths[leaf].
    d = jnp.arange(tree.max_depth + 1, dtype=jnp.int32)
    on_path = m[leaf][None, :] & (tree.depths[None, :] == d[:, None])  # [D+1, N]
    path = jnp.where(jnp.any(on_path, -1), jnp.argmax(on_path, -1), leaf).astype(jnp.int32)
    return Acceptance(leaf=leaf, num_accepted=tree.depths[leaf] + 1, path=path,
                      bonus=posterior[leaf])
