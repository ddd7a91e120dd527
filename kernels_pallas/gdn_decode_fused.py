"""A whole GDN decode step (T = 1) as ONE Pallas-Triton kernel: conv + SiLU, l2norm, beta/g, the recurrent
update (state in place) and the gated RMSNorm, from the layer's fused projection row to the input of
out_proj.

Same function as `kernels_pallas.gdn_reference.gdn_decode_fused` (re-exported as
`gdn_decode_fused_reference`), which composes the model's own ops. In the XLA path these are ~10 small
fusions per layer plus the recurrent-step kernel (×48 layers); here they are one launch.

    proj [B, conv_dim + Hv·dv + 2·Hv] = [q|k|v pre-conv | z | b | a]   (one GEMV row of the layer)
    -> o [B, Hv, dv] (proj's dtype), conv_state [B, K-1, conv_dim], state [B, Hv, dk, dv] fp32

Grid (B, Hv): program (b, h) owns value head h, which reads key head kh = h // (Hv/Hk). It
  * convolves its q and k channels (key head kh: computed redundantly by the Hv/Hk programs that share it)
    and its v channels over the K-1 conv-state rows and the token: Σ taps·w in fp32, rounded, SiLU in
    fp32, rounded (tree_conv);
  * q = l2norm(q)·dk^-1/2, k = l2norm(k) (fp32); beta = round(sigmoid(b)); g = -exp(A_log)·softplus(a + dt_bias);
  * runs the recurrent step on its [dk, dv] fp32 state, `block_v` columns at a time (a static loop;
    default the whole head): S ← e^g S; δ = β (v − Sᵀk); S ← S + k δᵀ; o = Sᵀq. The state output
    aliases the state input (`input_output_aliases`): in place under a jit that donates it;
  * rounds o, and applies the gated RMSNorm over its dv values with z: normalise in fp32, round,
    × w (rounded to promote(w, act) dtype), × silu(z) in fp32, round;
  * writes its rows of the new conv state (rows shifted by one, the token's pre-conv values last): the
    v channels always, the q/k channels of key head kh only when h is the first value head of kh.
The conv-state output is a fresh array, not aliased: the Hv/Hk programs of a key head all read its
q/k rows, so one of them overwriting them in place would race with the others.

`layer` (a scan over layers, issue 40): conv_state and state are the layers' stacked caches [L, ...] and the
kernel reads and writes layer `layer` of them in place (the layer a [1] int32 operand, put in the one indexer of
each load / store), so no per-layer slice is copied; so, likewise, are conv_w / A_log / dt_bias / norm_w where they
come stacked (read only). Both stacks are aliased to their outputs; in the conv stack
the kernel writes only the v channels (each read and rewritten by its one program). The new q/k rows go to a
small fresh output [B, K-1, 2·Hk·dk] (the race above) that one `dynamic_update_slice` after the kernel writes
into the stack at `layer` (in place: XLA updates the kernel's aliased output buffer).

proj may come as its GEMV's unsummed split-K partials [S, B, P] (`dense(..., reduce=False)`): every load of
the row then sums the S partials in order and rounds to the activations' dtype (conv_state's), as
`numerics.sum_partials` does, so no XLA reduction runs between the GEMV and this kernel.

Roundings: every `rounded(…, dtype)` of the model is a cast to the activations' dtype and back (Triton
keeps it; in interpret mode the kernel uses `reduce_precision`, which XLA cannot elide); fp32 activations
make every rounding the identity. Head dims need not be powers of two (masked loads; the 27B has 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.gdn_reference import gdn_decode_fused as gdn_decode_fused_reference
from kernels_pallas.numerics import rounded
from kernels_pallas._common import SharedMemoryError, compiler_params, feature_pad, is_pow2, pl, pltr
from kernels_pallas._common import smem_limit as _limit

__all__ = ["gdn_decode_fused", "gdn_decode_fused_reference", "smem_bytes"]


def smem_bytes(bv: int, num_warps: int) -> int:
    """Shared memory (bytes, an upper estimate) of a program: no tile is staged (no dot), only the cross-warp
    exchanges of its reductions: the state tile's column sums (bv values per warp) and scalar sums. 27B widths
    (bv 128, 4 warps): 2112 (Triton's allocation: 2048), in every dtype."""
    return 4 * num_warps * (bv + 4)

L2NORM_EPS = 1e-6  # the model's l2norm(q), l2norm(k)


def _kernel(*refs, hk: int, hv: int, dk: int, dv: int, K: int, eps: float, dkp: int, bv: int, nvt: int,
            nparts: int, act, wprod, has_layer: bool, stacked: tuple, interpret: bool):
    it = iter(refs)
    l_ref = next(it) if has_layer else None
    proj_ref, cs_ref, cw_ref, alog_ref, dtb_ref, nw_ref, s_ref, o_ref, cso_ref, so_ref = (next(it) for _ in range(10))
    lw = (l_ref[0],) if has_layer else ()  # the layer of the stacked caches, addressed in place
    # conv_w, A_log, dt_bias, norm_w: each the layer's own, or (stacked) the layers' [L, ...] read at the layer
    pcw, palog, pdtb, pnw = (lw if st_ else () for st_ in stacked)
    qko_ref = next(it) if has_layer else cso_ref  # where the new q/k conv rows go (channels < 2·Hk·dk)
    f32 = jnp.float32
    b, h = pl.program_id(0), pl.program_id(1)
    r = hv // hk
    kh = h // r
    key_dim = hk * dk
    cd = 2 * key_dim + hv * dv
    zoff, boff, aoff = cd, cd + hv * dv, cd + hv * dv + hv
    km1 = K - 1

    i32 = jnp.int32  # static row indices as int32 scalars (interpret mode needs shaped indices)

    def rnd(x, dt):  # fp32 x rounded once to dt, returned as fp32
        if jnp.dtype(dt) == jnp.float32:
            return x
        if interpret:
            return rounded(x, dt).astype(f32)
        return x.astype(dt).astype(f32)

    def silu(x):
        return x / (1.0 + jnp.exp(-x))

    def cols(off, n, npad):  # an index of npad channels from off, and its mask (None: a plain slice)
        if npad == n:
            return pl.ds(off, n), None
        ar = jnp.arange(npad, dtype=jnp.int32)
        return off + ar, ar < n

    def ld(ref_at, m):
        return pltr.load(ref_at, mask=m, other=0) if m is not None else pltr.load(ref_at)

    def st(ref_at, val, m):
        pltr.store(ref_at, val.astype(ref_at.dtype), mask=m)

    def ldp(c, m):  # the projection row at c; partials [S, B, P]: summed in order, rounded (sum_partials)
        if not nparts:
            return ld(proj_ref.at[b, c], m)
        acc = None
        for p_ in range(nparts):
            t = ld(proj_ref.at[i32(p_), b, c], m).astype(f32)
            acc = t if acc is None else acc + t
        return rnd(acc, act).astype(act)

    def conv(off, n, npad):
        """Channels [off, off + n) (padded to npad): pre-conv x, the K-1 state rows, conv+SiLU output."""
        c, m = cols(off, n, npad)
        x = ldp(c, m)
        rows = [ld(cs_ref.at[(*lw, b, i32(j), c)], m) for j in range(km1)]
        acc = None
        for j in range(km1):  # tree_conv: the state rows as the activations' dtype, taps summed in fp32
            t = rnd(rows[j].astype(f32), act) * ld(cw_ref.at[(*pcw, i32(j), c)], m).astype(f32)
            acc = t if acc is None else acc + t
        acc = acc + x.astype(f32) * ld(cw_ref.at[(*pcw, i32(km1), c)], m).astype(f32)
        return x, rows, rnd(silu(rnd(acc, act)), act), c, m

    def store_conv_state(x, rows, c, m, ref, pre):  # new rows: old rows 1..K-2, then the token; pre: ref's layer
        for j in range(km1 - 1):
            st(ref.at[(*pre, b, i32(j), c)], rows[j + 1], m)
        st(ref.at[(*pre, b, i32(km1 - 1), c)], x, m)

    def l2norm(x):
        return x * jax.lax.rsqrt(jnp.sum(x * x) + L2NORM_EPS)

    # q, k of key head kh
    xq, rq, q, cq, mq = conv(kh * dk, dk, dkp)
    xk, rk, k, ck, mk = conv(key_dim + kh * dk, dk, dkp)
    q = l2norm(q) * (dk ** -0.5)
    k = l2norm(k)

    @pl.when(h % r == 0)
    def _():
        store_conv_state(xq, rq, cq, mq, qko_ref, ())
        store_conv_state(xk, rk, ck, mk, qko_ref, ())

    # beta, g (blocks of one element)
    one = lambda ref, pre, i: pltr.load(ref.at[(*pre, pl.ds(i, 1))]).astype(f32)
    bb = ldp(pl.ds(boff + h, 1), None).astype(f32)
    aa = ldp(pl.ds(aoff + h, 1), None).astype(f32)
    beta = rnd(1.0 / (1.0 + jnp.exp(-bb)), act)
    sp = aa + one(dtb_ref, pdtb, h)
    sp = jnp.where(sp > 20.0, sp, jnp.log1p(jnp.exp(jnp.minimum(sp, 20.0))))
    g = -jnp.exp(one(alog_ref, palog, h)) * sp
    decay = jnp.exp(g)[:, None]  # [1, 1]

    ik = jnp.arange(dkp, dtype=jnp.int32)
    masked_s = dkp != dk or dv % bv != 0
    os_, ssq = [], None
    for t in range(nvt):  # static loop over dv tiles of the state
        v0 = t * bv
        nt = min(bv, dv - v0)
        xv, rv, v, cv, mv = conv(2 * key_dim + h * dv + v0, nt, bv)
        store_conv_state(xv, rv, cv, mv, cso_ref, lw)
        iv, mv = cols(v0, nt, bv)  # columns of this tile within the head
        if masked_s:
            ivv = v0 + jnp.arange(bv, dtype=jnp.int32)
            sidx, ms = (*lw, b, h, ik[:, None], ivv[None, :]), (ik < dk)[:, None] & (ivv < dv)[None, :]
        else:
            sidx, ms = (*lw, b, h, slice(None), iv), None
        s = ld(s_ref.at[sidx], ms).astype(f32) * decay  # [dkp, bv]
        pred = jnp.sum(s * k[:, None], axis=0)  # Sᵀk [bv]
        delta = beta * (v - pred)
        s = s + k[:, None] * delta[None, :]
        st(so_ref.at[sidx], s, ms)
        o = rnd(jnp.sum(s * q[:, None], axis=0), act)  # o rounded to the activations' dtype
        os_.append((o, iv, mv, v0, nt))
        sq = jnp.sum(o * o)
        ssq = sq if ssq is None else ssq + sq

    # gated RMSNorm over the head's dv values
    inv = jax.lax.rsqrt(ssq / dv + eps)
    for o, iv, mv, v0, nt in os_:
        zc, _ = cols(zoff + h * dv + v0, nt, bv)
        z = ldp(zc, mv).astype(f32)
        w = ld(nw_ref.at[(*pnw, iv)], mv).astype(f32)
        y = rnd(o * inv, act)
        y = rnd(w * y, wprod)
        st(o_ref.at[b, h, iv], rnd(y * silu(z), act), mv)


@functools.partial(jax.jit, static_argnames=("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
                                             "conv_kernel", "eps", "interpret", "block_v", "num_warps",
                                             "num_stages", "smem_limit"))
def gdn_decode_fused(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, *, num_k_heads: int,
                     num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int, eps: float, layer=None,
                     interpret: bool = False, block_v: int | None = None, num_warps: int = 4,
                     num_stages: int = 1, smem_limit: int | None = None):
    """One token through a GDN layer (see `gdn_decode_fused_reference` for the arguments).

    layer (an int32 scalar): conv_state [L, B, K-1, conv_dim] and state [L, B, Hv, dk, dv] are the layers' stacked
    caches, read and updated in place at `layer` (aliased: in place under a jit that donates them), so that a
    `lax.scan` over layers passes the whole stacks and no slice is copied; returns (o, conv_state, state) with
    the whole stacks. The new q/k conv rows are written into the stack by one small `dynamic_update_slice` after
    the kernel (module docstring). With layer, each of conv_w, A_log, dt_bias, norm_w may also be the layers'
    stack ([L, K, conv_dim], [L, Hv], [L, Hv], [L, dv]; told apart by ndim), read at `layer` in the kernel: XLA
    materialises every operand of a custom call, so a per-layer slice would be one more copy kernel each
    (measured on the H200: 4 launches per GDN layer per step).

    block_v: state columns per step of the program's static loop (a power of two; default the whole
    head, padded to a power of two); num_warps / num_stages: Triton's. Defaults from the H200 sweep
    (benchmarks/results/kernels_decode_fused_h200.json, 2026-11-30, 27B shapes, bf16): whole head with 4
    warps 4.38 µs/layer (8 warps 7.11, 16 warps 7.17, block_v 64 / 32 with 4 warps 5.44 / 6.91) vs 11.51 µs
    and 9 kernels for the XLA ops + the Pallas step; 48 layers 1.58 vs 3.47 ms wall."""
    hk, hv, dk, dv, K = num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel
    nparts = proj.shape[0] if proj.ndim == 3 else 0  # split-K partials of the projection: summed in here
    B, P = proj.shape[-2:]
    cd = 2 * hk * dk + hv * dv
    assert hv % hk == 0 and K >= 2, (hk, hv, K)
    assert P >= cd + hv * dv + 2 * hv, (proj.shape, cd)  # (columns past b | a: a padded w_in's, ignored)
    lead = () if layer is None else conv_state.shape[:1]  # (L,): the stacked caches
    assert conv_state.shape == (*lead, B, K - 1, cd), conv_state.shape
    # the small parameters: each the layer's own, or (with layer) the layers' stacked [L, ...] (by ndim)
    small = ((conv_w, (K, cd)), (A_log, (hv,)), (dt_bias, (hv,)), (norm_w, (dv,)))
    stacked = tuple(layer is not None and a.ndim == len(shp) + 1 for a, shp in small)
    for (a, shp), st in zip(small, stacked):
        assert a.shape == ((*lead, *shp) if st else shp), (a.shape, shp, lead)
    assert state.shape == (*lead, B, hv, dk, dv), state.shape
    dkp, dvp = feature_pad(dk), feature_pad(dv)
    bv = min(block_v or dvp, dvp)
    assert is_pow2(bv) and bv >= 16, bv
    if smem_bytes(bv, num_warps) > _limit(smem_limit):
        raise SharedMemoryError(f"gdn_decode_fused: {smem_bytes(bv, num_warps)} bytes of shared memory needed, "
                                f"{_limit(smem_limit)} available")
    nvt = -(-dv // bv)
    act = conv_state.dtype if nparts else proj.dtype
    kern = functools.partial(_kernel, hk=hk, hv=hv, dk=dk, dv=dv, K=K, eps=float(eps), dkp=dkp, bv=bv,
                             nvt=nvt, nparts=nparts, act=act, wprod=jnp.promote_types(norm_w.dtype, act),
                             has_layer=layer is not None, stacked=stacked, interpret=interpret)
    args = [proj, conv_state, conv_w, A_log, dt_bias, norm_w, state]
    out_shape = [
        jax.ShapeDtypeStruct((B, hv, dv), act),
        jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        jax.ShapeDtypeStruct(state.shape, state.dtype),
    ]
    aliases = {6: 2}
    if layer is not None:  # the layer first; both stacks in place; the new q/k conv rows apart
        args = [jnp.asarray(layer, jnp.int32).reshape(1)] + args
        out_shape.append(jax.ShapeDtypeStruct((B, K - 1, 2 * hk * dk), conv_state.dtype))
        aliases = {2: 1, 7: 2}
    out = pl.pallas_call(
        kern,
        grid=(B, hv),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_decode_fused",
    )(*args)
    if layer is None:
        return out
    o, conv, state, qk = out
    zero = jnp.zeros((), jnp.int32)
    conv = jax.lax.dynamic_update_slice(conv, qk[None], (jnp.asarray(layer, jnp.int32), zero, zero, zero))
    return o, conv, state
