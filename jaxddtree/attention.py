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

from jaxddtree.cache import KVCache
from jaxddtree.config import TextConfig
from jaxddtree.layout import TokenLayout
from jaxddtree.linear import dense, init_weight
from jaxddtree.norms import rms_norm_1p
from jaxddtree.rope import apply_rope, rope_cos_sin

NEG_INF = -1e30


@struct.dataclass
class AttentionStash:
    k: jax.Array  # [B, N, Hkv, hd]
    v: jax.Array  # [B, N, Hkv, hd]


def attend(q, k_cache, v_cache, cache_visible, k_new=None, v_new=None, new_visible=None):
    """Softmax attention of queries over cached keys (+ optional extra keys), GQA.

    q [B,T,H,hd] (already scaled by the caller? no: scaled here), k/v_cache [B,Hkv,S,hd],
    cache_visible [B,T,S] bool; k/v_new [B,N,Hkv,hd], new_visible [B,T,N] bool. Logits in the
    activations' dtype, softmax in fp32 (transformers' eager attention).
    """
    B, T, H, hd = q.shape
    hkv = k_cache.shape[1]
    qg = q.reshape(B, T, hkv, H // hkv, hd)
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scale = hd ** -0.5
    s = jnp.einsum("btkgd,bksd->btkgs", qg, k_cache, precision=prec) * scale  # [B,T,Hkv,G,S]
    s = jnp.where(cache_visible[:, :, None, None, :], s.astype(jnp.float32), NEG_INF)
    if k_new is not None:
        s2 = jnp.einsum("btkgd,bnkd->btkgn", qg, k_new, precision=prec) * scale  # [B,T,Hkv,G,N]
        s2 = jnp.where(new_visible[:, :, None, None, :], s2.astype(jnp.float32), NEG_INF)
        s = jnp.concatenate([s, s2], axis=-1)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    S = k_cache.shape[2]
    o = jnp.einsum("btkgs,bksd->btkgd", p[..., :S], v_cache, precision=prec)
    if k_new is not None:
        o = o + jnp.einsum("btkgn,bnkd->btkgd", p[..., S:], v_new, precision=prec)
    return o.reshape(B, T, H, hd)


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
        qg = dense("btd,dhe->bthe", x, self.wq[...])  # [B,T,H,2hd]
        q, gate = qg[..., :hd], qg[..., hd:]
        q = rms_norm_1p(q, self.q_norm[...], cfg.rms_norm_eps)
        k = rms_norm_1p(dense("btd,dhe->bthe", x, self.wk[...]), self.k_norm[...], cfg.rms_norm_eps)
        v = dense("btd,dhe->bthe", x, self.wv[...])  # [B,T,Hkv,hd]
        cos, sin = rope_cos_sin(layout.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def output(self, o, gate):
        B, T = o.shape[:2]
        o = o * jax.nn.sigmoid(gate)  # [B,T,H,hd], dtype
        return dense("bthe,hed->btd", o, self.wo[...])

    def __call__(self, x, cache: KVCache, layout: TokenLayout):
        q, k, v, gate = self.project(x, layout)
        S = cache.k.shape[2]
        key_pos = jnp.arange(S, dtype=jnp.int32)
        if layout.is_tree:
            visible = jnp.broadcast_to(key_pos < layout.start, q.shape[:2] + (S,))
            o = attend(q, cache.k, cache.v, visible, k, v, layout.mask)
            return self.output(o, gate), cache, AttentionStash(k=k, v=v)
        idx = (0, 0, layout.start, 0)
        kc = jax.lax.dynamic_update_slice(cache.k, jnp.swapaxes(k, 1, 2).astype(cache.k.dtype), idx)
        vc = jax.lax.dynamic_update_slice(cache.v, jnp.swapaxes(v, 1, 2).astype(cache.v.dtype), idx)
        visible = key_pos[None, None, :] <= layout.positions[:, :, None]  # causal over the cache
        o = attend(q, kc, vc, visible)
        return self.output(o, gate), KVCache(k=kc, v=vc), None
