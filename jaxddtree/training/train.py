"""Training with optax: a small Qwen3.6-style hybrid target and a DFlash drafter for it.

- Target: next-token cross-entropy through the model's own sequence pass (`Qwen35.__call__` with a fresh
  per-batch cache and `layout.sequence(0, T, K, batch=B)`; the GDN chunked WY form is differentiable).
- Drafter (DFlash recipe): for random anchor positions a of a sequence, the block is [x_a, MASK x (Bs-1)] at
  positions a .. a+Bs-1, the context is the frozen target's features (outputs of decoder layers
  `target_layer_ids`) of positions [0, a), and block slot j predicts x_{a+j}. The loss is the cross-entropy
  on the Bs-1 masked slots weighted by exp(-(j-1)/gamma). `drafter_train_logits` computes exactly what
  `drafter.draft_logits` computes at inference when its cache holds the features of [0, a) and the root is x_a
  (tests/test_train.py checks this), for K anchors per row at once.
- Both share `Trainer`: AdamW with linear warm-up + cosine decay, global-norm clipping, orbax checkpoints
  (params + optimizer state + step + data RNG state, so a crashed run resumes where it stopped), and a tqdm
  progress bar with the loss and tokens/s.
- Export: the target as an HF directory (config.json `qwen3_5_text` + model.safetensors with HF names,
  read back by `jaxddtree.load_target`), the drafter in the z-lab layout (read by `jaxddtree.load_drafter`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxddtree.model import layout as layout_lib
from jaxddtree.model.cache import init_cache
from jaxddtree.model.config import ATTENTION, GDN, TextConfig, text_config_from_dict
from jaxddtree.model.drafter import DrafterLayer, DrafterParams, rms_norm
from jaxddtree.model.rope import apply_rope, rope_cos_sin
from jaxddtree.model.drafter_config import DrafterConfig
from jaxddtree.model.qwen35 import Qwen35, per_layer_pure
from jaxddtree.model.target import Target

# ------------------------------------------------------------------------------------------- configs


def target_config_dict(vocab_size: int, hidden: int = 128, layers: int = 4, intermediate: int = 384,
                       heads: int = 4, kv_heads: int = 2, head_dim: int = 32, lin_k_heads: int = 2,
                       lin_v_heads: int = 4, lin_head_dim: int = 32, eos_token_id: int = 0,
                       max_positions: int = 4096) -> dict:
    """HF `qwen3_5_text` config of a small hybrid model: [linear x3, full] repeated."""
    types = [ATTENTION if (i + 1) % 4 == 0 else GDN for i in range(layers)]
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "layer_types": types, "full_attention_interval": 4, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "attn_output_gate": True,
        "attention_bias": False, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": lin_k_heads, "linear_num_value_heads": lin_v_heads,
        "linear_key_head_dim": lin_head_dim, "linear_value_head_dim": lin_head_dim,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": max_positions,
        "eos_token_id": eos_token_id, "bos_token_id": eos_token_id, "pad_token_id": eos_token_id,
        "tie_word_embeddings": False, "dtype": "float32",
    }


def drafter_config_dict(target_cfg: TextConfig, target_layer_ids, mask_token_id: int, layers: int = 2,
                        heads: int = 4, kv_heads: int = 2, head_dim: int = 32, intermediate: int = 384,
                        block_size: int = 16) -> dict:
    """z-lab DFlash drafter config (Qwen3 fields + block_size + dflash_config) for `target_cfg`."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": target_cfg.hidden_size,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": intermediate, "hidden_act": "silu", "attention_bias": False,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "max_position_embeddings": target_cfg.max_position_embeddings, "use_sliding_window": False,
        "layer_types": ["full_attention"] * layers, "block_size": block_size,
        "num_target_layers": target_cfg.num_hidden_layers, "vocab_size": target_cfg.vocab_size,
        "tie_word_embeddings": False, "dtype": "float32",
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id},
    }


# ------------------------------------------------------------------------------------------- target


