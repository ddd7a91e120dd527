"""DFlash block-diffusion drafter (z-lab `DFlashDraftModel`) in pure JAX.

Shapes: B batch, C context rows per call (static; only the first `num_ctx` are real), Bs block size,
S = S_max cache length, H hidden, nT target layers, nh/nkv/hd heads / kv heads / head dim, g = nh // nkv,
I intermediate, V vocab.

Conventions (see tests/test_drafter.py for the torch cross-check):
  * Positions: the cache holds context K/V at absolute positions [0, length) (cache row s = position s).
    New context row i sits at `length + i`, block slot j at `length + num_ctx + j`.
  * Block queries attend NON-causally to every valid context key and all Bs block keys.
  * Sliding-window layers (window w): a query at position p sees a key at position k iff |p - k| < w,
    i.e. keys p-w+1 .. p on the left (transformers' `kv_idx > q_idx - sliding_window`), and the same
    reach on the right: this is exactly flash_attn's `window_size=(w-1, w-1)` with `causal=False`, which
    is what the published drafter runs (transformers `_process_flash_attention_kwargs`, only applied when
    key_length > w, where the rule is a no-op anyway). With Bs <= w every block key is visible.
  * Only context K/V are cached (post k_norm, post RoPE); block K/V are transient.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from kernels_pallas import ops
from jaxddtree.model import draft_vocab as draft_vocab_lib
from jaxddtree.model import fp8 as fp8_lib
from jaxddtree.model import linear
from jaxddtree.model.drafter_config import DrafterConfig, build_target_layer_ids
from jaxddtree.model.rope import apply_rope, rope_cos_sin

__all__ = ["DrafterConfig", "DrafterLayer", "DrafterParams", "DraftCache", "Drafter", "build_target_layer_ids",
           "init_draft_cache", "drafter_forward", "draft_logits", "check_compatible"]

Array = jax.Array


# ----------------------------------------------------------------------------------------------- pytrees
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrafterLayer:
    attn_norm: Array  # [H]
    w_qkv: Array  # [H, nh*hd + 2*nkv*hd] = [q_proj | k_proj | v_proj] (head-major columns)
    wo: Array  # [nh, hd, H]
    q_norm: Array  # [hd]
    k_norm: Array  # [hd]
    mlp_norm: Array  # [H]
    w_gate_up: Array  # [H, 2, I]: gate = [:, 0], up = [:, 1]
    w_down: Array  # [I, H]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DrafterParams:
    fc: Array  # [nT*H, H]
    hidden_norm: Array  # [H]
    layers: tuple[DrafterLayer, ...]
    norm: Array  # [H]
    # a draft vocabulary (`Drafter.with_draft_vocab`): the logits over its ids only, the rest -inf; None: all ids
    vocab: draft_vocab_lib.DraftVocab | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftCache:
    k: tuple[Array, ...]  # per layer [B, nkv, S, hd], post k_norm + RoPE
    v: tuple[Array, ...]  # per layer [B, nkv, S, hd]
    length: Array  # int32 scalar: rows [0, length) are valid context

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def abstract_params(cfg: DrafterConfig, dtype) -> DrafterParams:
    """DrafterParams of cfg's shapes as ShapeDtypeStructs (every array in `dtype`, as the loaders give them): for
    compiling a drafter's programs before its weights load."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_heads, cfg.num_kv_heads
    a = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    layer = DrafterLayer(attn_norm=a(H), w_qkv=a(H, (nh + 2 * nkv) * hd), wo=a(nh, hd, H), q_norm=a(hd),
                         k_norm=a(hd), mlp_norm=a(H), w_gate_up=a(H, 2, I), w_down=a(I, H))
    return DrafterParams(fc=a(cfg.num_target_features * H, H), hidden_norm=a(H),
                         layers=tuple(layer for _ in range(cfg.num_layers)), norm=a(H))


def init_draft_cache(cfg: DrafterConfig, batch_size: int, max_len: int, dtype: Any = jnp.bfloat16) -> DraftCache:
    """Empty cache. `max_len` must be >= final context length + the static C of any call (slack for padding)."""
    shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
    return DraftCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                      v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                      length=jnp.zeros((), jnp.int32))


