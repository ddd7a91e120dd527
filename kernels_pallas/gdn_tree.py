"""Tree (ancestor-masked) gated delta rule, one WY block, as one Pallas-Triton kernel.

Same function as `jaxddtree.gdn_math.gdn_masked_block` (the reference, re-exported here as
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
its own G_j / W_j of finished blocks. Everything is fp32. The dots default to "bf16x3m": each fp32
operand split once into bf16 hi + lo, three bf16 tensor-core products summed in fp32 (rel. err 6e-6 on
o, 2e-7 on W at 27B shapes). Measured on the H200 (N=65, Hv=48, GPU µs per layer, 2026-11-29 round 4):
default (head block 128, bv 64, 8 warps) 44; the same with the bf16x3 preset (re-splits operands in every
product) ~+35%; head block 64 + a 16-row block 56; 16-row blocks only (round-3 design) 67-88; bv 128 64,
bv 32 94, 16 warps 153; tf32 37 (o err 4e-4); the XLA reference 85.

Round 5 (H200, 2026-11-29, same run): gram="xla" (the default since) — K Kᵀ and Q Kᵀ of each key head by
one batched fp32 XLA dot outside (`key_grams`), shared by its value heads and dv tiles; the kernel reads them
(exact fp32 grams: o err 4.4e-6 instead of 6e-6) and drops its two largest products: 43.4 µs/layer (kernel
33.6 + grams 6.0 + transpose 1.5) vs 46.4 for gram="kernel" and 85 for XLA. gram="kernel" computes them
inside. o_phase=True — the kernel solves W, G only and a second, fully parallel kernel (one
program per value head, dv tile, row block) forms o: 46-79 µs/layer in round 5 (not faster).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxddtree.gdn_math import gdn_masked_block as gdn_masked_block_reference
from kernels_pallas._common import compiler_params, feature_pad, is_pow2, matmul_fns, next_pow2, pad_axis, pl, pltr

__all__ = ["gdn_masked_block", "gdn_masked_block_reference", "key_grams"]


def _kernel(*refs, n: int, bh: int, bt: int, ntail: int, npc: int, max_depth: int | None, mm_w, mm_o,
            same: bool, barrier, gram: bool, do_o: bool):
    """Row blocks: a head block of `bh` rows [0, bh), then `ntail` tail blocks of `bt` rows (scf.for
    loops: the code stays small and only O(block) tensors are live). W_j and G_j of finished blocks are
    read back from the outputs (this program wrote them; a CTA barrier makes the global writes visible to
    all its threads). mm_w / mm_o = (split, dot, dot_nt): operands are split once (bf16 hi/lo for
    "bf16x3m") and reused by every product they enter.

    gram: the key grams K Kᵀ, Q Kᵀ of this key head come in as inputs (kk_ref, qk_ref [N, N], fp32,
    computed once per key head outside) instead of being formed here by every (value head, dv tile).
    do_o=False: only W and G (the output is formed by `_out_kernel`)."""
    q_ref, k_ref, v_ref, g_ref, b_ref, m_ref, s_ref, *rest = refs
    kk_ref = qk_ref = None
    if gram:
        kk_ref, qk_ref, *rest = rest
    if do_o:
        o_ref, w_ref, G_ref = rest
    else:
        o_ref, (w_ref, G_ref) = None, rest
    f32 = jnp.float32
    sw, dw, dtw = mm_w
    so, do_, dto = mm_o

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
        Qi = load_rows(q_ref, start, size) if do_o else None
        bi = load_vec(b_ref, start, size)
        # G_i = Σ_j M_ij g_j (path cumsum) from the [size, npc] mask row panel; written out, read back as G_j
        cols = jnp.arange(npc)
        gall = pltr.load(g_ref.at[pl.ds(0, npc)], mask=cols < n, other=0.0).astype(f32)
        panel = pltr.load(m_ref.at[sl, pl.ds(0, npc)], mask=ok[:, None] & (cols < n)[None, :], other=0) != 0
        Gi = jnp.sum(jnp.where(panel, gall[None, :], 0.0), axis=1)
        pltr.store(G_ref.at[sl], Gi.astype(G_ref.dtype), mask=ok)
        eG = jnp.exp(Gi)
        S0 = s_ref[...].astype(f32)  # [dk, BV], loaded where used (not kept live)
        Kw = sw(Ki)
        Qo = so(Qi) if do_o else None
        rhs = bi[:, None] * (Vi - eG[:, None] * dw(Kw, sw(S0)))  # [size, BV]
        o = eG[:, None] * do_(Qo, so(S0)) if do_o else None
        rhs, o = earlier(Kw, Qo, Ki, bi, Gi, rhs, o)
        # diagonal block: (I + L) W = rhs with L strictly lower and nilpotent: L^d = 0 for d ≥ the
        # number of nodes on any root path of the block's rows (their mask row sums), so
        # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...(I + L^(2^(m-1))) exactly, 2^m ≥ d. m is read from
        # the mask at run time (DDTree: paths of ≤ 16 nodes, 4 factors); max_depth only caps the loop.
        gam = jnp.exp(jnp.where(load_mask(start, size, start, size), Gi[:, None] - Gi[None, :], -jnp.inf))
        eye = jnp.arange(size)[:, None] == jnp.arange(size)[None, :]
        kk = load_gram(kk_ref, start, size, start, size) if gram else dtw(Kw, Kw)
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
        if do_o:
            qk = load_gram(qk_ref, start, size, start, size) if gram else dto(Qo, Kw if same else so(Ki))
            o = o + do_(so(gam * qk), sw(X) if same else so(X))
            pltr.store(o_ref.at[sl, :], o.astype(o_ref.dtype), mask=ok[:, None])
        pltr.store(w_ref.at[sl, :], X.astype(w_ref.dtype), mask=ok[:, None])
        barrier()  # W_i, G_i visible to every thread before the next block reads them

    def contrib(si, ni, Kw, Qo, Ki, bi, Gi, sj, nj, rhs, o):  # finished block j (rows sj.., nj) into block i
        Gj, Wj = load_vec(G_ref, sj, nj), load_rows(w_ref, sj, nj)
        gam = jnp.exp(jnp.where(load_mask(si, ni, sj, nj), Gi[:, None] - Gj[None, :], -jnp.inf))
        Wjw = sw(Wj)
        if gram:
            kk = load_gram(kk_ref, si, ni, sj, nj)
            qk = load_gram(qk_ref, si, ni, sj, nj) if do_o else None
        else:
            Kj = load_rows(k_ref, sj, nj)
            Kjw = sw(Kj)
            kk = dtw(Kw, Kjw)
            qk = dto(Qo, Kjw if same else so(Kj)) if do_o else None
        rhs = rhs - dw(sw(bi[:, None] * gam * kk), Wjw)
        if do_o:
            o = o + do_(so(gam * qk), Wjw if same else so(Wj))
        return rhs, o

    block(0, bh, lambda Kw, Qo, Ki, bi, Gi, rhs, o: (rhs, o))

    def tail(t, carry):
        si = bh + t * bt

        def earlier(Kw, Qo, Ki, bi, Gi, rhs, o):
            rhs, o = contrib(si, bt, Kw, Qo, Ki, bi, Gi, 0, bh, rhs, o)
            return jax.lax.fori_loop(
                0, t, lambda u, c: contrib(si, bt, Kw, Qo, Ki, bi, Gi, bh + u * bt, bt, *c), (rhs, o))

        block(si, bt, earlier)
        return carry

    if ntail:
        jax.lax.fori_loop(0, ntail, tail, 0)


def _out_kernel(*refs, n: int, ob: int, npc: int, mm, gram: bool):
    """Output phase (o_phase=True): rows [rb·ob, rb·ob + ob) of one (value head, dv tile), with W and G
    already solved: o_i = e^{G_i} q_iᵀ S0 + Σ_j (Γ ⊙ Q Kᵀ)_ij W_j over all columns j < N (no order,
    every row block is independent)."""
    if gram:
        q_ref, s_ref, w_ref, G_ref, m_ref, qk_ref, o_ref = refs
    else:
        q_ref, k_ref, s_ref, w_ref, G_ref, m_ref, o_ref = refs
    f32 = jnp.float32
    sp, dot, dot_nt = mm
    start = pl.multiple_of(pl.program_id(3) * ob, ob)
    ri = start + jnp.arange(ob)
    oki = ri < n
    cols = jnp.arange(npc)
    okj = cols < n
    sl, slj = pl.ds(start, ob), pl.ds(0, npc)
    Qi = pltr.load(q_ref.at[sl, :], mask=oki[:, None], other=0.0).astype(f32)
    Gi = pltr.load(G_ref.at[sl], mask=oki, other=0.0).astype(f32)
    Gj = pltr.load(G_ref.at[slj], mask=okj, other=0.0).astype(f32)
    Wj = pltr.load(w_ref.at[slj, :], mask=okj[:, None], other=0.0).astype(f32)
    msk = pltr.load(m_ref.at[sl, slj], mask=oki[:, None] & okj[None, :], other=0) != 0
    Qs = sp(Qi)
    if gram:
        qk = pltr.load(qk_ref.at[sl, slj], mask=oki[:, None] & okj[None, :], other=0.0).astype(f32)
    else:
        Kj = pltr.load(k_ref.at[slj, :], mask=okj[:, None], other=0.0).astype(f32)
        qk = dot_nt(Qs, sp(Kj))
    gam = jnp.exp(jnp.where(msk, Gi[:, None] - Gj[None, :], -jnp.inf))
    o = jnp.exp(Gi)[:, None] * dot(Qs, sp(s_ref[...].astype(f32))) + dot(sp(gam * qk), sp(Wj))
    pltr.store(o_ref.at[sl, :], o.astype(o_ref.dtype), mask=oki[:, None])


def key_grams(q, k):
    """[B, 2, Hk, N, N] fp32: K Kᵀ and Q Kᵀ per key head (one batched XLA dot, fp32 HIGHEST)."""
    qk = jnp.stack([k, q], axis=1)  # [B, 2, N, Hk, dk]
    return jnp.einsum("bsihd,bjhd->bshij", qk, k, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "block_t", "head_block", "max_depth",
                                             "num_warps", "num_stages", "precision", "gram", "o_phase",
                                             "o_block", "o_block_v", "o_num_warps"))
def gdn_masked_block(q, k, v, g, beta, mask, state, *, interpret: bool = False, block_v: int | None = None,
                     block_t: int = 16, head_block: int | None = None, max_depth: int | None = None,
                     num_warps: int | None = None, num_stages: int = 1, precision: str = "bf16x3m",
                     gram: str = "xla", o_phase: bool = False, o_block: int | None = None,
                     o_block_v: int | None = None, o_num_warps: int | None = None):
    """The WY form over one block of N tokens related by `mask` (ancestor-or-self, [B,N,N] bool).

    q,k [B,N,Hk,dk]; v [B,N,Hv,dv]; g,beta [B,N,Hv]; state [B,Hv,dk,dv] (all fp32).
    Returns o [B,N,Hv,dv], W [B,N,Hv,dv], G [B,N,Hv] — as `gdn_masked_block_reference`.

    head_block: rows of the first (head) block, solved in one piece (default: N rounded up to a power of
    two, at most 128, at least block_t); the rest in block_t-row blocks. The length of the nilpotent
    product of each diagonal solve follows the deepest root path in the mask at run time (exact for any
    ancestor mask). max_depth (optional, static): a promise that no root path has more nodes; it only
    caps that loop (unrolled bound).

    gram="xla": K Kᵀ and Q Kᵀ are formed once per key head by one batched fp32 XLA dot (`key_grams`,
    shared by the Hv/Hk value heads and every dv tile) and read by the kernel, which then only does the
    decay masking, the solve and the products with S0 / W (default "kernel": every program forms them).
    o_phase=True: the kernel solves W, G only; a second kernel forms o, one program per (value head,
    o_block_v tile, o_block rows) — all independent (defaults: o_block = head block ≤ 64, o_block_v = bv,
    o_num_warps 4).
    """
    assert gram in ("kernel", "xla"), gram
    B, N, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    assert is_pow2(block_t) and block_t >= 16, block_t
    bh = head_block or max(block_t, min(128, next_pow2(N)))
    assert is_pow2(bh) and bh >= block_t, bh
    dkp, dvp = feature_pad(dk), feature_pad(dv)
    f32 = jnp.float32
    q, k, v, g, beta, state = (x.astype(f32) for x in (q, k, v, g, beta, state))
    if dkp != dk:  # tiny test shapes only: zero features change nothing
        q, k, state = pad_axis(q, 3, dkp), pad_axis(k, 3, dkp), pad_axis(state, 2, dkp)
    if dvp != dv:
        v, state = pad_axis(v, 3, dvp), pad_axis(state, 3, dvp)
    bv = min(block_v or 64, dvp)
    num_warps = num_warps or (8 if bh >= 64 else 4)
    assert is_pow2(bv) and dvp % bv == 0
    nvt = dvp // bv
    ntail = -(-max(N - bh, 0) // block_t)
    mask_i8 = mask.astype(jnp.int8)

    barrier = (lambda: None) if interpret else pltr.debug_barrier
    # "mixed": the W path (K S0, k·k grams, the solve) in one TF32 product (W is dominated by β v, so
    # its error stays ~1e-5), the output path (Q S0, q·k, A W) in hand-made 3xTF32
    pw, po = ("tf32", "tf32x3m") if precision == "mixed" else (precision, precision)
    use_gram = gram == "xla"
    npc = next_pow2(N)
    kern = functools.partial(_kernel, n=N, bh=bh, bt=block_t, ntail=ntail, npc=npc, max_depth=max_depth,
                             mm_w=matmul_fns(pw, interpret), mm_o=matmul_fns(po, interpret), same=pw == po,
                             barrier=barrier, gram=use_gram, do_o=not o_phase)
    grams = key_grams(q, k) if use_gram else None  # [B, 2, Hk, N, N]
    gram_specs = [pl.BlockSpec((None, None, None, N, N), lambda b, h, t: (b, 0, h // r, 0, 0)),  # K Kᵀ
                  pl.BlockSpec((None, None, None, N, N), lambda b, h, t: (b, 1, h // r, 0, 0))]  # Q Kᵀ
    o_spec = [pl.BlockSpec((None, N, None, bv), lambda b, h, t: (b, 0, h, t))] if not o_phase else []
    o_shape = [jax.ShapeDtypeStruct((B, N, Hv, dvp), f32)] if not o_phase else []
    outs = pl.pallas_call(
        kern,
        grid=(B, Hv, nvt),
        in_specs=[
            pl.BlockSpec((None, N, None, dkp), lambda b, h, t: (b, 0, h // r, 0)),  # q
            pl.BlockSpec((None, N, None, dkp), lambda b, h, t: (b, 0, h // r, 0)),  # k
            pl.BlockSpec((None, N, None, bv), lambda b, h, t: (b, 0, h, t)),  # v
            pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),  # g
            pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),  # beta
            pl.BlockSpec((None, N, N), lambda b, h, t: (b, 0, 0)),  # mask
            pl.BlockSpec((None, None, dkp, bv), lambda b, h, t: (b, h, 0, t)),  # state
        ] + (gram_specs if use_gram else []),
        out_specs=o_spec + [
            pl.BlockSpec((None, N, None, bv), lambda b, h, t: (b, 0, h, t)),  # W
            pl.BlockSpec((None, N, None), lambda b, h, t: (b, 0, h)),  # G
        ],
        out_shape=o_shape + [
            jax.ShapeDtypeStruct((B, N, Hv, dvp), f32),
            jax.ShapeDtypeStruct((B, N, Hv), f32),
        ],
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_tree_block",
    )(q, k, v, g, beta, mask_i8, state, *((grams, grams) if use_gram else ()))
    if o_phase:
        W, G = outs
        ob = o_block or min(bh, 64)
        obv = min(o_block_v or bv, dvp)
        assert is_pow2(ob) and ob >= 16 and is_pow2(obv) and dvp % obv == 0, (ob, obv)
        nrb = -(-N // ob)
        okern = functools.partial(_out_kernel, n=N, ob=ob, npc=npc, mm=matmul_fns(po, interpret), gram=use_gram)
        qk_specs = ([pl.BlockSpec((None, None, None, N, N), lambda b, h, t, i: (b, 1, h // r, 0, 0))] if use_gram
                    else [pl.BlockSpec((None, N, None, dkp), lambda b, h, t, i: (b, 0, h // r, 0))])  # qk gram | k
        o = pl.pallas_call(
            okern,
            grid=(B, Hv, dvp // obv, nrb),
            in_specs=[pl.BlockSpec((None, N, None, dkp), lambda b, h, t, i: (b, 0, h // r, 0))]  # q
            + ([] if use_gram else qk_specs) + [
                pl.BlockSpec((None, None, dkp, obv), lambda b, h, t, i: (b, h, 0, t)),  # state
                pl.BlockSpec((None, N, None, obv), lambda b, h, t, i: (b, 0, h, t)),  # W
                pl.BlockSpec((None, N, None), lambda b, h, t, i: (b, 0, h)),  # G
                pl.BlockSpec((None, N, N), lambda b, h, t, i: (b, 0, 0)),  # mask
            ] + (qk_specs if use_gram else []),
            out_specs=pl.BlockSpec((None, N, None, obv), lambda b, h, t, i: (b, 0, h, t)),
            out_shape=jax.ShapeDtypeStruct((B, N, Hv, dvp), f32),
            compiler_params=compiler_params(o_num_warps or 4, 1),
            interpret=interpret,
            name="gdn_tree_out",
        )(q, *(() if use_gram else (k,)), state, W, G, mask_i8, *((grams,) if use_gram else ()))
    else:
        o, W, G = outs
    if dvp != dv:
        o, W = o[..., :dv], W[..., :dv]
    return o, W, G
