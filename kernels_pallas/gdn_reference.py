"""The gated delta rule in plain jnp, fp32: decode step, chunked prefill, tree verify, path commit.

These are the specification (and the `kernels="xla"` path); the Pallas kernels in `kernels_pallas/`
must compute the same functions with the same signatures.

Shapes: B batch, N/T tokens (or tree nodes), Hk key heads, Hv value heads (value head h reads key head
h // (Hv/Hk)), dk/dv head dims. Inputs are already prepared: `q` = l2norm(q)·dk^-1/2, `k` = l2norm(k),
`g` = log decay (≤ 0), `beta` = sigmoid(b), all fp32. The recurrent state S is `[B, Hv, dk, dv]`, fp32.

Per value head the recurrence is
    S_t = exp(g_t) S_{t-1};  S_t += k_t ⊗ beta_t (v_t − S_tᵀ k_t);  o_t = S_tᵀ q_t.
Over a set of tokens with ancestor-or-self mask M (a chain: the lower triangle; a tree: the ancestor
relation), with G = M g (path cumsum) and Γ_ij = exp(G_i − G_j) for M_ij:
    (I + L) W = beta⊙v − beta⊙exp(G)⊙(K S0),   L_ij = beta_i Γ_ij (k_i·k_j) for strict ancestors j,
    o_i = exp(G_i) q_iᵀ S0 + Σ_j M_ij Γ_ij (q_i·k_j) W_j,
    S after node a = exp(G_a) S0 + Σ_{j on a's path} Γ_aj k_j W_jᵀ.
Γ is evaluated from segment sums of g (Σ over the path nodes strictly below j down to i), never as a
difference G_i − G_j of large cumulative sums, which loses digits under strong decay.

Around the rule, the mixer's elementwise ops as the model computes them (it imports them from here):
`tree_conv` (causal depthwise conv + SiLU), `l2norm`, `softplus_torch`, `gated_rms_norm`; and
`gdn_decode_fused`, one whole decode step of a GDN layer from its fused projection row to the gated-norm
output (the spec of `kernels_pallas.gdn_decode_fused`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.numerics import f32, rounded, sigmoid32, silu32, sum_partials

HIGHEST = jax.lax.Precision.HIGHEST


def expand_kv_heads(x: jax.Array, num_v_heads: int) -> jax.Array:
    """[B, N, Hk, d] -> [B, N, Hv, d]: value head h uses key head h // (Hv/Hk)."""
    return jnp.repeat(x, num_v_heads // x.shape[2], axis=2)


def gdn_step(q, k, v, g, beta, state):
    """One token. q,k [B,Hk,dk], v [B,Hv,dv], g,beta [B,Hv], state [B,Hv,dk,dv] -> (o [B,Hv,dv], state)."""
    hv = v.shape[1]
    q = jnp.repeat(q, hv // q.shape[1], axis=1)
    k = jnp.repeat(k, hv // k.shape[1], axis=1)
    s = state * jnp.exp(g)[..., None, None]
    pred = jnp.einsum("bhkv,bhk->bhv", s, k, precision=HIGHEST)  # Sᵀk  [B,Hv,dv]
    delta = beta[..., None] * (v - pred)
    s = s + k[..., :, None] * delta[..., None, :]  # k ⊗ δ
    o = jnp.einsum("bhkv,bhk->bhv", s, q, precision=HIGHEST)
    return o, s


def gdn_masked_block(q, k, v, g, beta, mask, state, *, layer=None):
    """The WY form over one block of N tokens related by `mask` (ancestor-or-self, [B,N,N] bool).

    q,k [B,N,Hk,dk]; v [B,N,Hv,dv]; g,beta [B,N,Hv]; state [B,Hv,dk,dv] (or, with `layer`, an int32 scalar, the
    layers' stacked states [L,B,Hv,dk,dv], of which layer `layer` is read: the kernel reads it in place).
    Returns o [B,N,Hv,dv], W (pseudo-values) [B,N,Hv,dv], G (path cumsum of g) [B,N,Hv].
    Nothing of size N·dk·dv is formed.
    """
    if layer is not None:
        state = state[layer]
    hv = v.shape[2]
    r = hv // k.shape[2]
    maskf = mask.astype(jnp.float32)
    G = jnp.einsum("bij,bjh->bih", maskf, g, precision=HIGHEST)  # [B,N,Hv] path cumsum
    # log decay from j to i = Σ g over the path nodes below j down to i: Σ_k M_ik (1 - M_jk) g_k, summed
    # directly (all terms ≤ 0) rather than as G_i - G_j, a difference of large sums under strong decay
    seg = jnp.einsum("bikh,bjk->bijh", maskf[..., None] * g[:, None, :, :], 1.0 - maskf,
                     precision=HIGHEST)  # [B,N,N,Hv]
    gamma = jnp.exp(jnp.where(mask[..., None], seg, -jnp.inf))  # 0 off the ancestor relation
    strict = mask & ~jnp.eye(mask.shape[-1], dtype=bool)[None]
    kk = jnp.einsum("bihd,bjhd->bijh", k, k, precision=HIGHEST)  # [B,N,N,Hk]
    qk = jnp.einsum("bihd,bjhd->bijh", q, k, precision=HIGHEST)
    kk, qk = jnp.repeat(kk, r, axis=3), jnp.repeat(qk, r, axis=3)  # -> Hv
    L = jnp.where(strict[..., None], beta[:, :, None, :] * gamma * kk, 0.0)  # [B,N,N,Hv]
    ke = expand_kv_heads(k, hv)
    qe = expand_kv_heads(q, hv)
    ks0 = jnp.einsum("bnhk,bhkv->bnhv", ke, state, precision=HIGHEST)  # K S0
    eG = jnp.exp(G)
    rhs = beta[..., None] * (v - eG[..., None] * ks0)  # [B,N,Hv,dv]
    # unit-lower-triangular solve per (batch, head): (I + L) W = rhs
    Lh = jnp.moveaxis(L, 3, 1)  # [B,Hv,N,N]
    W = jax.lax.linalg.triangular_solve(Lh, jnp.moveaxis(rhs, 2, 1), left_side=True, lower=True,
                                        unit_diagonal=True)  # [B,Hv,N,dv]
    W = jnp.moveaxis(W, 1, 2)  # [B,N,Hv,dv]
    qs0 = jnp.einsum("bnhk,bhkv->bnhv", qe, state, precision=HIGHEST)
    A = jnp.where(mask[..., None], gamma * qk, 0.0)  # [B,N,N,Hv]
    o = eG[..., None] * qs0 + jnp.einsum("bijh,bjhv->bihv", A, W, precision=HIGHEST)
    return o, W, G


def gdn_state_after(state, k, W, g, path_mask):
    """State after the deepest node of a root path, `path_mask` [B,N] bool (nodes in topological order, so
    along the path a larger index is deeper).

    k [B,N,Hk,dk]; W [B,N,Hv,dv]; g [B,N,Hv] per-node log decay -> [B,Hv,dk,dv].
    S = exp(Σ_path g) S0 + Σ_{j on path} exp(Σ_{path nodes after j} g) k_j W_jᵀ (suffix sums: no cancellation).
    """
    hv = W.shape[2]
    gp = jnp.where(path_mask[..., None], g, 0.0)  # [B,N,Hv]
    suffix = jnp.flip(jnp.cumsum(jnp.flip(gp, 1), axis=1), 1)  # Σ_{k ≥ j} gp_k
    after = jnp.concatenate([suffix[:, 1:], jnp.zeros_like(suffix[:, :1])], axis=1)  # Σ_{k > j}: path below j
    coef = jnp.where(path_mask[..., None], jnp.exp(after), 0.0)  # [B,N,Hv]
    ke = expand_kv_heads(k, hv)
    upd = jnp.einsum("bnhk,bnh,bnhv->bhkv", ke, coef, W, precision=HIGHEST)
    return jnp.exp(jnp.sum(gp, axis=1))[..., None, None] * state + upd


def gdn_commit(state, conv, k, W, g, x, path, path_len):
    """Commit of an accepted root path into one GDN layer's cache, from the tree verify's stash.

    state [B,Hv,dk,dv] fp32; conv [B,K-1,C] (the last K-1 pre-conv rows); stash k [B,N,Hk,dk], W [B,N,Hv,dv],
    g [B,N,Hv] (fp32), x [B,N,C] (pre-conv inputs); path [B,P] node indices root -> leaf (entries past
    path_len[b] are ignored); path_len [B] (>= 1, root included) -> (state after the path's last node
    (`gdn_state_after`), conv: the last K-1 rows of [conv; x[path[:path_len]]])."""
    take = lambda a: jnp.take_along_axis(a, path.reshape(path.shape + (1,) * (a.ndim - 2)), axis=1)
    on = jnp.arange(path.shape[1])[None, :] < path_len[:, None]  # [B, P] rows of the path proper
    state = gdn_state_after(state, take(k), take(W), take(g), on)
    rows = jnp.concatenate([conv, take(x).astype(conv.dtype)], axis=1)  # [B, K-1+P, C]
    km1 = conv.shape[1]
    idx = path_len[:, None] + jnp.arange(km1)[None, :]  # [B, K-1]: rows n .. n+K-2
    return state, jnp.take_along_axis(rows, idx[..., None], axis=1)


def gdn_chunked(q, k, v, g, beta, state, chunk: int = 64, *, layer=None):
    """Chunked prefill over T tokens (pad to a multiple of `chunk` with beta=0, g=0: no effect).

    q,k [B,T,Hk,dk]; v [B,T,Hv,dv]; g,beta [B,T,Hv]; state [B,Hv,dk,dv] -> (o [B,T,Hv,dv], state).
    layer (an int32 scalar): state is the layers' stacked states [L,B,Hv,dk,dv]; layer `layer` is read and the
    whole stack returned with the new state written at `layer` (`state.at[layer].set(new)`).
    """
    if layer is not None:
        o, new = gdn_chunked(q, k, v, g, beta, state[layer], chunk)
        return o, state.at[layer].set(new)
    B, T = v.shape[:2]
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    n = (T + pad) // C
    to_chunks = lambda x: jnp.moveaxis(x.reshape((B, n, C) + x.shape[2:]), 1, 0)  # [n,B,C,...]
    xs = tuple(map(to_chunks, (q, k, v, g, beta)))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((C, C), bool)), (B, C, C))
    all_on = jnp.ones((B, C), bool)

    def body(s, x):
        qc, kc, vc, gc, bc = x
        o, W, G = gdn_masked_block(qc, kc, vc, gc, bc, causal, s)
        return gdn_state_after(s, kc, W, gc, all_on), o

    state, o = jax.lax.scan(body, state, xs)
    o = jnp.moveaxis(o, 0, 1).reshape((B, n * C) + o.shape[3:])[:, :T]
    return o, state


# ----------------------------------------------------------------------------- the mixer's elementwise ops
def softplus_torch(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def l2norm(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def tree_conv(conv_state, x, conv_src, w):
    """Causal depthwise conv with SiLU along each token's predecessor chain.

    conv_state [B, K-1, C]; x [B, T, C]; conv_src [B, T, K-1] rows of concat(conv_state, x) (oldest
    first), or None for a sequence (token t's taps are rows t .. t+K-2: static slices, no gather); w [K, C]
    (tap K-1 hits the current token). Sums in fp32, tap by tap (elementwise: no dot, so no transposed dot
    output for XLA to lay back out), rounded to the activations' dtype, SiLU in fp32, rounded (transformers'
    `causal_conv1d_fn` / `causal_conv1d_update` torch fallback: `F.conv1d` in the activations' dtype, then
    `ACT2FN["silu"]` on it). A tree's taps are gathered from conv_state and from x apart and selected: no
    concatenation of the two (one XLA kernel fewer per layer than gathering from it; H100, 2026-12-07).
    """
    km1, T = conv_state.shape[1], x.shape[1]
    if conv_src is None:
        rows = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
        tap = lambda s: rows[:, s:s + T]  # [B, T, C]
    else:
        def tap(s):
            src = conv_src[:, :, s]  # [B, T]
            old = jax.vmap(lambda r, i: r[i])(conv_state, jnp.clip(src, 0, km1 - 1)).astype(x.dtype)
            new = jax.vmap(lambda r, i: r[i])(x, jnp.clip(src - km1, 0, T - 1))
            return jnp.where((src < km1)[..., None], old, new)
    wf = w.astype(jnp.float32)
    acc = tap(0).astype(jnp.float32) * wf[0]
    for s in range(1, km1):
        acc = acc + tap(s).astype(jnp.float32) * wf[s]
    acc = acc + x.astype(jnp.float32) * wf[-1]
    return rounded(silu32(rounded(acc, x.dtype)), x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Plain-weight gated RMSNorm after the GDN core: normalise in fp32, round, times w (rounded: a product
    in the activations' dtype), times silu(z) in fp32, round (the casts of `Qwen3_5RMSNormGated.forward`:
    `self.weight * hidden_states.to(input_dtype)`, then `* silu(gate.to(torch.float32))`, `.to(input_dtype)`)."""
    xf = f32(x)
    y = rounded(xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps), x.dtype)
    y = rounded(f32(w) * f32(y), jnp.promote_types(w.dtype, x.dtype))
    return rounded(f32(y) * silu32(z), x.dtype)


# ----------------------------------------------------------------------------- one fused decode step
def split_proj(proj, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int):
    """The fused projection row [B, conv_dim + Hv·dv + 2·Hv (+ a padded w_in's zero columns, ignored)] -> (xin
    [B, conv_dim] pre-conv q|k|v, z [B, Hv, dv], b [B, Hv], a [B, Hv])."""
    B = proj.shape[0]
    cd = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    zd = num_v_heads * head_v_dim
    assert proj.shape[-1] >= cd + zd + 2 * num_v_heads, (proj.shape, cd, zd, num_v_heads)  # (padding past a)
    return (proj[:, :cd], proj[:, cd:cd + zd].reshape(B, num_v_heads, head_v_dim),
            proj[:, cd + zd:cd + zd + num_v_heads], proj[:, cd + zd + num_v_heads:cd + zd + 2 * num_v_heads])


def gdn_decode_fused(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, *, num_k_heads: int,
                     num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int, eps: float, layer=None):
    """One token through a GDN layer, from its projection row to the gated-norm output (before out_proj).

    proj [B, conv_dim + Hv·dv + 2·Hv]: columns [q|k|v pre-conv (conv_dim = 2·Hk·dk + Hv·dv) | z (Hv·dv,
    head-major) | b (Hv) | a (Hv)], in the activations' dtype; conv_state [B, K-1, conv_dim]; conv_w
    [K, conv_dim]; A_log, dt_bias [Hv]; norm_w [dv]; state [B, Hv, dk, dv] fp32.
    Returns (o [B, Hv, dv] in proj's dtype, conv_state [B, K-1, conv_dim], state [B, Hv, dk, dv]).

    The ops (and roundings) of the model's GDN layer at T = 1 before the fused op: conv over the K-1 state rows and the
    token; q,k l2-normalised (q·dk^-1/2), beta = round(sigmoid(b)), g = -exp(A_log)·softplus(a + dt_bias);
    the recurrent step (`gdn_step`); o rounded; gated RMSNorm with z; conv state shifted by one row.

    proj may also be [S, B, ...]: the S split-K partial sums of the projection (`dense(..., reduce=False)`),
    summed in order and rounded to the activations' dtype, conv_state's (`numerics.sum_partials`).

    layer (an int32 scalar): conv_state [L, B, K-1, conv_dim] and state [L, B, Hv, dk, dv] are the layers' stacked
    caches; layer `layer` is read, and both are returned whole with the new caches written at `layer`
    (`.at[layer].set(new)`; the kernel updates them in place). conv_w, A_log, dt_bias, norm_w: each the layer's own
    ([K, conv_dim], [Hv], [Hv], [dv]) or the layers' stack (one more leading axis L, told apart by ndim), read at
    `layer`.
    """
    if layer is not None:
        conv_w, A_log, dt_bias, norm_w = (a[layer] if a.ndim == n + 1 else a for a, n in
                                          ((conv_w, 2), (A_log, 1), (dt_bias, 1), (norm_w, 1)))
        o, conv, s = gdn_decode_fused(proj, conv_state[layer], conv_w, A_log, dt_bias, norm_w, state[layer],
                                      num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim,
                                      head_v_dim=head_v_dim, conv_kernel=conv_kernel, eps=eps)
        return o, conv_state.at[layer].set(conv), state.at[layer].set(s)
    hk, hv, dk, dv, K = num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel
    if proj.ndim == 3:
        proj = sum_partials(proj, conv_state.dtype)
    B = proj.shape[0]
    dtype = proj.dtype
    km1 = K - 1
    assert conv_state.shape[1] == km1 and conv_w.shape[0] == K, (conv_state.shape, conv_w.shape, K)
    xin, z, b, a = split_proj(proj, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv)
    # the single token sits at row K-1 of concat(conv_state, x); its taps are rows 0..K-2 (a sequence of one)
    xc = tree_conv(conv_state, xin[:, None], None, conv_w)  # [B, 1, conv_dim]
    q, k, v = jnp.split(xc[:, 0], [hk * dk, 2 * hk * dk], axis=-1)
    q = l2norm(q.reshape(B, hk, dk).astype(jnp.float32)) * dk ** -0.5
    k = l2norm(k.reshape(B, hk, dk).astype(jnp.float32))
    v = v.reshape(B, hv, dv).astype(jnp.float32)
    beta = f32(rounded(sigmoid32(b), dtype))
    g = -jnp.exp(A_log.astype(jnp.float32)) * softplus_torch(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    o, state = gdn_step(q, k, v, g, beta, state)
    o = gated_rms_norm(rounded(o, dtype), z, norm_w, eps)
    conv = jnp.concatenate([conv_state, xin[:, None].astype(conv_state.dtype)], axis=1)[:, 1:]
    return o, conv, state
