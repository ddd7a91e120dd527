"""Generation: AR, chain DFlash and DDTree, each one jit-compiled round over a donated state pytree.

Round (speculative): draft (drafter on the context features of the last accepted path + the root) ->
tree build (DDTree: best `budget` prefixes; DFlash: the argmax chain) -> one exact verify pass of the
target over the tree -> accept (on device, greedy or sampled) -> commit (attention KV, GDN states
rebuilt for the accepted path, drafter context) -> write the emitted tokens into the output buffer.
No host synchronisation inside a round; the host reads `done`/`n_out` back every few rounds
(`loop="host"`), or the rounds run inside one `lax.while_loop` (`loop="device"`).

Token bookkeeping: `root` is the last emitted token, not yet seen by the target. A round commits the
accepted path (root + accepted drafts) to the caches and emits the accepted drafts + the bonus token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxddtree.model import layout as layout_lib
from jaxddtree.model import sharding
from jaxddtree.speculative import tree as tree_lib
from jaxddtree.model.prefill import check_ids, check_vocab, chunk_size, padded_chunks, round_up
from jaxddtree.model.cache import ModelCache
from jaxddtree.model.drafter import check_compatible, draft_logits
from jaxddtree.model.target import Target
from jaxddtree.speculative.verify import commit, verify

METHODS = ("ar", "dflash", "ddtree")


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    acceptance_lengths: list[int]
    stats: dict[str, Any]


@struct.dataclass
class DecodeState:
    cache: ModelCache
    dcache: Any  # drafter context cache (None for AR)
    ctx: jax.Array  # [B, P, F] features of the last committed path (pending for the drafter)
    ctx_n: jax.Array  # int32: real rows of ctx
    root: jax.Array  # [B] int32
    out: jax.Array  # [B, max_new + P] int32 emitted tokens
    n_out: jax.Array  # int32
    done: jax.Array  # bool
    key: jax.Array
    acc: jax.Array  # [max_new] int32 acceptance length per round
    n_rounds: jax.Array  # int32
    stop_mask: jax.Array  # [V] bool: the stop ids as data, so that any stop set shares one compilation
    # sampling temperature as data (used when plan.sampling), so that every temperature shares one compilation
    temperature: jax.Array = dataclasses.field(default_factory=lambda: jnp.float32(1.0))
    # truncation of the sampled distribution as data (used when plan.truncate): one compilation for all values
    top_k: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))
    top_p: jax.Array = dataclasses.field(default_factory=lambda: jnp.float32(1.0))
    min_p: jax.Array = dataclasses.field(default_factory=lambda: jnp.float32(0.0))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static description of a compiled loop (hashable: one compilation per Plan)."""
    method: str
    budget: int
    max_new: int
    sampling: bool  # False: greedy (temperature 0); True: sample at state.temperature
    kernels: str
    conv_kernel: int
    feature_layers: tuple[int, ...]
    inject: bool = False  # test hook: draft logits from an oracle continuation
    mesh: Any = None  # tensor parallelism: the target's mesh (model/sharding.py); None: one device
    truncate: bool = False  # sampling truncated by state.top_k / top_p / min_p (tree.truncate); False: none


def _emit(state: DecodeState, emitted: jax.Array, count: jax.Array, plan: Plan) -> DecodeState:
    """Append emitted[:count] (fixed-size [P]) to the output, honouring stop ids and max_new."""
    P = emitted.shape[0]
    idx = jnp.arange(P)
    is_stop = jnp.take(state.stop_mask, emitted, mode="clip") & (idx < count)
    first = jnp.argmax(is_stop)
    hit = is_stop.any()
    count = jnp.where(hit, first + 1, count)
    count = jnp.minimum(count, plan.max_new - state.n_out)
    out = jax.lax.dynamic_update_slice(state.out, emitted[None].astype(jnp.int32), (0, state.n_out))
    n_out = state.n_out + count
    done = state.done | hit | (n_out >= plan.max_new)
    return state.replace(out=out, n_out=n_out, done=done)


def _record(state: DecodeState, n_acc) -> DecodeState:
    acc = jax.lax.dynamic_update_slice(state.acc, n_acc[None].astype(jnp.int32), (state.n_rounds,))
    return state.replace(acc=acc, n_rounds=state.n_rounds + 1)


def _temperature(state: DecodeState, plan: Plan):
    """0.0 (a Python float: greedy, chosen at trace time) or the state's traced temperature."""
    return state.temperature if plan.sampling else 0.0


def _truncation(state: DecodeState, plan: Plan) -> dict:
    """posterior_tokens' truncation arguments: the state's traced values, or none (no cost) when off."""
    return dict(top_k=state.top_k, top_p=state.top_p, min_p=state.min_p) if plan.truncate else {}


