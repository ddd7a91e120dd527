"""Gated DeltaNet mixer (Qwen3.5/3.6 `linear_attention` layers).

One fused input projection `w_in` = [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a] (one GEMM / GEMV),
then: qkv -> causal depthwise conv (kernel K, SiLU) over the [q|k|v] channels -> l2-normalised q,k;
beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias) -> gated delta rule -> gated RMSNorm with z ->
out_proj. Value head h reads key head h // (Hv/Hk).

Sequence pass: T = 1 uses the recurrent step, T > 1 the chunked WY form (chunk 64); both update the
cache. Tree pass: the conv runs along each node's ancestor chain and the delta rule in the
ancestor-masked WY form; nothing is written, and the stash (k̂, W, g, x) lets `verify.commit` rebuild
the state of any accepted path without per-node states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kernels_pallas import ops
from kernels_pallas.gdn_reference import l2norm, softplus_torch, tree_conv  # noqa: F401  (re-exported)
from jaxddtree.model.cache import GDNState, restack, unstack
from jaxddtree.model.config import TextConfig
from jaxddtree.model.layout import TokenLayout
from jaxddtree.model.linear import decode_row, dense, f32, init_weight, rounded, sigmoid32


@struct.dataclass
class GDNStash:
    k: jax.Array  # [B, N, Hk, dk] fp32, l2-normalised keys
    W: jax.Array  # [B, N, Hv, dv] fp32, pseudo-values
    g: jax.Array  # [B, N, Hv] fp32, per-node log decay
    x: jax.Array  # [B, N, conv_dim] pre-conv inputs


def in_proj_width(cfg: TextConfig) -> int:
    """Columns of the fused input projection `w_in`: conv_dim + Hv*dv + 2*Hv."""
    return cfg.conv_dim + cfg.linear_num_value_heads * (cfg.linear_value_head_dim + 2)


def in_proj_split(cfg: TextConfig) -> tuple[int, int, int]:
    """Column boundaries of `w_in` between qkv | z | b | a (for jnp.split)."""
    z0 = cfg.conv_dim
    b0 = z0 + cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return z0, b0, b0 + cfg.linear_num_value_heads


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: TextConfig, dtype, rngs: nnx.Rngs):
        d, hv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.cfg = cfg
        # all four input projections as one matrix: [D, qkv (conv_dim, the conv's channel order) | z (Hv*dv,
        # head-major) | b (Hv) | a (Hv)] (`in_proj_split` gives the column boundaries)
        self.w_in = nnx.Param(init_weight(rngs, (d, in_proj_width(cfg)), d, dtype))
        self.conv = nnx.Param(init_weight(rngs, (cfg.linear_conv_kernel_dim, cfg.conv_dim),
                                          cfg.linear_conv_kernel_dim, dtype))  # [K, conv_dim]
        self.dt_bias = nnx.Param(jax.random.uniform(rngs.params(), (hv,), minval=-1, maxval=1).astype(dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), minval=1, maxval=16))
                               .astype(dtype))
        self.norm = nnx.Param((1.0 + 0.1 * jax.random.normal(rngs.params(), (dv,))).astype(dtype))
        self.w_out = nnx.Param(init_weight(rngs, (hv, dv, d), hv * dv, dtype))  # [Hv, dv, D]

    def __call__(self, x, cache: GDNState, layout: TokenLayout, norm=None, residual=None, normed=None,
                 then_norm=None):
        """norm = (w, eps): the layer's input RMSNorm, applied to x inside the input projection; residual:
        added to the output inside out_proj (both folded into the GEMV on a decode step, `linear.dense`); normed /
        then_norm (a tree pass): `linear.dense`'s, the output then (out, h)."""
        cfg = self.cfg
        B, T, _ = x.shape
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        km1 = cfg.linear_conv_kernel_dim - 1

        w_in = self.w_in[...]
        (conv_c, li), (rec, _) = unstack(cache.conv), unstack(cache.recurrent)  # scanned: stacks + layer index
        if not layout.is_tree and T == 1:  # decode step (one real token): conv ... gated norm in one op
            # [B, C], or the Pallas GEMV's split-K partials [S, B, C], unsummed into the fused op
            proj = decode_row(x, w_in, layout.kernels, norm=norm)
            small = (ops.stack_at(p[...], li) for p in (self.conv, self.A_log, self.dt_bias, self.norm))
            o, conv, state = ops.gdn_decode_fused(  # (the small parameters: stacks too, read at li)
                proj, conv_c, *small, rec, layout.kernels, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk,
                head_v_dim=dv, conv_kernel=cfg.linear_conv_kernel_dim, eps=cfg.rms_norm_eps, layer=li)  # o [B,Hv,dv]
            out = dense("bthe,hed->btd", o[:, None], self.w_out[...], layout.kernels, residual=residual,
                        reduce=cfg.tp_axis)
            return out, GDNState(conv=restack(conv, li), recurrent=restack(state, li)), None
        full = dense("btd,dc->btc", x, w_in, layout.kernels, norm=norm, normed=normed)  # one GEMM: qkv|z|b|a
        proj = full[..., :in_proj_width(cfg)]  # (a bf16 stacked w_in's padding columns: target.pad_projection_columns)
        xin, _, b, a = jnp.split(proj, in_proj_split(cfg), axis=-1)  # xin [B,T,conv_dim] pre-conv; b, a: [B,T,Hv]

        conv_l = conv_c if li is None else jax.lax.dynamic_index_in_dim(conv_c, li, keepdims=False)  # small
        xc = tree_conv(conv_l, xin, layout.conv_src if layout.is_tree else None, ops.plain(self.conv[...]))
        q, k, v = jnp.split(xc, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        q = l2norm(q.reshape(B, T, hk, dk).astype(jnp.float32)) * dk ** -0.5
        k = l2norm(k.reshape(B, T, hk, dk).astype(jnp.float32))
        v = v.reshape(B, T, hv, dv).astype(jnp.float32)
        # transformers: `beta = b.sigmoid()` in the activations' dtype (fp32 math, rounded), fp32 in the rule
        beta = f32(rounded(sigmoid32(b), x.dtype))
        g = -jnp.exp(ops.plain(self.A_log[...]).astype(jnp.float32)) * softplus_torch(
            a.astype(jnp.float32) + ops.plain(self.dt_bias[...]).astype(jnp.float32))

        stash = None
        if layout.is_tree:
            o, W, _ = ops.gdn_masked_block(q, k, v, g, beta, layout.mask, rec, layout.kernels, layer=li)
            stash = GDNStash(k=k, W=W, g=g, x=xin)
            new_cache = cache
        else:
            valid = (jnp.arange(T) < layout.num_valid)[None, :, None]
            beta, g = jnp.where(valid, beta, 0.0), jnp.where(valid, g, 0.0)  # padding: no effect
            o, state = ops.gdn_chunked(q, k, v, g, beta, rec, layout.kernels, layer=li)  # (li: the stack)
            rows = jnp.concatenate([conv_l, xin.astype(conv_l.dtype)], axis=1)
            conv = jax.lax.dynamic_slice_in_dim(rows, layout.num_valid, km1, axis=1)
            if li is not None:
                conv = jax.lax.dynamic_update_index_in_dim(conv_c, conv, li, 0)
            new_cache = GDNState(conv=restack(conv, li), recurrent=restack(state, li))

        # the gated norm of o (rounded to x's dtype) with z inside out_proj (on a Mosaic GPU GEMM: one kernel)
        out = dense("bthe,hed->btd", o, self.w_out[...], layout.kernels, residual=residual, reduce=cfg.tp_axis,
                    # o [B,T,Hv,dv] fp32; z [B,T,Hv·dv]: the projection's columns from conv_dim on, read in place
                    gated_norm=(full, self.norm[...], cfg.rms_norm_eps, cfg.conv_dim),
                    then_norm=then_norm)
        return out, new_cache, stash