# ----------------------------------------------------------------------------------------------- math
def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """Qwen3RMSNorm: normalise in fp32, cast back to x.dtype, then multiply by the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w * y.astype(x.dtype)


def _window_ok(q_pos: Array, k_pos: Array, window: int | None) -> Array:
    """[Tq, Tk] visibility from the sliding window (|q - k| < w), all True for full attention."""
    if window is None:
        return jnp.ones((q_pos.shape[0], k_pos.shape[0]), bool)
    return jnp.abs(q_pos[:, None] - k_pos[None, :]) < window


def _block_attention(q: Array, k_cache: Array, v_cache: Array, k_b: Array, v_b: Array, end: Array,
                     blk_pos: Array, window: int | None) -> Array:
    """q [B, Bs, nh, hd] over the visible cache rows (< end, within the window) ++ the block keys, one softmax
    -> [B, Bs, nkv, g, hd]. A window layer scores only the `window` rows before `end` (a static-size slice)."""
    B, Bs, nh, hd = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    g = nh // nkv
    lo = jnp.int32(0)
    if window is not None and window < S:  # rows below end - window are never visible to the block
        lo = jnp.clip(end - window, 0, S - window)
        k_cache = jax.lax.dynamic_slice_in_dim(k_cache, lo, window, axis=2)
        v_cache = jax.lax.dynamic_slice_in_dim(v_cache, lo, window, axis=2)
    Sv = k_cache.shape[2]
    qg = q.reshape(B, Bs, nkv, g, hd)  # [B, Bs, nkv, g, hd]
    scale = hd ** -0.5
    s_c = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s_b = jnp.einsum("btkgd,bskd->bkgts", qg, k_b, preferred_element_type=jnp.float32) * scale  # [B,nkv,g,Bs,Bs]
    cache_pos = lo + jnp.arange(Sv, dtype=jnp.int32)
    ok_c = (cache_pos < end)[None, :] & _window_ok(blk_pos, cache_pos, window)  # [Bs, Sv]
    ok_b = _window_ok(blk_pos, blk_pos, window)  # [Bs, Bs]
    neg = jnp.float32(-jnp.inf)
    scores = jnp.concatenate([jnp.where(ok_c, s_c, neg), jnp.where(ok_b, s_b, neg)], axis=-1)  # [B,nkv,g,Bs,Sv+Bs]
    p = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return (jnp.einsum("bkgts,bksd->btkgd", p[..., :Sv], v_cache.astype(q.dtype))
            + jnp.einsum("bkgts,bskd->btkgd", p[..., Sv:], v_b))  # [B, Bs, nkv, g, hd]


def _proj(spec: str, x: Array, w, kernels: str) -> Array:
    """einsum(spec, x, w); an FP8 weight (`Drafter.to_fp8`) runs the target's W8A8 block product (`linear.dense`)."""
    if isinstance(w, fp8_lib.Fp8Weight):
        return linear.dense(spec, x, w, kernels)
    return jnp.einsum(spec, x, w)


