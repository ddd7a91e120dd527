"""The GDN tree verify's inputs, from the layer's fused projection to the tree block kernel's operands, as ONE
Pallas-Triton kernel: the conv along each node's ancestor chain + SiLU, the q / k / v split, l2norm(q)·dk^-1/2 and
l2norm(k), beta = round(sigmoid(b)), g = -exp(A_log)·softplus(a + dt_bias) and the key grams K Kᵀ, Q Kᵀ per key head.

Same function as `gdn_reference.gdn_tree_prep` (re-exported as `gdn_tree_prep_reference`; the model's ops: `gdn_reference.tree_conv`, the split, the l2norms,
beta / g, `gdn_tree.key_grams`' product). In XLA these were ≈ 9 kernels per GDN layer of the verify (H200, DDTree(64)
round, session 29: the conv's gather + concatenation fusion, two split fusions, two l2norm fusions, the beta / g
fusion, the grams' stack, the fp32 cuBLAS SGEMM and its transpose: ≈ 22 µs per layer, ≈ 1.07 ms per round).

    proj [B, T, P] = [q|k|v pre-conv | z | b | a (| a padded w_in's zero columns, ignored)]
    conv_state [B, K-1, C] (or with `layer` the stack [L, B, K-1, C]); conv_src [B, T, K-1]: each node's K-1
    predecessors as rows of concat(conv_state, proj's q|k|v) (`TokenLayout.conv_src`, oldest first)
    -> q, k [B, T, Hk, dk], v [B, T, Hv, dv], g, beta [B, T, Hv], grams [B, 2, Hk, T, T] (K Kᵀ, Q Kᵀ), all fp32

Grid (B, Hk + Hv). Program (b, j < Hk) owns key head j: it convolves its q and k channels for all T nodes (rows
padded to a power of two, masked), normalises them, writes them and forms both grams on the tensor cores in bf16x3
(each fp32 operand split once into bf16 hi + lo; `_common.matmul_fns`; the XLA product was one fp32 SGEMM on CUDA
cores), once per key head. Program (b, Hk + h) owns value head h: its v channels, beta and g. A conv tap is a
gather: rows < K-1 of a node's predecessors come from the conv state (read at `layer` in place), the others from
proj. The conv sums the taps in fp32 in tree_conv's order and rounds as it does (to the activations' dtype: proj's).
With `layer`, conv_w / A_log / dt_bias may also come as the layers' stacks (by ndim), read at the layer in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas.gdn_reference import gdn_tree_prep as gdn_tree_prep_reference
from kernels_pallas.numerics import rounded
from kernels_pallas._common import SharedMemoryError, compiler_params, feature_pad, matmul_fns, next_pow2, pl, pltr
from kernels_pallas._common import smem_limit as _limit

__all__ = ["gdn_tree_prep", "gdn_tree_prep_reference", "smem_bytes"]

L2NORM_EPS = 1e-6  # the model's l2norm(q), l2norm(k)


def smem_bytes(tp: int, dkp: int) -> int:
    """Shared memory (bytes) of a program: the grams' bf16 operands staged for the tensor cores (4 tiles [tp, dkp]:
    Triton's allocation in every dtype, tests/kernel_tests/test_shared_memory.py). 27B widths (65 nodes: tp 128, dk
    128): 131072; 129 nodes (tp 256): 262144, over the H200's 232448 (the call runs on the xla path)."""
    return 8 * tp * dkp


