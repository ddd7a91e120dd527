"""Causal prefill attention (a sequence chunk over the cache) as one Pallas-Triton flash-attention kernel.

Same function as `prefill_attention_reference` (= `tree_attention_reference` with the causal mask): the T
queries of a chunk at positions [start, start + T) attend to the committed cache rows [0, start) and,
causally, to the chunk's own new rows (query t sees new rows j ≤ t). No mask is read; key blocks above
the diagonal are never visited.

GQA is folded into the rows of a block as in `tree_attention`: for kv head h the R = T·G rows (t, head
h·G + i) are gathered straight from q [B, T·H, hd], so a K/V block is loaded once for the G query heads
of each row. Row block rb (rows [rb·bm, rb·bm + bm), tokens t_lo..t_hi) visits the prefix blocks
[0, ⌈start/bk⌉) and the new-row blocks [0, t_hi//bk]; only the last (partial) prefix block and the new-row
blocks that reach past t_lo compute a mask (from iotas). Heavy row blocks (late tokens) are launched first.
When the row blocks fill the GPU's last wave badly (short chunks, or 192 programs on 132 cores) the key
blocks are split over `n_split` programs and the partials merged by log-sum-exp (jnp), like
`tree_attention`.

The cache is read in place (no copy, no padding: partial blocks are gathered with clamped row indices),
so the cache capacity need not be a multiple of the block. bf16 (or fp32) in, fp32 accumulation and
softmax; fp32 inputs use exact fp32 products. With `layer` the caches are the stacked [L, B, Hkv, S, hd] of
every layer, layer `layer` read in place (as in `tree_attention`: no slice copied in a scan over layers).

Work: 4·hd·G·Hkv·T·(start + (T+1)/2) flops per layer (QKᵀ + PV); at 27B shapes (24 q heads, hd 256) a
128K-token prefill is 3.4 PFLOP over 16 layers, i.e. ≥ 3.4 s at the H200's 989 TFLOP/s dense bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.attention_reference import prefill_attention_reference, tree_attention_reference  # noqa: F401
#     (re-exported: the reference moved to attention_reference, which imports no Pallas back end)
from kernels_pallas.tree_attention import flash_blocks, flash_smem_bytes, flash_step, kv_head_specs, pos_operand
from kernels_pallas._common import HIGHEST, compiler_params, feature_pad, next_pow2, pad_axis, pl, pltr

__all__ = ["prefill_attention", "prefill_attention_reference", "prefill_flops", "plan"]

_LOG2E = 1.4426950408889634  # the softmax runs in base 2 (exp2 is one MUFU op; expf is a libdevice sequence)
_NEG = -1e30  # running-max init: finite, so fully masked blocks give exp2(-inf - _NEG) = 0


def prefill_flops(T: int, start: int, H: int, hd: int) -> float:
    """Useful flops of one layer's prefill attention (QKᵀ + PV, causal, no padding): 4·hd·H·Σ_t keys(t)."""
    return 4.0 * hd * H * T * (start + (T + 1) / 2)