def _layer(lp: DrafterLayer, cfg: DrafterConfig, window: int | None, h: Array, ctx: Array,
           k_cache: Array, v_cache: Array, length: Array, num_ctx: Array,
           all_rope: tuple[Array, Array], blk_rope: tuple[Array, Array], blk_pos: Array, kernels: str = "xla"):
    """One decoder layer. h [B, Bs, H], ctx [B, C, H]; returns (h, k_cache, v_cache) with ctx K/V written.

    Only the cache rows a block query can see are read: a sliding-window layer reads the last `window` rows
    before the block (a static-size slice at a run-time offset), a full-attention layer the committed rows
    [0, length + num_ctx) through the tree-attention kernel when kernels="pallas" (the XLA form scores the whole
    cache capacity, whose cost then follows the capacity instead of the context)."""
    B, Bs, _ = h.shape
    nkv, g, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    eps = cfg.rms_norm_eps

    nh = cfg.num_heads
    C = ctx.shape[1]
    x = rms_norm(h, lp.attn_norm, eps)  # [B, Bs, H]
    # One GEMM for the q/k/v of the C context rows and the Bs block rows (the context rows' q is unused: the
    # extra columns cost nothing next to reading the weight once instead of twice).
    qkv = _proj("bth,hn->btn", jnp.concatenate([ctx, x], axis=1), lp.w_qkv, kernels)  # [B, C+Bs, (nh+2nkv)*hd]
    q = qkv[:, C:, :nh * hd].reshape(B, Bs, nh, hd)  # [B, Bs, nh, hd]
    k = qkv[:, :, nh * hd:(nh + nkv) * hd].reshape(B, C + Bs, nkv, hd)  # [B, C+Bs, nkv, hd]
    v = qkv[:, :, (nh + nkv) * hd:].reshape(B, C + Bs, nkv, hd)  # [B, C+Bs, nkv, hd]
    q = apply_rope(rms_norm(q, lp.q_norm, eps), *blk_rope)
    k = apply_rope(rms_norm(k, lp.k_norm, eps), *all_rope)  # context rows then block rows
    k_c, k_b = k[:, :C], k[:, C:]  # [B, C, nkv, hd], [B, Bs, nkv, hd]
    v_c, v_b = v[:, :C], v[:, C:]

    # Append all C rows at [length, length + C); rows >= length + num_ctx are padding: masked below and
    # overwritten by the next call.
    at = (0, 0, length, 0)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k_c.transpose(0, 2, 1, 3).astype(k_cache.dtype), at)
    v_cache = jax.lax.dynamic_update_slice(v_cache, v_c.transpose(0, 2, 1, 3).astype(v_cache.dtype), at)

    end = length + num_ctx  # committed rows after this call's context
    if window is None and ops.is_pallas(kernels):  # rows [0, end) ++ the block (all of it visible), one kernel
        o = ops.tree_attention(q, k_cache, v_cache, end, k_b, v_b, jnp.ones((B, Bs, Bs), bool), kernels)
    else:
        o = _block_attention(q, k_cache, v_cache, k_b, v_b, end, blk_pos, window)
    o = o.reshape(B, Bs, nkv * g, hd)  # [B, Bs, nh, hd]
    h = h + _proj("btnd,ndh->bth", o, lp.wo, kernels)

    y = rms_norm(h, lp.mlp_norm, eps)
    gate_up = _proj("bth,hgi->btgi", y, lp.w_gate_up, kernels)  # [B, Bs, 2, I]
    h = h + _proj("bti,ih->bth", jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], lp.w_down, kernels)
    return h, k_cache, v_cache


def drafter_forward(params: DrafterParams, cfg: DrafterConfig, cache: DraftCache, target_hidden: Array,
                    num_ctx: Array | int, block_embeds: Array, kernels: str = "xla") -> tuple[Array, DraftCache]:
    """One drafter call.

    target_hidden [B, C, nT*H]: new context features (first `num_ctx` rows real, rest padding);
    block_embeds [B, Bs, H]: target-embedded block tokens. Returns (hidden [B, Bs, H] after the final norm,
    new cache with the num_ctx real context rows appended). Requires cache.length + C <= S_max.
    """
    dtype = params.norm.dtype
    C = target_hidden.shape[1]
    Bs = block_embeds.shape[1]
    length = cache.length.astype(jnp.int32)
    num_ctx = jnp.asarray(num_ctx, jnp.int32)
    if C > cache.max_len:
        raise ValueError(f"target_hidden has C={C} rows but the draft cache holds only S_max={cache.max_len}")

    ctx = _proj("bcf,fh->bch", target_hidden.astype(dtype), params.fc, kernels)  # [B, C, H]
    ctx = rms_norm(ctx, params.hidden_norm, cfg.rms_norm_eps)
    ctx_pos = length + jnp.arange(C, dtype=jnp.int32)  # [C]
    blk_pos = length + num_ctx + jnp.arange(Bs, dtype=jnp.int32)  # [Bs]
    all_rope = rope_cos_sin(jnp.concatenate([ctx_pos, blk_pos]), cfg.head_dim, cfg.rope_theta, dtype)  # [C+Bs]
    blk_rope = tuple(r[C:] for r in all_rope)

    h = block_embeds.astype(dtype)  # [B, Bs, H]
    ks, vs = [], []
    for i, lp in enumerate(params.layers):
        h, k_i, v_i = _layer(lp, cfg, cfg.layer_windows[i], h, ctx, cache.k[i], cache.v[i], length, num_ctx,
                             all_rope, blk_rope, blk_pos, kernels)
        ks.append(k_i)
        vs.append(v_i)
    h = rms_norm(h, params.norm, cfg.rms_norm_eps)
    return h, DraftCache(k=tuple(ks), v=tuple(vs), length=length + num_ctx)