def init_target(cfg: TextConfig, seed: int = 0, dtype=jnp.float32):
    """(graphdef, treedef, params dict) of a freshly initialised target: params {'000': leaf, ...}."""
    model = Qwen35(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return graphdef, treedef, leaves_to_dict(leaves)


def leaves_to_dict(leaves) -> dict:
    return {f"{i:04d}": x for i, x in enumerate(leaves)}


def dict_to_leaves(d: dict) -> list:
    return [d[k] for k in sorted(d)]


def target_of(cfg: TextConfig, graphdef, treedef, params: dict, source: str = "trained") -> Target:
    leaves = dict_to_leaves(params)
    return Target(config=cfg, graphdef=graphdef, treedef=treedef, leaves=leaves,
                  dtype=jnp.dtype(leaves[0].dtype).type, source=source)


def _model(graphdef, treedef, params: dict) -> Qwen35:
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, dict_to_leaves(params)))


def target_sequence_pass(model: Qwen35, tokens, feature_layers=(), logits="all"):
    """tokens [B, T] from position 0 with a fresh cache -> (logits [B, T, V] | None, features | None)."""
    cfg = model.cfg
    B, T = tokens.shape
    cache = init_cache(cfg, T, model.embed[...].dtype, batch=B)
    lay = layout_lib.sequence(0, T, cfg.linear_conv_kernel_dim, batch=B)
    out, _, feats, _ = model(tokens, cache, lay, feature_layers=tuple(feature_layers), logits=logits)
    return out, feats


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "feature_layers"))
def target_features(leaves, tokens, *, graphdef, treedef, feature_layers):
    """Features [B, T, nF*D] of the frozen target over tokens [B, T] (outputs of `feature_layers`)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    return target_sequence_pass(model, tokens, feature_layers, logits="none")[1]


def target_loss(params: dict, batch, *, graphdef, treedef):
    """batch: tokens [B, T+1] -> mean next-token cross-entropy."""
    model = _model(graphdef, treedef, params)
    logits, _ = target_sequence_pass(model, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@functools.partial(jax.jit, static_argnames=("graphdef", "treedef", "n_new"))
def greedy_continue(leaves, prompts, *, graphdef, treedef, n_new: int):
    """Batched greedy continuation: prompts [B, P] -> [B, P + n_new] (prompt + the target's argmax tokens)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    cfg = model.cfg
    B, P = prompts.shape
    K = cfg.linear_conv_kernel_dim
    cache = init_cache(cfg, P + n_new, model.embed[...].dtype, batch=B)
    logits, cache, _, _ = model(prompts, cache, layout_lib.sequence(0, P, K, batch=B), logits="last")
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

    def step(carry, _):
        cache, tok = carry
        lg, cache, _, _ = model(tok[:, None], cache, layout_lib.sequence(cache.length, 1, K, batch=B),
                                logits="all")
        return (cache, jnp.argmax(lg[:, 0], axis=-1).astype(jnp.int32)), tok

    _, toks = jax.lax.scan(step, (cache, first), None, length=n_new)
    return jnp.concatenate([prompts.astype(jnp.int32), toks.T], axis=1)


# ------------------------------------------------------------------------------------------- drafter


def init_drafter(cfg: DrafterConfig, seed: int = 0, dtype=jnp.float32) -> DrafterParams:
    """Random drafter weights (normal / sqrt(fan_in); output projections scaled down; norms = 1)."""
    H, nh, nkv, hd, I = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    F = cfg.num_target_features * H
    keys = iter(jax.random.split(jax.random.key(seed), 2 + 4 * cfg.num_layers))
    nrm = lambda shape, fan_in, s=1.0: (s / fan_in ** 0.5 * jax.random.normal(next(keys), shape)).astype(dtype)
    out_s = 1.0 / (2 * cfg.num_layers) ** 0.5
    layers = tuple(DrafterLayer(
        attn_norm=jnp.ones((H,), dtype), w_qkv=nrm((H, (nh + 2 * nkv) * hd), H),
        wo=nrm((nh, hd, H), nh * hd, out_s), q_norm=jnp.ones((hd,), dtype), k_norm=jnp.ones((hd,), dtype),
        mlp_norm=jnp.ones((H,), dtype), w_gate_up=nrm((H, 2, I), H), w_down=nrm((I, H), I, out_s))
        for _ in range(cfg.num_layers))
    return DrafterParams(fc=nrm((F, H), F), hidden_norm=jnp.ones((H,), dtype), layers=layers,
                         norm=jnp.ones((H,), dtype))


def drafter_train_logits(params: DrafterParams, cfg: DrafterConfig, feats, tokens, anchors, embed, lm_head):
    """Drafter logits for K blocks per row, as at inference.

    feats [B, T, nT*H] target features (position p = outputs of the feature layers at token p);
    tokens [B, T]; anchors [B, K] int (root positions, 0 <= a < T); embed [V, H]; lm_head [H, V].
    Block k of row b: tokens [x_a, MASK...] at positions a..a+Bs-1, attending (non-causally) to its own Bs
    slots and to the context rows at positions [0, a). Returns fp32 logits [B, K, Bs-1, V] for slots 1..Bs-1
    (slot j predicts x_{a+j}).
    """
    dtype = params.norm.dtype
    B, T, _ = feats.shape
    K, Bs = anchors.shape[1], cfg.block_size
    nh, nkv, g, hd = cfg.num_heads, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    nq = nh * hd
    eps = cfg.rms_norm_eps
    ctx = rms_norm(jnp.einsum("btf,fh->bth", feats.astype(dtype), params.fc), params.hidden_norm, eps)  # [B,T,H]
    ctx_pos = jnp.arange(T, dtype=jnp.int32)
    blk_pos = anchors[..., None].astype(jnp.int32) + jnp.arange(Bs, dtype=jnp.int32)  # [B,K,Bs]
    root = jnp.take_along_axis(tokens, anchors, axis=1)  # [B,K]
    ids = jnp.concatenate([root[..., None].astype(jnp.int32),
                           jnp.full((B, K, Bs - 1), cfg.mask_token_id, jnp.int32)], axis=-1)
    h = jnp.take(embed, ids, axis=0).astype(dtype)  # [B,K,Bs,H]
    cos_c, sin_c = rope_cos_sin(ctx_pos, hd, cfg.rope_theta, dtype)  # [T,hd]
    cos_b, sin_b = rope_cos_sin(blk_pos, hd, cfg.rope_theta, dtype)  # [B,K,Bs,hd]
    vis_c = ctx_pos[None, None, None, :] < anchors[:, :, None, None]  # [B,K,1,T]
    vis_b = jnp.ones((1, 1, Bs, Bs), bool)
    scale = hd ** -0.5
    for i, lp in enumerate(params.layers):
        w = cfg.layer_windows[i]
        vc, vb = vis_c, vis_b
        if w is not None:
            vc = vc & (jnp.abs(blk_pos[..., :, None] - ctx_pos) < w)
            vb = vb & (jnp.abs(blk_pos[..., :, None] - blk_pos[..., None, :]) < w)
        x = rms_norm(h, lp.attn_norm, eps)
        qkv_b = jnp.einsum("bkth,hn->bktn", x, lp.w_qkv).reshape(B, K, Bs, -1, hd)  # [B,K,Bs,nh+2nkv,hd]
        kv_c = jnp.einsum("bch,hn->bcn", ctx, lp.w_qkv[:, nq:]).reshape(B, T, 2 * nkv, hd)  # [B,T,2nkv,hd]
        q = apply_rope(rms_norm(qkv_b[..., :nh, :], lp.q_norm, eps), cos_b, sin_b)  # [B,K,Bs,nh,hd]
        k_c = apply_rope(rms_norm(kv_c[:, :, :nkv], lp.k_norm, eps), cos_c, sin_c)  # [B,T,nkv,hd]
        v_c = kv_c[:, :, nkv:]
        k_b = apply_rope(rms_norm(qkv_b[..., nh:nh + nkv, :], lp.k_norm, eps), cos_b, sin_b)  # [B,K,Bs,nkv,hd]
        v_b = qkv_b[..., nh + nkv:, :]
        qg = q.reshape(B, K, Bs, nkv, g, hd)
        s_c = jnp.einsum("bktngd,bsnd->bkngts", qg, k_c, preferred_element_type=jnp.float32) * scale
        s_b = jnp.einsum("bktngd,bksnd->bkngts", qg, k_b, preferred_element_type=jnp.float32) * scale
        neg = jnp.float32(-jnp.inf)
        s = jnp.concatenate([jnp.where(vc[:, :, None, None], s_c, neg),
                             jnp.where(vb[:, :, None, None], s_b, neg)], axis=-1)  # [B,K,nkv,g,Bs,T+Bs]
        p = jax.nn.softmax(s, axis=-1).astype(dtype)
        o = (jnp.einsum("bkngts,bsnd->bktngd", p[..., :T], v_c)
             + jnp.einsum("bkngts,bksnd->bktngd", p[..., T:], v_b)).reshape(B, K, Bs, nkv * g, hd)
        h = h + jnp.einsum("bktnd,ndh->bkth", o, lp.wo)
        y = rms_norm(h, lp.mlp_norm, eps)
        gu = jnp.einsum("bkth,hgi->bktgi", y, lp.w_gate_up)  # [B,K,Bs,2,I]
        h = h + jnp.einsum("bkti,ih->bkth", jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :], lp.w_down)
    h = rms_norm(h, params.norm, eps)
    return jnp.einsum("bkth,hv->bktv", h[:, :, 1:], lm_head.astype(dtype), preferred_element_type=jnp.float32)