def _kernel(pos_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, o_ref, lse_ref, *,
            T: int, H: int, G: int, S: int, bm: int, bk: int, n_rb: int, n_split: int, has_layer: bool,
            scale: float, exact: bool):
    """pos_ref: (start,), or (start, layer) with stacked caches (kc_ref / vc_ref then [L, S, hd])."""
    f32 = jnp.float32
    i_bh, s = pl.program_id(0), pl.program_id(2)
    rb = n_rb - 1 - pl.program_id(1)  # late (heavy) row blocks first
    hkv_idx = i_bh % (H // G)
    R = T * G
    r = rb * bm + jnp.arange(bm)
    row_ok = r < R
    rc = jnp.minimum(r, R - 1)
    t_of_r = rc // G  # token of each row
    qrow = t_of_r * H + hkv_idx * G + rc % G  # row of q [T·H, hd]
    # rows past R store into distinct spare rows T·H + (r mod bm) (sliced off): a masked scatter must not
    # hit a real row twice (interpret mode applies it as a gather/set)
    orow = jnp.where(row_ok, qrow, T * H + r % bm)
    t_lo = (rb * bm) // G
    t_hi = jnp.minimum(rb * bm + bm - 1, R - 1) // G
    hd = q_ref.shape[-1]
    cols = jnp.arange(hd)
    q = pltr.load(q_ref.at[qrow[:, None], cols[None, :]], mask=row_ok[:, None], other=0)
    prec = HIGHEST if exact else None

    def step(kb, vb, valid, carry):  # [bm, bk] logits × log2(e)
        return flash_step(q, kb, vb, valid, carry, scale=scale, precision=prec)

    lw = (pos_ref[1],) if has_layer else ()  # the cache blocks' leading index: the layer of stacked caches

    def full_blocks(k_ref, v_ref, lo, hi, carry, pre=()):  # whole blocks [lo, hi), every key visible
        def body(j, carry):
            keys = (*pre, pl.ds(pl.multiple_of(j * bk, bk), bk), slice(None))
            return step(k_ref[keys], v_ref[keys], None, carry)

        return jax.lax.fori_loop(lo, jnp.maximum(hi, lo), body, carry)

    def gathered(k_ref, v_ref, j, n_rows, pre=()):  # block j, rows clamped to the array (the mask drops the extra)
        c = jnp.minimum(j * bk + jnp.arange(bk), n_rows - 1)
        at = (*pre, c[:, None], cols[None, :])
        return pltr.load(k_ref.at[at]), pltr.load(v_ref.at[at])

    start = pos_ref[0]
    # the key-block sequence of this row block: nfp full prefix blocks, one partial prefix block when
    # start % bk, nfn new-row blocks visible to every row, then the diagonal blocks up to t_hi
    nfp = start // bk
    npart = pl.cdiv(start, bk) - nfp  # 1 when start % bk
    nfn = (t_lo + 1) // bk
    nnew = t_hi // bk + 1
    total = nfp + npart + nnew
    per = pl.cdiv(total, n_split)
    lo = s * per
    hi = jnp.minimum(lo + per, total)

    def partial_prefix(carry):
        kb, vb = gathered(kc_ref, vc_ref, nfp, S, lw)
        valid = (nfp * bk + jnp.arange(bk) < start)[None, :]
        return step(kb, vb, valid, carry)

    def diagonal(lo_d, hi_d, carry):  # new-row blocks [lo_d, hi_d) with the causal mask
        def body(j, carry):
            kb, vb = gathered(kn_ref, vn_ref, j, T)
            valid = (j * bk + jnp.arange(bk))[None, :] <= t_of_r[:, None]
            return step(kb, vb, valid, carry)

        return jax.lax.fori_loop(lo_d, jnp.maximum(hi_d, lo_d), body, carry)

    carry = (jnp.zeros((bm, hd), f32), jnp.full((bm,), _NEG, f32), jnp.zeros((bm,), f32))
    carry = full_blocks(kc_ref, vc_ref, lo, jnp.minimum(hi, nfp), carry, lw)
    in_part = (npart > 0) & (lo <= nfp) & (nfp < hi)
    carry = jax.lax.cond(in_part, partial_prefix, lambda c: c, carry)
    b0 = nfp + npart  # first new-row block in the sequence
    if T % bk == 0:  # whole new-row blocks load as slices
        carry = full_blocks(kn_ref, vn_ref, jnp.maximum(lo - b0, 0), jnp.minimum(hi - b0, nfn), carry)
    else:
        carry = diagonal(jnp.maximum(lo - b0, 0), jnp.minimum(hi - b0, nfn), carry)
    acc, m, l = diagonal(jnp.maximum(lo - b0, nfn), hi - b0, carry)
    safe_l = jnp.where(l > 0, l, 1.0)
    o = acc / safe_l[:, None]
    pltr.store(o_ref.at[orow[:, None], cols[None, :]], o.astype(o_ref.dtype), mask=row_ok[:, None])
    if lse_ref is not None:
        lse = jnp.where(l > 0, m + jnp.log2(safe_l), -jnp.inf)
        pltr.store(lse_ref.at[orow], lse, mask=row_ok)


def default_split(programs: int, n_blocks: int, num_cores: int) -> int:
    """Key splits for a grid of `programs` (row block, kv head) programs of about equal work, one resident
    per core: the fewest splits whose last wave is ≥ 90 % full (192 programs on 132 cores: 2 splits, 3
    waves of 128/132 instead of 2 waves of 96/132), else the fullest waves; at most one split per block."""
    def fill(ns):
        p = programs * ns
        return p / (num_cores * -(-p // num_cores))

    cands = range(1, max(1, min(n_blocks, max(8, 2 * -(-num_cores // programs)))) + 1)
    return next((ns for ns in cands if fill(ns) >= 0.9), max(cands, key=fill))


def plan(T: int, H: int, hkv: int, hd: int, S: int, dtype, *, block_m: int = 128, block_k: int = 64,
         num_stages: int = 2, limit: int | None = None) -> dict:
    """The blocks a `prefill_attention` call runs with (T tokens of H heads, hkv kv heads, head dim hd, S cache
    rows, q's dtype): block_m rows (at most the padded R = T·H/hkv) x block_k keys (at most the padded max(S, T)),
    shrunk where they do not fit the shared memory for the dtype (`tree_attention.flash_blocks`; fp32 at 27B
    widths: 128 x 32), with their estimate `smem`."""
    R = T * (H // hkv)
    hdp = feature_pad(hd)
    bm = min(block_m, max(16, next_pow2(R)))
    bk = min(block_k, max(16, next_pow2(max(S, T))))
    bm, bk = flash_blocks(bm, bk, hdp, dtype, num_stages, False, limit, what="prefill_attention")
    return dict(block_m=bm, block_k=bk, num_stages=num_stages,
                smem=flash_smem_bytes(bm, bk, hdp, dtype, num_stages, False))


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_k", "n_split", "num_warps",
                                             "num_stages", "num_cores", "smem_limit"))
def prefill_attention(q, k_cache, v_cache, start, k_new, v_new, *, layer=None, interpret: bool = False,
                      block_m: int = 128, block_k: int = 64, n_split: int | None = None,
                      num_warps: int | None = None, num_stages: int = 2, num_cores: int = 132,
                      smem_limit: int | None = None):
    """q [B,T,H,hd]; k/v_cache [B,Hkv,S,hd]; start int32 scalar; k/v_new [B,T,Hkv,hd] -> [B,T,H,hd]
    (q.dtype). Same as `prefill_attention_reference` (layer: the caches are the stacked [L,B,Hkv,S,hd] of every
    layer, layer `layer` read in place). Grid (B·Hkv, row blocks, n_split); n_split > 1
    (by default only when the row blocks leave the last wave of `num_cores` programs under 90 % full)
    adds a jnp log-sum-exp merge of fp32 partials. The blocks are `plan`'s (shrunk to fit `smem_limit`, default
    `_common.SMEM_LIMIT`, for q's dtype; SharedMemoryError when none fits)."""
    B, T, H, hd = q.shape
    L = None if layer is None else k_cache.shape[0]
    hkv, S = k_cache.shape[-3:-1]
    G = H // hkv
    R = T * G
    hdp = feature_pad(hd)
    if hdp != hd:  # tiny test shapes only: zero features change no logit
        q, k_cache, v_cache, k_new, v_new = (pad_axis(x, -1, hdp) for x in (q, k_cache, v_cache, k_new, v_new))
    cfg = plan(T, H, hkv, hd, S, q.dtype, block_m=block_m, block_k=block_k, num_stages=num_stages,
               limit=smem_limit)
    bm, bk = cfg["block_m"], cfg["block_k"]
    nw = num_warps or (4 if bm <= 64 else 8)
    n_rb = -(-R // bm)
    ns = n_split or default_split(B * hkv * n_rb, -(-(S + T) // bk), num_cores)
    exact = q.dtype == jnp.float32
    odt = q.dtype if ns == 1 else jnp.float32

    q2 = q.reshape(B, T * H, hdp)  # free
    kern = functools.partial(_kernel, T=T, H=H, G=G, S=S, bm=bm, bk=bk, n_rb=n_rb, n_split=ns,
                             has_layer=layer is not None, scale=hd ** -0.5 * _LOG2E, exact=exact)
    out_specs = [pl.BlockSpec((None, None, T * H + bm, hdp), lambda i, rb, s: (s, i // hkv, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((ns, B, T * H + bm, hdp), odt)]
    if ns > 1:
        out_specs.append(pl.BlockSpec((None, None, T * H + bm), lambda i, rb, s: (s, i // hkv, 0)))
        out_shape.append(jax.ShapeDtypeStruct((ns, B, T * H + bm), jnp.float32))
    else:
        kern = functools.partial(lambda *refs, k: k(*refs, None), k=kern)
    outs = pl.pallas_call(
        kern,
        grid=(B * hkv, n_rb, ns),
        in_specs=kv_head_specs(T * H, S, T, hdp, hkv, L),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(nw, num_stages),
        interpret=interpret,
        name="prefill_attention",
    )(pos_operand(start, layer), q2, k_cache, v_cache, k_new, v_new)
    if ns == 1:
        o = outs[0][0, :, :T * H]
    else:  # merge the split partials by log-sum-exp (base 2): o = Σ_p w_p o_p with w_p = 2^(lse_p − lse)
        o_p, lse_p = outs[0][:, :, :T * H], outs[1][:, :, :T * H]
        mx = jnp.max(lse_p, axis=0)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        w = jnp.exp2(lse_p - mx)  # [P, B, TH]
        w = w / jnp.maximum(jnp.sum(w, axis=0), 1e-30)
        o = jnp.sum(w[..., None] * o_p, axis=0)
    return o.reshape(B, T, H, hdp)[..., :hd].astype(q.dtype)
