"""Exact tree verification and commit on the hybrid model (fp32, tiny random models).

Error metric: rel = max|ours - ref| / max|ref|. Bounds: vs transformers rel <= 1e-4 (goal 1e-5; measured
values printed); ours vs ours: states after commit vs a linear prefill rel <= 1e-5, logits of the tree
pass vs a linear pass of the same path rel <= 3e-5 (see TOL_SELF_LOGITS).

- Every node's logits from the tree pass equal transformers' logits of prefix + that node's root path run
  as a plain sequence, and our own linear (sequence-layout) pass of that path.
- After `verify.commit` of an accepted path the KV rows, conv and recurrent states and the length equal
  those after prefilling the path linearly; the next decode step agrees.
- A naive flattened pass (GDN over storage order, attention correct) is wrong on siblings: the tests
  have power. Padding slots do not change real nodes. A chain equals the chunked prefill.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import hf_models
import jaxddtree
from hf_models import rel_err, root_paths
from jaxddtree.model import layout as layout_lib
from jaxddtree.model.attention import Attention
from jaxddtree.model.linear import dense
from jaxddtree.speculative.verify import commit, verify

TOL = 1e-4  # vs transformers
TOL_SELF = 1e-5  # states after commit vs after a linear prefill of the path
# logits, tree vs our own linear pass of the same path. The random model's strong GDN decay makes a few
# positions ill-conditioned in fp32 (exp of differences of cumulative decays): there both of our passes
# sit ~1-2e-5 from a float64 transformers run (transformers' fp32 ~5e-6), and differ by up to ~1e-5.
TOL_SELF_LOGITS = 3e-5
BUDGET = 64  # padded tree width (one jit shape for most trees)
P = 16  # path slots of commit (max depth 15 + 1), and the width of the linear path passes
MAX_DEPTH = 15
VOCAB = hf_models.BASE["vocab_size"]


# ----------------------------------------------------------------------------- trees

def random_tree(kind: str, n: int, rs: np.random.RandomState, max_depth: int = MAX_DEPTH) -> list[int]:
    """parents[n] (topological, root -1) of a random tree of the given flavour, depth <= max_depth."""
    parents, depth = [-1], [0]
    for i in range(1, n):
        ok = [j for j in range(i) if depth[j] < max_depth]
        if kind == "chain":
            assert n <= max_depth + 1, "a chain of n nodes has depth n - 1"
            p = i - 1
        elif kind == "star":
            p = 0
        elif kind == "deep":  # mostly extend one of the last few nodes
            p = ok[-1] if rs.rand() < 0.7 else ok[rs.randint(max(0, len(ok) - 4), len(ok))]
        elif kind == "bushy":  # uniform over all earlier nodes
            p = ok[rs.randint(len(ok))]
        elif kind == "ddtree":  # few deep spines with side branches, like a best-first draft tree
            p = ok[min(len(ok) - 1, int(rs.exponential(2.0)))] if rs.rand() < 0.3 else max(ok)
        else:
            raise ValueError(kind)
        assert depth[p] < max_depth
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


def tree_tokens(parents, rs) -> np.ndarray:
    """Random tokens, distinct among siblings (as DDTree's top-K children are)."""
    toks = np.zeros(len(parents), np.int32)
    used: dict[int, set] = {}
    for i, p in enumerate(parents):
        sib = used.setdefault(p, set())
        t = int(rs.randint(VOCAB))
        while t in sib:
            t = int(rs.randint(VOCAB))
        sib.add(t)
        toks[i] = t
    return toks


def depths_of(parents):
    return np.array([len(p) - 1 for p in root_paths(parents)])


# ----------------------------------------------------------------------------- jitted passes

# The tree layouts are built inside the jits (layout.tree's fori_loops would recompile on every eager call).

def _model_and_layout(leaves, graphdef, treedef, cache, parents, mask, kernels):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    lay = layout_lib.tree(cache.length, parents, model.cfg.linear_conv_kernel_dim, mask=mask, kernels=kernels)
    return model, lay


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "kernels"))
def _verify_commit(leaves, cache, tokens, parents, mask, path, path_len, *, graphdef, treedef, kernels):
    model, lay = _model_and_layout(leaves, graphdef, treedef, cache, parents, mask, kernels)
    logits, _, stashes = verify(model, cache, tokens, lay)
    return logits, commit(cache, stashes, path, path_len)


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "feature_layers", "kernels"))
def _verify_features(leaves, cache, tokens, parents, mask, *, graphdef, treedef, feature_layers, kernels):
    model, lay = _model_and_layout(leaves, graphdef, treedef, cache, parents, mask, kernels)
    logits, features, _ = verify(model, cache, tokens, lay, feature_layers=feature_layers)
    return logits, features


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "kernels"))
def _per_layer_forward(leaves, cache, tokens, parents, mask, naive_gdn, *, graphdef, treedef, kernels):
    """The decoder run layer by layer with the tree layout for attention layers and, for GDN layers,
    either the same tree layout or (naive_gdn) a flattened one: storage-order causal mask and conv
    window, at the same depth-based positions."""
    model, tree_lay = _model_and_layout(leaves, graphdef, treedef, cache, parents, mask, kernels)
    n = tokens.shape[1]
    seq = layout_lib.sequence(cache.length, n, model.cfg.linear_conv_kernel_dim, kernels=kernels)
    gdn_lay = layout_lib.TokenLayout(positions=tree_lay.positions, start=tree_lay.start,
                                     num_valid=tree_lay.num_valid,
                                     mask=jnp.where(naive_gdn, seq.mask, tree_lay.mask),
                                     conv_src=jnp.where(naive_gdn, seq.conv_src, tree_lay.conv_src), is_tree=True,
                                     kernels=kernels)
    x = model.embed[...][tokens]
    for i, layer in enumerate(model.layers):
        lay = tree_lay if isinstance(layer.mixer, Attention) else gdn_lay
        x, _, _, _ = layer(x, cache.layers[i], lay)
    return dense("btd,dv->btv", model.final_norm(x), model.lm_head[...]).astype(jnp.float32)


