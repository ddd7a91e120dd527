"""Tree attention (verify, decode, or a masked sequence pass) as one Pallas-Triton kernel + an LSE merge.

Same function as `kernels_pallas.attention_reference.tree_attention_reference` (re-exported as
`tree_attention_reference`): query t (all H heads) attends to committed cache rows [0, start) and to the
new rows j with mask[b, t, j].

GQA is folded into the rows of a block: for kv head h_kv the R = T·G query rows (t, head h_kv·G + i)
are gathered straight from q [B, T·H, hd] (no transpose), so K/V of a kv head are read once per row
block for all its G query heads. The grid is (B·Hkv, row blocks, n_split): the prefix blocks [0, start)
followed by the N new rows' blocks (dense mask [T, N]) form one sequence of key blocks, and split s runs
flash-decoding over an equal share of it (sized from `start` at run time, so the work follows the
prefix, not the cache capacity). The cache is read in place: a partial last prefix block is gathered
with clamped rows (no padded copy), so the capacity need not be a multiple of the block. The last row
block computes with the smallest power-of-two tile that holds its rows (T = 65, G = 6: 3 × 128 + 16
rows instead of 4 × 128; at long context the kernel is bound by tensor-core flops, not by K/V bytes).
Each program writes its partial output (normalised) and its log-sum-exp (base 2: the softmax uses exp2
on logits × log2 e); a jnp merge combines them. bf16 (or fp32) in, fp32 accumulation, fp32 softmax.

With `layer` the caches are the stacked [L, B, Hkv, S, hd] of every layer (a `lax.scan` over layers passes
the whole stack: XLA copies a slice that feeds a kernel) and a program's cache block holds its kv head's rows
of all L layers, of which it reads layer `layer` in place (an index map sees only the grid: the layer comes
as an operand, next to `start`).

H200, T=65, 4K prefix, GPU µs per layer (kernel + merge): 128x64 tiles, 8 warps, 2 stages, 8 splits 35
(34.4 in round 5); 1 stage 39; 6 / 10 / 16 splits 40 / 50 / 50; 64-row tiles 38-46. Removed: the round-3
layout (n_split prefix splits + one split for the tree rows, 40) and the merge of the split partials as
one Pallas kernel (35.8-36.7 in round 5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.attention_reference import tree_attention_reference
from kernels_pallas._common import (HIGHEST, compiler_params, feature_pad, first_fit, next_pow2, pad_axis,
                                    pipeline_buffers, pl, pltr, tile_bytes)

__all__ = ["tree_attention", "tree_attention_reference", "flash_smem_bytes", "flash_blocks", "plan"]

_LOG2E = 1.4426950408889634  # the softmax runs in base 2 (exp2 is one MUFU op; expf is a libdevice sequence)
_NEG = -1e30  # running-max init: finite, so fully masked blocks give exp2(-inf - _NEG) = 0


def _kernel(pos_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, m_ref, o_ref, lse_ref, *,
            T: int, H: int, G: int, N: int, bm: int, bm_tail: int, bk: int, n_split: int, rows_last: bool,
            has_layer: bool, scale: float, exact: bool):
    """pos_ref: (start,), or (start, layer) with stacked caches (kc_ref / vc_ref then [L, S, hd])."""
    i_bh = pl.program_id(0)
    rb, s = (pl.program_id(2), pl.program_id(1)) if rows_last else (pl.program_id(1), pl.program_id(2))
    n_rb = -(-(T * G) // bm)
    args = (pos_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, m_ref, o_ref, lse_ref)
    kw = dict(T=T, H=H, G=G, N=N, bk=bk, n_split=n_split, scale=scale, exact=exact, i_bh=i_bh, s=s,
              row0=rb * bm, spare=bm, lw=(pos_ref[1],) if has_layer else ())
    if bm_tail == bm:
        _rows(*args, rows=bm, **kw)
    else:  # the last row block holds only R mod bm rows: a smaller tile for it
        pl.when(rb < n_rb - 1)(lambda: _rows(*args, rows=bm, **kw))
        pl.when(rb == n_rb - 1)(lambda: _rows(*args, rows=bm_tail, **kw))


def _rows(pos_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, m_ref, o_ref, lse_ref, *,
          T: int, H: int, G: int, N: int, bk: int, n_split: int, scale: float, exact: bool, i_bh, s, row0,
          rows: int, spare: int, lw: tuple):
    """Rows [row0, row0 + rows) of kv head i_bh % Hkv over key split s; lw: () or (layer,), the cache blocks'
    leading index."""
    f32 = jnp.float32
    hkv_idx = i_bh % (H // G)
    R = T * G
    r = row0 + jnp.arange(rows)
    row_ok = r < R
    rc = jnp.minimum(r, R - 1)
    t_of_r = rc // G
    qrow = t_of_r * H + hkv_idx * G + rc % G  # row of q [T·H, hd]
    # rows past R store into distinct spare rows T·H + (r mod spare) of the partials (sliced off by the
    # merge): a masked scatter must not hit a real row twice (interpret mode applies it as a gather/set)
    orow = jnp.where(row_ok, qrow, T * H + r % spare)
    hd = q_ref.shape[-1]
    cols = jnp.arange(hd)
    q = pltr.load(q_ref.at[qrow[:, None], cols[None, :]], mask=row_ok[:, None], other=0)
    prec = HIGHEST if exact else None

    def step(kb, vb, valid, carry):
        return flash_step(q, kb, vb, valid, carry, scale=scale, precision=prec)

    init = (jnp.zeros((rows, hd), f32), jnp.full((rows,), _NEG, f32), jnp.zeros((rows,), f32))

    start = pos_ref[0]
    S = kc_ref.shape[-2]
    nfp = start // bk  # whole prefix blocks
    nbp = pl.cdiv(start, bk)  # prefix blocks, the last one partial when start % bk
    nbt = pl.cdiv(N, bk)  # tree blocks

    def prefix_loop(jlo, jhi, carry):  # whole prefix blocks [jlo, jhi): every key visible
        def body(j, carry):
            k0 = pl.multiple_of(j * bk, bk)
            keys = (*lw, pl.ds(k0, bk), slice(None))
            return step(kc_ref[keys], vc_ref[keys], None, carry)

        return jax.lax.fori_loop(jlo, jnp.maximum(jhi, jlo), body, carry)

    def partial_prefix(carry):  # block nfp, rows clamped to the cache (no padded copy), keys < start
        c = nfp * bk + jnp.arange(bk)
        cc = jnp.minimum(c, S - 1)
        kb = pltr.load(kc_ref.at[(*lw, cc[:, None], cols[None, :])])
        vb = pltr.load(vc_ref.at[(*lw, cc[:, None], cols[None, :])])
        return step(kb, vb, (c < start)[None, :], carry)

    def tree_loop(tlo, thi, carry):  # tree blocks [tlo, thi) of bk new rows, dense mask
        def body(j, carry):
            c = j * bk + jnp.arange(bk)
            c_ok = c < N
            cc = jnp.minimum(c, N - 1)
            kb = pltr.load(kn_ref.at[cc[:, None], cols[None, :]], mask=c_ok[:, None], other=0)
            vb = pltr.load(vn_ref.at[cc[:, None], cols[None, :]], mask=c_ok[:, None], other=0)
            mk = pltr.load(m_ref.at[t_of_r[:, None], cc[None, :]], mask=row_ok[:, None] & c_ok[None, :], other=0)
            return step(kb, vb, mk != 0, carry)

        return jax.lax.fori_loop(tlo, jnp.maximum(thi, tlo), body, carry)

    # split s takes units [lo, hi) of the nbp prefix blocks followed by the nbt tree blocks: every split
    # has the same number of blocks (the tree part rides on the last splits)
    per = pl.cdiv(nbp + nbt, n_split)
    lo = s * per
    hi = jnp.minimum(lo + per, nbp + nbt)
    carry = prefix_loop(lo, jnp.minimum(hi, nfp), init)
    carry = jax.lax.cond((nbp > nfp) & (lo <= nfp) & (nfp < hi), partial_prefix, lambda c: c, carry)
    acc, m, l = tree_loop(jnp.maximum(lo - nbp, 0), hi - nbp, carry)
    safe_l = jnp.where(l > 0, l, 1.0)
    o = acc / safe_l[:, None]
    lse = jnp.where(l > 0, m + jnp.log2(safe_l), -jnp.inf)
    pltr.store(o_ref.at[orow[:, None], cols[None, :]], o.astype(o_ref.dtype), mask=row_ok[:, None])
    pltr.store(lse_ref.at[orow], lse, mask=row_ok)


def flash_step(q, kb, vb, valid, carry, *, scale: float, precision):
    """One key block of the online softmax in base 2 (scale includes log2 e): carry (acc [rows, hd] fp32, running
    max m [rows], sum l [rows]) updated with q [rows, hd] · kb [bk, hd]ᵀ, keys where `valid` (None: all) -> PV
    with vb [bk, hd]. fp32 logits and accumulation; p cast to vb's dtype for the PV dot."""
    acc, m, l = carry
    sc = jax.lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32) * scale  # [rows, bk]
    if valid is not None:
        sc = jnp.where(valid, sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    corr = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])
    l = l * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + jnp.dot(p.astype(vb.dtype), vb, precision=precision,
                                        preferred_element_type=jnp.float32)
    return acc, m_new, l


