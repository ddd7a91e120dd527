"""Tree (ancestor-masked) gated delta rule, one WY block, as one Pallas-Triton kernel.

Same function as `kernels_pallas.gdn_reference.gdn_masked_block` (the reference, re-exported here as
`gdn_masked_block_reference`): for every (batch, value head, dv tile) program, over row blocks (a head
block of up to 128 rows solved in one piece, then 16-row blocks; the tree is in topological order so the
mask is lower triangular):

    G_i   = Σ_j M_ij g_j                                   (path cumsum)
    Γ_ij  = exp(G_i − G_j) on the ancestor-or-self relation, 0 elsewhere
    rhs_i = β_i (v_i − e^{G_i} k_iᵀ S0) − Σ_{j in earlier blocks} L_ij W_j,  L_ij = β_i Γ_ij k_i·k_j
    W_i   = (I + L_ii)⁻¹ rhs_i        (diagonal block: L_ii is nilpotent, L^d = 0 with d the most nodes
                                       on a root path (mask row sums, read at run time), so the inverse
                                       is the exact product (I − L)(I + L²)(I + L⁴)…: ceil(log2 d) factors;
                                       DDTree trees (≤ 16 nodes per path): 4 factors for any N)
    o_i   = e^{G_i} q_iᵀ S0 + Σ_{j ≤ i} (Γ ⊙ Q Kᵀ)_ij W_j

N need not be a multiple of the block: rows ≥ N are loaded as zeros (β = 0, mask 0), so their W is 0,
and they are never stored. Every program writes G (all dv tiles write the same values) and reads back
its own G_j / W_j of finished blocks. The key grams K Kᵀ and Q Kᵀ come from one batched fp32 XLA dot
(`key_grams`: once per key head, shared by its value heads and dv tiles); the kernel does the decay
masking, the solve and the products with S0 and W. Everything is fp32. The kernel's dots default to
"bf16x3m": each fp32 operand split once into bf16 hi + lo, three bf16 tensor-core products summed in fp32
(rel. err 4.4e-6 on o at 27B shapes).

H200, N=65, Hv=48, GPU µs per layer (2026-11-29): default (head block 128, bv 64, 8 warps) 43.4 (kernel
33.6 + grams 6.0 + transpose 1.5); the XLA reference 85. Round 4 (grams still in the kernel): bf16x3
preset (re-splits operands in every product) ~+35%; head block 64 + a 16-row block 56; 16-row blocks only
67-88; bv 128 64, bv 32 94, 16 warps 153; tf32 37 (o err 4e-4). Removed after round 5: grams formed inside
the kernel by every program (46.4) and a two-kernel split (W/G kernel + a parallel output kernel, 46-79).
Under vmap (the pool's slots) the slots are a grid axis; merging their trees into one block-diagonal launch lost
three times (sessions 10 and 12; H200 2026-12-02, µs per layer: 4 x 32 nodes 144 vs 68, 8 x 16 109 vs 39).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kernels_pallas.gdn_reference import gdn_masked_block as gdn_masked_block_reference
from kernels_pallas._common import (SharedMemoryError, compiler_params, feature_pad, is_pow2, matmul_fns, next_pow2,
                                    pad_axis, pl, pltr, smem_limit as _limit, tile_bytes)

__all__ = ["gdn_masked_block", "gdn_masked_block_reference", "key_grams", "smem_bytes", "plan"]


def smem_bytes(bh: int, dkp: int, bv: int) -> int:
    """Shared memory (bytes, an upper estimate) of a tree-block program with a head block of bh rows: the larger of
    the q / k rows [bh, dkp] staged (fp32) and the solve's operands staged as bf16 hi / lo pairs ([bh, bh] and
    [bh, bv]; the 16-row tail blocks need less). 27B widths (bh 128, dk 128, bv 64): 131072 (Triton: 98304)."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    return max(2 * tile_bytes((bh, dkp), f32), 2 * (tile_bytes((bh, bh), bf16) + tile_bytes((bh, bv), bf16)) * 2)


def plan(N: int, dkp: int, dvp: int, *, block_v: int | None = None, block_t: int = 16, head_block: int | None = None,
         limit: int | None = None) -> dict:
    """(head_block, block_v) of a call: the defaults (head block: N rounded up to a power of two, in
    [block_t, 128]; bv 64, at most dvp), the head block halved (down to block_t) where they do not fit the
    shared memory (`smem_bytes`; every dtype runs in fp32 here); SharedMemoryError when none fits."""
    bh = head_block or max(block_t, min(128, next_pow2(N)))
    bv = min(block_v or 64, dvp)
    while smem_bytes(bh, dkp, bv) > _limit(limit) and bh > block_t:
        bh //= 2
    if smem_bytes(bh, dkp, bv) > _limit(limit):
        raise SharedMemoryError(f"gdn_tree: no tile configuration fits {_limit(limit)} bytes of shared memory "
                                f"(the smallest needs {smem_bytes(bh, dkp, bv)})")
    return dict(head_block=bh, block_v=bv, smem=smem_bytes(bh, dkp, bv))


