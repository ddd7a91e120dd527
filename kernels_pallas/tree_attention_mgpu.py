"""Tree attention as a Hopper kernel in Pallas Mosaic GPU (FlashAttention-3 style) + an LSE merge in jnp.

Same function as `kernels_pallas.attention_reference.tree_attention_reference` and
`kernels_pallas.tree_attention.tree_attention` (Pallas-Triton): query t (all H heads) attends to the committed
cache rows [0, start) and to the new rows j with mask[b, t, j]. bf16 / fp16 only (wgmma operands; `supports`,
`check_supported`); fp32 accumulation and softmax (base 2: logits × scale·log2 e, exp2).

Layout. GQA is folded into the rows: for kv head h the R = T·G query rows (node t, head h·G + i) are row
r = t·G + i of a [B·Hkv, Rp, hd] copy of q (one transpose + pad in jnp, Rp a multiple of 128), so a CTA's two
compute warpgroups (64 rows each, the wgmma M) share every K/V tile. A CTA has 3 warpgroups: 2 consumers
(wgmma QKᵀ, online softmax in registers, wgmma PV, ping-pong scheduled through a barrier so that one group's
softmax overlaps the other's matmuls) and 1 producer issuing the TMA loads of K/V tiles [block_k, hd] into a
`num_stages` ring (barriers: loaded / consumed per slot). A warpgroup whose 64 rows are all padding keeps the
barrier protocol and computes nothing. The grid is 1-D: (row blocks fastest, B·Hkv, n_split) — the row blocks of
one (kv head, split) run side by side and share its K/V tiles in L2 — then, with `tail_split`, a light last row
block (one live warpgroup: T = 65 at G = 6 leaves 6 of 390 rows) on its own split count.

Run-time length. `start` is read from GMEM in the kernel (a scalar or one per batch row): the prefix blocks
[0, cdiv(start, bk)) followed by the cdiv(N, bk) tree blocks form one sequence of units and split s takes an
equal share (as the Triton kernel), so the trip counts are run-time values: no loads or flops past `start`
except the last, partial, prefix block (its keys >= start are masked; its TMA window is clamped inside the
cache, so the capacity need only be >= block_k; rows [start, S) must hold finite values, as for the Triton
kernel: a masked key's V row still enters the PV product with weight 0). The tree blocks (the new rows, padded
to a multiple of bk) ride on the last split; their mask arrives as one 32-bit word per (query row, 32 new keys),
loaded into SMEM once per CTA and expanded in registers (no per-step mask traffic).

Cache rows. The kernel takes the caches as [C, Hkv, S, hd] and one int32 per batch row, the cache row it reads
(read from GMEM, as `start`; its TMA windows address that row in place): b itself for plain caches [B, ...]; with
`layer` the stacked caches [L, B, Hkv, S, hd] of every layer (a `lax.scan` over layers passes the whole stack:
XLA copies a slice that feeds a kernel) are viewed as [L·B, ...] (free) and batch row b reads row layer·B + b;
under vmap each slot's rows are offset into the folded caches (`_fold_vmap`).

Causal mode (`attention(..., causal=True)`, behind `prefill_attention_mgpu`): the new rows are the queries' own
tokens; a CTA visits the new-row blocks up to its last token only, masks from iotas only the blocks that reach
past a warpgroup's first token, and the late (heavy) row blocks launch first.

Each CTA writes its partial output (normalised, q's dtype) and log-sum-exp (base 2) for its rows and split;
the jnp merge combines the splits (none with one split) and undoes the GQA fold.

Interpret mode (CPU, `interpret=True`): the Mosaic GPU interpreter has no `pl.run_state`, so there the PV
product is `acc + jnp.dot(p, v_tile)` on the SMEM tile (fenced with `commit_smem` before the slot's release)
instead of a wgmma into the running accumulator; every other line (TMA, barriers, QKᵀ wgmma, masks, splits) is
the code that runs on the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import mgpu_kernel_hash
from kernels_pallas.attention_reference import tree_attention_reference

mgpu_kernel_hash.install()  # one compilation of each kernel per process, not per program (its docstring)

__all__ = ["tree_attention", "tree_attention_reference", "supports", "check_supported", "plan", "smem_bytes"]

_LOG2E = 1.4426950408889634
_NEG = -1e30  # running-max init: finite, so fully masked blocks give exp2(-inf - _NEG) = 0
_BQ = 64  # rows per compute warpgroup (the wgmma M)
_WGS = 2  # compute warpgroups per CTA
SMEM_LIMIT = 232448  # the H200's opt-in shared memory per block (227 KiB)
DTYPES = (jnp.bfloat16, jnp.float16)


def smem_bytes(hd: int, block_k: int, num_stages: int, n_words: int, dtype=jnp.bfloat16) -> int:
    """Shared memory of one CTA: q (reused for the output) for both compute warpgroups, the K and V rings,
    the tree-mask words, the LSE staging, the barriers (an upper estimate)."""
    it = jnp.dtype(dtype).itemsize
    return (_WGS * _BQ * hd * it + 2 * num_stages * block_k * hd * it + _WGS * n_words * _BQ * 4
            + _WGS * _BQ * 4 + 8 * (4 * num_stages + 2 * _WGS + 1) + 3072)


def supports(q, k_cache=None) -> bool:
    """True when `tree_attention` takes these operands (dtype bf16/fp16, head dim a multiple of 64, <= 256)."""
    return _unsupported(q.dtype, q.shape[-1], None if k_cache is None else k_cache.dtype) is None


def check_supported(q, k_cache, v_cache, k_new, v_new) -> None:
    """Raises ValueError (one line) when the operands are not ones this kernel takes."""
    dts = {jnp.dtype(x.dtype) for x in (q, k_cache, v_cache, k_new, v_new)}
    if len(dts) != 1:
        raise ValueError(f"tree_attention_mgpu: q, k/v cache and k/v new must share one dtype, got "
                         f"{sorted(str(d) for d in dts)}")
    why = _unsupported(q.dtype, q.shape[-1], k_cache.dtype)
    if why:
        raise ValueError(f"tree_attention_mgpu: {why}")


def _unsupported(dtype, hd, kv_dtype) -> str | None:
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
        return f"dtype {jnp.dtype(dtype)} not supported (bf16 or fp16 only: wgmma operands); use the Triton kernel"
    if kv_dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        return f"k/v dtype {jnp.dtype(kv_dtype)} differs from q's {jnp.dtype(dtype)}"
    if hd % 64 or hd > 256:
        return f"head dim {hd} not supported (a multiple of 64, at most 256)"
    return None


def plan(T: int, H: int, hkv: int, hd: int, S: int, N: int, *, block_k: int = 64, num_stages: int = 2,
         n_split: int | None = None, tail_split: int | None = None, B: int = 1, dtype=jnp.bfloat16,
         target_ctas: int = 132, causal: bool = False) -> dict:
    """Static configuration of a call: row blocks, padded rows, tree blocks / mask words, splits, SMEM bytes.

    A last row block whose second warpgroup holds only padding rows ("light": T = 65 at G = 6 leaves 390 - 384 =
    6 rows) runs one warpgroup, faster than a full block; tail_split (default n_split) gives it its own split
    count so that its CTAs can take longer key ranges (light CTAs then read K/V apart from the full ones)."""
    G = H // hkv
    R = T * G
    n_rb = -(-R // (_WGS * _BQ))
    bk = block_k
    nbt = -(-N // bk)
    n_words = 0 if causal else nbt * bk // 32
    # default: as many splits as fit one wave of target_ctas CTAs (a second, partial wave would double the time)
    BH = B * hkv
    light = n_rb > 1 and R - (n_rb - 1) * _WGS * _BQ <= _BQ
    cap = max(1, S // bk)
    if n_split is None and tail_split is None and light:
        # a light last block's CTA computes one warpgroup, so it takes fewer, longer splits: the full blocks count
        # 1, the light one 2/3 in the wave (H200, 128K, T = 65: 9 + 6 splits 6.79 ms vs 8 for all 7.17, 10 + 3 11.94)
        ns = max(1, min(int(target_ctas // (BH * (n_rb - 1 + 2 / 3))), cap))
        tail_split = max(1, min(ns, (target_ctas - BH * (n_rb - 1) * ns) // BH))
    else:
        ns = int(n_split or max(1, min(target_ctas // (BH * n_rb), cap)))
    ns_tail = int(tail_split or ns) if light else ns
    if ns_tail == ns:  # one split count: every row block in the main part of the grid
        light = False
    n_main_rb = n_rb - int(light)
    smem = smem_bytes(hd, bk, num_stages, n_words, dtype)
    return dict(G=G, R=R, n_rb=n_rb, Rp=n_rb * _WGS * _BQ, block_k=bk, nbt=nbt, Np=nbt * bk, n_words=n_words,
                n_split=ns, tail_split=ns_tail, n_main_rb=n_main_rb,
                n_ctas=B * hkv * (n_main_rb * ns + int(light) * ns_tail), num_stages=num_stages, smem=smem)


def _mask_words(mask, G: int, Rp: int, Np: int):
    """mask [B, T, N] bool -> [B, Rp / 64, Np / 32, 64] int32: bit c of word w of query row r (= t·G + i) is
    mask[b, t, 32 w + c] (0 on padding rows / keys); rows grouped by compute warpgroup (64)."""
    B, T, N = mask.shape
    m = jnp.pad(mask != 0, ((0, 0), (0, 0), (0, Np - N)))
    m = jnp.repeat(m, G, axis=1)  # [B, T·G, Np]
    m = jnp.pad(m, ((0, 0), (0, Rp - T * G), (0, 0)))
    bits = m.reshape(B, Rp, Np // 32, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    w = lax.bitcast_convert_type(jnp.sum(bits, axis=-1, dtype=jnp.uint32), jnp.int32)  # [B, Rp, Nw]
    return w.reshape(B, Rp // _BQ, _BQ, Np // 32).transpose(0, 1, 3, 2)


def _kernel(*refs, hkv: int, S: int, R: int, G: int, bk: int, nst: int, ns: int, ns_tail: int, n_main_rb: int,
            BH: int, nbt: int, scale: float, pingpong: bool, causal: bool, interpret: bool):
    """One CTA: rows [rb·128, rb·128 + 128) of kv head bh % Hkv (batch row bh // Hkv, cache row row_ref[b]) over
    split s. causal: the new rows are the queries' own tokens (query row t·G + i sees new rows j <= t: the prefill
    mode, no mask words; only the new-row blocks up to the CTA's last token are visited)."""
    if causal:
        (start_ref, row_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, o_ref, lse_ref,
         q_smem, k_smem, v_smem, lse_smem, q_bar, k_bar, v_bar, k_used, v_used, sched) = refs
        w_ref = w_smem = w_bar = None
    else:
        (start_ref, row_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, w_ref, o_ref, lse_ref,
         q_smem, k_smem, v_smem, w_smem, lse_smem, q_bar, w_bar, k_bar, v_bar, k_used, v_used, sched) = refs
    f32 = jnp.float32
    # 1-D grid: the main CTAs (row blocks fastest, so the row blocks of one (kv head, split) run side by side
    # and share its K/V tiles in L2), then the light last row block's CTAs (their own split count)
    cta = lax.axis_index("cta")
    n_main = jnp.int32(n_main_rb * BH * ns)
    is_main = cta < n_main
    ct = cta - n_main
    rb = jnp.where(is_main, lax.rem(cta, jnp.int32(n_main_rb)), n_main_rb)
    if causal:  # the late (heavy) row blocks first
        rb = jnp.where(is_main, n_main_rb - 1 - rb, rb)
    bh = jnp.where(is_main, lax.rem(lax.div(cta, jnp.int32(n_main_rb)), jnp.int32(BH)), lax.rem(ct, jnp.int32(BH)))
    s = jnp.where(is_main, lax.div(cta, jnp.int32(n_main_rb * BH)), lax.div(ct, jnp.int32(BH)))
    nsc = jnp.where(is_main, jnp.int32(ns), jnp.int32(ns_tail))  # this CTA's split count
    wg = lax.axis_index("wg")
    b = lax.div(bh, jnp.int32(hkv))
    h = lax.rem(bh, jnp.int32(hkv))
    hd = q_smem.shape[-1]
    dtype = q_smem.dtype

    start = start_ref[b]
    nfp = lax.div(start, jnp.int32(bk))  # whole prefix blocks
    nbp = lax.div(start + (bk - 1), jnp.int32(bk))  # prefix blocks, the last one partial when start % bk
    if causal:  # new-row blocks [0, t_hi // bk] for the CTA's last query token t_hi
        t_hi = lax.div(jnp.minimum(R - 1, rb * (_WGS * _BQ) + _WGS * _BQ - 1), jnp.int32(G))
        nbt = lax.div(t_hi, jnp.int32(bk)) + 1
    per = lax.div(nbp + nbt + nsc - 1, nsc)
    lo = s * per
    hi = jnp.minimum(lo + per, nbp)
    n_full = jnp.maximum(jnp.minimum(hi, nfp) - lo, 0)
    n_part = ((nbp > nfp) & (lo <= nfp) & (nfp < hi)).astype(jnp.int32)
    n_pre = n_full + n_part
    n_steps = n_pre + jnp.where(s == nsc - 1, nbt, 0)

    def block_start(i):  # first cache row of prefix step i (the partial block's window kept inside the cache)
        return jnp.minimum((lo + i) * bk, S - bk)

    def sched_sync():
        if pingpong:
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

    def sync_steps(i, carry, compute):
        """Step i of a compute warpgroup: the barrier protocol around `compute` (which waits for step i + 1's K
        tile itself, while its PV product runs; None: a warpgroup whose rows are all padding keeps the protocol,
        computes nothing)."""
        slot = lax.rem(i, jnp.int32(nst))
        if compute is None:
            plgpu.barrier_wait(k_bar.at[slot])
            sched_sync()
            plgpu.barrier_arrive(k_used.at[slot])
            if pingpong:
                plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_bar.at[slot])
            if pingpong:
                plgpu.barrier_wait(sched)
            plgpu.barrier_arrive(v_used.at[slot])
            return carry
        return compute(i, slot, carry)

    r0 = (rb * _WGS + wg) * _BQ

    @pl.when((wg < _WGS) & (r0 >= R))
    def _idle_consumer():
        plgpu.set_max_registers(232, action="increase")
        pl.when(wg == 1)(sched_sync)
        lax.fori_loop(0, n_steps, lambda i, c: sync_steps(i, c, None), jnp.int32(0))
        pl.when(wg == 0)(sched_sync)

    @pl.when((wg < _WGS) & (r0 < R))
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        qs = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[bh, pl.ds(r0, _BQ)], qs, q_bar.at[wg])
        if not causal:
            plgpu.copy_gmem_to_smem(w_ref.at[b, rb * _WGS + wg], w_smem.at[wg], w_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        if not causal:
            plgpu.barrier_wait(w_bar.at[wg])
        row_l = plgpu.Layout.WGMMA.reduce(1)
        m = plgpu.layout_cast(jnp.full((_BQ,), _NEG, f32), row_l)
        l = plgpu.layout_cast(jnp.full((_BQ,), 0.0, f32), row_l)
        acc = plgpu.layout_cast(jnp.full((_BQ, hd), 0.0, f32), plgpu.Layout.WGMMA)

        def col_iota():
            return plgpu.broadcasted_iota(jnp.int32, (_BQ, bk), 1, layout=plgpu.Layout.WGMMA)

        def compute(i, slot, carry, kind: str):
            acc, m, l = carry

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, qs, k_smem.at[slot].transpose((1, 0)))
                sched_sync()
                return acc_ref[...]

            qk = pl.run_scoped(qk_scope, plgpu.ACC((_BQ, bk), f32))
            plgpu.barrier_arrive(k_used.at[slot])
            if kind == "part":  # keys [nfp·bk, start) of the window starting at block_start(i)
                key = block_start(i) + col_iota()
                qk = jnp.where((key >= nfp * bk) & (key < start), qk, -jnp.inf)
            elif kind == "tree":  # the row's mask words for new keys [jt·bk, (jt + 1)·bk)
                jt = i - n_pre
                col = col_iota()
                word = None
                for c in range(bk // 32):
                    wc = plgpu.load(w_smem.at[wg, jt * (bk // 32) + c], layout=row_l)
                    wc = lax.broadcast_in_dim(wc, (_BQ, bk), [0])
                    word = wc if word is None else jnp.where(col >= 32 * c, wc, word)
                bit = lax.shift_right_logical(word, lax.rem(col, jnp.int32(32))) & 1
                qk = jnp.where(bit != 0, qk, -jnp.inf)
            elif kind == "causal":  # new key j visible to query row r iff j <= r // G
                key = (i - n_pre) * bk + col_iota()
                row = plgpu.broadcasted_iota(jnp.int32, (_BQ, bk), 0, layout=plgpu.Layout.WGMMA)
                qk = jnp.where(key <= lax.div(r0 + row, jnp.int32(G)), qk, -jnp.inf)
            m_new = jnp.maximum(m, qk.max(axis=1) * scale)
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(qk * scale - lax.broadcast_in_dim(m_new, qk.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            l = l * alpha
            p16 = p.astype(dtype)
            if pingpong:
                plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(v_bar.at[slot])
            if pingpong:
                plgpu.barrier_wait(sched)
            l = l + p.sum(axis=1)
            vs = v_smem.at[slot]

            def wait_next_k():
                @pl.when(i + 1 < n_steps)
                def _():
                    plgpu.barrier_wait(k_bar.at[lax.rem(i + 1, jnp.int32(nst))])

            if interpret:  # no pl.run_state in the Mosaic GPU interpreter: a generic-proxy read of V,
                # fenced before the slot's release (the TMA refilling it writes through the async proxy)
                acc = acc + jnp.dot(p16, vs[...], preferred_element_type=f32)
                plgpu.commit_smem()
                wait_next_k()
            else:
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, vs)
                    wait_next_k()  # while the PV wgmma runs

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_used.at[slot])
            return acc, m_new, l

        def loop(lo_, hi_, kind, carry):
            body = lambda i, c: sync_steps(i, c, functools.partial(compute, kind=kind))
            return lax.fori_loop(lo_, hi_, body, carry)

        pl.when(n_steps > 0)(lambda: plgpu.barrier_wait(k_bar.at[0]))
        pl.when(wg == 1)(sched_sync)
        carry = loop(0, n_full, "full", (acc, m, l))
        carry = loop(n_full, n_pre, "part", carry)
        if causal:  # new-row blocks wholly below this warpgroup's first token need no mask
            n_vis = jnp.minimum(lax.div(lax.div(r0, jnp.int32(G)) + 1, jnp.int32(bk)), n_steps - n_pre)
            carry = loop(n_pre, n_pre + n_vis, "full", carry)
            acc, m, l = loop(n_pre + n_vis, n_steps, "causal", carry)
        else:
            acc, m, l = loop(n_pre, n_steps, "tree", carry)
        pl.when(wg == 0)(sched_sync)

        pos = l > 0
        l_safe = jnp.where(pos, l, 1.0)
        acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        lse = jnp.where(pos, m + jnp.log(l_safe) * _LOG2E, -jnp.inf)
        qs[...] = acc.astype(dtype)
        lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qs, o_ref.at[s, bh, pl.ds(r0, _BQ)])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[s, bh, pl.ds(r0, _BQ)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        crow = row_ref[b]  # the cache row of batch row b

        def issue(i, src_c, src_n, smem, bar):
            slot = lax.rem(i, jnp.int32(nst))

            @pl.when(i < n_pre)
            def _():
                plgpu.copy_gmem_to_smem(src_c.at[crow, h, pl.ds(block_start(i), bk)], smem.at[slot], bar.at[slot])

            @pl.when(i >= n_pre)
            def _():
                j0 = (i - n_pre) * bk
                plgpu.copy_gmem_to_smem(src_n.at[b, pl.ds(j0, bk), h], smem.at[slot], bar.at[slot])

        for i in range(nst):
            @pl.when(i < n_steps)
            def _():
                issue(jnp.int32(i), kc_ref, kn_ref, k_smem, k_bar)
                issue(jnp.int32(i), vc_ref, vn_ref, v_smem, v_bar)

        def body(i, _):
            slot = lax.rem(i, jnp.int32(nst))
            plgpu.barrier_wait(k_used.at[slot])
            issue(i, kc_ref, kn_ref, k_smem, k_bar)
            plgpu.barrier_wait(v_used.at[slot])
            issue(i, vc_ref, vn_ref, v_smem, v_bar)
            return _

        lax.fori_loop(jnp.int32(nst), jnp.maximum(n_steps, nst), body, None)

        def drain(i, _):  # observe the last consumptions too (no barrier phase left unobserved at exit)
            slot = lax.rem(i, jnp.int32(nst))
            plgpu.barrier_wait(k_used.at[slot])
            plgpu.barrier_wait(v_used.at[slot])
            return _

        lax.fori_loop(jnp.maximum(n_steps - nst, 0), n_steps, drain, None)


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "num_stages", "n_split", "tail_split",
                                             "pingpong", "target_ctas"))
def tree_attention(q, k_cache, v_cache, start, k_new, v_new, mask, *, layer=None, interpret: bool = False,
                   block_k: int = 64, num_stages: int = 2, n_split: int | None = None, tail_split: int | None = None,
                   pingpong: bool = True, target_ctas: int = 132):
    """q [B,T,H,hd]; k/v_cache [B,Hkv,S,hd]; start int32 scalar or [B]; k/v_new [B,N,Hkv,hd]; mask [B,T,N] bool
    -> [B,T,H,hd] (q.dtype). Same as `tree_attention_reference`; bf16 / fp16 only (`check_supported`). layer: the
    caches are the stacked [L,B,Hkv,S,hd] of every layer, layer `layer` read in place.

    block_k: keys per step (64; the SMEM ring holds num_stages K and V tiles [block_k, hd]); n_split: prefix
    splits (default: as many as fit one wave of target_ctas CTAs); tail_split: the splits of a light last row
    block (`plan`); pingpong: the FA3 barrier that alternates the two compute warpgroups between softmax and
    matmuls. interpret: run on the Mosaic GPU interpreter (CPU); True, or a `plgpu.InterpretGPUParams` (e.g.
    detect_races=True)."""
    return attention(q, k_cache, v_cache, start, k_new, v_new, mask, causal=False, layer=layer, interpret=interpret,
                     block_k=block_k, num_stages=num_stages, n_split=n_split, tail_split=tail_split,
                     pingpong=pingpong, target_ctas=target_ctas)


def attention(q, k_cache, v_cache, start, k_new, v_new, mask, *, causal: bool, layer=None, **kw):
    """The kernel call behind `tree_attention` (mask [B, T, N]) and, with causal=True (mask None, N = T: query t
    sees new rows j <= t), `prefill_attention_mgpu.prefill_attention`. layer: the caches are the stacked
    [L, B, Hkv, S, hd], viewed as [L·B, Hkv, S, hd] (free), batch row b reading cache row layer·B + b in place.
    Under `jax.vmap` (the pool's batched round, grouped prefill) each vmapped axis is folded into the batch axis
    B — one launch over V·B batch rows, each with its own start and cache row — by `_fold_vmap`."""
    B = q.shape[0]
    rows = jnp.arange(B, dtype=jnp.int32)  # the cache row of each batch row
    if layer is not None:
        k_cache, v_cache = (x.reshape((-1,) + x.shape[2:]) for x in (k_cache, v_cache))
        rows = rows + jnp.asarray(layer, jnp.int32) * B
    call = functools.partial(_attention, causal=causal, **kw)
    if causal:
        return _fold_vmap(lambda q, kc, vc, st, r, kn, vn: call(q, kc, vc, st, r, kn, vn, None))(
            q, k_cache, v_cache, start, rows, k_new, v_new)
    return _fold_vmap(call)(q, k_cache, v_cache, start, rows, k_new, v_new, mask)


def _fold_vmap(call):
    """call(q, k_cache, v_cache, start, rows, k_new, v_new[, mask]) -> [B, T, H, hd] (caches [C, Hkv, S, hd], batch
    row b reading cache row rows[b]), made vmappable by folding the vmapped axis V into the batch axis instead of
    leaving it to the Mosaic GPU kernel's own batching rule: q and the new rows [V, B, ...] -> [V·B, ...]
    (unbatched ones broadcast); start -> one per folded row; batched caches [V, C, ...] -> [V·C, ...] (free),
    slot v's rows offset by v·C; unbatched caches are shared as they are (no copy), their rows too."""
    f = jax.custom_batching.custom_vmap(call)

    @f.def_vmap
    def _rule(axis_size, in_batched, q, k_cache, v_cache, start, rows, *rest):
        V = axis_size
        B = q.shape[1] if in_batched[0] else q.shape[0]

        def fold(x, batched):
            x = x if batched else jnp.broadcast_to(x, (V,) + x.shape)
            return x.reshape((V * x.shape[1],) + x.shape[2:])

        def per_row(x, batched):  # [B] or [V, B] (a scalar start: [] or [V]) -> [V·B]
            x = jnp.asarray(x, jnp.int32)
            return jnp.broadcast_to(x.reshape((V, -1) if batched else (1, -1)), (V, B)).reshape(V * B)

        r = per_row(rows, in_batched[4])
        if in_batched[1] or in_batched[2]:
            k_cache, v_cache = fold(k_cache, in_batched[1]), fold(v_cache, in_batched[2])
            r = r + jnp.repeat(jnp.arange(V, dtype=jnp.int32) * (k_cache.shape[0] // V), B)
        folded = [fold(x, b) for x, b in zip(rest, in_batched[5:])]
        out = f(fold(q, in_batched[0]), k_cache, v_cache, per_row(start, in_batched[3]), r, *folded)
        return out.reshape((V, B) + out.shape[1:]), True

    return f


def _attention(q, k_cache, v_cache, start, rows, k_new, v_new, mask, *, causal: bool, interpret=False,
               block_k: int = 64, num_stages: int = 2, n_split: int | None = None, tail_split: int | None = None,
               pingpong: bool = True, target_ctas: int = 132):
    """One launch: q [B, T, H, hd]; caches [C, Hkv, S, hd], batch row b reading cache row rows[b] ([B] int32)."""
    check_supported(q, k_cache, v_cache, k_new, v_new)
    B, T, H, hd = q.shape
    hkv, S = k_cache.shape[1], k_cache.shape[2]
    N = k_new.shape[1]
    if H % hkv:
        raise ValueError(f"tree_attention_mgpu: {H} query heads not a multiple of {hkv} kv heads")
    if block_k % 64 or block_k > 128:
        raise ValueError(f"tree_attention_mgpu: block_k {block_k} must be 64 or 128")
    if num_stages < 1:
        raise ValueError(f"tree_attention_mgpu: num_stages {num_stages} must be >= 1")
    if causal and N != T:
        raise ValueError(f"tree_attention_mgpu: the causal mode takes T new rows (got {N} for {T} queries)")
    cfg = plan(T, H, hkv, hd, S, N, block_k=block_k, num_stages=num_stages, n_split=n_split,
               tail_split=tail_split, B=B, dtype=q.dtype, target_ctas=target_ctas, causal=causal)
    if cfg["smem"] > SMEM_LIMIT:
        raise ValueError(f"tree_attention_mgpu: block_k {block_k} x {num_stages} stages at head dim {hd} needs "
                         f"{cfg['smem']} bytes of shared memory (> {SMEM_LIMIT})")
    G, R, Rp, Np, bk = cfg["G"], cfg["R"], cfg["Rp"], cfg["Np"], block_k
    ns = max(cfg["n_split"], cfg["tail_split"])  # split slots of the partials
    if S < bk:  # tiny caches only: the kernel slices whole [bk, hd] windows out of the cache
        pad = ((0, 0), (0, 0), (0, bk - S), (0, 0))
        k_cache, v_cache, S = jnp.pad(k_cache, pad), jnp.pad(v_cache, pad), bk
    qf = q.reshape(B, T, hkv, G, hd).transpose(0, 2, 1, 3, 4).reshape(B * hkv, R, hd)
    qf = jnp.pad(qf, ((0, 0), (0, Rp - R), (0, 0)))
    kn = jnp.pad(k_new, ((0, 0), (0, Np - N), (0, 0), (0, 0)))
    vn = jnp.pad(v_new, ((0, 0), (0, Np - N), (0, 0), (0, 0)))
    start_b = jnp.broadcast_to(jnp.asarray(start, jnp.int32).reshape(-1), (B,))
    operands = [start_b, rows, qf, k_cache, v_cache, kn, vn] + ([] if causal else [_mask_words(mask, G, Rp, Np)])

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    nst = num_stages
    words = [] if causal else [plgpu.SMEM((_WGS, cfg["n_words"], _BQ), jnp.int32)]  # tree-mask words
    scratch = [
        plgpu.SMEM((_WGS, _BQ, hd), q.dtype, transforms=tiled),  # q, then the output
        plgpu.SMEM((nst, bk, hd), q.dtype, transforms=tiled),  # K ring
        plgpu.SMEM((nst, bk, hd), q.dtype, transforms=tiled),  # V ring
        *words,
        plgpu.SMEM((_WGS, _BQ), jnp.float32),  # lse staging
        plgpu.Barrier(num_barriers=_WGS),  # q loaded
        *([] if causal else [plgpu.Barrier(num_barriers=_WGS)]),  # words loaded
        plgpu.Barrier(num_barriers=nst),  # K slot loaded
        plgpu.Barrier(num_barriers=nst),  # V slot loaded
        plgpu.Barrier(num_arrivals=_WGS, num_barriers=nst),  # K slot consumed
        plgpu.Barrier(num_arrivals=_WGS, num_barriers=nst),  # V slot consumed
        plgpu.Barrier(num_arrivals=_WGS),  # ping-pong schedule
    ]
    body = functools.partial(_kernel, hkv=hkv, S=S, R=R, G=G, bk=bk, nst=nst, ns=cfg["n_split"],
                             ns_tail=cfg["tail_split"], n_main_rb=cfg["n_main_rb"], BH=B * hkv, nbt=cfg["nbt"],
                             scale=hd ** -0.5 * _LOG2E, pingpong=pingpong, causal=causal,
                             interpret=bool(interpret))
    o_p, lse_p = plgpu.kernel(
        body,
        out_type=[jax.ShapeDtypeStruct((ns, B * hkv, Rp, hd), q.dtype),
                  jax.ShapeDtypeStruct((ns, B * hkv, Rp), jnp.float32)],
        scratch_types=scratch,
        grid=(cfg["n_ctas"],),
        grid_names=("cta",),
        num_threads=_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
    )(*operands)
    if ns == 1:  # one split: the normalised partial is the output
        o = o_p[0, :, :R]
        return o.reshape(B, hkv, T, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, H, hd)
    # split slots a row's CTAs never wrote (the light row block's, past its tail_split) are left out
    r_split = np.where(np.arange(Rp) >= cfg["n_main_rb"] * _WGS * _BQ, cfg["tail_split"], cfg["n_split"])
    written = jnp.asarray(np.arange(ns)[:, None] < r_split[None, :])[:, None, :]  # [ns, 1, Rp]
    return _merge(o_p, lse_p, written, B=B, T=T, hkv=hkv, G=G, R=R).astype(q.dtype)


def _merge(o_p, lse_p, written, *, B, T, hkv, G, R):
    """Split partials [ns, B·Hkv, Rp, hd] (normalised) + LSE [ns, B·Hkv, Rp] (base 2), of which the slots
    `written` [ns, 1, Rp] hold results -> [B, T, H, hd] fp32."""
    written = written[:, :, :R]
    o_p = jnp.where(written[..., None], o_p[:, :, :R], 0)
    lse_p = jnp.where(written, lse_p[:, :, :R], -jnp.inf)
    mx = jnp.max(lse_p, axis=0)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp2(lse_p - mx)
    w = w / jnp.maximum(jnp.sum(w, axis=0), 1e-30)
    o = jnp.sum(w[..., None] * o_p.astype(jnp.float32), axis=0)  # [B·Hkv, R, hd]
    hd = o.shape[-1]
    return o.reshape(B, hkv, T, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, T, hkv * G, hd)
