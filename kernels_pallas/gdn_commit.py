"""Commit of the accepted path into one GDN layer's cache in one kernel (spec: `gdn_reference.gdn_commit`).

The XLA form is about ten small kernels per layer (the path gathers of k / W / g / x, the suffix sums, the
fp32 contraction, the state update, the conv rows). Here one program per (batch row, value head, block of
state columns) loads the
path's rows of the stash with gather-loads (the path indices are read in the kernel), forms the suffix sums
of the path's log decays ([P, P] masked sums: no cancellation, as the reference), contracts
(k·coef)ᵀ W over the P path rows with one fp32 dot, and updates the [dk, dv] state in place
(input_output_aliases). The first ceil(C / CB) column-block-0 programs of a batch row also write one CB-channel block of the
new conv rows (rows n .. n+K-2 of [conv; x[path]]), in place too: every row is loaded before any is stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels_pallas._common import compiler_params, dot_fn, first_fit, is_pow2, next_pow2, pl, pltr, tile_bytes
from kernels_pallas.gdn_reference import gdn_commit as gdn_commit_reference

__all__ = ["gdn_commit", "gdn_commit_reference", "smem_bytes"]


def smem_bytes(dk: int, P: int, bv: int, CB: int = 0, conv_bytes: int = 2) -> int:
    """Shared memory (bytes, an upper estimate) of a commit program: the fp32 dot's operands staged, (k·coef)ᵀ
    [dk, Pp] and W [Pp, bv] (Pp = P padded), and the conv rows block it rewrites. 27B widths: 24576 + the conv
    block (Triton's allocation: 24576)."""
    Pp = max(16, next_pow2(P))
    f32 = jnp.float32
    return tile_bytes((dk, Pp), f32) + tile_bytes((Pp, bv), f32) + CB * conv_bytes


def _kernel(path_ref, plen_ref, k_ref, W_ref, g_ref, x_ref, s_ref, c_ref, so_ref, co_ref, *,
            r: int, P: int, Pp: int, km1: int, C: int, CB: int, bv: int, precision: str, interpret: bool):
    f32, i32 = jnp.float32, jnp.int32
    b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // r
    dk = s_ref.shape[2]
    n = pltr.load(plen_ref.at[pl.ds(b, 1)])                                  # [1] path length
    ip = jnp.arange(Pp, dtype=i32)
    pm = ip < P
    path = pltr.load(path_ref.at[b, ip], mask=pm, other=0)                   # [Pp] node indices
    on = (ip < n) & pm                                                       # [Pp] rows of the path proper
    ik, iv = jnp.arange(dk, dtype=i32), t * bv + jnp.arange(bv, dtype=i32)  # this program's state columns
    kp = pltr.load(k_ref.at[b, path[:, None], kh, ik[None, :]]).astype(f32)  # [Pp, dk]
    wp = pltr.load(W_ref.at[b, path[:, None], h, iv[None, :]]).astype(f32)   # [Pp, bv]
    gp = jnp.where(on, pltr.load(g_ref.at[b, path, h]).astype(f32), 0.0)     # [Pp]
    # Σ_{q > p} g_q over the path (the decay from node p down to the leaf), summed directly
    after = jnp.sum(jnp.where(ip[None, :] > ip[:, None], gp[None, :], 0.0), axis=1)  # [Pp]
    coef = jnp.where(on, jnp.exp(after), 0.0)
    dot = dot_fn(precision, interpret)
    upd = dot((kp * coef[:, None]).T, wp)                                    # [dk, bv] = Σ_p coef_p k_p W_pᵀ
    s = pltr.load(s_ref.at[b, h, ik[:, None], iv[None, :]])
    pltr.store(so_ref.at[b, h, ik[:, None], iv[None, :]], jnp.exp(jnp.sum(gp)) * s + upd)

    @pl.when((t == 0) & (h * CB < C))
    def _():  # conv rows: new row i = row n+i of [conv; x[path]] for channels [h*CB, h*CB + CB)
        ic = h * CB + jnp.arange(CB, dtype=i32)
        m = ic < C
        new = []
        for i in range(km1):
            j = n + i                                                        # [1]
            xr = pltr.load(path_ref.at[b, jnp.maximum(j - km1, 0)])          # [1] node of path row j-(K-1)
            from_conv = pltr.load(c_ref.at[b, jnp.minimum(j, km1 - 1)[:, None], ic[None, :]],
                                  mask=m[None, :], other=0)                  # [1, CB]
            from_x = pltr.load(x_ref.at[b, xr[:, None], ic[None, :]], mask=m[None, :], other=0)
            new.append(jnp.where((j < km1)[:, None], from_conv, from_x.astype(from_conv.dtype)))
        for i in range(km1):
            pltr.store(co_ref.at[b, jnp.full((1, 1), i, i32), ic[None, :]], new[i], mask=m[None, :])


@functools.partial(jax.jit, static_argnames=("precision", "block_v", "num_warps", "interpret", "smem_limit"))
def gdn_commit(state, conv, k, W, g, x, path, path_len, *, precision: str = "ieee", block_v: int = 64,
               num_warps: int = 4, interpret: bool = False, smem_limit: int | None = None):
    """Pallas version of `gdn_commit_reference` (one launch per layer; state and conv updated in place).
    precision: the fp32 dot's algorithm (`_common.PRECISIONS`; "ieee": plain fp32, the state is exact to
    fp32 summation order); block_v: state columns per program (grid (B, Hv, dv / block_v): 96 programs at
    27B shapes; not tuned on the H200 yet)."""
    B, Hv, dk, dv = state.shape
    _, N, Hk, _ = k.shape
    km1, C = conv.shape[1], conv.shape[2]
    P = path.shape[1]
    assert Hv % Hk == 0 and is_pow2(dk) and is_pow2(dv) and dk >= 16 and dv >= 16, (state.shape, k.shape)
    assert W.shape == (B, N, Hv, dv) and g.shape == (B, N, Hv) and x.shape == (B, N, C), (W.shape, x.shape)
    CB = next_pow2(-(-C // Hv))  # conv channels per program: ceil(C / CB) <= Hv programs carry a block
    bvs = [min(block_v, dv)]
    while bvs[-1] > 16:  # halved where the staged operands do not fit the shared memory (`smem_bytes`)
        bvs.append(bvs[-1] // 2)
    bv = first_fit(bvs, lambda b: smem_bytes(dk, P, b, CB, conv.dtype.itemsize), smem_limit, what="gdn_commit")
    assert is_pow2(bv) and bv >= 16, bv
    kern = functools.partial(_kernel, r=Hv // Hk, P=P, Pp=max(16, next_pow2(P)), km1=km1, C=C, CB=CB,
                             bv=bv, precision=precision, interpret=interpret)
    return pl.pallas_call(
        kern,
        grid=(B, Hv, dv // bv),
        out_shape=[jax.ShapeDtypeStruct(state.shape, state.dtype), jax.ShapeDtypeStruct(conv.shape, conv.dtype)],
        input_output_aliases={6: 0, 7: 1},
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="gdn_commit",
    )(path.astype(jnp.int32), path_len.astype(jnp.int32), k, W, g, x, state, conv)
