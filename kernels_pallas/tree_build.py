"""DDTree tree selection in one kernel: per-depth top-K draft log-probs -> the `budget` best prefixes.

`tree_select(top_lp, top_id, budget)`: top_lp [D, K] fp32 (row d: the K best log-probs of depth d+1, sorted
descending), top_id [D, K] int32 (their tokens) -> (tokens, parents, depths, valid), each [budget], for the
drafted nodes 1..budget of the tree (node 0, the root, is the caller's). The nodes are the `budget` prefixes
with the highest summed log-prob, ordered by (score desc, depth asc, rank within the depth asc); parents are
node indices (0 = root); padding nodes (score -inf) get token -1, parent 0, depth 1, valid False.

The spec (`tree_select_reference`) keeps, depth by depth, the top-B prefixes one token deeper (a top-B over
the statically pruned candidate pairs (kept slot i, token rank r) with (i+1)(r+1) <= B, see
`candidate_pairs`), then orders all D*B kept prefixes with one stable sort. XLA runs that as a scan of about
five small kernels per depth. The Pallas kernel (one program, one launch) does the same selection with
ranks instead of sorts: a candidate's rank is the number of candidates that beat it (larger score, or equal
score and lower index: exactly `lax.top_k`'s and the stable sort's tie-breaking), and the kept prefix of rank
j is picked by a one-hot reduction, so its trees are identical to the reference's, ties included.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas._common import SharedMemoryError, compiler_params, next_pow2, pl
from kernels_pallas._common import smem_limit as _limit

PAD_TOKEN = -1
CHUNK = 64  # candidates compared per step of the kernel's rank loop


def candidate_pairs(b: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (prefix slot i, token rank r) pairs that can be in the top-b of kept[i] + top[r].

    Both lists are sorted descending, so candidate (i, r) is beaten or tied by the (i+1)(r+1) - 1
    candidates (i' <= i, r' <= r); it can only make the top b when (i+1)(r+1) <= b. This keeps
    O(b log b) of the b*k products (exact up to ties).
    """
    i, r = np.meshgrid(np.arange(b), np.arange(k), indexing="ij")  # [b, k]
    keep = (i + 1) * (r + 1) <= b
    return i[keep].astype(np.int32), r[keep].astype(np.int32)  # [C], [C], C >= b


def tree_select_reference(top_lp, top_id, budget: int):
    """jnp spec of `tree_select` (see the module docstring)."""
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

    _, (score_r, slot_r, token_r) = jax.lax.scan(step, score1, (top_lp[1:], top_id[1:]))
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


