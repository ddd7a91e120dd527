"""Chunked gated-delta-rule prefill: intra-chunk WY parts in jnp (batched over all chunks at once),
the inter-chunk recurrence in ONE Pallas-Triton kernel that loops over the chunks with the state on chip.

Same function as `kernels_pallas.gdn_reference.gdn_chunked` (re-exported as `gdn_chunked_reference`).

Per chunk c (C = 64 tokens, G = in-chunk cumsum of g, Γ_ij = e^{G_i − G_j} for j ≤ i, β, K, Q, V):
    L = strict_tril(β Γ ⊙ K Kᵀ);  (I + L) [W0 | U] = [β V | β e^G K]       (jnp, all chunks at once;
                                                                       (I + L)⁻¹ by `unit_lower_inverse`)
    A = tril(Γ ⊙ Q Kᵀ);  O0 = A W0;  Qt = e^G Q − A U
With the state S entering the chunk, the pseudo-values are W = W0 − U S and
    O = O0 + Qt S,      S ← e^{G_last} S + Ktᵀ W,   Kt = e^{G_last − G} K   (Kt formed in the kernel).
The kernel (one program per (batch, value head, dv tile)) runs that recurrence over all chunks in an
in-kernel loop; the [dk, BV] state tile never leaves registers. With `layer` (a scan over layers, issue 40) the
state operand is the layers' whole stacked state [L, B, Hv, dk, dv], aliased to the state output: each program
reads its tile of layer `layer` and writes the new one back in place (the layer, a [1] int32 operand, in the
load's / store's one indexer: an index map cannot take it), so no state slice is copied.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.gdn_reference import gdn_chunked as gdn_chunked_reference
from kernels_pallas._common import (HIGHEST, compiler_params, dot_fn, feature_pad, first_fit, is_pow2, pad_axis,
                                    pipeline_buffers, pl, pltr, tile_bytes)

__all__ = ["gdn_chunked", "gdn_chunked_reference", "intra_chunk", "smem_bytes", "plan"]


def smem_bytes(C: int, dkp: int, bv: int, num_stages: int) -> int:
    """Shared memory (bytes, an upper estimate) of the inter-chunk program: per chunk the W0 [C, bv], U / Qt / k
    [C, dkp] and G rows (fp32), kept `pipeline_buffers` times (its dots do not accumulate over the loop: not
    asynchronous), plus the dot operands staged as hi / lo pairs: S [dkp, bv] for U·S and Qt·S, then Ktᵀ [dkp, C]
    and W [C, bv] for the state update. 27B widths (dk 128, C 64, bv 64, 2 stages): 213504, Triton's allocation."""
    f32 = jnp.float32
    loads = tile_bytes((C, bv), f32) + 3 * tile_bytes((C, dkp), f32) + 2 * tile_bytes((C,), f32)
    staged = 2 * max(tile_bytes((dkp, bv), f32), tile_bytes((dkp, C), f32) + tile_bytes((C, bv), f32))
    return pipeline_buffers(num_stages, async_mma=False) * loads + staged