def _ar_round(model, state: DecodeState, plan: Plan) -> DecodeState:
    lay = layout_lib.sequence(state.cache.length, 1, plan.conv_kernel, kernels=plan.kernels)
    logits, cache, _, _ = model(state.root[:, None], state.cache, lay, logits="all")
    key, sub = jax.random.split(state.key)
    tok = tree_lib.posterior_tokens(logits[0], _temperature(state, plan), sub, **_truncation(state, plan))  # [1]
    state = state.replace(cache=cache, key=key, root=tok)
    state = _emit(state, tok, jnp.asarray(1, jnp.int32), plan)
    return _record(state, jnp.asarray(1, jnp.int32))


def _oracle_logits(state: DecodeState, oracle: jax.Array, depth: int, vocab: int) -> jax.Array:
    """Test hook: draft logits that rank the target's own continuation high (often first, sometimes
    second), plus noise, so that long paths get accepted and side branches exist."""
    key = jax.random.fold_in(state.key, 7)
    k1, k2 = jax.random.split(key)
    noise = 2.0 * jax.random.normal(k1, (depth, vocab))
    pos = state.n_out - 1 + jnp.arange(1, depth + 1)
    want = oracle[jnp.minimum(pos, oracle.shape[0] - 1)]
    boost = jnp.where(jax.random.uniform(k2, (depth,)) < 0.8, 12.0, 1.5)
    return noise.at[jnp.arange(depth), want].add(boost)


def _spec_round(model, dparams, dcfg, embed, lm_head, state: DecodeState, plan: Plan,
                oracle=None) -> DecodeState:
    D = dcfg.block_size - 1
    dl, dcache = draft_logits(dparams, dcfg, state.dcache, state.ctx, state.ctx_n, state.root, embed, lm_head,
                              plan.kernels)
    dl = dl[0]  # [D, V] (batch 1 today)
    if plan.inject:
        dl = _oracle_logits(state, oracle, D, dl.shape[-1])
    root = state.root[0]
    if plan.method == "ddtree":
        tree = tree_lib.build_tree(root, dl, plan.budget, kernels=plan.kernels)
    else:  # dflash: the argmax chain of the block
        chain = jnp.argmax(dl, axis=-1).astype(jnp.int32)
        n = D + 1
        tree = tree_lib.Tree(tokens=jnp.concatenate([root[None], chain]),
                             parents=jnp.arange(-1, n - 1, dtype=jnp.int32),
                             depths=jnp.arange(n, dtype=jnp.int32), valid=jnp.ones((n,), bool), max_depth=D)
    mask = tree_lib.ancestor_mask(tree)
    lay = layout_lib.tree(state.cache.length, tree.parents, plan.conv_kernel, mask=mask, depths=tree.depths,
                          kernels=plan.kernels)
    tokens = jnp.where(tree.valid, tree.tokens, 0)[None]  # padding embeds token 0; never accepted
    logits, feats, stashes = verify(model, state.cache, tokens, lay, feature_layers=plan.feature_layers)
    key, sub = jax.random.split(state.key)
    post = tree_lib.posterior_tokens(logits[0], _temperature(state, plan), sub, **_truncation(state, plan))
    acc = tree_lib.accept(tree, post, mask)
    n_acc = acc.num_accepted
    cache = commit(state.cache, stashes, acc.path[None], n_acc[None], kernels=plan.kernels, mesh=plan.mesh)
    ctx = jnp.take(feats, acc.path, axis=1)  # [1, D+1, F]
    # emitted: accepted drafts (depths 1..n_acc-1) then the bonus token
    drafts = tree.tokens[jnp.concatenate([acc.path[1:], acc.path[-1:]])]  # [D+1]
    emitted = jnp.where(jnp.arange(D + 1) == n_acc - 1, acc.bonus, drafts)
    state = state.replace(cache=cache, dcache=dcache, ctx=ctx.astype(state.ctx.dtype), ctx_n=n_acc,
                          root=acc.bonus[None], key=key)
    state = _emit(state, emitted, n_acc, plan)
    return _record(state, n_acc)


def _round(leaves, dparams, state, oracle, *, graphdef, treedef, dcfg, plan):
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    if plan.method == "ar":
        return _ar_round(model, state, plan)
    return _spec_round(model, dparams, dcfg, model.embed[...], model.lm_head[...], state, plan, oracle)


_STATIC = ("graphdef", "treedef", "dcfg", "plan")