def _kernel(lp_ref, id_ref, ci_ref, cr_ref, tok_ref, par_ref, dep_ref, val_ref, *, d_max: int, b: int, k: int):
    """One program. Padded sizes: Dp >= D rows, Kp >= K ranks, Bp >= B slots, Cp candidates (a multiple of
    CHUNK; padding candidates have slot -1 / rank -1 and score -inf). All indices are compared, never used
    as addresses: a gather is a one-hot max/sum over a broadcast comparison."""
    f32, i32 = jnp.float32, jnp.int32
    neg = f32(-jnp.inf)
    Dp, Kp = lp_ref.shape
    Bp = tok_ref.shape[0]
    Cp = ci_ref.shape[0]
    lp = lp_ref[...]                                                 # [Dp, Kp]
    ids = id_ref[...]                                                # [Dp, Kp]
    ci, cr = ci_ref[...], cr_ref[...]                                # [Cp]
    row_d = jax.lax.broadcasted_iota(i32, (Dp, Bp), 0)               # [Dp, Bp]
    jb = jax.lax.broadcasted_iota(i32, (Bp, 1), 0)                   # [Bp, 1] slot / node index
    bs = jax.lax.broadcasted_iota(i32, (1, Bp), 1)                   # [1, Bp]
    cidx = jax.lax.broadcasted_iota(i32, (Cp, 1), 0)                 # [Cp, 1]

    def lp_row(d):  # [Kp] row d of the log-probs
        return jnp.max(jnp.where(jax.lax.broadcasted_iota(i32, (Dp, Kp), 0) == d, lp, neg), axis=0)

    def id_row(d):
        return jnp.sum(jnp.where(jax.lax.broadcasted_iota(i32, (Dp, Kp), 0) == d, ids, 0), axis=0)

    def take_f(x, idx):  # x [N] f32, idx [M] int -> x[idx] [M], -inf where idx is out of range
        return jnp.max(jnp.where(idx[:, None] == jax.lax.broadcasted_iota(i32, (1, x.shape[0]), 1),
                                 x[None, :], neg), axis=1)

    def take_i(x, idx):  # int version, 0 where idx is out of range
        return jnp.sum(jnp.where(idx[:, None] == jax.lax.broadcasted_iota(i32, (1, x.shape[0]), 1),
                                 x[None, :], 0), axis=1)

    # depth 1: the K best tokens under the root (slot j = rank j)
    lp0, id0 = lp_row(0), id_row(0)
    slot_ids = jnp.arange(Bp, dtype=i32)
    kept = jnp.where(slot_ids < min(b, k), take_f(lp0, slot_ids), neg)  # [Bp]
    S = jnp.where(row_d == 0, kept[None, :], neg)                         # [Dp, Bp] scores
    P = jnp.zeros((Dp, Bp), i32)                                          # parent slot at depth d-1
    T = jnp.where(row_d == 0, take_i(id0, slot_ids)[None, :], PAD_TOKEN)  # tokens

    def depth_step(d, carry):
        kept, S, P, T = carry
        lp_d, id_d = lp_row(d), id_row(d)
        cand = take_f(kept, ci) + take_f(lp_d, cr)                        # [Cp]

        def rank_step(c, rank):  # rank[c] += #candidates of chunk c that beat candidate c
            ci_c = ci_ref[pl.ds(c * CHUNK, CHUNK)]
            cr_c = cr_ref[pl.ds(c * CHUNK, CHUNK)]
            other = take_f(kept, ci_c) + take_f(lp_d, cr_c)               # [CHUNK]
            oidx = c * CHUNK + jax.lax.broadcasted_iota(i32, (1, CHUNK), 1)
            beats = (other[None, :] > cand[:, None]) | ((other[None, :] == cand[:, None]) & (oidx < cidx))
            return rank + jnp.sum(beats.astype(i32), axis=1)

        rank = jax.lax.fori_loop(0, Cp // CHUNK, rank_step, jnp.zeros((Cp,), i32))  # [Cp] 0..Cp-1
        pick = rank[None, :] == jb                                        # [Bp, Cp]: candidate of rank j
        new = jnp.where(slot_ids < b, jnp.max(jnp.where(pick, cand[None, :], neg), axis=1), neg)  # [Bp]
        slot = jnp.sum(jnp.where(pick, ci[None, :], 0), axis=1)           # [Bp]
        tok = take_i(id_d, jnp.sum(jnp.where(pick, cr[None, :], 0), axis=1))
        on = row_d == d
        return new, jnp.where(on, new[None, :], S), jnp.where(on, slot[None, :], P), jnp.where(on, tok[None, :], T)

    _, S, P, T = jax.lax.fori_loop(1, d_max, depth_step, (kept, S, P, T))

    def row_f(X, d):  # [Bp] row d of X [Dp, Bp]
        return jnp.max(jnp.where(row_d == d, X, neg), axis=0)

    def row_i(X, d):
        return jnp.sum(jnp.where(row_d == d, X, 0), axis=0)

    # global rank G[d, j] of every kept prefix: #prefixes (d', j') before it in (score desc, d, j) order,
    # counted row against row
    G = jnp.zeros((Dp, Bp), i32)

    def grank_rows(d, G):
        s = row_f(S, d)                                                   # [Bp] entries of row d (as j)

        def against(dd, acc):
            s_o = row_f(S, dd)                                            # [Bp] entries of row d' (as j')
            tie_first = (dd < d) | ((dd == d) & (bs < jb))                # [Bp(j), Bp(j')]
            beat = (s_o[None, :] > s[:, None]) | ((s_o[None, :] == s[:, None]) & tie_first)
            return acc + jnp.sum(beat.astype(i32), axis=1)

        cnt = jax.lax.fori_loop(0, Dp, against, jnp.zeros((Bp,), i32))
        return jnp.where(row_d == d, cnt[None, :], G)

    G = jax.lax.fori_loop(0, Dp, grank_rows, G)                          # [Dp, Bp] 0..Dp*Bp-1

    # node n = the prefix of global rank n; parent node = 1 + global rank of (d-1, P[d, j])
    def emit_rows(d, out):
        tok, par, dep, sc = out
        g, s, t, p = row_i(G, d), row_f(S, d), row_i(T, d), row_i(P, d)
        g_up = row_i(G, jnp.maximum(d - 1, 0))
        ppos = jnp.where(d == 0, 0, 1 + take_i(g_up, p))                 # [Bp]
        hit = g[None, :] == jb                                            # [Bp(n), Bp(j)]
        tok = tok + jnp.sum(jnp.where(hit, t[None, :], 0), axis=1)
        par = par + jnp.sum(jnp.where(hit, ppos[None, :], 0), axis=1)
        dep = dep + jnp.sum(jnp.where(hit, d + 1, 0), axis=1)
        sc = jnp.maximum(sc, jnp.max(jnp.where(hit, s[None, :], neg), axis=1))
        return tok, par, dep, sc

    z = jnp.zeros((Bp,), i32)
    tok, par, dep, sc = jax.lax.fori_loop(0, Dp, emit_rows, (z, z, z, jnp.full((Bp,), neg)))
    valid = sc > neg
    tok_ref[...] = jnp.where(valid, tok, PAD_TOKEN)
    par_ref[...] = jnp.where(valid, par, 0)
    dep_ref[...] = jnp.where(valid, dep, 1)
    val_ref[...] = valid.astype(i32)


def smem_bytes(Cp: int, Bp: int, num_warps: int) -> int:
    """Shared memory (bytes, an upper estimate) of the one program: no tile is staged (no dot), only the
    cross-warp exchanges of its reductions (at most max(Cp, Bp) values per warp). Budget 64: 16384 (Triton's
    allocation: 2048); scores are fp32 whatever the model's dtype."""
    return 4 * num_warps * max(Cp, Bp)


@functools.partial(jax.jit, static_argnames=("budget", "num_warps", "interpret", "smem_limit"))
def tree_select(top_lp, top_id, budget: int, *, num_warps: int = 8, interpret: bool = False,
                smem_limit: int | None = None):
    """Pallas version of `tree_select_reference` (one launch)."""
    d_max, k = top_lp.shape
    b = int(budget)
    Dp, Kp, Bp = next_pow2(d_max), next_pow2(k), next_pow2(b)
    ci, cr = candidate_pairs(b, k)
    Cp = max(CHUNK, next_pow2(len(ci)))  # a power of two >= CHUNK: a multiple of CHUNK
    if smem_bytes(Cp, Bp, num_warps) > _limit(smem_limit):
        raise SharedMemoryError(f"tree_select: {smem_bytes(Cp, Bp, num_warps)} bytes of shared memory needed, "
                                f"{_limit(smem_limit)} available")
    ci = np.pad(ci, (0, Cp - len(ci)), constant_values=-1)
    cr = np.pad(cr, (0, Cp - len(cr)), constant_values=-1)
    lp = jnp.pad(top_lp.astype(jnp.float32), ((0, Dp - d_max), (0, Kp - k)), constant_values=-jnp.inf)
    ids = jnp.pad(top_id.astype(jnp.int32), ((0, Dp - d_max), (0, Kp - k)), constant_values=PAD_TOKEN)
    out = jax.ShapeDtypeStruct((Bp,), jnp.int32)
    tok, par, dep, val = pl.pallas_call(
        functools.partial(_kernel, d_max=d_max, b=b, k=k),
        grid=(1,),
        out_shape=[out, out, out, out],
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="tree_select",
    )(lp, ids, jnp.asarray(ci), jnp.asarray(cr))
    return tok[:b], par[:b], dep[:b], val[:b].astype(bool)