def plan(C: int, dkp: int, dvp: int, *, block_v: int | None = None, num_stages: int = 2,
         limit: int | None = None) -> dict:
    """(block_v, num_stages) of a call: bv = block_v or 64 (at most dvp), halved (down to 16), then fewer stages,
    where the tiles do not fit the shared memory (`smem_bytes`; every dtype runs in fp32 here)."""
    bv = min(block_v or 64, dvp)
    bvs = [bv]
    while bvs[-1] > 16:
        bvs.append(bvs[-1] // 2)
    cands = [(b, n) for n in range(num_stages, 0, -1) for b in bvs]
    bv, ns = first_fit(cands, lambda c: smem_bytes(C, dkp, c[0], c[1]), limit, what="gdn_prefill")
    return dict(block_v=bv, num_stages=ns, smem=smem_bytes(C, dkp, bv, ns))


def unit_lower_inverse(L):
    """(I + L)⁻¹ for L [..., C, C] strictly lower triangular, C a power of two, by doubling the inverted diagonal
    blocks: with A⁻¹, D⁻¹ the inverses of a 2b-block's two b-blocks and E its lower-left block of L,
    [[A, 0], [E, D]]⁻¹ = [[A⁻¹, 0], [−D⁻¹ E A⁻¹, D⁻¹]] — forward substitution in log2(C) levels of batched fp32
    products (HIGHEST) instead of one triangular solve: on the H200 (2026-12-01) cuBLAS' batched trsm ran 0.67 ms
    of each 27B GDN layer's 2048-row prefill pass; one layer's whole chunked prefill of 8192 tokens took 4.74 ms
    this way, 6.69 ms with the trsm."""
    C = L.shape[-1]
    assert C & (C - 1) == 0, C
    lead = L.shape[:-2]
    inv = jnp.ones(lead + (C, 1, 1), L.dtype)  # [..., n, b, b]: the n = C / b inverted diagonal blocks
    b = 1
    while b < C:
        n = C // (2 * b)
        Lb = L.reshape(lead + (n, 2 * b, n, 2 * b))
        E = jnp.moveaxis(jnp.diagonal(Lb, axis1=-4, axis2=-2), -1, -3)[..., b:, :b]  # [..., n, b, b]
        Ai, Di = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        low = -jnp.einsum("...ij,...jk,...kl->...il", Di, E, Ai, precision=HIGHEST)
        top = jnp.concatenate([Ai, jnp.zeros_like(Ai)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([low, Di], axis=-1)], axis=-2)  # [..., n, 2b, 2b]
        b *= 2
    return inv[..., 0, :, :]


def intra_chunk(q, k, v, g, beta, C: int):
    """Chunk-local parts. Inputs padded to n·C tokens. Returns O0, W0 [B,n,Hv,C,dv]; U, Qt [B,n,Hv,C,dk] (the
    batched products' own layout: the inter-chunk kernel reads a head's chunks from it, so no transpose back to
    [B,T,Hv,d] — four 50 MB fp32 transposes per 27B GDN layer per 2048-row pass; H200, 2026-12-02: one layer's
    8K prefill 4.17 vs 4.74 ms); G [B,T,Hv] (cumsum of g inside each chunk), all fp32."""
    B, T, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    n = T // C
    r = Hv // Hk
    ch = lambda x: x.reshape((B, n, C) + x.shape[2:])
    qc, kc, vc, gc, bc = map(ch, (q, k, v, g, beta))  # [B,n,C,H,d], [B,n,C,Hv]
    G = jnp.cumsum(gc, axis=2)  # [B,n,C,Hv]
    causal = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    Gh = jnp.moveaxis(G, 3, 2)  # [B,n,Hv,C]
    gam = jnp.exp(jnp.where(causal, Gh[..., :, None] - Gh[..., None, :], -jnp.inf))  # [B,n,Hv,C,C]
    kk = jnp.einsum("bnihd,bnjhd->bnhij", kc, kc, precision=HIGHEST)  # [B,n,Hk,C,C]
    qk = jnp.einsum("bnihd,bnjhd->bnhij", qc, kc, precision=HIGHEST)
    kk, qk = jnp.repeat(kk, r, axis=2), jnp.repeat(qk, r, axis=2)  # -> Hv
    bh = jnp.moveaxis(bc, 3, 2)  # [B,n,Hv,C]
    L = jnp.where(strict, bh[..., :, None] * gam * kk, 0.0)
    ke = jnp.moveaxis(jnp.repeat(kc, r, axis=3), 3, 2)  # [B,n,Hv,C,dk]
    qe = jnp.moveaxis(jnp.repeat(qc, r, axis=3), 3, 2)
    vh = jnp.moveaxis(vc, 3, 2)  # [B,n,Hv,C,dv]
    eG = jnp.exp(Gh)[..., None]
    rhs = jnp.concatenate([bh[..., None] * vh, bh[..., None] * eG * ke], axis=-1)
    X = jnp.einsum("...ij,...jd->...id", unit_lower_inverse(L), rhs, precision=HIGHEST)  # (I + L)⁻¹ rhs
    W0, U = X[..., :dv], X[..., dv:]
    A = jnp.where(causal, gam * qk, 0.0)
    O0 = jnp.einsum("bnhij,bnhjv->bnhiv", A, W0, precision=HIGHEST)
    Qt = eG * qe - jnp.einsum("bnhij,bnhjk->bnhik", A, U, precision=HIGHEST)
    return O0, W0, U, Qt, G.reshape(B, T, Hv)


def _kernel(*refs, C: int, n: int, bv: int, has_layer: bool, dot):
    if has_layer:
        l_ref, *refs = refs
        b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        s_idx = (l_ref[0], b, h, slice(None), pl.ds(pl.multiple_of(t * bv, bv), bv))  # the stacked state's tile
    else:
        s_idx = (...,)
    o0_ref, w0_ref, u_ref, qt_ref, k_ref, G_ref, s_ref, o_ref, so_ref = refs
    f32 = jnp.float32
    last = jnp.arange(C) == C - 1

    def body(c, S):
        rows = pl.ds(pl.multiple_of(c * C, C), C)
        W = w0_ref[c].astype(f32) - dot(u_ref[c].astype(f32), S)  # [C, BV]
        o_ref[rows, :] = (o0_ref[c].astype(f32) + dot(qt_ref[c].astype(f32), S)).astype(o_ref.dtype)
        G = G_ref[rows].astype(f32)  # [C]
        g_last = jnp.sum(jnp.where(last, G, 0.0))
        kt = jnp.exp(g_last - G)[:, None] * k_ref[rows, :].astype(f32)  # [C, dk]
        return jnp.exp(g_last) * S + dot(kt.T, W)

    S = jax.lax.fori_loop(0, n, body, s_ref[s_idx].astype(f32))
    so_ref[s_idx] = S.astype(so_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "block_v", "num_warps", "num_stages",
                                             "precision", "smem_limit"))