def padded_tree(parents, budget=None):
    """(parents [budget] int32, ancestor mask [budget, budget]) of the tree padded to `budget` nodes
    (padding: parent 0, self-only mask row); numpy, so nothing compiles eagerly."""
    n = len(parents)
    budget = n if budget is None else budget
    par = np.zeros(budget, np.int32)
    par[:n] = parents
    mask = np.eye(budget, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return jnp.asarray(par), jnp.asarray(mask)


def run_tree(target, cache, parents, tokens, budget=None, path=(0,), pad_token=0):
    """(logits [n, V] numpy, cache after committing `path`) of the tree padded to `budget` nodes."""
    n = len(parents)
    budget = n if budget is None else budget
    toks = np.full((1, budget), pad_token, np.int32)
    toks[0, :n] = tokens
    pth = np.zeros((1, P), np.int32)
    pth[0, :len(path)] = path
    par, mask = padded_tree(parents, budget)
    logits, new = _verify_commit(target.leaves, cache, jnp.asarray(toks), par, mask, jnp.asarray(pth),
                                 jnp.asarray([len(path)], jnp.int32), graphdef=target.graphdef,
                                 treedef=target.treedef, kernels=target.kernels)
    return np.asarray(logits)[0, :n], new


def linear_path_logits(target, jx, cache, parents, tokens) -> np.ndarray:
    """Our own linear pass: every node's root path as a plain sequence continuing `cache` (all paths in
    one batch of BUDGET rows x P tokens, causal, so padding after a path does not matter)."""
    n = len(parents)
    paths = root_paths(parents)
    rows = np.zeros((BUDGET, P), np.int32)
    for i, pth in enumerate(paths):
        rows[i, :len(pth)] = np.asarray(tokens)[pth]
    big = jax.tree.map(lambda x: jnp.broadcast_to(x, x.shape[:1] + (BUDGET,) + x.shape[2:]) if x.ndim else jnp.copy(x),
                       cache)  # the batch axis (after the group axis), fresh buffers: prefill donates its cache
    out, _, _, _ = target.prefill(big, jnp.asarray(rows), logits="all")
    out = np.asarray(out)
    return np.stack([out[i, len(paths[i]) - 1] for i in range(n)])


@pytest.fixture(scope="module")
def prefix_cache(target_base, jx):
    """cache after prefilling a prefix (one jit shape for every prefix length)."""
    cached = {}

    def get(prefix):
        key = tuple(int(t) for t in prefix)
        if key not in cached:
            _, c, _ = jx.prefill(target_base, target_base.init_cache(jx.MAX_LEN), prefix, width=jx.PAD_T)
            cached[key] = c
        return cached[key]
    return get


# ----------------------------------------------------------------------------- random trees

# (kind, real nodes, prefix length, seed). Padded to BUDGET unless n is in UNPADDED (then the tree runs
# at its own width).
TREES = [
    ("chain", 16, 21, 0), ("star", 64, 21, 1), ("deep", 64, 9, 2), ("bushy", 64, 33, 3), ("ddtree", 64, 2, 4),
    ("bushy", 40, 1, 5), ("deep", 25, 40, 6), ("ddtree", 33, 14, 7), ("star", 5, 21, 8), ("bushy", 9, 3, 9),
    ("chain", 2, 17, 10), ("deep", 50, 21, 11), ("bushy", 1, 21, 12), ("ddtree", 64, 60, 13),
    ("bushy", 64, 21, 14), ("bushy", 7, 21, 15),
]
UNPADDED = (1, 7)


@pytest.mark.parametrize("kind,n,plen,seed", TREES, ids=[f"{k}{n}-prefix{p}-s{s}" for k, n, p, s in TREES])
def test_tree_logits_equal_per_path_sequences(hf_base, target_base, jx, prefix_cache, kind, n, plen, seed):
    """Every node's tree-verify logits == transformers' logits of prefix + root path as a plain sequence
    (rel <= 1e-4) and == our own linear pass of that path (rel <= 3e-5)."""
    rs = np.random.RandomState(100 + seed)
    parents = random_tree(kind, n, rs)
    tokens = tree_tokens(parents, rs)
    prefix = rs.randint(0, VOCAB, size=plen)
    assert depths_of(parents).max() <= MAX_DEPTH
    cache = prefix_cache(prefix)
    budget = None if n in UNPADDED else BUDGET
    ours, _ = run_tree(target_base, cache, parents, tokens, budget=budget, pad_token=int(rs.randint(VOCAB)))
    lin = linear_path_logits(target_base, jx, cache, parents, tokens)
    e_lin = rel_err(ours, lin)
    msg = (f"\n{kind} N={n} depth={depths_of(parents).max()} prefix={plen} width={budget or n}: "
           f"vs our linear pass {e_lin:.1e}")
    ref = hf_models.hf_tree_logits(hf_base, prefix, tokens, parents)
    ref = np.stack([ref[i] for i in range(n)])
    e_hf = rel_err(ours, ref)
    print(msg + f", vs transformers {e_hf:.1e} (linear vs transformers {rel_err(lin, ref):.1e})")
    assert e_hf <= TOL
    assert e_lin <= TOL_SELF_LOGITS


def test_tree_features_equal_per_path_hidden_states(hf_base, target_base, prefix_cache):
    """The drafter features of the tree pass (`verify(..., feature_layers)`: outputs of the chosen decoder
    layers, concatenated) of every node == transformers' hidden states at the end of that node's root
    path (rel <= 1e-4 per layer), on a padded 64-slot tree."""
    rs = np.random.RandomState(70)
    parents = random_tree("ddtree", 40, rs)
    tokens = tree_tokens(parents, rs)
    prefix = rs.randint(0, VOCAB, size=21)
    cache = prefix_cache(prefix)
    layers = (0, 2, 3)
    D = target_base.config.hidden_size
    toks = np.zeros((1, BUDGET), np.int32)
    toks[0, :len(parents)] = tokens
    _, feats = _verify_features(target_base.leaves, cache, jnp.asarray(toks), *padded_tree(parents, BUDGET),
                                graphdef=target_base.graphdef, treedef=target_base.treedef,
                                feature_layers=layers, kernels=target_base.kernels)
    feats = np.asarray(feats)[0, :len(parents)].reshape(len(parents), len(layers), D)
    _, hid = hf_models.hf_tree_logits(hf_base, prefix, tokens, parents, hidden=True)
    ref = np.stack([hid[i] for i in range(len(parents))])  # [N, L, D]
    errs = [rel_err(feats[:, j], ref[:, l]) for j, l in enumerate(layers)]
    print(f"\ntree features (layers {layers}) vs transformers hidden states: {['%.1e' % e for e in errs]}")
    assert max(errs) <= TOL


def test_score_tree_api_matches_transformers(hf_base, target_base):
    """`jaxddtree.score_tree` (prefill + tree verify, its own shapes) vs transformers per path."""
    rs = np.random.RandomState(7)
    parents = random_tree("bushy", 12, rs)
    tokens = tree_tokens(parents, rs)
    prefix = rs.randint(0, VOCAB, size=21)
    ours = jaxddtree.score_tree(target_base, prefix, tokens, parents)
    ref = hf_models.hf_tree_logits(hf_base, prefix, tokens, parents)
    err = rel_err(ours, np.stack([ref[i] for i in range(12)]))
    print(f"\nscore_tree N=12 vs transformers: rel err {err:.2e}")
    assert ours.shape == (12, VOCAB)
    assert err <= TOL


@pytest.mark.parametrize("tokens,parents,match", [
    ([1, 2], [0, 0], "parents must"), ([1, 2], [-1, 1], "parents must"), ([1, 2, 3, 4], [-1, 0, 3, 1], "parents must"),
    ([1, 2, 3], [-1, 0], "parents has 2 entries for 3"), ([1, VOCAB], [-1, 0], "tree_tokens"),
    ([], [], "tree_tokens is empty")])
def test_score_tree_rejects_bad_trees(target_base, tokens, parents, match):
    with pytest.raises(ValueError, match=match):
        jaxddtree.score_tree(target_base, [1, 2, 3], tokens, parents)


@pytest.mark.parametrize("variant", sorted(set(hf_models.VARIANTS) - {"base"}))
def test_tree_and_commit_vs_transformers_all_variants(zoo, jx, variant):
    """Every variant (GVA 3, conv kernel 2 / one conv-state row, attention-first pattern, ...): a 12-node
    tree's logits == transformers per root path (rel <= 1e-4), and committing its deepest path gives
    transformers' cache of prefix + path (rel <= 1e-4)."""
    hf, target = zoo.hf(variant), zoo.target(variant)
    rs = np.random.RandomState(80)
    ids = rs.randint(0, VOCAB, size=20)
    parents = random_tree("ddtree", 12, rs)
    tokens = tree_tokens(parents, rs)
    _, cache, _ = jx.prefill(target, target.init_cache(jx.MAX_LEN), ids)  # same shape as test_model's
    path = max(root_paths(parents), key=len)
    ours, committed = run_tree(target, cache, parents, tokens, path=path)
    ref = hf_models.hf_tree_logits(hf, ids, tokens, parents)
    err = rel_err(ours, np.stack([ref[i] for i in range(len(parents))]))
    _, _, _, hf_layers = hf_models.hf_prefill_state(hf, np.concatenate([ids, tokens[path]])[None])
    errs = jx.state_errors(jx.states(committed)[0], jx.hf_states_as_ours(hf_layers))
    print(f"\n[{variant}] tree N=12 logits vs transformers {err:.1e}; states after committing "
          f"{len(path)} tokens {max(errs.values()):.1e}")
    assert int(committed.length) == 20 + len(path)
    assert err <= TOL and max(errs.values()) <= TOL


# ----------------------------------------------------------------------------- commit

COMMITS = [  # (tree kind, n, seed, accepted path length)
    ("bushy", 64, 20, 1), ("bushy", 64, 21, 2), ("deep", 64, 22, 8), ("ddtree", 64, 23, 11),
    ("deep", 64, 24, 16), ("star", 30, 25, 2),
]


@pytest.mark.parametrize("kind,n,seed,plen", COMMITS, ids=[f"{k}{n}-path{p}" for k, n, _, p in COMMITS])
def test_commit_equals_linear_prefill_of_path(hf_base, target_base, jx, prefix_cache, kind, n, seed, plen):
    """After verify + commit of an accepted root path of length plen (padded tree of BUDGET nodes), the
    KV rows [0, length), conv and recurrent states and length equal a linear prefill of prefix + path
    (rel <= 1e-5; and transformers' cache, rel <= 1e-4), and the next decode step's logits agree."""
    rs = np.random.RandomState(200 + seed)
    parents = random_tree(kind, n, rs)
    tokens = tree_tokens(parents, rs)
    prefix = rs.randint(0, VOCAB, size=19)
    paths = root_paths(parents)
    leaf = int(rs.choice([i for i, p in enumerate(paths) if len(p) == plen]))
    path = paths[leaf]
    cache = prefix_cache(prefix)
    logits, committed = run_tree(target_base, cache, parents, tokens, budget=BUDGET, path=path)
    seq = np.asarray(tokens)[path]
    lin_logits, linear, _ = jx.prefill(target_base, cache, seq, width=P)
    ours_states, n_ours = jx.states(committed)
    lin_states, n_lin = jx.states(linear)
    assert n_ours == n_lin == len(prefix) + plen
    errs = jx.state_errors(ours_states, lin_states)
    _, _, _, hf_layers = hf_models.hf_prefill_state(hf_base, np.concatenate([prefix, seq])[None])
    e_hf = jx.state_errors(ours_states, jx.hf_states_as_ours(hf_layers))
    e_path = rel_err(logits[path], lin_logits)
    nxt = int(rs.randint(VOCAB))
    d_ours, _ = jx.decode(target_base, committed, nxt)
    d_lin, _ = jx.decode(target_base, linear, nxt)
    e_dec = rel_err(d_ours, d_lin)
    ref_next = hf_models.hf_logits(hf_base, np.concatenate([prefix, seq, [nxt]])[None])[0, -1]
    e_dec_hf = rel_err(d_ours, ref_next)
    print(f"\ncommit {kind} path len {plen}: states vs linear { {k: '%.1e' % v for k, v in errs.items()} }, "
          f"vs transformers {max(e_hf.values()):.1e}; path logits {e_path:.1e}; next decode vs linear "
          f"{e_dec:.1e}, vs transformers {e_dec_hf:.1e}")
    assert set(errs) == {"k", "v", "conv", "recurrent"}
    assert max(errs.values()) <= TOL_SELF
    assert max(e_hf.values()) <= TOL
    assert e_path <= TOL_SELF_LOGITS and e_dec <= TOL_SELF_LOGITS and e_dec_hf <= TOL
    # power: the same comparison against the path with its last token changed (a sibling) fails in every
    # kind of state by orders of magnitude
    wrong = seq.copy()
    wrong[-1] = (wrong[-1] + 1) % VOCAB
    _, other, _ = jx.prefill(target_base, cache, wrong, width=P)
    e_wrong = jx.state_errors(ours_states, jx.states(other)[0])
    assert min(e_wrong.values()) > 100 * TOL_SELF, e_wrong


def test_commit_twice_equals_linear(target_base, jx, prefix_cache):
    """Two verify + commit rounds in a row (the second tree starts at the first's committed length)
    equal one linear prefill of prefix + both paths."""
    rs = np.random.RandomState(30)
    prefix = rs.randint(0, VOCAB, size=12)
    cache = prefix_cache(prefix)
    seqs = []
    for r in range(2):
        parents = random_tree("ddtree", 64, rs)
        tokens = tree_tokens(parents, rs)
        paths = root_paths(parents)
        path = max(paths, key=len)[: 6 + 3 * r]
        _, cache = run_tree(target_base, cache, parents, tokens, budget=BUDGET, path=path)
        seqs.append(np.asarray(tokens)[path])
    _, linear, _ = jx.prefill(target_base, prefix_cache(prefix), np.concatenate(seqs), width=P)
    a, na = jx.states(cache)
    b, nb = jx.states(linear)
    errs = jx.state_errors(a, b)
    print(f"\ntwo commits (6 + 9 tokens) vs linear: {max(errs.values()):.1e}")
    assert na == nb == 12 + 15
    assert max(errs.values()) <= TOL_SELF


def test_bf16_tree_and_commit_equal_bf16_linear_pass(zoo, jx):
    """bf16 (the production dtype): the tree pass of a 64-slot tree gives every node the logits of our
    bf16 linear pass of its root path, and committing a 10-token path gives the bf16 linear prefill's
    cache (rel <= 2e-2, a few bf16 ulps: rounding of differently scheduled sums); logits within 5e-2 of
    transformers' bf16 model per path."""
    target = zoo.target("bf16", dtype="bfloat16")
    hf16 = hf_models.causal_lm_bf16()
    hf16.load_state_dict(zoo.hf("bf16").state_dict())
    hf16 = hf16.to(torch.bfloat16)
    rs = np.random.RandomState(90)
    parents = random_tree("ddtree", 64, rs)
    tokens = tree_tokens(parents, rs)
    prefix = rs.randint(0, VOCAB, size=21)
    _, cache, _ = jx.prefill(target, target.init_cache(jx.MAX_LEN), prefix, width=jx.PAD_T)
    path = max(root_paths(parents), key=len)[:10]
    ours, committed = run_tree(target, cache, parents, tokens, budget=BUDGET, path=path)
    lin = linear_path_logits(target, jx, cache, parents, tokens)
    _, linear, _ = jx.prefill(target, cache, tokens[path], width=P)
    errs = jx.state_errors(jx.states(committed)[0], jx.states(linear)[0])
    ref = hf_models.hf_tree_logits(hf16, prefix, tokens, parents)
    e_hf = rel_err(ours, np.stack([ref[i] for i in range(len(parents))]))
    e_lin = rel_err(ours, lin)
    print(f"\nbf16 tree: vs our bf16 linear pass {e_lin:.1e}; states after commit vs linear "
          f"{ {k: '%.1e' % v for k, v in errs.items()} }; vs transformers bf16 {e_hf:.1e}")
    assert e_lin <= 2e-2 and max(errs.values()) <= 2e-2
    assert e_hf <= 5e-2


# ----------------------------------------------------------------------------- power

def test_naive_flattened_gdn_is_wrong_on_siblings(target_base, prefix_cache):
    """Power check. A naive verify that runs the GDN layers over the flattened tree in storage order (conv
    window and recurrence along node index, as transformers does with a 4-D mask) while attention uses the
    correct ancestor mask and depth positions: nodes whose ancestors are exactly 0..i-1 still match the
    exact tree pass, every other node is off by far more than the tolerance (max > 1e-2 rel)."""
    rs = np.random.RandomState(40)
    parents = random_tree("bushy", 24, rs)
    tokens = tree_tokens(parents, rs)
    cache = prefix_cache(rs.randint(0, VOCAB, size=21))
    n = len(parents)
    exact, _ = run_tree(target_base, cache, parents, tokens)
    run = lambda naive_gdn: np.asarray(_per_layer_forward(
        target_base.leaves, cache, jnp.asarray(tokens)[None], *padded_tree(parents), jnp.asarray(naive_gdn),
        graphdef=target_base.graphdef, treedef=target_base.treedef, kernels=target_base.kernels))[0]
    harness = run(False)  # the per-layer harness with the right layouts is the tree pass
    naive = run(True)
    first_chain = [i for i, p in enumerate(root_paths(parents)) if p == list(range(i + 1))]
    others = [i for i in range(n) if i not in first_chain]
    scale = np.abs(exact).max()
    node_err = np.abs(naive - exact).max(-1) / scale
    e_harness = rel_err(harness, exact)
    print(f"\nnaive flattened GDN: first-chain nodes {first_chain} err {node_err[first_chain].max():.1e}; "
          f"other nodes err min {node_err[others].min():.1e} max {node_err[others].max():.1e} "
          f"(harness with exact layouts {e_harness:.1e})")
    assert len(first_chain) >= 2 and len(others) >= 10
    assert e_harness <= TOL_SELF
    assert node_err[first_chain].max() <= TOL_SELF
    assert node_err[others].max() > 1e-2
    assert (node_err[others] > 10 * TOL).mean() >= 0.9  # nearly every off-chain node is caught


# ----------------------------------------------------------------------------- padding, chain

def test_padding_slots_do_not_change_real_nodes(target_base, jx, prefix_cache):
    """A 7-node tree padded to 64 slots (padding: parent 0, self-only mask row, arbitrary tokens) gives
    the same real-node logits as the unpadded tree, and committing the same path gives the same cache."""
    rs = np.random.RandomState(50)
    parents = random_tree("bushy", 7, rs)
    tokens = tree_tokens(parents, rs)
    cache = prefix_cache(rs.randint(0, VOCAB, size=21))
    path = max(root_paths(parents), key=len)
    a, ca = run_tree(target_base, cache, parents, tokens, path=path)
    outs = []
    for pad_token in (0, VOCAB - 1, int(tokens[1])):
        b, cb = run_tree(target_base, cache, parents, tokens, budget=BUDGET, path=path, pad_token=pad_token)
        outs.append(b)
        e = rel_err(b, a)
        es = jx.state_errors(jx.states(cb)[0], jx.states(ca)[0])
        print(f"\npadding 7 -> 64 (pad token {pad_token}): logits {e:.1e}, states {max(es.values()):.1e}")
        assert e <= TOL_SELF_LOGITS and max(es.values()) <= TOL_SELF
    for b in outs[1:]:
        np.testing.assert_array_equal(b, outs[0])  # the pad tokens do not matter at all


def test_chain_tree_equals_chunked_prefill(target_base, jx, prefix_cache):
    """A 16-node chain verified as a tree == the chunked prefill of the same 16 tokens (logits), and
    committing the whole chain == the state after that prefill."""
    rs = np.random.RandomState(60)
    tokens = rs.randint(0, VOCAB, size=P)
    parents = list(range(-1, P - 1))
    cache = prefix_cache(rs.randint(0, VOCAB, size=33))
    tree_logits, committed = run_tree(target_base, cache, parents, tokens, budget=BUDGET, path=list(range(P)))
    lin_logits, linear, _ = jx.prefill(target_base, cache, tokens, width=P)
    e = rel_err(tree_logits, lin_logits)
    es = jx.state_errors(jx.states(committed)[0], jx.states(linear)[0])
    print(f"\nchain of 16 vs chunked prefill: logits {e:.1e}, states {max(es.values()):.1e}")
    assert int(committed.length) == int(linear.length) == 33 + P
    assert e <= TOL_SELF_LOGITS and max(es.values()) <= TOL_SELF
