"""Tree attention in plain jnp: the specification of `kernels_pallas.tree_attention` (same signature) and
the `kernels="xla"` path of the model. A sequence pass (prefill, decode) is the same call with a causal mask.
Also the decode step's attention prologue (`decode_attention_prep`: q/k norm, RoPE, output gate, KV-cache
write; the specification of `kernels_pallas.attention_decode`) and the RoPE rotation the model uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.numerics import f32, rms_norm_1p, rounded, sigmoid32, sum_partials

NEG_INF = -1e30


def tree_attention_reference(q, k_cache, v_cache, start, k_new, v_new, mask, *, layer=None):
    """Queries attend to the committed cache rows [0, start) and to the new rows their mask allows.

    q [B,T,H,hd]; k/v_cache [B,Hkv,S,hd]; start int32 scalar; k/v_new [B,N,Hkv,hd]; mask [B,T,N] bool
    -> [B,T,H,hd]. GQA: query head h reads kv head h // (H/Hkv). Logits in the activations' dtype,
    softmax in fp32 (transformers' eager attention). A sequence pass is the same call with a causal mask.
    layer (an int32 scalar): the caches are the stacked [L,B,Hkv,S,hd] of every layer and the queries attend to
    layer `layer`'s (the kernels read it in place: a `lax.scan` over layers passes the whole stack, no slice).
    """
    if layer is not None:
        k_cache, v_cache = k_cache[layer], v_cache[layer]
    S = k_cache.shape[2]
    visible = jnp.broadcast_to(jnp.arange(S) < start, q.shape[:2] + (S,))
    return attend(q, k_cache, v_cache, visible, k_new, v_new, mask)


def prefill_attention_reference(q, k_cache, v_cache, start, k_new, v_new, *, layer=None):
    """q [B,T,H,hd]; k/v_cache [B,Hkv,S,hd]; start int32 scalar; k/v_new [B,T,Hkv,hd] -> [B,T,H,hd]:
    query t attends to cache rows [0, start) and to new rows j ≤ t (the spec: the tree reference with the
    causal mask). layer (an int32 scalar): the caches are the stacked [L,B,Hkv,S,hd] of every layer, layer
    `layer`'s attended to."""
    B, T = q.shape[:2]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    return tree_attention_reference(q, k_cache, v_cache, start, k_new, v_new, mask, layer=layer)


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


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Partial rotary embedding (rotate-half). x [..., T, H, hd]; cos/sin [..., T, rd] in x's dtype
    (broadcast over the head axis): rotate dims [0, rd), pass the rest through. Rounds like transformers'
    `apply_rotary_pos_emb` in x's dtype: `(q_rot * cos) + (rotate_half(q_rot) * sin)`, each product and the
    sum rounded (no-ops in fp32)."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    c, s = cos[..., None, :], sin[..., None, :]
    dt = x.dtype
    out = rounded(f32(rounded(f32(xr) * f32(c), dt)) + f32(rounded(f32(rot) * f32(s), dt)), dt)
    return jnp.concatenate([out, xp], axis=-1)


def decode_attention_prep(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, start, *, num_heads: int,
                          num_kv_heads: int, head_dim: int, eps: float, layer=None):
    """The attention layer's work between its fused projection and the attention itself, for one token.

    qkv [B, H·2hd + 2·Hkv·hd] = [per head (query | gate), h-major | k | v] (the rounded projection row);
    q_norm, k_norm [hd] (1 + w norms); cos, sin [B, rd] in qkv's dtype (`rope_cos_sin` at the token's
    position); k_cache, v_cache [B, Hkv, S, hd]; start int32 scalar (the token's cache row)
    -> q [B, H, hd] (normed, rotated), sgate [B, H, hd] = rounded(sigmoid(gate)) (o_proj's input is
       rounded(o · sgate)), k [B, Hkv, hd] (normed, rotated), v [B, Hkv, hd], and both caches with row
       `start` set to k / v.
    qkv may also be [S, B, C]: the S split-K partial sums of the projection (`dense(..., reduce=False)`),
    summed in order and rounded to the activations' dtype, k_cache's (`numerics.sum_partials`).
    layer (an int32 scalar): the caches are the stacked [L, B, Hkv, S, hd] of every layer; row `start` of layer
    `layer` is set (`k_cache.at[layer].set(...)`: the other layers untouched) and the whole stacks returned;
    q_norm / k_norm may then be stacked [L, hd] too (2-D: row `layer` is the layer's norm)."""
    if layer is not None:
        q_norm, k_norm = (jax.lax.dynamic_index_in_dim(w, layer, keepdims=False) if w.ndim == 2 else w
                          for w in (q_norm, k_norm))
    if qkv.ndim == 3:
        qkv = sum_partials(qkv, k_cache.dtype)
    B = qkv.shape[0]
    h, hkv, hd = num_heads, num_kv_heads, head_dim
    qg, k, v = jnp.split(qkv, [h * 2 * hd, (h * 2 + hkv) * hd], axis=-1)
    qg = qg.reshape(B, h, 2 * hd)
    q = apply_rope(rms_norm_1p(qg[..., :hd], q_norm, eps), cos, sin)  # [B,H,hd] (H in rope's T place)
    sgate = rounded(sigmoid32(qg[..., hd:]), qkv.dtype)
    k = apply_rope(rms_norm_1p(k.reshape(B, hkv, hd), k_norm, eps), cos, sin)
    v = v.reshape(B, hkv, hd)
    k_row, v_row, idx = k[:, :, None], v[:, :, None], (0, 0, start, 0)  # [B, Hkv, 1, hd] at row start
    if layer is not None:  # into layer `layer` of the stacks
        k_row, v_row, idx = k_row[None], v_row[None], (layer,) + idx
    kc = jax.lax.dynamic_update_slice(k_cache, k_row.astype(k_cache.dtype), idx)
    vc = jax.lax.dynamic_update_slice(v_cache, v_row.astype(v_cache.dtype), idx)
    return q, sgate, k, v, kc, vc
