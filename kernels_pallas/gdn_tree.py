"""Tree (ancestor-masked) gated delta rule, one WY block, as one Pallas-Triton kernel.

Same function as `jaxddtree.gdn_math.gdn_masked_block` (the reference, re-exported here as
`gdn_masked_block_reference`): for every (batch, value head, dv tile) program, over row blocks of
`block_t` nodes (static loop; the tree is in topological order so the mask is lower triangular):

    G_i   = Σ_j M_ij g_j                                   (path cumsum)
    Γ_ij  = exp(G_i − G_j) on the ancestor-or-self relation, 0 elsewhere
    rhs_i = β_i (v_i − e^{G_i} k_iᵀ S0) − Σ_{j in earlier blocks} L_ij W_j,  L_ij = β_i Γ_ij k_i·k_j
    W_i   = (I + L_ii)⁻¹ rhs_i        (diagonal block: L_ii is nilpotent, so the inverse is the
                                       exact product (I − L)(I + L²)(I + L⁴)…: log2(block_t) steps)
    o_i   = e^{G_i} q_iᵀ S0 + Σ_{j ≤ i} (Γ ⊙ Q Kᵀ)_ij W_j

N need not be a multiple of the block: rows ≥ N are loaded as zeros (β = 0, mask 0), so their W is 0,
and they are never stored. Every program writes G (all dv tiles write the same values) and reads back
its own G_j / W_j of finished blocks. Everything is fp32. The dots default to "bf16x3" (each fp32
operand split into bf16 hi + lo, three bf16 tensor-core products summed in fp32: rel. err ~6e-6 on o,
~2e-7 on W at 27B shapes). Measured on the H200 (N=65, Hv=48, GPU µs per layer): bf16x3 67, tf32 42
(but o err 4e-4), plain fp32 FMA ("ieee") 194, Triton's TF32x3 1131, hand 3xTF32 1039, bf16x6 249;
the XLA reference 85.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxddtree.gdn_math import gdn_masked_block as gdn_masked_block_reference
from kernels_pallas._common import compiler_params, dot_fn, feature_pad, is_pow2, next_pow2, pad_axis, pl, pltr

__all__ = ["gdn_masked_block", "gdn_masked_block_reference"]


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, m_ref, s_ref, o_ref, w_ref, G_ref, *,
            n: int, bt: int, nb: int, npc: int, dot_w, dot_o, barrier):
    """Loops over row blocks i (and earlier blocks j < i) in scf.for loops: the code stays small and
    only O(block) tensors are live. W_j and G_j of finished blocks are read back from the outputs (this
    program wrote them; a CTA barrier makes the global writes visible to all its threads)."""
    f32 = jnp.float32
    ar = jnp.arange(bt)
    eye = ar[:, None] == ar[None, :]

    def blk(i):
        r = i * bt + ar
        return pl.ds(pl.multiple_of(i * bt, bt), bt), r < n

    def load_rows(ref, i):  # [bt, d], zeros past n
        sl, ok = blk(i)
        return pltr.load(ref.at[sl, :], mask=ok[:, None], other=0.0).astype(f32)

    def load_vec(ref, i):  # [bt], zeros past n
        sl, ok = blk(i)
        return pltr.load(ref.at[sl], mask=ok, other=0.0).astype(f32)

    def load_mask(i, j):  # [bt, bt] bool block (i, j) of the ancestor mask
        si, oki = blk(i)
        sj, okj = blk(j)
        return pltr.load(m_ref.at[si, sj], mask=oki[:, None] & okj[None, :], other=0) != 0

    def row_block(i, carry):
        sl, ok = blk(i)
        Ki, Qi, Vi = load_rows(k_ref, i), load_rows(q_ref, i), load_rows(v_ref, i)
        bi = load_vec(b_ref, i)
        # G_i = Σ_j M_ij g_j (path cumsum) from the [bt, npc] mask row panel; written out, read back as G_j
        cols = jnp.arange(npc)
        gall = pltr.load(g_ref.at[pl.ds(0, npc)], mask=cols < n, other=0.0).astype(f32)
        panel = pltr.load(m_ref.at[sl, pl.ds(0, npc)], mask=ok[:, None] & (cols < n)[None, :], other=0) != 0
        Gi = jnp.sum(jnp.where(panel, gall[None, :], 0.0), axis=1)
        pltr.store(G_ref.at[sl], Gi.astype(G_ref.dtype), mask=ok)
        eG = jnp.exp(Gi)
        S0 = s_ref[...].astype(f32)  # [dk, BV], loaded where used (not kept live)
        rhs = bi[:, None] * (Vi - eG[:, None] * dot_w(Ki, S0))  # [bt, BV]
        o = eG[:, None] * dot_o(Qi, S0)

        def earlier(j, c):  # block j < i: its W is final
            rhs, o = c
            Kj, Gj, Wj = load_rows(k_ref, j), load_vec(G_ref, j), load_rows(w_ref, j)
            gam = jnp.exp(jnp.where(load_mask(i, j), Gi[:, None] - Gj[None, :], -jnp.inf))
            rhs = rhs - dot_w(bi[:, None] * gam * dot_w(Ki, Kj.T), Wj)
            o = o + dot_o(gam * dot_o(Qi, Kj.T), Wj)
            return rhs, o

        rhs, o = jax.lax.fori_loop(0, i, earlier, (rhs, o))
        # diagonal block: (I + L) W = rhs with L strictly lower (nilpotent, L^bt = 0):
        # (I + L)^-1 = (I - L)(I + L^2)(I + L^4)...(I + L^(bt/2))
        gam = jnp.exp(jnp.where(load_mask(i, i), Gi[:, None] - Gi[None, :], -jnp.inf))
        L = jnp.where(eye, 0.0, bi[:, None] * gam * dot_w(Ki, Ki.T))
        X = rhs - dot_w(L, rhs)
        P = L
        for _ in range(int(math.log2(bt)) - 1):
            P = dot_w(P, P)
            X = X + dot_w(P, X)
        o = o + dot_o(gam * dot_o(Qi, Ki.T), X)
        pltr.store(w_ref.at[sl, :], X.astype(w_ref.dtype), mask=ok[:, None])
        pltr.store(o_ref.at[sl, :], o.astype(o_ref.dtype), mask=ok[:, None])
        barrier()  # W_i, G_i visible to every thread before block i + 1 reads them
        return carry

    jax.lax.fori_loop(0, nb, row_block, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "block_t", "num_warps", "num_stages",
                                             "precision"))
def gdn_masked_block(q, k, v, g, beta, mask, state, *, interpret: bool = False, block_v: int | None = None,
                     block_t: int = 16, num_warps: int = 4, num_stages: int = 1, precision: str = "bf16x3"):
    """The WY form over one block of N tokens related by `mask` (ancestor-or-self, [B,N,N] bool).

    q,k [B,N,Hk,dk]; v [B,N,Hv,dv]; g,beta [B,N,Hv]; state [B,Hv,dk,dv] (all fp32).
    Returns o [B,N,Hv,dv], W [B,N,Hv,dv], G [B,N,Hv] — as `gdn_masked_block_reference`.
    """
    B, N, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    assert is_pow2(block_t) and block_t >= 16, block_t
    dkp, dvp = feature_pad(dk), feature_pad(dv)
    f32 = jnp.float32
    q, k, v, g, beta, state = (x.astype(f32) for x in (q, k, v, g, beta, state))
    if dkp != dk:  # tiny test shapes only: zero features change nothing
        q, k, state = pad_axis(q, 3, dkp), pad_axis(k, 3, dkp), pad_axis(state, 2, dkp)
    if dvp != dv:
        v, state = pad_axis(v, 3, dvp), pad_axis(state, 3, dvp)
    bv = min(block_v or 64, dvp)  # H200, N=65: bv 64 ≈ bv 32 < bv 16 (w2); see benchmarks/results/kernels_h200.json
    assert is_pow2(bv) and dvp % bv == 0
    nvt = dvp // bv
    nb = -(-N // block_t)
    mask_i8 = mask.astype(jnp.int8)

    barrier = (lambda: None) if interpret else pltr.debug_barrier
    # "mixed": the W path (K S0, k·k grams, the solve) in one TF32 product (W is dominated by β v, so
    # its error stays ~1e-5), the output path (Q S0, q·k, A W) in hand-made 3xTF32
    pw, po = ("tf32", "tf32x3m") if precision == "mixed" else (precision, precision)
    kern = functools.partial(_kernel, n=N, bt=block_t, nb=nb, npc=next_pow2(N), dot_w=dot_fn(pw, interpret),
                             dot_o=dot_fn(po, interpret), barrier=barrier)
    o, W, G = pl.pallas_call(
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
    )(q, k, v, g, beta, mask_i8, state)
    if dvp != dv:
        o, W = o[..., :dv], W[..., :dv]
    return o, W, G