def drafter_loss_terms(params, cfg: DrafterConfig, feats, tokens, anchors, embed, lm_head, gamma: float):
    """(weighted CE sum, weight sum, accuracy sum per slot [Bs-1], valid count per slot [Bs-1])."""
    T = tokens.shape[1]
    Bs = cfg.block_size
    logits = drafter_train_logits(params, cfg, feats, tokens, anchors, embed, lm_head)  # [B,K,Bs-1,V]
    pos = anchors[..., None] + jnp.arange(1, Bs)  # [B,K,Bs-1]
    valid = pos < T
    labels = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(pos, T - 1), axis=2)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    w = jnp.exp(-(jnp.arange(1, Bs, dtype=jnp.float32) - 1.0) / gamma) * valid
    hit = (jnp.argmax(logits, axis=-1) == labels) & valid
    return (ce * w).sum(), w.sum(), hit.sum((0, 1)), valid.sum((0, 1))


def drafter_loss(params, batch, *, cfg: DrafterConfig, graphdef, treedef, gamma: float):
    """batch = (tokens [B, T], anchors [B, K], target leaves). Features come from the frozen target."""
    tokens, anchors, tleaves = batch
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, tleaves))
    _, feats = target_sequence_pass(model, tokens, cfg.target_layer_ids, logits="none")
    feats = jax.lax.stop_gradient(feats)
    embed, lm_head = jax.lax.stop_gradient(model.embed[...]), jax.lax.stop_gradient(model.lm_head[...])
    num, den, _, _ = drafter_loss_terms(params, cfg, feats, tokens, anchors, embed, lm_head, gamma)
    return num / jnp.maximum(den, 1e-6)