@functools.partial(jax.jit, static_argnames=_STATIC + ("rounds",), donate_argnames=("state",))
def run_rounds(leaves, dparams, state, oracle, *, graphdef, treedef, dcfg, plan, rounds: int | None):
    """Rounds until done, at most `rounds` of them (None: no limit), inside one `lax.while_loop`.

    The loop's condition skips the rounds after `done`, so no `lax.cond` wraps a round (its pass-through
    branch can make XLA copy the carried caches; issue 15)."""
    body = functools.partial(_round, graphdef=graphdef, treedef=treedef, dcfg=dcfg, plan=plan)
    limit = jnp.iinfo(jnp.int32).max if rounds is None else rounds

    def cond(carry):
        i, s = carry
        return (i < limit) & ~s.done

    state = jax.lax.while_loop(cond, lambda c: (c[0] + 1, body(leaves, dparams, c[1], oracle)),
                               (jnp.int32(0), state))[1]
    return sharding.constrain(state, plan.mesh)  # the layout `generate` placed it in: one compilation


def _max_len(prompt_len: int, max_new: int, slack: int) -> int:
    """Static cache length: bucketed so that nearby prompt lengths share one compilation."""
    return round_up(prompt_len + max_new + slack, 256)


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def check_memory(target: Target, drafter, max_len: int, prompt_len: int, max_new: int, chunk: int, device=None):
    """ValueError (one line, before any work) when the caches for `max_len` positions plus a working reserve do
    not fit in the device's free memory. Devices that report no memory statistics (the CPU) are not checked."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return
    cache = _nbytes(jax.eval_shape(lambda: target.init_cache(max_len))) // target.tp  # split by heads
    if drafter is not None:
        cache += _nbytes(jax.eval_shape(lambda: drafter.init_cache(1, max_len)))
    cfg = target.config
    # activations of one prefill chunk (the MLP's gate|up rows dominate) and of a verify pass, with room to spare
    reserve = 2 * chunk * (2 * cfg.intermediate_size + 4 * cfg.hidden_size) * 4 + (1 << 30)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    if cache + reserve > free:
        gib = 1 << 30
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) does not fit on {device.device_kind}: the "
            f"caches for {max_len} positions need {cache / gib:.1f} GiB (+ {reserve / gib:.1f} GiB working memory), "
            f"{free / gib:.1f} GiB of {stats['bytes_limit'] / gib:.1f} GiB are free; shorten the prompt or "
            f"max_new_tokens")


def generate(target: Target, prompt_ids, *, drafter=None, method: str = "ar", max_new_tokens: int = 128,
             tree_budget: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, seed: int = 0, stop_ids=None,
             loop: str = "host", sync_every: int = 4, on_tokens: Callable[[list[int]], None] | None = None,
             _oracle_tokens=None) -> Generation:
    """Generate up to `max_new_tokens` new tokens after `prompt_ids`.

    method: "ar" (autoregressive), "dflash" (chain of the drafter's block) or "ddtree" (best tree of
    `tree_budget` drafted nodes). At temperature 0 all three give identical tokens; at T > 0 they sample
    exactly from the target's distribution at that temperature, truncated by `top_k` (the k most probable
    tokens; 0 = off), `top_p` (the nucleus: the smallest most-probable set with mass >= top_p; 1 = off) and
    `min_p` (tokens with p >= min_p * p_max; 0 = off), renormalised (`speculative.tree.truncate`; the speculative
    methods too: their acceptance samples every tree node from the truncated target distribution). The
    truncation values are data (one compilation for all of them; any truncation at all adds 32 passes over the
    vocabulary per verified row). `stop_ids` end generation after their first occurrence
    (inclusive). `on_tokens` receives newly emitted tokens as the host reads them back (streaming).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method '{method}' (choose one of {', '.join(METHODS)})")
    if method != "ar" and drafter is None:
        raise ValueError(f"method '{method}' needs a drafter (load one with jaxddtree.load_drafter)")
    if loop not in ("host", "device"):
        raise ValueError(f"loop must be 'host' or 'device', got '{loop}'")
    cfg = target.config
    ids = check_ids(prompt_ids, "prompt_ids")
    check_vocab(target, ids, "prompt_ids")
    max_new = int(max_new_tokens)
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    temperature = float(temperature)
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    top_k, top_p, min_p = tree_lib.check_truncation(top_k, top_p, min_p)
    budget = int(tree_budget)
    if method == "ddtree" and not 1 <= budget < cfg.vocab_size:
        raise ValueError(f"tree_budget must be in [1, vocab_size={cfg.vocab_size}), got {tree_budget}")
    stops = sorted({int(s) for s in (stop_ids or ())})
    if stops and not (0 <= stops[0] and stops[-1] < cfg.vocab_size):
        raise ValueError(f"stop_ids must lie in [0, {cfg.vocab_size}); got {stops}")
    stop_mask = np.zeros((cfg.vocab_size,), bool)
    stop_mask[stops] = True
    if drafter is not None:
        check_compatible(drafter.config, target)
    dcfg = drafter.config if (drafter is not None and method != "ar") else None
    block = dcfg.block_size if dcfg else 1
    P = block  # rows per round: path length <= block_size
    n_tree = (budget + 1) if method == "ddtree" else block
    chunk = chunk_size(len(ids))
    slack = max(chunk, n_tree, P) + P
    if len(ids) + max_new > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    S = _max_len(len(ids), max_new, slack)
    check_memory(target, drafter if dcfg else None, S, len(ids), max_new, chunk)
    feature_layers = tuple(dcfg.target_layer_ids) if dcfg else ()
    # budget only shapes DDTree rounds: normalised for the others so that it does not split their compilations
    sampling = temperature >= tree_lib.GREEDY_EPS
    truncate = sampling and tree_lib.truncates(top_k, top_p, min_p)  # greedy: truncation keeps the argmax
    plan = Plan(method=method, budget=budget if method == "ddtree" else 0, max_new=max_new, sampling=sampling,
                kernels=target.kernels, conv_kernel=cfg.linear_conv_kernel_dim, feature_layers=feature_layers,
                inject=_oracle_tokens is not None, mesh=target.mesh, truncate=truncate)

    t0 = time.perf_counter()
    cache = target.init_cache(S)
    dparams = drafter.params if dcfg else None
    dcache = drafter.init_cache(1, S) if dcfg else None
    logits = None
    for padded, n in padded_chunks(ids, chunk):
        logits, cache, feats, _ = target.prefill(cache, padded, n, feature_layers=feature_layers, logits="last")
        if dcfg:  # the drafter's context cache takes the prompt's features
            blank = jnp.zeros((1, dcfg.block_size, cfg.hidden_size), dparams.norm.dtype)
            _, dcache = drafter.forward(dcache, feats, jnp.int32(n), blank)
    logits = logits[:, 0]  # [1, V]: the last prompt position
    key = jax.random.key(seed)
    key, sub = jax.random.split(key)
    trunc = dict(top_k=top_k, top_p=top_p, min_p=min_p) if truncate else {}
    first = tree_lib.posterior_tokens(logits, temperature, sub, **trunc)  # [1]
    F = len(feature_layers) * cfg.hidden_size
    state = DecodeState(
        cache=cache, dcache=dcache,
        ctx=jnp.zeros((1, P, max(F, 1)), target.dtype), ctx_n=jnp.int32(0),
        root=first.astype(jnp.int32), out=jnp.zeros((1, max_new + P), jnp.int32), n_out=jnp.int32(0),
        done=jnp.asarray(False), key=key, acc=jnp.zeros((max_new,), jnp.int32), n_rounds=jnp.int32(0),
        stop_mask=jnp.asarray(stop_mask), temperature=jnp.float32(temperature if sampling else 1.0),
        top_k=jnp.int32(min(top_k, cfg.vocab_size)), top_p=jnp.float32(top_p), min_p=jnp.float32(min_p))
    state = sharding.place(_emit(state, first.astype(jnp.int32), jnp.int32(1), plan), target.mesh)
    first_np = int(np.asarray(first)[0])
    ttft = time.perf_counter() - t0
    if on_tokens:
        on_tokens([first_np])
    oracle = (jnp.asarray(np.asarray(_oracle_tokens, np.int32)) if _oracle_tokens is not None
              else jnp.zeros((1,), jnp.int32))
    static = dict(graphdef=target.graphdef, treedef=target.treedef, dcfg=dcfg, plan=plan)

    t1 = time.perf_counter()
    shown = 1
    if loop == "device":
        state = run_rounds(target.leaves, dparams, state, oracle, rounds=None, **static)
    else:
        while True:
            state = run_rounds(target.leaves, dparams, state, oracle, rounds=sync_every, **static)
            done, n_out = jax.device_get((state.done, state.n_out))
            if on_tokens and n_out > shown:  # whole (small) buffer to the host: a device-side slice
                on_tokens(np.asarray(state.out)[0, shown:n_out].tolist())  # would compile per (shown, n_out)
                shown = int(n_out)
            if done:
                break
    n_out, n_rounds = (int(x) for x in jax.device_get((state.n_out, state.n_rounds)))
    tokens = np.asarray(state.out)[0, :n_out].tolist()
    if on_tokens and loop == "device" and n_out > shown:
        on_tokens(tokens[shown:])
    t2 = time.perf_counter()
    acc = np.asarray(state.acc)[:n_rounds].tolist()
    decode_s = t2 - t1
    stats = {
        "method": method, "rounds": n_rounds, "new_tokens": n_out,
        "time_to_first_token_s": ttft, "decode_s": decode_s,
        "tokens_per_s": (n_out - 1) / decode_s if decode_s > 0 and n_out > 1 else 0.0,
        "mean_acceptance_length": float(np.mean(acc)) if acc else 0.0,
        "tree_budget": budget if method == "ddtree" else None,
    }
    return Generation(tokens=tokens, acceptance_lengths=acc, stats=stats)