def gdn_chunked(q, k, v, g, beta, state, chunk: int = 64, *, layer=None, interpret: bool = False,
                block_v: int | None = None, num_warps: int = 4, num_stages: int = 2, precision: str = "tf32x3",
                smem_limit: int | None = None):
    """Chunked prefill over T tokens. q,k [B,T,Hk,dk]; v [B,T,Hv,dv]; g,beta [B,T,Hv]; state [B,Hv,dk,dv]
    -> (o [B,T,Hv,dv], state). Same as `gdn_chunked_reference`.

    layer (an int32 scalar): state is the layers' stacked states [L,B,Hv,dk,dv]; the kernel reads layer `layer`
    and writes the new state there in place (the stack aliased to the output: in place under a jit that donates
    it, or as a `lax.scan` carry), and the whole stack is returned, so no state slice is copied."""
    f32 = jnp.float32
    B, T, Hk, dk = k.shape
    Hv, dv = v.shape[2], v.shape[3]
    C = min(chunk, T)
    r = Hv // Hk
    # kernel rows: a power of two ≥ 16 (chunking is exact in any chunk size, so this may differ from C)
    Cp = max(16, 1 << (C - 1).bit_length())
    pad = (-T) % Cp
    q, k, v, g, beta, state = (x.astype(f32) for x in (q, k, v, g, beta, state))
    sd = state.ndim - 2  # state's dk axis (stacked: one more leading axis)
    if pad:  # beta = 0, g = 0: padded tokens change nothing
        padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    Tp = T + pad
    n = Tp // Cp
    dkp, dvp = feature_pad(dk), feature_pad(dv)
    if dkp != dk:  # tiny test shapes only
        q, k, state = pad_axis(q, 3, dkp), pad_axis(k, 3, dkp), pad_axis(state, sd, dkp)
    if dvp != dv:
        v, state = pad_axis(v, 3, dvp), pad_axis(state, sd + 1, dvp)
    O0, W0, U, Qt, Gc = intra_chunk(q, k, v, g, beta, Cp)
    cfg = plan(Cp, dkp, dvp, block_v=block_v, num_stages=num_stages, limit=smem_limit)
    bv, num_stages = cfg["block_v"], cfg["num_stages"]
    assert is_pow2(bv) and dvp % bv == 0
    kern = functools.partial(_kernel, C=Cp, n=n, bv=bv, has_layer=layer is not None, dot=dot_fn(precision, interpret))
    args = [O0, W0, U, Qt, k, Gc, state]
    state_spec = pl.BlockSpec((None, None, dkp, bv), lambda b, h, t: (b, h, 0, t))
    layer_specs, aliases = [], {6: 1}
    if layer is not None:  # the layer first; the whole stacked state, read and written at the layer inside
        assert state.shape[1:] == (B, Hv, dkp, dvp), state.shape
        args = [jnp.asarray(layer, jnp.int32).reshape(1)] + args
        state_spec = pl.BlockSpec(state.shape, lambda b, h, t: (0,) * 5)
        layer_specs, aliases = [pl.BlockSpec((1,), lambda b, h, t: (0,))], {7: 1}
    o, state_new = pl.pallas_call(
        kern,
        grid=(B, Hv, dvp // bv),
        in_specs=layer_specs + [
            pl.BlockSpec((None, n, None, Cp, bv), lambda b, h, t: (b, 0, h, 0, t)),  # O0 [B,n,Hv,C,dv]
            pl.BlockSpec((None, n, None, Cp, bv), lambda b, h, t: (b, 0, h, 0, t)),  # W0
            pl.BlockSpec((None, n, None, Cp, dkp), lambda b, h, t: (b, 0, h, 0, 0)),  # U [B,n,Hv,C,dk]
            pl.BlockSpec((None, n, None, Cp, dkp), lambda b, h, t: (b, 0, h, 0, 0)),  # Qt
            pl.BlockSpec((None, Tp, None, dkp), lambda b, h, t: (b, 0, h // r, 0)),  # k
            pl.BlockSpec((None, Tp, None), lambda b, h, t: (b, 0, h)),  # G (in-chunk cumsum)
            state_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, Tp, None, bv), lambda b, h, t: (b, 0, h, t)),
            state_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, Hv, dvp), f32),
            jax.ShapeDtypeStruct(state.shape, f32),
        ],
        input_output_aliases=aliases,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_prefill_inter_chunk",
    )(*args)
    return o[:, :T, :, :dv], state_new[..., :dk, :dv]