def _kernel(*refs, T: int, tp: int, hk: int, hv: int, dk: int, dv: int, K: int, dkp: int, dvp: int, act,
            has_layer: bool, stacked: tuple, mm, grams: bool, interpret: bool):
    it = iter(refs)
    lw = (next(it)[0],) if has_layer else ()
    proj_ref, cs_ref, src_ref, cw_ref, alog_ref, dtb_ref = (next(it) for _ in range(6))
    q_ref, k_ref, v_ref, g_ref, beta_ref = (next(it) for _ in range(5))
    gr_ref = next(it) if grams else None
    nkp = hk if grams else 2 * hk  # key-head programs: (q and k) per head, or q heads then k heads
    pcw, palog, pdtb = (lw if s else () for s in stacked)
    f32_ = jnp.float32
    i32 = jnp.int32
    b, j = pl.program_id(0), pl.program_id(1)
    key_dim, km1 = hk * dk, K - 1
    cd = 2 * key_dim + hv * dv
    boff, aoff = cd + hv * dv, cd + hv * dv + hv
    ri = jnp.arange(tp, dtype=i32)
    rok = ri < T
    rc = jnp.minimum(ri, T - 1)  # (rows past T: read row T-1, masked)

    def rnd(x, dt):  # fp32 x rounded once to dt, as fp32
        if jnp.dtype(dt) == jnp.float32:
            return x
        return rounded(x, dt).astype(f32_) if interpret else x.astype(dt).astype(f32_)

    def silu(x):
        return x / (1.0 + jnp.exp(-x))

    # each node's predecessors: rows of concat(conv_state, proj), split by where they live
    srcs = [pltr.load(src_ref.at[b, rc, i32(s)]) for s in range(km1)]  # [tp] each

    def conv(off, n, npad):
        """Channels [off, off + n) (padded to npad, masked) for every node: the tree conv + SiLU, [tp, npad]."""
        cn = jnp.arange(npad, dtype=i32)
        cm = (cn < n)[None, :]
        c = (off + cn)[None, :]  # (past n: masked; not clamped, so that no two lanes store to one place)
        acc = None
        for s in range(km1):
            src = srcs[s]
            ins = (src < km1)[:, None]
            xs = pltr.load(cs_ref.at[(*lw, b, jnp.where(src < km1, src, 0)[:, None], c)],
                           mask=ins & rok[:, None] & cm, other=0)
            xp = pltr.load(proj_ref.at[b, jnp.where(src < km1, 0, src - km1)[:, None], c],
                           mask=~ins & rok[:, None] & cm, other=0)
            tap = jnp.where(ins, rnd(xs.astype(f32_), act), xp.astype(f32_))
            t = tap * pltr.load(cw_ref.at[(*pcw, i32(s), c)], mask=cm, other=0).astype(f32_)
            acc = t if acc is None else acc + t
        x = pltr.load(proj_ref.at[b, rc[:, None], c], mask=rok[:, None] & cm, other=0).astype(f32_)
        acc = acc + x * pltr.load(cw_ref.at[(*pcw, i32(km1), c)], mask=cm, other=0).astype(f32_)
        return rnd(silu(rnd(acc, act)), act), c, cm

    def l2n(x):  # rows of [tp, npad]
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2NORM_EPS)

    def qk_heads():  # grams=False: program j < 2 Hk convolves and normalises one head of q (j < Hk) or of k
        is_k = j >= hk
        ik = is_k.astype(i32)
        kh = j - ik * hk
        off = ik * key_dim + kh * dk
        x, c, cm = conv(off, dk, dkp)
        x = l2n(x) * jnp.where(is_k, jnp.float32(1.0), jnp.float32(dk ** -0.5))
        m2 = rok[:, None] & cm
        cl = c - off

        @pl.when(is_k)
        def _():
            pltr.store(k_ref.at[b, ri[:, None], kh, cl], x, mask=m2)

        @pl.when(~is_k)
        def _():
            pltr.store(q_ref.at[b, ri[:, None], kh, cl], x, mask=m2)

    def qk_grams():  # program j < Hk: head j of q and k, and its grams
        kh = j
        q, c, cm = conv(kh * dk, dk, dkp)
        k, _, _ = conv(key_dim + kh * dk, dk, dkp)
        q, k = l2n(q) * (dk ** -0.5), l2n(k)
        cl = c - (kh * dk)  # columns within the head
        m2 = rok[:, None] & cm
        pltr.store(q_ref.at[b, ri[:, None], kh, cl], q, mask=m2)
        pltr.store(k_ref.at[b, ri[:, None], kh, cl], k, mask=m2)
        split, dot = mm
        kt = jax.tree.map(lambda x: x.T, split(k))  # kᵀ (split once: bf16 hi / lo on the GPU)
        kk, qk = dot(split(k), kt), dot(split(q), kt)  # [tp, tp]
        gm = rok[:, None] & rok[None, :]
        pltr.store(gr_ref.at[b, i32(0), kh, ri[:, None], ri[None, :]], kk, mask=gm)
        pltr.store(gr_ref.at[b, i32(1), kh, ri[:, None], ri[None, :]], qk, mask=gm)

    pl.when(j < nkp)(qk_heads if not grams else qk_grams)

    @pl.when(j >= nkp)
    def _():
        h = j - nkp
        v, c, cm = conv(2 * key_dim + h * dv, dv, dvp)
        pltr.store(v_ref.at[b, ri[:, None], h, c - (2 * key_dim + h * dv)], v, mask=rok[:, None] & cm)
        bb = pltr.load(proj_ref.at[b, rc, boff + h], mask=rok, other=0).astype(f32_)
        aa = pltr.load(proj_ref.at[b, rc, aoff + h], mask=rok, other=0).astype(f32_)
        one = lambda ref, pre: pltr.load(ref.at[(*pre, pl.ds(h, 1))]).astype(f32_)  # [1]
        beta = rnd(1.0 / (1.0 + jnp.exp(-bb)), act)
        sp = aa + one(dtb_ref, pdtb)
        sp = jnp.where(sp > 20.0, sp, jnp.log1p(jnp.exp(jnp.minimum(sp, 20.0))))
        g = -jnp.exp(one(alog_ref, palog)) * sp
        pltr.store(beta_ref.at[b, ri, h], beta, mask=rok)
        pltr.store(g_ref.at[b, ri, h], g, mask=rok)