def sample_anchors(rng: np.random.Generator, batch: int, k: int, lo: int, hi: int) -> np.ndarray:
    """[batch, k] anchor positions uniform in [lo, hi] (without replacement when possible)."""
    n = hi - lo + 1
    if n >= k:
        return np.stack([lo + rng.choice(n, size=k, replace=False) for _ in range(batch)]).astype(np.int32)
    return rng.integers(lo, hi + 1, size=(batch, k)).astype(np.int32)


# ------------------------------------------------------------------------------------------- trainer


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.01, clip: float = 1.0):
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1), lr * 0.05)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask)), sched


class Trainer:
    """AdamW + warm-up/cosine, orbax checkpoints (resume), tqdm progress with loss and tokens/s.

    `loss_fn(params, batch) -> scalar` (static parts bound with functools.partial); `params` any pytree of
    arrays. Checkpoints hold {"params", "opt_state", "step", "rng"} where "rng" is the data sampler's
    numpy bit-generator state (as JSON) so that a resumed run continues the same data stream.
    """

    def __init__(self, loss_fn: Callable, params, *, lr: float, steps: int, warmup: int, ckpt_dir: str | None,
                 weight_decay: float = 0.01, save_every: int = 200, keep: int = 2):
        self.steps = steps
        self.tx, self.schedule = make_optimizer(lr, steps, warmup, weight_decay)
        self.params = params
        self.opt_state = self.tx.init(params)
        self.step = 0
        self.save_every = save_every
        self.manager = None
        if ckpt_dir:
            import orbax.checkpoint as ocp
            self._ocp = ocp
            self.manager = ocp.CheckpointManager(
                os.path.abspath(ckpt_dir),
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
                item_names=("state", "meta"))

        tx = self.tx

        @jax.jit
        def train_step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

        self._train_step = train_step

    # -- checkpoints
    def restore(self) -> dict | None:
        """Restore the latest checkpoint if any; returns its metadata (e.g. the sampler state) or None."""
        if self.manager is None or self.manager.latest_step() is None:
            return None
        ocp = self._ocp
        step = self.manager.latest_step()
        abstract = {"params": self.params, "opt_state": self.opt_state}
        r = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)),
            meta=ocp.args.JsonRestore()))
        self.params, self.opt_state = r["state"]["params"], r["state"]["opt_state"]
        self.step = int(r["meta"]["step"])
        return r["meta"]

    def save(self, meta: dict | None = None, force: bool = False) -> None:
        if self.manager is None:
            return
        ocp = self._ocp
        meta = dict(meta or {}, step=self.step)
        self.manager.save(self.step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": self.params, "opt_state": self.opt_state}),
            meta=ocp.args.JsonSave(meta)), force=force)
        self.manager.wait_until_finished()

    # -- loop
    def run(self, next_batch: Callable[[], Any], tokens_per_step: int, *, meta_fn: Callable[[], dict] | None = None,
            desc: str = "train", log: Callable[[int, float], None] | None = None, progress: bool = True):
        """Train from self.step to self.steps. `next_batch()` -> batch; returns the list of (step, loss)."""
        from tqdm.auto import tqdm

        bar = tqdm(total=self.steps, initial=self.step, desc=desc, disable=not progress, dynamic_ncols=True)
        hist, ema, t_last, n_tok = [], None, time.perf_counter(), 0
        while self.step < self.steps:
            batch = next_batch()
            self.params, self.opt_state, loss, gnorm = self._train_step(self.params, self.opt_state, batch)
            self.step += 1
            n_tok += tokens_per_step
            if self.step % 10 == 0 or self.step == self.steps:
                loss = float(loss)
                ema = loss if ema is None else 0.9 * ema + 0.1 * loss
                now = time.perf_counter()
                bar.set_postfix(loss=f"{loss:.3f}", ema=f"{ema:.3f}", gnorm=f"{float(gnorm):.2f}",
                                lr=f"{float(self.schedule(self.step)):.1e}", tok_s=f"{n_tok / (now - t_last):.0f}")
                t_last, n_tok = now, 0
                hist.append((self.step, loss))
                if log:
                    log(self.step, loss)
            bar.update(1)
            if self.manager is not None and (self.step % self.save_every == 0 or self.step == self.steps):
                self.save(meta_fn() if meta_fn else None)
        bar.close()
        return hist


