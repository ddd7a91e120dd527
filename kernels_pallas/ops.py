"""Kernel dispatch: the model calls these with `kernels="xla"` (plain jnp references, the spec) or
`kernels="pallas"` (the GPU kernels in `kernels_pallas/`, same signatures, same results)."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas import gdn_reference
from kernels_pallas.numerics import f32, rms_norm_1p, rounded

KERNELS = ("xla", "pallas")

# The Pallas weight-streaming GEMV runs the projections of single-token passes (the AR decode step) with at
# least PALLAS_DENSE_MIN_COLS outputs. H200 sweep (benchmarks/bench_gemv.py, 2026-11-29): 1.04-1.22x XLA's GEMVs
# for the 27B projections at M = 1, 0.97x for the 1024-wide k/v, and 0.79-0.86x at M = 65 (verify), so
# everything else stays on XLA's GEMMs. (That sweep predates the fused parameter layout; since then every 27B
# projection is at least 5120 wide — the narrow k/v, b, a are columns of the fused w_qkv / w_in — so the whole
# decode step takes the GEMV.)
PALLAS_DENSE_MAX_ROWS = 1
PALLAS_DENSE_MIN_COLS = 2048

# Decode-step fusions (kernels="pallas", bf16): the output gate folded into the Pallas GEMV's prologue, the
# residual add into its epilogue (`dense`), and the attention layer's q/k norm + RoPE + gate + KV-cache write
# as one kernel (`attention_decode_prep`). Same results either way; off = the separate ops (XLA fusions) around
# the plain GEMV, for A/B timing (`fused_decode(False)`, benchmarks/profile_gpu.py --decode-fusions). Read when
# a function is traced: set it before the first call of a jitted step.
FUSED_DECODE = True
# The part of the decode fusions that can be switched off on its own: the unsummed split-K partials handed to
# the GDN / attention decode kernels (AR step, H200, 27B, 4K, 2026-11-30: 17.68 ms default, 17.97 without the
# partials, 18.14 unfused).
# Removed (git history), lost on the H200: the RMSNorm in the GEMV prologue and the MLP as two GEMVs with the
# SwiGLU in the down GEMV's prologue (AR step 17.68 ms without them vs 20.63 with the MLP chain;
# benchmarks/ab_decode_fusions.py, 2026-11-30): both delay the weight stream. The norm runs before the GEMV.
FUSED_PARTIALS = True


@contextlib.contextmanager
def fused_decode(enabled: bool):
    """Trace the decode-step fusions on or off inside this block (see FUSED_DECODE)."""
    global FUSED_DECODE
    old, FUSED_DECODE = FUSED_DECODE, bool(enabled)
    try:
        yield
    finally:
        FUSED_DECODE = old


def _check(kernels: str):
    if kernels not in KERNELS:
        raise ValueError(f"unknown kernels '{kernels}' (choose one of {KERNELS})")


def _pallas_or(reference, kernel):
    """kernel() (the Pallas call), or reference() where no tile configuration of the kernel fits the GPU's shared
    memory for these shapes / dtypes (`_common.SharedMemoryError`, raised while tracing, before any work): one
    plain line on stderr, once per process and kernel."""
    from kernels_pallas._common import SharedMemoryError, note_once
    try:
        return kernel()
    except SharedMemoryError as e:
        note_once(("smem", str(e).split(":")[0]), f"kernels_pallas: {e}; that call runs on the xla path")
        return reference()


def tree_attention(q, k_cache, v_cache, start, k_new, v_new, mask, kernels="xla"):
    """q [B,T,H,hd] attends to cache rows [0, start) and to new rows j with mask[b,i,j] -> [B,T,H,hd]."""
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import tree_attention as ta
        from kernels_pallas.attention_reference import tree_attention_reference
        return _pallas_or(lambda: tree_attention_reference(q, k_cache, v_cache, start, k_new, v_new, mask),
                          lambda: ta.tree_attention(q, k_cache, v_cache, start, k_new, v_new, mask))
    from kernels_pallas.attention_reference import tree_attention_reference
    return tree_attention_reference(q, k_cache, v_cache, start, k_new, v_new, mask)


def prefill_attention(q, k_cache, v_cache, start, k_new, v_new, kernels="xla"):
    """Causal sequence pass: q [B,T,H,hd] at positions [start, start+T) attends to cache rows [0, start) and
    to new rows j <= t -> [B,T,H,hd] (= tree_attention with the causal mask; no mask is built or read)."""
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import prefill_attention as pa
        return _pallas_or(lambda: pa.prefill_attention_reference(q, k_cache, v_cache, start, k_new, v_new),
                          lambda: pa.prefill_attention(q, k_cache, v_cache, start, k_new, v_new))
    from kernels_pallas.prefill_attention import prefill_attention_reference
    return prefill_attention_reference(q, k_cache, v_cache, start, k_new, v_new)


def gdn_chunked(q, k, v, g, beta, state, kernels="xla"):
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import gdn_prefill
        return _pallas_or(lambda: gdn_reference.gdn_chunked(q, k, v, g, beta, state),
                          lambda: gdn_prefill.gdn_chunked(q, k, v, g, beta, state))
    return gdn_reference.gdn_chunked(q, k, v, g, beta, state)


def gdn_masked_block(q, k, v, g, beta, mask, state, kernels="xla", max_depth: int | None = None):
    """max_depth (optional, static): no root path of `mask` has more nodes (DDTree: the drafter's block
    size); the Pallas kernel uses it only to bound its solve loop. The result does not depend on it."""
    _check(kernels)
    if kernels == "pallas":
        from kernels_pallas import gdn_tree
        return _pallas_or(lambda: gdn_reference.gdn_masked_block(q, k, v, g, beta, mask, state),
                          lambda: gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, max_depth=max_depth))
    return gdn_reference.gdn_masked_block(q, k, v, g, beta, mask, state)


def gdn_decode_fused(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, kernels="xla", *,
                     num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int,
                     eps: float):
    """One GDN decode step (T = 1) from the layer's fused projection row [q|k|v pre-conv | z | b | a] (or its
    unsummed split-K partials [S, B, P], `dense_partials`) to the gated-norm output: conv + SiLU, l2norm, beta/g, the recurrent step, gated RMSNorm; -> (o [B,Hv,dv],
    conv_state [B,K-1,conv_dim], state [B,Hv,dk,dv]). See `gdn_reference.gdn_decode_fused`."""
    _check(kernels)
    dims = dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                conv_kernel=conv_kernel, eps=eps)
    if kernels == "pallas":
        from kernels_pallas import gdn_decode_fused as fused
        args = (proj, conv_state, conv_w, A_log, dt_bias, norm_w, state)
        return _pallas_or(lambda: gdn_reference.gdn_decode_fused(*args, **dims),
                          lambda: fused.gdn_decode_fused(*args, **dims))
    return gdn_reference.gdn_decode_fused(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, **dims)


def gdn_commit(state, conv, k, W, g, x, path, path_len, kernels="xla"):
    """One GDN layer's commit of the accepted path from the verify stash -> (state, conv) (see
    `gdn_reference.gdn_commit`), on XLA for both paths: a one-kernel-per-layer Pallas commit lost to it on the H200
    (3.94 vs 1.43 ms per round, 2026-11-30) and was removed (git history: kernels_pallas/gdn_commit.py)."""
    _check(kernels)
    return gdn_reference.gdn_commit(state, conv, k, W, g, x, path, path_len)


def tree_select(top_lp, top_id, budget: int, kernels="xla"):
    """DDTree node selection from the per-depth top-K log-probs top_lp / tokens top_id [D, K] -> (tokens,
    parents, depths, valid) [budget] of the drafted nodes (`kernels_pallas.tree_build`, XLA on both paths)."""
    _check(kernels)
    from kernels_pallas import tree_build
    return tree_build.tree_select(top_lp, top_id, budget)


def attention_decode_prep(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, start, kernels="xla", *,
                          num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """An attention layer's decode step (T = 1) from its projection row (or its unsummed split-K partials
    [S, B, C], `dense_partials`) to the attention's inputs: q/k norm,
    RoPE, the output gate's sigmoid, the KV-cache write at row `start`; -> (q [B,H,hd], sgate [B,H,hd],
    k [B,Hkv,hd], v [B,Hkv,hd], k_cache, v_cache). See `attention_reference.decode_attention_prep`. One Pallas
    kernel with kernels="pallas", bf16 and FUSED_DECODE; the jnp reference otherwise."""
    _check(kernels)
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps)
    args = (qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, start)
    if (kernels == "pallas" and FUSED_DECODE and k_cache.dtype == jnp.bfloat16 and head_dim >= 16
            and head_dim & (head_dim - 1) == 0):
        from kernels_pallas import attention_decode
        from kernels_pallas.attention_reference import decode_attention_prep
        return _pallas_or(lambda: decode_attention_prep(*args, **dims),
                          lambda: attention_decode.decode_attention_prep(*args, **dims))
    from kernels_pallas.attention_reference import decode_attention_prep
    return decode_attention_prep(*args, **dims)


def dense_partials(x, w, kernels="xla", *, norm=None):
    """x [B, T, K] (B·T = 1) @ w [K, N] on the Pallas GEMV with its split-K partial sums left unsummed:
    [S, B·T, N] (fp32; S = 1: already rounded to x's dtype), for a consumer kernel that sums them in order
    (`gdn_decode_fused`, `attention_decode_prep`: no XLA kernel between the two); norm as in `dense` (applied
    before the kernel). None where that path does not apply (not kernels="pallas" with FUSED_DECODE, not the
    GEMV's domain): the caller then uses `dense`."""
    rows, K = math.prod(x.shape[:-1]), x.shape[-1]
    if not (kernels == "pallas" and FUSED_DECODE and FUSED_PARTIALS and _gemv(x, w, rows, w.shape[1])):
        return None
    nw, eps = norm if norm is not None else (None, 1e-6)

    def f(acts, weights):
        x_, = acts
        w_, nw_ = weights
        if nw_ is not None:
            x_ = rms_norm_1p(x_, nw_, eps)
        from kernels_pallas import dense as dense_kernel
        return dense_kernel.dense(x_.reshape(-1, K), w_, reduce=False)

    def folded(acts, weights, like):
        # the rows of all slots (no longer one row: not the GEMV's domain for the consumer's fused op): `dense`
        # on them, handed over in the partials' layout (the sum as partial 0, zeros after it: the same sum)
        x_, = acts
        w_, nw_ = weights
        y = _dense("btd,dc->btc", x_.reshape(1, -1, K), w_, kernels, norm=None if nw_ is None else (nw_, eps))
        y = rounded(y[0], x_.dtype)
        return jnp.zeros(like.shape[:1] + y.shape, like.dtype).at[0].set(y.astype(like.dtype))
    return fold_rows(f, (x,), (w, nw), out_axis=1, rule=folded)


def fold_rows(f, acts, weights, out_axis: int = 0, rule=None):
    """f(acts, weights) for one projection: acts (a tuple of activations or None: x and what has its rows, e.g.
    gate / residual) lead with the rows' axes, weights (a tuple of arrays or None) do not. Under jax.vmap
    (a batched round's slot axis, in front of every batched activation) with unbatched weights: ONE call of f on
    the slot axis folded into the activations' first axis (a Pallas kernel then re-picks its configuration for
    the B·rows; pallas_call's own batching rule would run the kernel once per slot and stream the weights B
    times); the output's axis `out_axis` holds the rows. `rule(acts, weights, like)` (optional) computes the
    folded call instead (like: the per-slot output's ShapeDtypeStruct). Batched weights: plain vmap of f."""
    fn = jax.custom_batching.custom_vmap(f)

    @fn.def_vmap
    def _rule(axis_size, in_batched, acts, weights):
        acts_b, weights_b = in_batched
        if any(jax.tree.leaves(weights_b)):
            axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
            return jax.vmap(f, in_axes=tuple(axes))(acts, weights), True
        per_slot = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
                         for a, b in zip(acts, acts_b))
        lead = next(a.shape[0] for a in per_slot if a is not None)  # the rows' first axis, per slot

        def fold(a, b):
            if a is None:
                return None
            a = a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            return a.reshape((axis_size * a.shape[1],) + a.shape[2:])
        folded = tuple(fold(a, b) for a, b in zip(acts, acts_b))
        y = rule(folded, weights, jax.eval_shape(f, per_slot, weights)) if rule is not None else f(folded, weights)
        y = y.reshape(y.shape[:out_axis] + (axis_size, lead) + y.shape[out_axis + 1:])
        return jnp.moveaxis(y, out_axis, 0), True
    return fn(acts, weights)


def _gemv(x, w, rows: int, cols: int) -> bool:
    """The Pallas GEMV's domain (kernels="pallas" decided by the caller): bf16, few rows, wide outputs."""
    return (x.dtype == jnp.bfloat16 and w.dtype == jnp.bfloat16 and 0 < rows <= PALLAS_DENSE_MAX_ROWS
            and cols >= PALLAS_DENSE_MIN_COLS)


class Pick(NamedTuple):
    """The kernel of one projection einsum(spec, x, w) (`pick`): kernel is "gemv" (the Pallas bf16
    weight-streaming GEMV, kernels_pallas/dense.py), "xla" (XLA's einsum), "w8a8" (the Pallas W8A8 block FP8
    kernel, kernels_pallas/w8a8.py) or "w8a8_ref" (its jnp reference: the same function on XLA); nc contracted
    axes, rows x rows, K contracted and N output elements of the flattened [rows, K] x [K, N] problem."""
    kernel: str
    nc: int
    rows: int
    K: int
    N: int


def _contraction(spec: str, x, w_ndim: int):
    """(nc, rows, flat): flat when the spec contracts x's trailing axes with w's leading ones in order and keeps
    the rest in order (every projection of the model)."""
    lhs, out = spec.split("->")
    xs, ws = lhs.split(",")
    contracted = [c for c in xs if c in ws and c not in out]
    nc = len(contracted)
    flat = (len(ws) == w_ndim and xs.endswith("".join(contracted)) and ws.startswith("".join(contracted))
            and out == xs[:len(xs) - nc] + ws[nc:])
    return nc, math.prod(x.shape[:x.ndim - nc]), flat


def pick(spec: str, x, w, kernels: str = "xla", fp8_blocks: tuple[int, int] | None = None) -> Pick:
    """The one place a projection's kernel is chosen, from (weight format, row count): w a plain array, or the
    fp8 values q of an FP8 weight with fp8_blocks = (block_in, block_out) of its compact scale grid.
      fp8: "w8a8" with kernels="pallas" (bf16 / fp32 activations, any row count: decode, verify, prefill) where
           a power-of-two K chunk ≥ 16 divides block_in, else "w8a8_ref" — the same W8A8 numerics either way;
      plain: "gemv" with kernels="pallas", bf16, 1..PALLAS_DENSE_MAX_ROWS rows and ≥ PALLAS_DENSE_MIN_COLS
           outputs, else "xla"."""
    _check(kernels)
    nc, rows, flat = _contraction(spec, x, w.ndim)
    K, N = math.prod(w.shape[:nc]), math.prod(w.shape[nc:])
    if fp8_blocks is not None:
        from kernels_pallas import w8a8
        assert flat, spec
        ok = (kernels == "pallas" and x.dtype in (jnp.bfloat16, jnp.float32)
              and w8a8.applies(rows, K, N, *fp8_blocks))
        return Pick("w8a8" if ok else "w8a8_ref", nc, rows, K, N)
    gemv = kernels == "pallas" and flat and _gemv(x, w, rows, N)
    return Pick("gemv" if gemv else "xla", nc, rows, K, N)


def dense(spec: str, x, w, kernels="xla", *, norm=None, gate=None, residual=None):
    """einsum(spec, x, w) with fp32 accumulation, returned UNROUNDED in fp32 (the caller rounds), for specs
    that contract x's trailing axes with w's leading axes (every projection of the model), e.g.
    "btd,dhe->bthe" or "bthe,hed->btd". With kernels="pallas", bf16 operands and few rows (`pick`), it runs the
    Pallas weight-streaming GEMV on the flattened [rows, K] x [K, N] problem (one bf16 rounding of the fp32 sum,
    as the caller's rounding would give).

    Optional parts of a decoder layer around the projection (the same ops on every path; on the GEMV path, with
    FUSED_DECODE, the gate / residual inside the kernel's prologue / epilogue instead of separate kernels):
      norm = (w_n, eps): x -> rms_norm_1p(x, w_n, eps) first (the layer's input / post / final norm; always a
        separate op before the projection);
      gate (x's shape): x -> rounded(x · gate) first (attention's output gate);
      residual (the output's shape): y -> rounded(residual + rounded(y)) (returned in fp32, already rounded).

    Under jax.vmap (the slot axis of batched rounds, speculative/batch.py) with kernels="pallas": one call on the
    rows of all slots (`fold_rows`), its kernel re-picked for them, so the weights are streamed once."""
    if kernels != "pallas":
        return _dense(spec, x, w, kernels, norm=norm, gate=gate, residual=residual)
    nw, eps = norm if norm is not None else (None, None)

    def f(acts, weights):
        x_, gate_, residual_ = acts
        w_, nw_ = weights
        return _dense(spec, x_, w_, kernels, norm=None if nw_ is None else (nw_, eps), gate=gate_,
                      residual=residual_)
    return fold_rows(f, (x, gate, residual), (w, nw))


def _dense(spec: str, x, w, kernels="xla", *, norm=None, gate=None, residual=None):
    p = pick(spec, x, w, kernels)
    nc, rows, K = p.nc, p.rows, p.K
    gemv = p.kernel == "gemv"
    out_shape = x.shape[:x.ndim - nc] + w.shape[nc:]
    if gemv and FUSED_DECODE and (norm is None or nc == 1):
        from kernels_pallas import dense as dense_kernel
        if norm is not None:
            x = rms_norm_1p(x, *norm)
        y = dense_kernel.dense(x.reshape(rows, K), w.reshape(K, -1),
                               None if gate is None else gate.reshape(rows, K),
                               None if residual is None else residual.reshape(rows, -1))
        return y.reshape(out_shape).astype(jnp.float32)
    if norm is not None:
        x = rms_norm_1p(x, *norm)
    if gate is not None:
        x = rounded(f32(x) * f32(gate), x.dtype)
    if gemv:
        from kernels_pallas import dense as dense_kernel
        y = dense_kernel.dense(x.reshape(rows, K), w.reshape(K, -1)).reshape(out_shape).astype(jnp.float32)
    else:
        prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        y = jnp.einsum(spec, x, w.astype(x.dtype), precision=prec, preferred_element_type=jnp.float32)
    if residual is not None:
        y = f32(rounded(f32(residual) + f32(rounded(y, x.dtype)), residual.dtype))
    return y


def dense_w8a8(spec: str, x, q, scale, tail, block_in: int, block_out: int, kernels: str = "xla"):
    """einsum(spec, x, W) for an FP8 weight W = q ⊙ compact block scales [| tail] with transformers' W8A8
    numerics (kernels_pallas/w8a8.py: x quantized per row and input block to e4m3, the block-scaled fp8
    product), fp32 result holding values already rounded to x's dtype (the caller's rounding keeps them).
    q fp8 in the model's layout (contracted axes first), scale fp32 [ceil(K / block_in), ceil(N / block_out)],
    tail None or the trailing plain columns [K, n_tail] of a 2-D weight (an XLA product in fp32, concatenated:
    the caller rounds it). The kernel is `pick`'s: the Pallas kernel or its jnp reference. Under jax.vmap with
    kernels="pallas": one call on the rows of all slots (`fold_rows`)."""
    if kernels != "pallas":
        return _dense_w8a8(spec, x, q, scale, tail, block_in, block_out, kernels)
    return fold_rows(lambda acts, ws: _dense_w8a8(spec, acts[0], *ws, block_in, block_out, kernels), (x,),
                     (q, scale, tail))


def _dense_w8a8(spec: str, x, q, scale, tail, block_in: int, block_out: int, kernels: str = "xla"):
    from kernels_pallas import w8a8
    p = pick(spec, x, q, kernels, (block_in, block_out))
    x2, q2 = x.reshape(p.rows, p.K), q.reshape(p.K, p.N)
    if p.kernel == "w8a8":
        y = w8a8.w8a8(x2, q2, scale, block_in=block_in, block_out=block_out)
    else:
        y = w8a8.w8a8_reference(x2, q2, scale, block_in=block_in, block_out=block_out)
    y = y.astype(jnp.float32)
    lead = x.shape[:x.ndim - p.nc]
    if tail is None:
        return y.reshape(lead + q.shape[p.nc:])
    y = jnp.concatenate([y, jnp.dot(x2, tail.astype(x.dtype), preferred_element_type=jnp.float32)], axis=-1)
    return y.reshape(lead + y.shape[-1:])
