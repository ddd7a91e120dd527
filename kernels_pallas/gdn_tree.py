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
and they are never stored. Everything is fp32; dots use three TF32 products by default ("tf32x3").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxddtree.gdn_math import gdn_masked_block as gdn_masked_block_reference
from kernels_pallas._common import compiler_params, dot_fn, feature_pad, is_pow2, pad_axis, pl, pltr

__all__ = ["gdn_masked_block", "gdn_masked_block_reference"]


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, m_ref, s_ref, o_ref, w_ref, G_ref, *,
            n: int, bt: int, nb: int, dot):
    f32 = jnp.float32
    t = pl.program_id(2)
    S0 = s_ref[...].astype(f32)  # [dk, BV]
    ar = jnp.arange(bt)
    eye = ar[:, None] == ar[None, :]

    zero = pl.program_id(0) * 0  # a traced 0: a static slice past N would be rejected at trace time

    def start(i):
        return i * bt if (i + 1) * bt <= n else pl.multiple_of(zero + i * bt, bt)

    def rows(i):
        r = i * bt + ar
        return r, r < n

    def load_rows(ref, i):  # [bt, d] rows i*bt.., zeros past n
        _, ok = rows(i)
        return pltr.load(ref.at[pl.ds(start(i), bt), :], mask=ok[:, None], other=0.0).astype(f32)

    def load_vec(ref, i):
        _, ok = rows(i)
        return pltr.load(ref.at[pl.ds(start(i), bt)], mask=ok, other=0.0).astype(f32)

    def load_mask(i, j):  # [bt, bt] bool block (i, j) of the ancestor mask
        _, oki = rows(i)
        _, okj = rows(j)
        mij = pltr.load(m_ref.at[pl.ds(start(i), bt), pl.ds(start(j), bt)],
                        mask=oki[:, None] & okj[None, :], other=0)
        return mij != 0

    gs, Gs, Ws = [], [], []
    for i in range(nb):
        Ki, Qi, Vi = load_rows(k_ref, i), load_rows(q_ref, i), load_rows(v_ref, i)
        gs.append(load_vec(g_ref, i))
        bi = load_vec(b_ref, i)
        Ms = [load_mask(i, j) for j in range(i + 1)]
        Gi = jnp.zeros((bt,), f32)
        for j in range(i + 1):
            Gi = Gi + jnp.sum(jnp.where(Ms[j], gs[j][None, :], 0.0), axis=1)
        eG = jnp.exp(Gi)
        rhs = bi[:, None] * (Vi - eG[:, None] * dot(Ki, S0))  # [bt, BV]
        o = eG[:, None] * dot(Qi, S0)
        for j in range(i):  # earlier blocks: their W is final
            Kj = load_rows(k_ref, j)
            gam = jnp.exp(jnp.where(Ms[j], Gi[:, None] - Gs[j][None, :], -jnp.inf))
            Lij = bi[:, None] * gam * dot(Ki, Kj.T)
            Aij = gam * dot(Qi, Kj.T)
            rhs = rhs - dot(Lij, Ws[j])
            o = o + dot(Aij, Ws[j])
        # diagonal block: (I + L) W = rhs with L strictly lower (nilpotent, L^bt = 0)
        gam = jnp.exp(jnp.where(Ms[i], Gi[:, None] - Gi[None, :], -jnp.inf))
        L = jnp.where(eye, 0.0, bi[:, None] * gam * dot(Ki, Ki.T))
        X = rhs - dot(L, rhs)  # (I - L) rhs
        P = L
        for _ in range(int(math.log2(bt)) - 1):  # (I + L^2)(I + L^4)...(I + L^(bt/2))
            P = dot(P, P)
            X = X + dot(P, X)
        Wi = X
        o = o + dot(gam * dot(Qi, Ki.T), Wi)
        Gs.append(Gi)
        Ws.append(Wi)
        _, ok = rows(i)
        pltr.store(o_ref.at[pl.ds(start(i), bt), :], o.astype(o_ref.dtype), mask=ok[:, None])
        pltr.store(w_ref.at[pl.ds(start(i), bt), :], Wi.astype(w_ref.dtype), mask=ok[:, None])

        @pl.when(t == 0)
        def _():
            pltr.store(G_ref.at[pl.ds(start(i), bt)], Gi.astype(G_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("interpret", "block_v", "block_t", "num_warps", "num_stages",
                                             "precision"))
def gdn_masked_block(q, k, v, g, beta, mask, state, *, interpret: bool = False, block_v: int | None = None,
                     block_t: int = 16, num_warps: int = 4, num_stages: int = 1, precision: str = "tf32x3"):
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
    bv = min(block_v or 64, dvp)
    assert is_pow2(bv) and dvp % bv == 0
    nvt = dvp // bv
    nb = -(-N // block_t)
    mask_i8 = mask.astype(jnp.int8)

    kern = functools.partial(_kernel, n=N, bt=block_t, nb=nb, dot=dot_fn(precision, interpret))
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
