"""DDTree tree selection: per-depth top-K draft log-probs -> the `budget` best prefixes (XLA).

`tree_select(top_lp, top_id, budget)`: top_lp [D, K] fp32 (row d: the K best log-probs of depth d+1, sorted
descending), top_id [D, K] int32 (their tokens) -> (tokens, parents, depths, valid), each [budget], for the
drafted nodes 1..budget of the tree (node 0, the root, is the caller's). The nodes are the `budget` prefixes
with the highest summed log-prob, ordered by (score desc, depth asc, rank within the depth asc); parents are
node indices (0 = root); padding nodes (score -inf) get token -1, parent 0, depth 1, valid False.

Depth by depth it keeps the top-B prefixes one token deeper (a top-B over the statically pruned candidate
pairs (kept slot i, token rank r) with (i+1)(r+1) <= B, see `candidate_pairs`), then orders all D*B kept
prefixes with one stable sort: a scan of about five small XLA kernels per depth (0.33 ms per round at budget 64
on the H200, device loop, 2026-12-01). A one-program Pallas selection (ranks instead of sorts) lost to it on the
H200 (1.37 vs 0.86 ms, 2026-11-30) and was removed (git history: kernels_pallas/tree_build.py before session 7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PAD_TOKEN = -1


def candidate_pairs(b: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (prefix slot i, token rank r) pairs that can be in the top-b of kept[i] + top[r].

    Both lists are sorted descending, so candidate (i, r) is beaten or tied by the (i+1)(r+1) - 1
    candidates (i' <= i, r' <= r); it can only make the top b when (i+1)(r+1) <= b. This keeps
    O(b log b) of the b*k products (exact up to ties).
    """
    i, r = np.meshgrid(np.arange(b), np.arange(k), indexing="ij")  # [b, k]
    keep = (i + 1) * (r + 1) <= b
    return i[keep].astype(np.int32), r[keep].astype(np.int32)  # [C], [C], C >= b


def tree_select(top_lp, top_id, budget: int):
    """See the module docstring."""
    d_max, k = top_lp.shape
    b = int(budget)
    neg_inf = jnp.float32(-jnp.inf)
    top_lp = top_lp.astype(jnp.float32)
    top_id = top_id.astype(jnp.int32)

    # Depth 1: the top-K tokens under the root, padded to B slots with -inf.
    score1 = jnp.full((b,), neg_inf).at[:k].set(top_lp[0])               # [B]
    token1 = jnp.full((b,), PAD_TOKEN, jnp.int32).at[:k].set(top_id[0])  # [B]
    slot1 = jnp.zeros((b,), jnp.int32)                                    # [B] parent slot (root)

    cand_i, cand_r = map(jnp.asarray, candidate_pairs(b, k))  # [C] (static values)

    def step(kept, xs):  # kept [B] sorted desc -> top-B prefixes one depth deeper
        lp_d, id_d = xs                                   # [K], [K]
        cand = kept[cand_i] + lp_d[cand_r]                # [C] = kept[i] + logp_d[r]
        score, sel = jax.lax.top_k(cand, b)               # [B] sorted desc, [B]
        return score, (score, cand_i[sel], id_d[cand_r[sel]])

    # unrolled (rolled, the H200 profile showed ≈ 10 carried copies per depth step; unrolled: −0.07 ms a round, H100)
    _, (score_r, slot_r, token_r) = jax.lax.scan(step, score1, (top_lp[1:], top_id[1:]), unroll=True)
    score = jnp.concatenate([score1[None], score_r])  # [D, B]
    slot = jnp.concatenate([slot1[None], slot_r])     # [D, B] parent's slot at depth d-1
    token = jnp.concatenate([token1[None], token_r])  # [D, B]

    # Global top B over all depths; a stable sort of the depth-major flattening breaks score ties
    # by depth (asc), so a parent (score >= child's) always precedes its children.
    order = jnp.argsort(-score.reshape(-1), stable=True)[:b]  # [B] flat (depth-1)*B + slot
    node_score = score.reshape(-1)[order]                     # [B]
    valid = node_score > neg_inf                              # [B]
    depth = (order // b + 1).astype(jnp.int32)                # [B] 1..D
    # Final position (1..B) of every kept candidate; parents are remapped through it.
    pos = jnp.zeros((d_max * b,), jnp.int32).at[order].set(jnp.arange(1, b + 1, dtype=jnp.int32))
    parent_flat = jnp.maximum(depth - 2, 0) * b + slot.reshape(-1)[order]  # [B]
    parent = jnp.where(depth == 1, 0, pos[parent_flat])
    return (jnp.where(valid, token.reshape(-1)[order], PAD_TOKEN), jnp.where(valid, parent, 0),
            jnp.where(valid, depth, 1), valid)