def draft_logits(params: DrafterParams, cfg: DrafterConfig, cache: DraftCache, target_hidden: Array,
                 num_ctx: Array | int, root_token: Array, embed_table: Array, lm_head: Array, kernels: str = "xla",
                 subset: bool = False) -> tuple[Array, DraftCache]:
    """Block [root, MASK x (Bs-1)] -> fp32 logits [B, Bs-1, V] for block slots 1..Bs-1 (slot j predicts the
    token at position length+num_ctx+j). root_token [B] int; embed_table [V, H]; lm_head [H, V] (not read when
    params.vocab holds a draft vocabulary: its own head scores its ids, every other id gets -inf; with subset=True
    the logits are the subset's columns only, [B, Bs-1, Vp]: `draft_vocab.ids_of` maps a column to its id)."""
    B, Bs = root_token.shape[0], cfg.block_size
    ids = jnp.concatenate([root_token.astype(jnp.int32)[:, None],
                           jnp.full((B, Bs - 1), cfg.mask_token_id, jnp.int32)], axis=1)  # [B, Bs]
    h, cache = drafter_forward(params, cfg, cache, target_hidden, num_ctx, jnp.take(embed_table, ids, axis=0),
                               kernels)
    if params.vocab is not None:
        fn = draft_vocab_lib.subset_logits if subset else draft_vocab_lib.logits
        return fn(params.vocab, h[:, 1:]), cache
    logits = jnp.einsum("bth,hv->btv", h[:, 1:], lm_head.astype(h.dtype), preferred_element_type=jnp.float32)
    return logits, cache


# ----------------------------------------------------------------------------------------------- Drafter
_forward_jit = jax.jit(drafter_forward, static_argnums=(1,), static_argnames=("kernels",), donate_argnums=(2,))
_logits_jit = jax.jit(draft_logits, static_argnums=(1,), static_argnames=("kernels",), donate_argnums=(2,))


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(2,))
def _forward_many_jit(params, cfg, caches, target_hidden, num_ctx, block_embeds):
    def one(cache, hidden, n):  # [k] leading axis on every argument but the weights and the block input
        return drafter_forward(params, cfg, cache, hidden, n, block_embeds)
    return jax.vmap(one)(caches, target_hidden, num_ctx)


