"""Gated full attention (Qwen3.5/3.6): per-head [query | gate] split, q/k RMSNorm (1+w), partial RoPE,
GQA over a preallocated KV cache, output times sigmoid(gate), o_proj.

Sequence pass: K/V of the new tokens are written at `start ..` and every query attends causally over the
cache. Tree pass: nodes attend to the committed prefix `[0, start)` and to their tree ancestors; their
K/V are returned as the stash (already final: computed at position start + depth).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxddtree import ops
from jaxddtree.cache import KVCache
from jaxddtree.config import TextConfig
from jaxddtree.layout import TokenLayout
from jaxddtree.linear import dense, f32, init_weight, rounded, sigmoid32
from jaxddtree.norms import rms_norm_1p
from jaxddtree.rope import apply_rope, rope_cos_sin

NEG_INF = -1e30


@struct.dataclass
class AttentionStash:
    k: jax.Array  # [B, N, Hkv, hd]
    v: jax.Array  # [B, N, Hkv, hd]


def tree_attention_reference(q, k_cache, v_cache, start, k_new, v_new, mask):
    """Queries attend to the committed cache rows [0, start) and to the new rows their mask allows.

    q [B,T,H,hd]; k/v_cache [B,Hkv,S,hd]; start int32 scalar; k/v_new [B,N,Hkv,hd]; mask [B,T,N] bool
    -> [B,T,H,hd]. GQA: query head h reads kv head h // (H/Hkv). Logits in the activations' dtype,
    softmax in fp32 (transformers' eager attention). A sequence pass is the same call with a causal mask.
    """
    S = k_cache.shape[2]
    visible = jnp.broadcast_to(jnp.arange(S) < start, q.shape[:2] + (S,))
    return attend(q, k_cache, v_cache, visible, k_new, v_new, mask)


def attend(q, k_cache, v_cache, cache_visible, k_new=None, v_new=None, new_visible=None):
    """Softmax attention over cached keys (cache_visible [B,T,S]) and optional new keys (new_visible).

    Rounds like transformers' `eager_attention_forward` in the activations' dtype: logits
    `matmul(q, k^T)` rounded, `* scaling` rounded, softmax in fp32 rounded, `matmul(p, v)` rounded once
    (the cache and new-key halves are accumulated in fp32 before that rounding). The matmuls take their
    operands upcast to fp32 (products of bf16 values are exact in fp32, so this is bf16 x bf16 with fp32
    accumulation; XLA:CPU has no batched bf16 x bf16 -> f32 dot)."""
    B, T, H, hd = q.shape
    dt = q.dtype
    hkv = k_cache.shape[1]
    qg = q.reshape(B, T, hkv, H // hkv, hd)
    prec = jax.lax.Precision.HIGHEST if dt == jnp.float32 else None
    scale = hd ** -0.5

    def logits(spec, k):
        s = jnp.einsum(spec, f32(qg), f32(k), precision=prec)
        return f32(rounded(f32(rounded(s, dt)) * scale, dt))

    s = logits("btkgd,bksd->btkgs", k_cache)  # [B,T,Hkv,G,S]
    s = jnp.where(cache_visible[:, :, None, None, :], s, NEG_INF)
    if k_new is not None:
        s2 = logits("btkgd,bnkd->btkgn", k_new)  # [B,T,Hkv,G,N]
        s2 = jnp.where(new_visible[:, :, None, None, :], s2, NEG_INF)
        s = jnp.concatenate([s, s2], axis=-1)
    p = rounded(jax.nn.softmax(s, axis=-1), dt)
    S = k_cache.shape[2]
    o = jnp.einsum("btkgs,bksd->btkgd", f32(p[..., :S]), f32(v_cache), precision=prec)
    if k_new is not None:
        o = o + jnp.einsum("btkgn,bnkd->btkgd", f32(p[..., S:]), f32(v_new), precision=prec)
    return rounded(o, dt).reshape(B, T, H, hd)


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, dtype, rngs: nnx.Rngs):
        d, h, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.wq = nnx.Param(init_weight(rngs, (d, h, 2 * hd), d, dtype))  # [D, H, query|gate]
        self.wk = nnx.Param(init_weight(rngs, (d, hkv, hd), d, dtype))  # [D, Hkv, hd]
        self.wv = nnx.Param(init_weight(rngs, (d, hkv, hd), d, dtype))  # [D, Hkv, hd]
        self.wo = nnx.Param(init_weight(rngs, (h, hd, d), h * hd, dtype))  # [H, hd, D]
        self.q_norm = nnx.Param(0.1 * jax.random.normal(rngs.params(), (hd,)).astype(dtype))
        self.k_norm = nnx.Param(0.1 * jax.random.normal(rngs.params(), (hd,)).astype(dtype))

    def project(self, x, layout: TokenLayout):
        cfg = self.cfg
        hd = cfg.head_dim
        qg = dense("btd,dhe->bthe", x, self.wq[...], layout.kernels)  # [B,T,H,2hd]
        q, gate = qg[..., :hd], qg[..., hd:]
        q = rms_norm_1p(q, self.q_norm[...], cfg.rms_norm_eps)
        k = rms_norm_1p(dense("btd,dhe->bthe", x, self.wk[...], layout.kernels), self.k_norm[...],
                        cfg.rms_norm_eps)
        v = dense("btd,dhe->bthe", x, self.wv[...], layout.kernels)  # [B,T,Hkv,hd]
        cos, sin = rope_cos_sin(layout.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def output(self, o, gate, kernels: str = "xla"):
        B, T = o.shape[:2]
        # transformers: `attn_output * torch.sigmoid(gate)`, both rounded in the activations' dtype
        o = rounded(f32(o) * f32(rounded(sigmoid32(gate), o.dtype)), o.dtype)  # [B,T,H,hd]
        return dense("bthe,hed->btd", o, self.wo[...], kernels)

    def __call__(self, x, cache: KVCache, layout: TokenLayout):
        q, k, v, gate = self.project(x, layout)
        o = ops.tree_attention(q, cache.k, cache.v, layout.start, k, v, layout.mask, layout.kernels)
        out = self.output(o, gate, layout.kernels)
        if layout.is_tree:
            return out, cache, AttentionStash(k=k, v=v)
        idx = (0, 0, layout.start, 0)
        kc = jax.lax.dynamic_update_slice(cache.k, jnp.swapaxes(k, 1, 2).astype(cache.k.dtype), idx)
        vc = jax.lax.dynamic_update_slice(cache.v, jnp.swapaxes(v, 1, 2).astype(cache.v.dtype), idx)
        return out, KVCache(k=kc, v=vc), None