# ------------------------------------------------------------------------------------------- export


def _to_np(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(jax.device_get(x), dtype=np.float32))


def target_hf_tensors(cfg: TextConfig, graphdef, treedef, params: dict) -> dict[str, np.ndarray]:
    """Our parameters -> HF `Qwen3_5ForCausalLM` (text-only) tensors (inverse of `hf_target._rules`: the
    fused projections are split back into their HF tensors, so saved checkpoints keep the HF layout)."""
    pure = per_layer_pure(cfg, nnx.to_pure_dict(jax.tree.unflatten(treedef, dict_to_leaves(params))))
    D = cfg.hidden_size

    def split_rows(w, names_rows):  # fused [D, ...] -> HF [rows, D] blocks in column order
        hf = _to_np(w).reshape(D, -1).T
        assert hf.shape[0] == sum(n for _, n in names_rows), (hf.shape, names_rows)
        lo = 0
        for name, n in names_rows:
            out[name] = hf[lo:lo + n]
            lo += n

    out = {"model.embed_tokens.weight": _to_np(pure["embed"]),
           "model.norm.weight": _to_np(pure["final_norm"]["weight"]),
           "lm_head.weight": _to_np(pure["lm_head"]).T}
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Hv, dv, F = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.intermediate_size
    for i, t in enumerate(cfg.layer_types):
        L = pure["layers"][i]
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = _to_np(L["input_norm"]["weight"])
        out[p + "post_attention_layernorm.weight"] = _to_np(L["post_norm"]["weight"])
        split_rows(L["mlp"]["w_gate_up"], [(p + "mlp.gate_proj.weight", F), (p + "mlp.up_proj.weight", F)])
        out[p + "mlp.down_proj.weight"] = _to_np(L["mlp"]["w_down"]).T
        m = L["mixer"]
        if t == ATTENTION:
            a = p + "self_attn."
            split_rows(m["w_qkv"], [(a + "q_proj.weight", H * 2 * hd), (a + "k_proj.weight", Hkv * hd),
                                    (a + "v_proj.weight", Hkv * hd)])
            out[a + "o_proj.weight"] = _to_np(m["wo"]).reshape(-1, D).T
            out[a + "q_norm.weight"] = _to_np(m["q_norm"])
            out[a + "k_norm.weight"] = _to_np(m["k_norm"])
        else:
            g = p + "linear_attn."
            split_rows(m["w_in"], [(g + "in_proj_qkv.weight", cfg.conv_dim), (g + "in_proj_z.weight", Hv * dv),
                                   (g + "in_proj_b.weight", Hv), (g + "in_proj_a.weight", Hv)])
            out[g + "conv1d.weight"] = _to_np(m["conv"]).T[:, None, :]
            out[g + "dt_bias"] = _to_np(m["dt_bias"])
            out[g + "A_log"] = _to_np(m["A_log"])
            out[g + "norm.weight"] = _to_np(m["norm"])
            out[g + "out_proj.weight"] = _to_np(m["w_out"]).reshape(-1, D).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_target_hf(out_dir: str, config_dict: dict, cfg: TextConfig, graphdef, treedef, params: dict) -> None:
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
    save_file(target_hf_tensors(cfg, graphdef, treedef, params), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})