def _kernel(*refs, n: int, bh: int, bt: int, bv: int, ntail: int, npc: int, max_depth: int | None, mm_w, mm_o,
            same: bool, has_layer: bool, barrier):
    """Row blocks: a head block of `bh` rows [0, bh), then `ntail` tail blocks of `bt` rows (scf.for
    loops: the code stays small and only O(block) tensors are live). W_j and G_j of finished blocks are
    read back from the outputs (this program wrote them; a CTA barrier makes the global writes visible to
    all its threads). mm_w / mm_o = (split, dot): operands are split once (bf16 hi/lo for "bf16x3m") and
    reused by every product they enter. The key grams K Kᵀ, Q Kᵀ of this key head come in as inputs
    (kk_ref, qk_ref [N, N], fp32, computed once per key head outside by `key_grams`). has_layer: a [1] int32
    layer comes first and s_ref is the whole stacked state [L, B, Hv, dk, dv]: the program reads its [dk, bv] tile
    of layer `layer` in place (one indexer: the layer cannot come from an index map)."""
    if has_layer:
        l_ref, *refs = refs
    q_ref, k_ref, v_ref, g_ref, b_ref, m_ref, s_ref, kk_ref, qk_ref, o_ref, w_ref, G_ref = refs
    if has_layer:
        b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        s_idx = (l_ref[0], b, h, slice(None), pl.ds(pl.multiple_of(t * bv, bv), bv))
    else:
        s_idx = (...,)
    f32 = jnp.float32
    sw, dw = mm_w
    so, do_ = mm_o

    def rows(start, size):
        ar = start + jnp.arange(size)
        return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, size), size), ar < n

    def load_rows(ref, start, size):  # [size, d], zeros past n
        sl, ok = rows(start, size)
        return pltr.load(ref.at[sl, :], mask=ok[:, None], other=0.0).astype(f32)

    def load_vec(ref, start, size):  # [size], zeros past n
        sl, ok = rows(start, size)
        return pltr.load(ref.at[sl], mask=ok, other=0.0).astype(f32)

    def load_mask(si, ni, sj, nj):  # [ni, nj] bool block of the ancestor mask
        sli, oki = rows(si, ni)
        slj, okj = rows(sj, nj)
        return pltr.load(m_ref.at[sli, slj], mask=oki[:, None] & okj[None, :], other=0) != 0

    def load_gram(ref, si, ni, sj, nj):  # [ni, nj] fp32 block of a precomputed gram, zeros past n
        sli, oki = rows(si, ni)
        slj, okj = rows(sj, nj)
        return pltr.load(ref.at[sli, slj], mask=oki[:, None] & okj[None, :], other=0.0).astype(f32)

    def block(start, size, earlier):
        sl, ok = rows(start, size)
        Ki, Vi = load_rows(k_ref, start, size), load_rows(v_ref, start, size)
        Qi = load_rows(q_ref, start, size)
        bi = load_vec(b_ref, start, size)
        # G_i = Σ_j M_ij g_j (path cumsum) from the [size, npc] mask row panel; written out, read back as G_j
        cols = jnp.arange(npc)
        gall = pltr.load(g_ref.at[pl.ds(0, npc)], mask=cols < n, other=0.0).astype(f32)
        panel = pltr.load(m_ref.at[sl, pl.ds(0, npc)], mask=ok[:, None] & (cols < n)[None, :], other=0) != 0
        Gi = jnp.sum(jnp.where(panel, gall[None, :], 0.0), axis=1)
        pltr.store(G_ref.at[sl], Gi.astype(G_ref.dtype), mask=ok)
        eG = jnp.exp(Gi)
        S0 = s_ref[s_idx].astype(f32)  # [dk, BV], loaded where used (not kept live)
        Kw = sw(Ki)
        Qo = so(Qi)
        rhs = bi[:, None] * (Vi - eG[:, None] * dw(Kw, sw(S0)))  # [size, BV]
        o = eG[:, None] * do_(Qo, so(S0))
        rhs, o = earlier(bi, Gi, rhs, o)
        # diagonal block: (I + L) W = rhs with L strictly lower and nilpotent: L^d = 0 for d ≥ the
        # number of nodes on any root path of the block's rows (their mask row sums), so
        # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...(I + L^(2^(m-1))) exactly, 2^m ≥ d. m is read from
        # the mask at run time (DDTree: paths of ≤ 16 nodes, 4 factors); max_depth only caps the loop.
        gam = jnp.exp(jnp.where(load_mask(start, size, start, size), Gi[:, None] - Gi[None, :], -jnp.inf))
        eye = jnp.arange(size)[:, None] == jnp.arange(size)[None, :]
        kk = load_gram(kk_ref, start, size, start, size)
        L = jnp.where(eye, 0.0, bi[:, None] * gam * kk)
        dcap = min(size, max_depth) if max_depth else size
        mcap = math.ceil(math.log2(dcap)) if dcap > 1 else 0
        dmax = jnp.max(jnp.sum(panel.astype(jnp.int32), axis=1))
        m = sum((dmax > (1 << e)).astype(jnp.int32) for e in range(mcap))  # ceil(log2 dmax), ≤ mcap
        Ls = sw(L)
        X = rhs - dw(Ls, sw(rhs))

        def factor(_, c):
            P, X = c
            P = sw(dw(P, P))
            return P, X + dw(P, sw(X))

        if mcap > 1:
            _, X = jax.lax.fori_loop(0, m - 1, factor, (Ls, X))
        qk = load_gram(qk_ref, start, size, start, size)
        o = o + do_(so(gam * qk), sw(X) if same else so(X))
        pltr.store(o_ref.at[sl, :], o.astype(o_ref.dtype), mask=ok[:, None])
        pltr.store(w_ref.at[sl, :], X.astype(w_ref.dtype), mask=ok[:, None])
        barrier()  # W_i, G_i visible to every thread before the next block reads them

    def contrib(si, ni, bi, Gi, sj, nj, rhs, o):  # finished block j (rows sj.., nj) into block i
        Gj, Wj = load_vec(G_ref, sj, nj), load_rows(w_ref, sj, nj)
        gam = jnp.exp(jnp.where(load_mask(si, ni, sj, nj), Gi[:, None] - Gj[None, :], -jnp.inf))
        Wjw = sw(Wj)
        kk = load_gram(kk_ref, si, ni, sj, nj)
        qk = load_gram(qk_ref, si, ni, sj, nj)
        rhs = rhs - dw(sw(bi[:, None] * gam * kk), Wjw)
        o = o + do_(so(gam * qk), Wjw if same else so(Wj))
        return rhs, o

    block(0, bh, lambda bi, Gi, rhs, o: (rhs, o))

    def tail(t, carry):
        si = bh + t * bt

        def earlier(bi, Gi, rhs, o):
            rhs, o = contrib(si, bt, bi, Gi, 0, bh, rhs, o)
            return jax.lax.fori_loop(0, t, lambda u, c: contrib(si, bt, bi, Gi, bh + u * bt, bt, *c), (rhs, o))

        block(si, bt, earlier)
        return carry

    if ntail:
        jax.lax.fori_loop(0, ntail, tail, 0)