def flash_smem_bytes(bm: int, bk: int, hdp: int, dtype, num_stages: int, mask: bool) -> int:
    """Shared memory (bytes, an upper estimate) of a flash-attention program with [bm, hdp] query rows and [bk, hdp]
    key / value blocks (`tree_attention`, `prefill_attention`): q staged once as the QKᵀ operand, the K and V
    blocks of the loop `pipeline_buffers` times (bf16: wgmma, asynchronous from 64 rows; fp32: exact FMA dots,
    not asynchronous), p [bm, bk] as the PV operand, the int8 mask block (tree blocks) and the row max / sum
    exchanges. fp32 at 27B widths (hd 256), 128 x 64 tiles: 295424 + the mask block; Triton's allocation for
    that kernel is 295424 (the H200's "requested 295424, available: 232448")."""
    exact = jnp.dtype(dtype) == jnp.float32
    bufs = pipeline_buffers(num_stages, async_mma=not exact and bm >= 64)
    return (tile_bytes((bm, hdp), dtype) + bufs * 2 * tile_bytes((bk, hdp), dtype) + tile_bytes((bm, bk), dtype)
            + (bm * bk if mask else 0) + 4 * bm)


def flash_blocks(bm: int, bk: int, hdp: int, dtype, num_stages: int, mask: bool, limit: int | None = None,
                 what: str = "attention") -> tuple[int, int]:
    """(bm, bk): the requested blocks, or the largest smaller ones that fit the shared memory (`flash_smem_bytes`):
    the key block halved first (down to 16), then the row block; SharedMemoryError when none fits."""
    cands = [(m, k) for m in _halvings(bm) for k in _halvings(bk)]
    return first_fit(cands, lambda c: flash_smem_bytes(c[0], c[1], hdp, dtype, num_stages, mask), limit,
                     what=what)