def drafter_hf_tensors(cfg: DrafterConfig, params: DrafterParams) -> dict[str, np.ndarray]:
    """DrafterParams -> z-lab tensor names (inverse of `drafter._GLOBAL` / `drafter._LAYER`)."""
    H = cfg.hidden_size
    out = {"fc.weight": _to_np(params.fc).T, "hidden_norm.weight": _to_np(params.hidden_norm),
           "norm.weight": _to_np(params.norm)}
    for i, lp in enumerate(params.layers):
        p = f"layers.{i}."
        out[p + "input_layernorm.weight"] = _to_np(lp.attn_norm)
        out[p + "post_attention_layernorm.weight"] = _to_np(lp.mlp_norm)
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = _to_np(lp.w_qkv).T  # [nq + 2 nkv, H]: q_proj | k_proj | v_proj rows
        out[p + "self_attn.q_proj.weight"] = qkv[:nq]
        out[p + "self_attn.k_proj.weight"] = qkv[nq:nq + nkv]
        out[p + "self_attn.v_proj.weight"] = qkv[nq + nkv:]
        out[p + "self_attn.o_proj.weight"] = _to_np(lp.wo).transpose(2, 0, 1).reshape(H, -1)
        out[p + "self_attn.q_norm.weight"] = _to_np(lp.q_norm)
        out[p + "self_attn.k_norm.weight"] = _to_np(lp.k_norm)
        out[p + "mlp.gate_proj.weight"] = _to_np(lp.w_gate_up)[:, 0].T
        out[p + "mlp.up_proj.weight"] = _to_np(lp.w_gate_up)[:, 1].T
        out[p + "mlp.down_proj.weight"] = _to_np(lp.w_down).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_drafter_hf(out_dir: str, config_dict: dict, cfg: DrafterConfig, params: DrafterParams) -> None:
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_dict, f, indent=2)
    save_file(drafter_hf_tensors(cfg, params), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})


# ------------------------------------------------------------------------------------------- evaluation


def evaluate_acceptance(target: Target, drafter, prompts: list, max_new_tokens: int = 96, budget: int = 64,
                        check_ar: bool = True) -> dict:
    """τ (mean acceptance length, bonus token included; AR = 1) of chain DFlash and DDTree@budget over
    `prompts` (lists of token ids), aggregated as emitted tokens / rounds; also whether every run matches AR."""
    from jaxddtree.speculative.loop import generate

    res = {"dflash": [0, 0], "ddtree": [0, 0]}
    same = True
    for ids in prompts:
        ar = generate(target, ids, method="ar", max_new_tokens=max_new_tokens).tokens if check_ar else None
        for m in ("dflash", "ddtree"):
            g = generate(target, ids, drafter=drafter, method=m, max_new_tokens=max_new_tokens, tree_budget=budget)
            res[m][0] += sum(g.acceptance_lengths)
            res[m][1] += len(g.acceptance_lengths)
            if check_ar and g.tokens != ar:
                same = False
    tau = {m: a / max(r, 1) for m, (a, r) in res.items()}
    return {"tau_dflash": tau["dflash"], "tau_ddtree": tau["ddtree"],
            "ratio": tau["ddtree"] / max(tau["dflash"], 1e-9), "identical_to_ar": same if check_ar else None,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "budget": budget}


def text_config(d: dict) -> TextConfig:
    return text_config_from_dict(d, where="generated config")