def key_grams(q, k):
    """[B, 2, Hk, N, N] fp32: K Kᵀ and Q Kᵀ per key head, one batched fp32 XLA dot (cuBLAS SGEMM on the H200;
    one bf16 dot of split operands [hi | lo | hi] · [hi | hi | lo] measured 44.1 vs 43.3 µs per layer with the
    kernel, o err 2.2e-3: H200 2026-12-02)."""
    qk = jnp.stack([k, q], axis=1)  # [B, 2, N, Hk, dk]
    return jnp.einsum("bsihd,bjhd->bshij", qk, k, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "block_t", "head_block", "max_depth",
                                             "num_warps", "num_stages", "precision", "smem_limit"))
def gdn_masked_block(q, k, v, g, beta, mask, state, *, layer=None, interpret: bool = False,
                     block_v: int | None = None, block_t: int = 16, head_block: int | None = None,
                     max_depth: int | None = None, num_warps: int | None = None, num_stages: int = 1,
                     precision: str = "bf16x3m", smem_limit: int | None = None):
    """The WY form over one block of N tokens related by `mask` (ancestor-or-self, [B,N,N] bool).

    q,k [B,N,Hk,dk]; v [B,N,Hv,dv]; g,beta [B,N,Hv]; state [B,Hv,dk,dv] (all fp32).
    Returns o [B,N,Hv,dv], W [B,N,Hv,dv], G [B,N,Hv] — as `gdn_masked_block_reference`.

    layer (an int32 scalar): state is the layers' stacked states [L,B,Hv,dk,dv]; the kernel reads layer `layer` in
    place (a whole-array operand, indexed inside), so that a `lax.scan` over layers copies no state slice.

    head_block: rows of the first (head) block, solved in one piece (default: N rounded up to a power of
    two, at most 128, at least block_t); the rest in block_t-row blocks. The length of the nilpotent
    product of each diagonal solve follows the deepest root path in the mask at run time (exact for any
    ancestor mask). max_depth (optional, static): a promise that no root path has more nodes; it only
    caps that loop (unrolled bound).

    K Kᵀ and Q Kᵀ are formed once per key head by one batched fp32 XLA dot (`key_grams`, shared by the
    Hv/Hk value heads and every dv tile) and read by the kernel, which does the decay masking, the solve
    and the products with S0 / W.
    """
    B, N, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    assert is_pow2(block_t) and block_t >= 16, block_t
    dkp, dvp = feature_pad(dk), feature_pad(dv)
    cfg = plan(N, dkp, dvp, block_v=block_v, block_t=block_t, head_block=head_block, limit=smem_limit)
    bh = cfg["head_block"]
    assert is_pow2(bh) and bh >= block_t, bh
    f32 = jnp.float32
    q, k, v, g, beta, state = (x.astype(f32) for x in (q, k, v, g, beta, state))
    sd = state.ndim - 2  # state's dk axis (stacked: one more leading axis)
    if dkp != dk:  # tiny test shapes only: zero features change nothing
        q, k, state = pad_axis(q, 3, dkp), pad_axis(k, 3, dkp), pad_axis(state, sd, dkp)
    if dvp != dv:
        v, state = pad_axis(v, 3, dvp), pad_axis(state, sd + 1, dvp)
    bv = cfg["block_v"]
    num_warps = num_warps or (8 if bh >= 64 else 4)
    assert is_pow2(bv) and dvp % bv == 0
    nvt = dvp // bv
    ntail = -(-max(N - bh, 0) // block_t)
    mask_i8 = mask.astype(jnp.int8)

    barrier = (lambda: None) if interpret else pltr.debug_barrier
    # "mixed": the W path (K S0, the solve) in one TF32 product (W is dominated by β v, so its error
    # stays ~1e-5), the output path (Q S0, A W) in hand-made 3xTF32
    pw, po = ("tf32", "tf32x3m") if precision == "mixed" else (precision, precision)
    kern = functools.partial(_kernel, n=N, bh=bh, bt=block_t, bv=bv, ntail=ntail, npc=next_pow2(N),
                             max_depth=max_depth, mm_w=matmul_fns(pw, interpret), mm_o=matmul_fns(po, interpret),
                             same=pw == po, has_layer=layer is not None, barrier=barrier)
    kkqk = key_grams(q, k)  # [B, 2, Hk, N, N]
    args = [q, k, v, g, beta, mask_i8, state, kkqk, kkqk]
    state_spec = pl.BlockSpec((None, None, dkp, bv), lambda b, h, t: (b, h, 0, t))
    layer_specs = []
    if layer is not None:  # the layer first; the whole stacked state, read at the layer inside
        assert state.shape[1:] == (B, Hv, dkp, dvp), state.shape
        args = [jnp.asarray(layer, jnp.int32).reshape(1)] + args
        state_spec = pl.BlockSpec(state.shape, lambda b, h, t: (0,) * 5)
        layer_specs = [pl.BlockSpec((1,), lambda b, h, t: (0,))]
    o, W, G = pl.pallas_call(
        kern,
        grid=(B, Hv, nvt),
        in_specs=layer_specs + [
            pl.BlockSpec((None, N, None, dkp), lambda b, h, t: (b, 0, h // r, 0)),  # q
            pl.BlockSpec((None, N, None, dkp), lambda b, h, t: (b, 0, h // r, 0)),  # k
            pl.BlockSpec((None, N, None, bv), lambda b, h, t: (b, 0, h, t)),  # v
            pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),  # g
            pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),  # beta
            pl.BlockSpec((None, N, N), lambda b, h, t: (b, 0, 0)),  # mask
            state_spec,
            pl.BlockSpec((None, None, None, N, N), lambda b, h, t: (b, 0, h // r, 0, 0)),  # K Kᵀ
            pl.BlockSpec((None, None, None, N, N), lambda b, h, t: (b, 1, h // r, 0, 0)),  # Q Kᵀ
        ],
        out_specs=[
            pl.BlockSpec((None, N, None, bv), lambda b, h, t: (b, 0, h, t)),  # o
            pl.BlockSpec((None, N, None, bv), lambda b, h, t: (b, 0, h, t)),  # W
            pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),  # G
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, N, Hv, dvp), f32),
            jax.ShapeDtypeStruct((B, N, Hv, dvp), f32),
            jax.ShapeDtypeStruct((B, N, Hv), f32),
        ],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_tree_block",
    )(*args)
    if dvp != dv:
        o, W = o[..., :dv], W[..., :dv]
    return o, W, G