def _halvings(n: int) -> list[int]:
    out = [n]
    while out[-1] > 16:
        out.append(max(16, out[-1] // 2))
    return out


def plan(T: int, H: int, hkv: int, hd: int, S: int, dtype, *, block_m: int | None = None, block_k: int = 64,
         num_stages: int | None = None, limit: int | None = None) -> dict:
    """The blocks a `tree_attention` call runs with (T query rows of H heads, hkv kv heads, head dim hd, S cache
    rows, q's dtype): the H200 defaults (R = T·H/hkv <= 16 rows: 16-row blocks, else 128; 64-key blocks, at most
    S; 2 stages), shrunk where they do not fit the shared memory for the dtype (`flash_blocks`; fp32 at 27B
    widths: 128 x 32), with their estimate `smem`."""
    R = T * (H // hkv)
    hdp = feature_pad(hd)
    nst = num_stages or 2
    bm = block_m or (16 if R <= 16 else 128)
    bk = min(block_k, max(16, 1 << (S.bit_length() - 1)))  # ≤ S: whole blocks are sliced from the cache
    bm, bk = flash_blocks(bm, bk, hdp, dtype, nst, True, limit, what="tree_attention")
    return dict(block_m=bm, block_k=bk, num_stages=nst, smem=flash_smem_bytes(bm, bk, hdp, dtype, nst, True))


def kv_head_specs(q_rows: int, S: int, N: int, hdp: int, hkv: int, layers: int | None = None) -> list:
    """BlockSpecs of (pos, q [B, q_rows, hdp], k/v cache [B, Hkv, S, hdp], k/v new [B, N, Hkv, hdp]) for a grid
    whose first axis is b·Hkv + kv head: each program sees its batch row's q rows and its kv head's keys. pos:
    (start,); layers (L, stacked caches [L, B, Hkv, S, hdp]): pos (start, layer) and the cache blocks [L, S, hdp]
    (the kernel indexes the layer: an index map sees only the grid)."""
    if layers is None:
        pos, cache = (1,), pl.BlockSpec((None, None, S, hdp), lambda i, a, b: (i // hkv, i % hkv, 0, 0))
    else:
        pos, cache = (2,), pl.BlockSpec((layers, None, None, S, hdp), lambda i, a, b: (0, i // hkv, i % hkv, 0, 0))
    return [
        pl.BlockSpec(pos, lambda i, a, b: (0,)),  # pos
        pl.BlockSpec((None, q_rows, hdp), lambda i, a, b: (i // hkv, 0, 0)),  # q rows
        cache,  # k_cache
        cache,  # v_cache
        pl.BlockSpec((None, N, None, hdp), lambda i, a, b: (i // hkv, 0, i % hkv, 0)),  # k_new
        pl.BlockSpec((None, N, None, hdp), lambda i, a, b: (i // hkv, 0, i % hkv, 0)),  # v_new
    ]


def pos_operand(start, layer=None):
    """The int32 operand [1] = (start,) or, with a layer of stacked caches, [2] = (start, layer) (under vmap the
    batched start and shared layer make one batched operand)."""
    vals = (start,) if layer is None else (start, layer)
    return jnp.stack([jnp.asarray(x, jnp.int32).reshape(()) for x in vals])


def default_split(B: int, hkv: int, n_rb: int, S: int, bk: int, target_programs: int) -> int:
    """Prefix splits so that the grid holds about `target_programs` programs. More splits mean more
    partial outputs to write and merge (n_split · T·H · hd each)."""
    return int(max(1, min(round(target_programs / (B * hkv * n_rb)), max(1, S // bk))))


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_k", "n_split", "num_warps",
                                             "num_stages", "partial_dtype", "target_programs", "rows_last",
                                             "tail", "smem_limit"))
def tree_attention(q, k_cache, v_cache, start, k_new, v_new, mask, *, layer=None, interpret: bool = False,
                   block_m: int | None = None, block_k: int = 64, n_split: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, partial_dtype=None,
                   target_programs: int | None = None, rows_last: bool | None = None, tail: bool = False,
                   smem_limit: int | None = None):
    """q [B,T,H,hd]; k/v_cache [B,Hkv,S,hd]; start int32 scalar; k/v_new [B,N,Hkv,hd]; mask [B,T,N] bool
    -> [B,T,H,hd] (q.dtype). Same as `tree_attention_reference`; layer: the caches are the stacked
    [L,B,Hkv,S,hd] of every layer, layer `layer` read in place.

    The grid is (B·Hkv, row blocks, n_split) and split s takes an equal share of the (prefix blocks +
    tree blocks) sequence; the split partials are combined by jnp (a few small XLA kernels). Programs
    launch with the first grid axis fastest, so the row blocks of one split run side by side and share
    its K/V blocks in L2. tail: the last row block, when its R mod block_m rows fit a smaller
    power-of-two tile, computes with that tile (390 = 3·128 + 6 rows: 400 rows computed instead of 512),
    the splits are counted for the full row blocks only, and (rows_last, the default with a tail) the
    grid is (B·Hkv, n_split, row blocks) so that the light tail programs launch after the full ones. Off by
    default: H200, T = 65, 27B shapes (bench_kernels attn_long, 2026-11-30): 40.0 / 239.5 / 882 µs per layer at
    4K / 32K / 128K with the tail vs 37.2 / 214.1 µs without (its extra split count leaves a second, bandwidth-only
    wave of tail programs).

    The blocks are `plan`'s: the defaults (or block_m / block_k) shrunk to fit `smem_limit` (default
    `_common.SMEM_LIMIT`, the H200's) for q's dtype; SharedMemoryError when no block fits."""
    B, T, H, hd = q.shape
    L = None if layer is None else k_cache.shape[0]
    hkv, S = k_cache.shape[-3:-1]
    N = k_new.shape[1]
    G = H // hkv
    R = T * G
    scale = hd ** -0.5 * _LOG2E  # logits in base 2
    hdp = feature_pad(hd)
    if hdp != hd:  # tiny test shapes only: zero features change no logit
        q, k_cache, v_cache, k_new, v_new = (pad_axis(x, -1, hdp) for x in (q, k_cache, v_cache, k_new, v_new))
    # defaults measured on the H200 at 27B shapes (hd 256, see benchmarks/results/kernels_h200.json)
    cfg = plan(T, H, hkv, hd, S, q.dtype, block_m=block_m, block_k=block_k, num_stages=num_stages,
               limit=smem_limit)
    bm, bk, nst = cfg["block_m"], cfg["block_k"], cfg["num_stages"]
    target = target_programs or 132
    n_rb = -(-R // bm)
    bm_tail = max(16, next_pow2(R - (n_rb - 1) * bm)) if tail else bm
    bm_tail = min(bm_tail, bm)
    if n_rb == 1:  # a single row block: just the smaller tile
        bm = bm_tail
    ns = n_split or default_split(B, hkv, max(1, n_rb - (bm_tail < bm)), S + N, bk, target)
    rows_last = (bm_tail < bm) if rows_last is None else rows_last
    nw = num_warps or (4 if bm <= 64 else 8)
    exact = q.dtype == jnp.float32
    pdt = jnp.float32 if exact else (partial_dtype or q.dtype)  # bf16 partials halve the merge traffic

    q2 = q.reshape(B, T * H, hdp)  # free
    pos = pos_operand(start, layer)
    mask_i8 = mask.astype(jnp.int8)
    kern = functools.partial(_kernel, T=T, H=H, G=G, N=N, bm=bm, bm_tail=bm_tail, bk=bk, n_split=ns,
                             rows_last=rows_last, has_layer=layer is not None, scale=scale, exact=exact)
    # index maps take (i, a, b) = (kv head, row block, split), or (kv head, split, row block) if rows_last
    o_p, lse_p = pl.pallas_call(
        kern,
        grid=(B * hkv, ns, n_rb) if rows_last else (B * hkv, n_rb, ns),
        in_specs=kv_head_specs(T * H, S, N, hdp, hkv, L) + [
            pl.BlockSpec((None, T, N), lambda i, a, b: (i // hkv, 0, 0)),  # mask
        ],
        out_specs=[
            pl.BlockSpec((None, None, T * H + bm, hdp),
                         lambda i, a, b: (a if rows_last else b, i // hkv, 0, 0)),
            pl.BlockSpec((None, None, T * H + bm), lambda i, a, b: (a if rows_last else b, i // hkv, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((ns, B, T * H + bm, hdp), pdt),
            jax.ShapeDtypeStruct((ns, B, T * H + bm), jnp.float32),
        ],
        compiler_params=compiler_params(nw, nst),
        interpret=interpret,
        name="tree_attention",
    )(pos, q2, k_cache, v_cache, k_new, v_new, mask_i8)
    # merge the split partials by log-sum-exp (base 2): o = Σ_p w_p o_p with w_p = 2^(lse_p − lse)
    o_p, lse_p = o_p[:, :, :T * H], lse_p[:, :, :T * H]
    mx = jnp.max(lse_p, axis=0)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp2(lse_p - mx)  # [P, B, TH]
    w = w / jnp.maximum(jnp.sum(w, axis=0), 1e-30)
    o = jnp.sum(w[..., None] * o_p.astype(jnp.float32), axis=0)
    return o.reshape(B, T, H, hdp)[..., :hd].astype(q.dtype)
