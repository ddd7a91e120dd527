"""Gated full attention (Qwen3.5/3.6): one fused q(+gate)|k|v projection `w_qkv`, per-head [query | gate]
split, q/k RMSNorm (1+w), partial RoPE, GQA over a preallocated KV cache, output times sigmoid(gate), o_proj.

Sequence pass: K/V of the new tokens are written at `start ..` and every query attends causally over the
cache (a chunk of T > 1 tokens through `ops.prefill_attention`, a decode step through `ops.tree_attention`).
Tree pass: nodes attend to the committed prefix `[0, start)` and to their tree ancestors; their K/V are
returned as the stash (already final: computed at position start + depth).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from kernels_pallas import ops
from jaxddtree.model.cache import KVCache, restack, unstack
from jaxddtree.model.config import TextConfig
from jaxddtree.model.layout import TokenLayout
from jaxddtree.model.linear import decode_row, dense, init_weight, rounded, sigmoid32
from jaxddtree.model.norms import rms_norm_1p
from jaxddtree.model.rope import apply_rope, rope_cos_sin


@struct.dataclass
class AttentionStash:
    k: jax.Array  # [B, N, Hkv, hd]
    v: jax.Array  # [B, N, Hkv, hd]


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, dtype, rngs: nnx.Rngs):
        d, h, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        # q(+gate) | k | v as one matrix: [D, H*2hd (per head [query|gate], h-major) | Hkv*hd | Hkv*hd]
        self.w_qkv = nnx.Param(init_weight(rngs, (d, h * 2 * hd + 2 * hkv * hd), d, dtype))
        self.wo = nnx.Param(init_weight(rngs, (h, hd, d), h * hd, dtype))  # [H, hd, D]
        self.q_norm = nnx.Param(0.1 * jax.random.normal(rngs.params(), (hd,)).astype(dtype))
        self.k_norm = nnx.Param(0.1 * jax.random.normal(rngs.params(), (hd,)).astype(dtype))

    def project(self, x, layout: TokenLayout, norm=None, normed=None):
        cfg = self.cfg
        B, T, _ = x.shape
        h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv = dense("btd,dc->btc", x, self.w_qkv[...], layout.kernels, norm=norm,  # one GEMM/GEMV: q(+gate)|k|v
                    normed=normed)
        qg, k, v = jnp.split(qkv, [h * 2 * hd, (h * 2 + hkv) * hd], axis=-1)
        qg = qg.reshape(B, T, h, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        q = rms_norm_1p(q, ops.plain(self.q_norm[...]), cfg.rms_norm_eps)
        k = rms_norm_1p(k.reshape(B, T, hkv, hd), ops.plain(self.k_norm[...]), cfg.rms_norm_eps)
        v = v.reshape(B, T, hkv, hd)  # [B,T,Hkv,hd]
        cos, sin = rope_cos_sin(layout.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def output(self, o, gate, kernels: str = "xla", residual=None, then_norm=None):
        # transformers: `attn_output * torch.sigmoid(gate)`, both rounded in the activations' dtype
        sgate = rounded(sigmoid32(gate), o.dtype)
        return dense("bthe,hed->btd", o, self.wo[...], kernels, gate=sgate, residual=residual,
                     reduce=self.cfg.tp_axis, then_norm=then_norm)  # o·sgate rounded

    def decode(self, x, cache: KVCache, layout: TokenLayout, norm=None, residual=None):
        """The T = 1 sequence pass (decode step): projection (+ the input norm), then q/k norm, RoPE, gate and the
        cache write in one op (`ops.attention_decode_prep`), attention over rows [0, start] of the updated
        cache, o_proj (+ the gate and the residual add); the same results as the general path."""
        cfg = self.cfg
        h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        # [B, C], or the Pallas GEMV's split-K partials [S, B, C], unsummed into the fused op
        qkv = decode_row(x, self.w_qkv[...], layout.kernels, norm=norm)
        cos, sin = rope_cos_sin(layout.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)  # [B,1,rd]
        (kc, li), (vc, _) = unstack(cache.k), unstack(cache.v)  # a scanned layer: the stacks + its index
        qn, kn = ops.stack_at(self.q_norm[...], li), ops.stack_at(self.k_norm[...], li)  # stacked: read in the kernel
        q, sgate, k, v, kc, vc = ops.attention_decode_prep(
            qkv, qn, kn, cos[:, 0], sin[:, 0], kc, vc, layout.start, layout.kernels, num_heads=h,
            num_kv_heads=hkv, head_dim=hd, eps=cfg.rms_norm_eps, layer=li)
        o = ops.tree_attention(q[:, None], kc, vc, layout.start, k[:, None], v[:, None], layout.mask,
                               layout.kernels, layer=li)  # [B,1,H,hd]
        out = dense("bthe,hed->btd", o, self.wo[...], layout.kernels, gate=sgate[:, None], residual=residual,
                    reduce=self.cfg.tp_axis)
        return out, KVCache(k=restack(kc, li), v=restack(vc, li)), None

    def __call__(self, x, cache: KVCache, layout: TokenLayout, norm=None, residual=None, normed=None,
                 then_norm=None):
        """norm = (w, eps): the layer's input RMSNorm, applied to x inside the projection; residual: added to the
        output inside o_proj (both folded into the GEMV on a decode step, `linear.dense`); normed / then_norm (a
        tree pass): `linear.dense`'s, the output then (out, h)."""
        if not layout.is_tree and layout.num_tokens == 1:
            return self.decode(x, cache, layout, norm, residual)
        q, k, v, gate = self.project(x, layout, norm, normed)
        (kc, li), (vc, _) = unstack(cache.k), unstack(cache.v)  # a scanned layer: the stacks + its index
        if layout.is_tree:
            o = ops.tree_attention(q, kc, vc, layout.start, k, v, layout.mask, layout.kernels, layer=li)
        else:  # a causal chunk (prefill): the flash kernel needs no mask
            o = ops.prefill_attention(q, kc, vc, layout.start, k, v, layout.kernels, layer=li)
        out = self.output(o, gate, layout.kernels, residual, then_norm)
        if layout.is_tree:
            return out, cache, AttentionStash(k=k, v=v)
        rows = lambda a: jnp.swapaxes(a, 1, 2).astype(kc.dtype)  # [B, Hkv, T, hd]
        if li is None:
            idx, new_k, new_v = (0, 0, layout.start, 0), rows(k), rows(v)
        else:  # into layer li of the stacks, in place
            idx, new_k, new_v = (li, 0, 0, layout.start, 0), rows(k)[None], rows(v)[None]
        kc = jax.lax.dynamic_update_slice(kc, new_k, idx)
        vc = jax.lax.dynamic_update_slice(vc, new_v, idx)
        return out, KVCache(k=restack(kc, li), v=restack(vc, li)), None