@dataclasses.dataclass
class Drafter:
    config: DrafterConfig
    params: DrafterParams
    path: str = ""

    @property
    def dtype(self):
        return self.params.norm.dtype

    def init_cache(self, batch_size: int, max_len: int) -> DraftCache:
        return init_draft_cache(self.config, batch_size, max_len, self.dtype)

    def forward(self, cache, target_hidden, num_ctx, block_embeds):
        """Jitted `drafter_forward`; `cache` is donated (do not reuse it)."""
        return _forward_jit(self.params, self.config, cache, target_hidden, num_ctx, block_embeds)

    @staticmethod
    def forward_fn():
        """The jitted function `forward` calls: fn(params, config, cache, target_hidden, num_ctx, block_embeds)
        (config static; e.g. to compile it ahead)."""
        return _forward_jit

    def forward_many(self, caches, target_hidden, num_ctx, block_embeds):
        """`forward` of k requests in one pass (caches stacked on a leading k axis, target_hidden [k, ...],
        num_ctx [k]; block_embeds shared); `caches` is donated."""
        return _forward_many_jit(self.params, self.config, caches, target_hidden, jnp.asarray(num_ctx, jnp.int32),
                                 block_embeds)

    @staticmethod
    def forward_many_fn():
        """The jitted function `forward_many` calls: fn(params, config, caches, target_hidden, num_ctx [k],
        block_embeds)."""
        return _forward_many_jit

    @property
    def draft_vocab(self) -> draft_vocab_lib.DraftVocab | None:
        """The draft vocabulary (`with_draft_vocab`), or None: the drafter scores every id."""
        return self.params.vocab

    def with_draft_vocab(self, ids, target: Any) -> "Drafter":
        """This drafter drafting only the token ids `ids` (unique, in [0, V); None: all ids again): the target's
        lm_head columns of those ids are gathered here, once, into the drafter's own small head; every other id
        gets probability 0 in the draft. Acceptance may change, the output never does (the target verifies as
        before). The layers' arrays are shared with this drafter; the head is placed like them (replicated on a
        sharded target's mesh)."""
        vocab = None
        if ids is not None:
            vocab = jax.device_put(draft_vocab_lib.make(ids, target.lm_head, self.dtype), self.params.norm.sharding)
        return dataclasses.replace(self, params=dataclasses.replace(self.params, vocab=vocab))

    def to_fp8(self, block: int = 128) -> "Drafter":
        """This drafter with its projections (fc; each layer's w_qkv, wo, w_gate_up, w_down) in FP8, as the target's
        FP8 checkpoint stores its own (`fp8.quantize`: block × block scales) and computed as the target computes
        them (W8A8: `linear.dense`); the norms, the draft vocabulary's head and the caches keep their dtype. At
        Qwen3.6-27B it halves ≈ 3.5 GB of what a drafter call streams. Acceptance may change, the output never does
        (the target verifies as before)."""
        q = functools.partial(fp8_lib.quantize, block=block)
        p = self.params
        layers = tuple(dataclasses.replace(lp, w_qkv=q(lp.w_qkv, 1), wo=q(lp.wo, 2), w_gate_up=q(lp.w_gate_up, 1),
                                           w_down=q(lp.w_down, 1)) for lp in p.layers)
        params = jax.device_put(dataclasses.replace(p, fc=q(p.fc, 1), layers=layers), p.norm.sharding)
        return dataclasses.replace(self, params=params)

    @property
    def fp8(self) -> bool:
        """Its projections are FP8 (`to_fp8`)."""
        return isinstance(self.params.fc, fp8_lib.Fp8Weight)

    def logits(self, cache, target_hidden, num_ctx, root_token, embed_table, lm_head):
        """Jitted `draft_logits`; `cache` is donated (do not reuse it)."""
        return _logits_jit(self.params, self.config, cache, target_hidden, num_ctx, root_token, embed_table,
                           lm_head)


def check_compatible(cfg: DrafterConfig, target: Any, source: str = "drafter", draft_vocab=None) -> None:
    """ValueError naming the mismatch if the drafter cannot run on `target` (uses only target.config.*);
    draft_vocab: the drafter's (`Drafter.draft_vocab`), made for a vocabulary of the target's size."""
    tc = target.config
    H, L, V = int(tc.hidden_size), int(tc.num_hidden_layers), int(tc.vocab_size)
    if cfg.hidden_size != H:
        raise ValueError(f"{source}: hidden_size={cfg.hidden_size} != target hidden_size={H}")
    bad = [i for i in cfg.target_layer_ids if i >= L]
    if bad:
        raise ValueError(f"{source}: target_layer_ids {list(cfg.target_layer_ids)} include {bad}, but the target "
                         f"has only {L} layers")
    if cfg.num_target_layers is not None and cfg.num_target_layers != L:
        raise ValueError(f"{source}: num_target_layers={cfg.num_target_layers} != target num_hidden_layers={L}")
    if cfg.vocab_size is not None and cfg.vocab_size != V:
        raise ValueError(f"{source}: vocab_size={cfg.vocab_size} != target vocab_size={V}")
    if cfg.mask_token_id >= V:
        raise ValueError(f"{source}: mask_token_id={cfg.mask_token_id} >= target vocab_size={V}")
    if draft_vocab is not None and draft_vocab.column.shape[0] != V:
        raise ValueError(f"{source}: its draft vocabulary was made for a vocabulary of {draft_vocab.column.shape[0]} "
                         f"ids, the target has {V}")