@functools.partial(jax.jit, static_argnames=("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "interpret",
                                             "num_warps", "num_stages", "smem_limit", "grams"))
def gdn_tree_prep(proj, conv_state, conv_src, conv_w, A_log, dt_bias, *, num_k_heads: int, num_v_heads: int,
                  head_k_dim: int, head_v_dim: int, layer=None, grams: bool = True, interpret: bool = False,
                  num_warps: int = 8, num_stages: int = 1, smem_limit: int | None = None):
    """One GDN layer's tree-verify inputs (see `gdn_tree_prep_reference` and the module docstring).

    layer (an int32 scalar): conv_state is the layers' stacked conv states [L, B, K-1, C], read at `layer` in place
    (a scan over layers copies no slice); conv_w [K, C] / A_log / dt_bias [Hv] each the layer's own or the stack.
    grams=False: None for the grams, and a program per q head and per k head (no tensor-core work)."""
    hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
    B, T, P = proj.shape
    cd = 2 * hk * dk + hv * dv
    assert hv % hk == 0 and P >= cd + hv * dv + 2 * hv, (proj.shape, cd)
    lead = () if layer is None else conv_state.shape[:1]
    K = conv_state.shape[-2] + 1
    assert conv_state.shape == (*lead, B, K - 1, cd), conv_state.shape
    assert conv_src.shape == (B, T, K - 1), conv_src.shape
    small = ((conv_w, (K, cd)), (A_log, (hv,)), (dt_bias, (hv,)))
    stacked = tuple(layer is not None and a.ndim == len(shp) + 1 for a, shp in small)
    for (a, shp), st in zip(small, stacked):
        assert a.shape == ((*lead, *shp) if st else shp), (a.shape, shp, lead)
    tp, dkp, dvp = max(16, next_pow2(T)), feature_pad(dk), feature_pad(dv)
    if grams and smem_bytes(tp, dkp) > _limit(smem_limit):
        raise SharedMemoryError(f"gdn_tree_prep: {smem_bytes(tp, dkp)} bytes of shared memory needed for {T} nodes, "
                                f"{_limit(smem_limit)} available")
    kern = functools.partial(_kernel, T=T, tp=tp, hk=hk, hv=hv, dk=dk, dv=dv, K=K, dkp=dkp, dvp=dvp, act=proj.dtype,
                             has_layer=layer is not None, stacked=stacked, mm=matmul_fns("bf16x3m", interpret),
                             grams=grams, interpret=interpret)
    f32_ = jnp.float32
    args = [proj, conv_state, conv_src.astype(jnp.int32), conv_w, A_log, dt_bias]
    if layer is not None:
        args = [jnp.asarray(layer, jnp.int32).reshape(1)] + args
    outs = pl.pallas_call(
        kern,
        grid=(B, (hk if grams else 2 * hk) + hv),
        out_shape=[jax.ShapeDtypeStruct((B, T, hk, dk), f32_), jax.ShapeDtypeStruct((B, T, hk, dk), f32_),
                   jax.ShapeDtypeStruct((B, T, hv, dv), f32_), jax.ShapeDtypeStruct((B, T, hv), f32_),
                   jax.ShapeDtypeStruct((B, T, hv), f32_)] + [jax.ShapeDtypeStruct((B, 2, hk, T, T), f32_)] * grams,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="gdn_tree_prep",
    )(*args)
    return tuple(outs) + (() if grams else (None,))
