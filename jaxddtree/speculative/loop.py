"""Generation: AR, chain DFlash and DDTree, each one jit-compiled round over a donated state pytree.

Round (speculative): draft (drafter on the context features of the last accepted path + the root) ->
tree build (DDTree: best `budget` prefixes; DFlash: the argmax chain) -> one exact verify pass of the
target over the tree -> accept (on device, greedy or sampled) -> commit (attention KV, GDN states
rebuilt for the accepted path, drafter context) -> write the emitted tokens into the output buffer.
No host synchronisation inside a round; the rounds run inside one `lax.while_loop` per call, to the end
(`loop="device"`) or `sync_every` at a time (`loop="host"`, streaming): the host enqueues the next call before
it reads the previous call's `done` / `n_out` (asynchronous copies), so the GPU never waits on Python between
calls. The static parts of a round (graph definition, drafter config, `Plan`) are bound once per target and
plan (`loop_fn`): a call passes only arrays.

Token bookkeeping: `root` is the last emitted token, not yet seen by the target. A round commits the
accepted path (root + accepted drafts) to the caches and emits the accepted drafts + the bonus token.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxddtree.model import draft_vocab as draft_vocab_lib
from jaxddtree.model import layout as layout_lib
from jaxddtree.model import sharding
from jaxddtree.speculative import budget as budget_lib
from jaxddtree.speculative import precompile as precompile_lib
from jaxddtree.speculative import tree as tree_lib
from jaxddtree.model.prefill import (PREFILL_CHUNK, check_ids, check_vocab, chunk_bounds, chunk_size, padded_chunks,
                                     round_up)
from jaxddtree.model.cache import ModelCache, init_cache
from jaxddtree.model.drafter import check_compatible, draft_logits, init_draft_cache
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
    max_new: jax.Array  # int32: tokens to emit at most (data: every max_new_tokens of one buffer size shares a round)
    # sampling temperature as data (< tree.GREEDY_EPS: greedy), so that every temperature shares one compilation
    temperature: jax.Array = dataclasses.field(default_factory=lambda: jnp.float32(1.0))
    # truncation of the sampled distribution as data: one compilation for all values (and for none)
    top_k: jax.Array = dataclasses.field(default_factory=lambda: jnp.int32(0))
    top_p: jax.Array = dataclasses.field(default_factory=lambda: jnp.float32(1.0))
    min_p: jax.Array = dataclasses.field(default_factory=lambda: jnp.float32(0.0))
    auto: Any = None  # budget_lib.AutoState when tree_budget="auto" (cost table as data, chosen budget per round)
    # DDTree: the tree budget as data (int32 <= plan.budget; nodes past budget + 1 are padding), so that slots of a
    # batched round (speculative/batch.py) with different budgets share one compilation; None: plan.budget
    budget: Any = None


@struct.dataclass
class Progress:
    """What the host reads back after a call of rounds (copies: the state itself is donated to the next call)."""
    done: jax.Array
    n_out: jax.Array
    n_rounds: jax.Array
    out: jax.Array  # [B, max_new + P] the emitted tokens so far (streaming)
    accepted: Any = None  # int32: the sum of the acceptance lengths so far


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static description of a compiled loop (hashable: one compilation per Plan and buffer shapes)."""
    method: str
    budget: int
    kernels: str
    conv_kernel: int
    feature_layers: tuple[int, ...]
    inject: bool = False  # test hook: draft logits from an oracle continuation
    mesh: Any = None  # tensor parallelism: the target's mesh (model/sharding.py); None: one device
    budgets: tuple[int, ...] = ()  # tree_budget="auto": the candidates (budget_lib.CHAIN = 0); budget = the largest


def _emit(state: DecodeState, emitted: jax.Array, count: jax.Array) -> DecodeState:
    """Append emitted[:count] (fixed-size [P]) to the output, honouring stop ids and max_new."""
    P = emitted.shape[0]
    idx = jnp.arange(P)
    is_stop = jnp.take(state.stop_mask, emitted, mode="clip") & (idx < count)
    first = jnp.argmax(is_stop)
    hit = is_stop.any()
    count = jnp.where(hit, first + 1, count)
    count = jnp.minimum(count, state.max_new - state.n_out)
    out = jax.lax.dynamic_update_slice(state.out, emitted[None].astype(jnp.int32), (0, state.n_out))
    n_out = state.n_out + count
    done = state.done | hit | (n_out >= state.max_new)
    return state.replace(out=out, n_out=n_out, done=done)


def _record(state: DecodeState, n_acc) -> DecodeState:
    acc = jax.lax.dynamic_update_slice(state.acc, n_acc[None].astype(jnp.int32), (state.n_rounds,))
    return state.replace(acc=acc, n_rounds=state.n_rounds + 1)


def mode_of(state: DecodeState) -> jax.Array:
    """The state's sampling class (`tree.sampling_mode`): computed once per call of rounds, outside the loop."""
    return tree_lib.sampling_mode(state.temperature, state.top_k, state.top_p, state.min_p)


def _posterior(logits, state: DecodeState, key, mode):
    """[N, V] logits -> [N] posterior tokens at the state's settings; mode: its class (data, or a Python int)."""
    return tree_lib.posterior_by_mode(logits, mode, state.temperature, key, state.top_k, state.top_p, state.min_p)


def _ar_round(model, state: DecodeState, plan: Plan, mode) -> DecodeState:
    lay = layout_lib.sequence(state.cache.length, 1, plan.conv_kernel, kernels=plan.kernels)
    logits, cache, _, _ = model(state.root[:, None], state.cache, lay, logits="all")
    key, sub = jax.random.split(state.key)
    tok = _posterior(logits[0], state, sub, mode)  # [1]
    state = state.replace(cache=cache, key=key, root=tok)
    state = _emit(state, tok, jnp.asarray(1, jnp.int32))
    return _record(state, jnp.asarray(1, jnp.int32))


def _oracle_logits(state: DecodeState, oracle: jax.Array, depth: int, width: int, vocab=None) -> jax.Array:
    """Test hook: draft logits [depth, width] that rank the target's own continuation high (often first, sometimes
    second), plus noise, so that long paths get accepted and side branches exist. vocab (a DraftVocab): over its
    columns (an id outside it is never boosted)."""
    key = jax.random.fold_in(state.key, 7)
    k1, k2 = jax.random.split(key)
    noise = 2.0 * jax.random.normal(k1, (depth, width))
    pos = state.n_out - 1 + jnp.arange(1, depth + 1)
    want = draft_vocab_lib.columns_of(vocab, oracle[jnp.minimum(pos, oracle.shape[0] - 1)])
    boost = jnp.where(jax.random.uniform(k2, (depth,)) < 0.8, 12.0, 1.5)
    x = noise.at[jnp.arange(depth), want].add(boost, mode="drop")
    return x if vocab is None else x + vocab.bias


# The four stages of a speculative round, as separate functions so that benchmarks/bench.py times exactly what
# the round runs (each stage in a jitted loop of its own); `_spec_round` composes them under named scopes (the
# profile's per-part GPU time, benchmarks/profile_gpu.py).
def draft_stage(dparams, dcfg, state: DecodeState, embed, lm_head, plan: Plan, oracle=None):
    """The drafter on the last accepted path's features + the root -> (logits [D, Vc] fp32, drafter cache): Vc the
    vocabulary's V, or with a draft vocabulary (dparams.vocab) its Vp columns only, which `tree_stage` /
    `chain_tree` / `budget_lib.decide` take with that vocab (a top-K over Vp, not over V with -inf elsewhere)."""
    dl, dcache = draft_logits(dparams, dcfg, state.dcache, state.ctx, state.ctx_n, state.root, embed, lm_head,
                              plan.kernels, subset=True)
    dl = dl[0]  # [D, Vc] (batch 1 today)
    if plan.inject:
        dl = _oracle_logits(state, oracle, dl.shape[0], dl.shape[-1], dparams.vocab)
    return dl, dcache


def tree_stage(root, dl, plan: Plan, budget=None, vocab=None):
    """DDTree: the best `budget` prefixes of the draft (auto: at the largest candidate); DFlash: its argmax chain
    -> (Tree, ancestor mask). budget (DDTree, optional): a traced int32 <= plan.budget; the tree is built at
    plan.budget and its nodes past budget + 1 become padding (`limit_tree`). vocab: the draft vocabulary whose
    columns dl holds (`draft_stage`), or None."""
    if plan.method == "ddtree":
        tree = tree_lib.build_tree(root, dl, plan.budget, kernels=plan.kernels,
                                   ids=None if vocab is None else vocab.ids)
        if budget is not None:
            tree = limit_tree(tree, budget)
    else:  # dflash: the argmax chain of the block
        tree = chain_tree(root, dl, vocab)
    return tree, tree_lib.ancestor_mask(tree)


def limit_tree(tree: tree_lib.Tree, budget) -> tree_lib.Tree:
    """The tree of `budget` drafted nodes (a traced int32) inside a tree built at a larger static budget: rows past
    budget + 1 become padding (the build's first b + 1 rows are the best b-node tree, `budget_lib.truncate`; parents
    precede children, so no kept node loses its parent). Same shapes, so every budget shares one compilation."""
    keep = tree.valid & (jnp.arange(tree.num_nodes) <= budget)  # the root (row 0) always stays
    return tree_lib.Tree(tokens=jnp.where(keep, tree.tokens, tree_lib.PAD_TOKEN),
                         parents=jnp.where(keep, tree.parents, 0), depths=jnp.where(keep, tree.depths, 1),
                         valid=keep, max_depth=tree.max_depth)


def chain_tree(root, dl, vocab=None) -> tree_lib.Tree:
    """The argmax chain of the drafter's block dl [D, Vc] as a degenerate tree of D + 1 rows (chain DFlash's tree;
    the chain candidate of tree_budget="auto"); vocab: the draft vocabulary whose columns dl holds, or None."""
    n = dl.shape[0] + 1
    chain = draft_vocab_lib.ids_of(vocab, jnp.argmax(dl, axis=-1).astype(jnp.int32))
    return tree_lib.Tree(tokens=jnp.concatenate([root[None], chain]), parents=jnp.arange(-1, n - 1, dtype=jnp.int32),
                         depths=jnp.arange(n, dtype=jnp.int32), valid=jnp.ones((n,), bool), max_depth=n - 1)


def verify_stage(model, cache: ModelCache, tree, mask, plan: Plan):
    """One exact pass of the target over the tree -> (logits [1, N, V], features, GDN stashes)."""
    lay = layout_lib.tree(cache.length, tree.parents, plan.conv_kernel, mask=mask, depths=tree.depths,
                          kernels=plan.kernels)
    tokens = jnp.where(tree.valid, tree.tokens, 0)[None]  # padding embeds token 0; never accepted
    return verify(model, cache, tokens, lay, feature_layers=plan.feature_layers)


def commit_stage(state: DecodeState, dcache, tree, mask, logits, feats, stashes, plan: Plan,
                 mode=tree_lib.GREEDY) -> DecodeState:
    """Accept (greedy or sampled: mode, `tree.posterior_by_mode`), commit the accepted path (KV, GDN states rebuilt),
    emit its tokens."""
    D = tree.max_depth
    key, sub = jax.random.split(state.key)
    post = _posterior(logits[0], state, sub, mode)
    acc = tree_lib.accept(tree, post, mask)
    n_acc = acc.num_accepted
    cache = commit(state.cache, stashes, acc.path[None], n_acc[None], kernels=plan.kernels, mesh=plan.mesh)
    ctx = jnp.take(feats, acc.path, axis=1)  # [1, D+1, F]
    # emitted: accepted drafts (depths 1..n_acc-1) then the bonus token
    drafts = tree.tokens[jnp.concatenate([acc.path[1:], acc.path[-1:]])]  # [D+1]
    emitted = jnp.where(jnp.arange(D + 1) == n_acc - 1, acc.bonus, drafts)
    state = state.replace(cache=cache, dcache=dcache, ctx=ctx.astype(state.ctx.dtype), ctx_n=n_acc,
                          root=acc.bonus[None], key=key)
    state = _emit(state, emitted, n_acc)
    return _record(state, n_acc)


def _spec_round(model, dparams, dcfg, embed, lm_head, state: DecodeState, plan: Plan, mode,
                oracle=None) -> DecodeState:
    with jax.named_scope("draft"):
        dl, dcache = draft_stage(dparams, dcfg, state, embed, lm_head, plan, oracle)
    with jax.named_scope("tree_build"):
        tree, mask = tree_stage(state.root[0], dl, plan, state.budget, dparams.vocab)

    def verify_commit(st, tree, mask):
        with jax.named_scope("verify"):
            logits, feats, stashes = verify_stage(model, st.cache, tree, mask, plan)
        with jax.named_scope("accept_commit"):
            return commit_stage(st, dcache, tree, mask, logits, feats, stashes, plan, mode)

    if not plan.budgets:
        return verify_commit(state, tree, mask)
    # tree_budget="auto": the tree above is built at the largest candidate; its first b + 1 rows are the tree of
    # budget b (budget_lib's docstring); one switch branch per candidate verifies and commits its own tree
    with jax.named_scope("tree_build"):
        decision = budget_lib.decide(state.auto, state.cache.length, plan.budgets, tree, mask, dl, dparams.vocab)
        chain = chain_tree(state.root[0], dl, dparams.vocab)
        chain_mask = tree_lib.ancestor_mask(chain)

    def one(b):
        if b == budget_lib.CHAIN:
            return chain, chain_mask
        return budget_lib.truncate(tree, b + 1), mask[:b + 1, :b + 1]

    groups = budget_lib.verify_groups(plan.budgets, chain.num_nodes)
    n_max = max(one(b)[0].num_nodes for b in plan.budgets)

    def branch(members):  # one verify per width; its outputs padded to n_max rows, so that one accept + commit
        def run(cache):   # follows the switch (compiled once, not once per branch)
            t, m = one(plan.budgets[members[0]])
            for i in members[1:]:
                pick = decision.k == i
                ti, mi = one(plan.budgets[i])
                t, m = jax.tree.map(lambda a, b: jnp.where(pick, a, b), (ti, mi), (t, m))
            with jax.named_scope("verify"):
                logits, feats, stashes = verify_stage(model, cache, t, m, plan)
            return pad_rows(t, m, logits, feats, stashes, n_max)
        return run

    group_of = jnp.asarray([next(g for g, ms in enumerate(groups) if i in ms) for i in range(len(plan.budgets))],
                           jnp.int32)
    r = state.n_rounds
    tree, mask, logits, feats, stashes = jax.lax.switch(group_of[decision.k], [branch(ms) for ms in groups],
                                                        state.cache)
    with jax.named_scope("accept_commit"):
        state = commit_stage(state, dcache, tree, mask, logits, feats, stashes, plan, mode)
    return state.replace(auto=budget_lib.record(state.auto, r, state.acc[r], plan.budgets, decision))


def pad_rows(tree: tree_lib.Tree, mask, logits, feats, stashes, n: int):
    """A verify's tree, mask [N, N], logits [1, N, V], features [1, N, F] and stashes ([G, B, N, ...] per group
    position) padded to n nodes: padding nodes are invalid (never accepted: each is its own only ancestor, and not
    good) and their rows zero."""
    p = n - tree.num_nodes
    if p == 0:
        return tree, mask, logits, feats, stashes

    def pad(x, axis, value=0):
        return jnp.pad(x, [(0, p) if a == axis else (0, 0) for a in range(x.ndim)], constant_values=value)
    tree = tree_lib.Tree(tokens=pad(tree.tokens, 0, -1), parents=pad(tree.parents, 0), depths=pad(tree.depths, 0, 1),
                         valid=pad(tree.valid, 0, False), max_depth=tree.max_depth)
    mask = pad(pad(mask, 0, False), 1, False) | (jnp.eye(n, dtype=bool) & (jnp.arange(n) >= n - p)[:, None])
    feats = None if feats is None else pad(feats, 1)
    return tree, mask, pad(logits, 1), feats, jax.tree.map(lambda x: pad(x, 2), stashes)


def _round(leaves, dparams, state, oracle, mode, *, graphdef, treedef, dcfg, plan):
    """One round; mode: the sampling class (`mode_of`; unbatched under the batched round's vmap)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    if plan.method == "ar":
        new = _ar_round(model, state, plan, mode)
    else:
        new = _spec_round(model, dparams, dcfg, model.embed[...], model.lm_head[...], state, plan, mode, oracle)
    return _hold_if_done(state, new)


def _hold_if_done(old: DecodeState, new: DecodeState) -> DecodeState:
    """A round run after `done` changes nothing the host reads (n_out, out[:n_out], acc[:n_rounds], n_rounds,
    done) and keeps the committed lengths where they were, so that its writes stay inside the caches; what it
    leaves in the caches' contents is never used (the generation is over). This lets a fixed number of rounds
    run per call with no data-dependent control flow (`chunk` calls: no host synchronisation inside)."""
    d = old.done
    cache = new.cache.replace(length=jnp.where(d, old.cache.length, new.cache.length))
    dcache = new.dcache
    if dcache is not None:
        dcache = dataclasses.replace(dcache, length=jnp.where(d, old.dcache.length, dcache.length))
    auto = new.auto
    if auto is not None:  # tree_budget="auto": its statistics (the next rounds' choices, the reported ones) too
        auto = jax.tree.map(lambda a, b: jnp.where(d, a, b), old.auto, auto)
    return new.replace(cache=cache, dcache=dcache, n_out=jnp.where(d, old.n_out, new.n_out),
                       n_rounds=jnp.where(d, old.n_rounds, new.n_rounds), done=d | new.done, auto=auto)


def run_rounds(leaves, dparams, state, oracle, rounds=None, *, graphdef, treedef, dcfg, plan, chunk=None):
    """The rounds of one call -> (state, Progress); the pure function behind `loop_fn`, which binds the keyword
    arguments once and jits it with the state donated.

    chunk=None: rounds until done, at most `rounds` (an int32 array), inside one `lax.while_loop`: the device
    loop. Its condition skips the rounds after `done`, so no `lax.cond` wraps a round (its pass-through branch
    can make XLA copy the carried caches; issue 15) — but XLA reads a while loop's condition back on the host
    every iteration, so a call returns only when its GPU work is done.
    chunk=k: exactly k rounds (a static trip count, no data-dependent control flow: the call returns at once and
    the next can be enqueued while these run); rounds after `done` change nothing (`_hold_if_done`)."""
    TRACES["rounds"] += 1  # runs once per compilation (tests count them)
    mode = mode_of(state)  # the sampling class, as data: greedy, sampled and truncated share this program
    body = functools.partial(_round, graphdef=graphdef, treedef=treedef, dcfg=dcfg, plan=plan)
    if chunk is None:
        def cond(carry):
            i, s = carry
            return (i < rounds) & ~s.done

        state = jax.lax.while_loop(cond, lambda c: (c[0] + 1, body(leaves, dparams, c[1], oracle, mode)),
                                   (jnp.int32(0), state))[1]
    elif chunk == 1:
        state = body(leaves, dparams, state, oracle, mode)
    else:
        state = jax.lax.fori_loop(0, chunk, lambda i, s: body(leaves, dparams, s, oracle, mode), state)
    state = sharding.constrain(state, plan.mesh)  # the layout `generate` placed it in: one compilation
    return state, progress(state)


def progress(state: DecodeState) -> Progress:
    """The Progress of a (per-slot) state. acc past n_rounds may hold a held round's value (`_hold_if_done`)."""
    acc = jnp.where(jnp.arange(state.acc.shape[-1]) < state.n_rounds, state.acc, 0)
    return Progress(done=state.done, n_out=state.n_out, n_rounds=state.n_rounds, out=state.out,
                    accepted=jnp.sum(acc, axis=-1))


TRACES = collections.Counter()  # traces (= compilations) of the bound functions, by name
NO_LIMIT = int(jnp.iinfo(jnp.int32).max)


def loop_fn(target: Target, dcfg, plan: Plan, chunk: int | None = None):
    """`run_rounds` of (target, drafter config, plan, chunk), jitted once per target with its static parts
    bound, the state donated. chunk=None (the device loop): `fn(leaves, dparams, state, oracle, rounds)`;
    chunk=k (the host loop: k rounds per call): `fn(leaves, dparams, state, oracle)`. -> (state, Progress)."""
    return target.bind(("rounds", dcfg, plan, chunk), lambda: jax.jit(functools.partial(
        run_rounds, graphdef=target.graphdef, treedef=target.treedef, dcfg=dcfg, plan=plan, chunk=chunk),
        donate_argnames=("state",)))


def _start(logits, cache, dcache, seed, stop_mask, temperature, max_new, top_k, top_p, min_p, costs=None, *,
           plan: Plan, P: int, F: int, out_len: int, dtype):
    """The decode state after the prompt: the first token drawn from the last prompt position's logits [1, V]
    and emitted. One jitted call (a request's setup costs one dispatch, not dozens of eager ops). costs:
    tree_budget="auto"'s table as data, (contexts [C], ms [K, C]) (`budget_lib.padded`), else None."""
    TRACES["start"] += 1
    key, sub = jax.random.split(jax.random.key(seed))
    mode = tree_lib.sampling_mode(temperature, top_k, top_p, min_p)
    first = tree_lib.posterior_by_mode(logits, mode, temperature, sub, top_k, top_p, min_p).astype(jnp.int32)
    state = DecodeState(
        cache=cache, dcache=dcache, ctx=jnp.zeros((1, P, F), dtype), ctx_n=jnp.int32(0), root=first,
        out=jnp.zeros((1, out_len + P), jnp.int32), n_out=jnp.int32(0), done=jnp.asarray(False), key=key,
        acc=jnp.zeros((out_len,), jnp.int32), n_rounds=jnp.int32(0), stop_mask=stop_mask, max_new=max_new,
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        auto=budget_lib.init_state(*costs, out_len) if plan.budgets else None)
    return _emit(state, first, jnp.int32(1))


def start_fn(target: Target, plan: Plan, P: int, F: int, out_len: int):
    return target.bind(("start", plan, P, F, out_len), lambda: jax.jit(functools.partial(
        _start, plan=plan, P=P, F=F, out_len=out_len, dtype=target.dtype), donate_argnames=("cache", "dcache")))


class Prefill:
    """A prompt's prefill and start, one chunk per `advance()` (each enqueued, nothing read back): the target's
    prefill of the chunk, the drafter's context prefill of its features, and after the last chunk `start_fn` (the
    first token drawn and emitted). `generate` runs it to the end at once; a slot pool (speculative/batch.py) runs
    one chunk between its batched rounds. `state` (a batch-1 DecodeState) once `advance()` returned True.
    drafter None: AR. stop_mask: [V] bool (numpy); costs: tree_budget="auto"'s `budget_lib.padded` table or None.
    Prefix caching (speculative/prefix_cache.py): `start` = (cache, drafter cache) holding the prompt's first p
    tokens (their `length`: p < len(ids); pass p as `start_len`, else it is read back from the device), the prefill
    resumes there (with at most PREFILL_CHUNK tokens left, in chunks of that width when the prompt's are wider: a
    completion's or a tool result's few tokens in one 256-row pass, not a mostly padded 2048-row one, ≈ 8 × the
    work at 27B); `grid` > 0 also ends chunks at its multiples
    (`model.prefill.chunk_bounds`); `on_chunk(end, cache, dcache)` is called after each chunk (end: the prompt
    tokens in the caches) and may copy them (a snapshot), never keep them (they are donated to the next call)."""

    def __init__(self, target: Target, drafter, plan: Plan, ids, chunk: int, S: int, out_len: int, *, seed: int,
                 stop_mask, temperature: float, max_new: int, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, costs=None, start=None, start_len: int | None = None, grid: int = 0,
                 on_chunk=None):
        cfg = target.config
        self.target, self.drafter, self.plan, self.out_len = target, drafter, plan, out_len
        self.F = len(plan.feature_layers) * cfg.hidden_size
        self.P = drafter.config.block_size if drafter is not None else 1
        self.skip = 0 if start is None else int(start[0].length if start_len is None else start_len)  # in `start`
        if start is not None and len(ids) - self.skip <= PREFILL_CHUNK < chunk:
            chunk = PREFILL_CHUNK
        self._start_caches = start
        self._on_chunk = on_chunk
        self.n_chunks = len(chunk_bounds(len(ids), chunk, self.skip, grid))
        self._end = self.skip
        self.chunks_done = 0  # chunks enqueued so far (a group's too)
        self._chunks = padded_chunks(ids, chunk, self.skip, grid)
        self._start_args = (jnp.uint32(seed % (1 << 32)), jnp.asarray(stop_mask), jnp.float32(temperature),
                            jnp.int32(max_new), jnp.int32(min(top_k, cfg.vocab_size)), jnp.float32(top_p),
                            jnp.float32(min_p), costs)
        self._cache = self._dcache = self._logits = self._blank = None
        self._S = S
        self.n_tokens = len(ids)
        self.shape = (chunk, self.n_chunks)  # (chunk width, chunks): one shape can prefill together
        self._group = None  # the PrefillGroup that runs this prompt's chunks, if any
        self.state = None

    def advance(self) -> bool:
        """Enqueue the next chunk (the first call also makes the caches); True once the start state is enqueued.
        In a PrefillGroup: the group's next pass (every member's chunk)."""
        if self.state is not None:
            return True
        if self._group is not None:
            return self._group.advance()
        target, drafter = self.target, self.drafter
        if self._cache is None:
            if self._start_caches is not None:
                self._cache, self._dcache = self._start_caches
                self._start_caches = None
            else:
                self._cache = target.init_cache(self._S)
                if drafter is not None:
                    self._dcache = drafter.init_cache(1, self._S)
            if drafter is not None:
                # the drafter's block input during prefill: made once, not once per chunk
                self._blank = jnp.zeros((1, drafter.config.block_size, target.config.hidden_size), drafter.dtype)
        nxt = next(self._chunks, None)
        if nxt is not None:
            padded, n = nxt
            self._logits, self._cache, feats, _ = target.prefill(self._cache, padded, n,
                                                                 feature_layers=self.plan.feature_layers,
                                                                 logits="last")
            if drafter is not None:  # the drafter's context cache takes the prompt's features
                _, self._dcache = drafter.forward(self._dcache, feats, jnp.int32(n), self._blank)
            self._end += n
            self.chunks_done += 1
            if self._on_chunk is not None:
                self._on_chunk(self._end, self._cache, self._dcache)
            return False
        self.state = start_fn(target, self.plan, self.P, max(self.F, 1), self.out_len)(
            self._logits[:, 0], self._cache, self._dcache, *self._start_args)
        self._cache = self._dcache = self._logits = None
        return True

    def programs(self) -> tuple[list, Any]:
        """(jitted function, abstract arguments) of each program `advance` will run, in order: the target's
        prefill of a chunk, the drafter's context pass, the start (`precompile.compile_all`). Call before the
        first `advance`. -> (those jobs, the start's output state, abstract)."""
        A = precompile_lib.abstract
        target, drafter = self.target, self.drafter
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        if self._start_caches is not None:
            cache, dcache = A(self._start_caches)
        else:
            cache = jax.eval_shape(lambda: target.init_cache(self._S))
            dcache = jax.eval_shape(lambda: drafter.init_cache(1, self._S)) if drafter is not None else None
        pf = target.prefill_fn(self.plan.feature_layers, "last")
        args = (target.leaves, cache, jax.ShapeDtypeStruct((1, self.shape[0]), jnp.int32), i32)
        logits, cache, feats, _ = precompile_lib.shape_of(pf, *args)
        jobs = [(pf, args)]
        if drafter is not None:
            blank = jax.ShapeDtypeStruct((1, drafter.config.block_size, target.config.hidden_size), drafter.dtype)
            args = (drafter.params, drafter.config, dcache, feats, i32, blank)
            _, dcache = precompile_lib.shape_of(drafter.forward_fn(), *args)
            jobs.append((drafter.forward_fn(), args))
        sf = start_fn(target, self.plan, self.P, max(self.F, 1), self.out_len)
        args = (jax.ShapeDtypeStruct(logits.shape[:1] + logits.shape[2:], logits.dtype), cache, dcache,
                *A(self._start_args))
        jobs.append((sf, args))
        return jobs, precompile_lib.shape_of(sf, *args)

    @property
    def prefilled(self) -> bool:
        """Every chunk enqueued (the next advance() would run the start)."""
        return self.state is not None or self.chunks_done >= self.n_chunks

    def wait(self) -> None:
        """Block until the chunks enqueued so far have run (for progress reports; `advance` never blocks)."""
        jax.block_until_ready((self._logits, self._dcache))


class PrefillGroup:
    """k >= 2 prompts of one shape (chunk width and count; `Prefill.shape`) prefilled together: each `advance()`
    runs the members' next chunks as ONE pass (`Target.prefill_many`, `Drafter.forward_many`: every projection one
    GEMM of k·width rows instead of k GEMMs of width rows: at 27B a 256-row chunk is far from the tensor cores'
    rate); after the last chunk each member's start as `Prefill` runs it (its own first token, key and settings).
    A member's `advance()` / `state` run the group. The k members' caches are stacked while the group runs (and
    copied out once at the end: 2k requests' caches at the peak)."""

    def __init__(self, members):
        members = list(members)
        m0 = members[0]
        if len(members) < 2:
            raise ValueError("a PrefillGroup needs at least 2 prompts (one prefills on its own)")
        for m in members:
            if (m.target is not m0.target or m.drafter is not m0.drafter or m.plan != m0.plan or m._S != m0._S
                    or m.shape != m0.shape or m.out_len != m0.out_len):
                raise ValueError(f"prompts of different shapes cannot prefill together: {m.shape} vs {m0.shape}")
            if m._group is not None or m._cache is not None or m.state is not None:
                raise ValueError("a prompt already prefilling cannot join a PrefillGroup")
            if m.skip:
                raise ValueError("a prompt resumed from a prefix cache prefills on its own")
        self.members = members
        for m in members:
            m._group = self
        self._caches = self._dcaches = self._logits = None
        self.done = False

    def advance(self) -> bool:
        if self.done:
            return True
        ms, m0 = self.members, self.members[0]
        target, drafter, k = m0.target, m0.drafter, len(self.members)
        if self._caches is None:
            self._caches, self._dcaches = init_many(target, drafter, m0._S, k)
            if drafter is not None:
                m0._blank = jnp.zeros((1, drafter.config.block_size, target.config.hidden_size), drafter.dtype)
        nxt = [next(m._chunks, None) for m in ms]
        if nxt[0] is not None:
            tokens = jnp.stack([c[0] for c in nxt])  # [k, 1, width]
            n = np.asarray([c[1] for c in nxt], np.int32)
            self._logits, self._caches, feats, _ = target.prefill_many(self._caches, tokens, n,
                                                                       feature_layers=m0.plan.feature_layers,
                                                                       logits="last")
            if drafter is not None:
                _, self._dcaches = drafter.forward_many(self._dcaches, feats, n, m0._blank)
            for m in ms:
                m.chunks_done += 1
            return False
        take = target.bind(("take_member",), lambda: jax.jit(
            lambda tree, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), tree)))
        for i, m in enumerate(ms):
            m._logits, m._cache, m._dcache = take((self._logits, self._caches, self._dcaches), jnp.int32(i))
            if m._on_chunk is not None:  # (a group reports only its prompts' ends)
                m._end = m.n_tokens
                m._on_chunk(m._end, m._cache, m._dcache)
            m._group = None  # its own start (Prefill.advance: no chunk left)
            m.advance()
            m._group = self
        self._caches = self._dcaches = self._logits = m0._blank = None
        self.done = True
        return True

    @staticmethod
    def programs(m0: Prefill, k: int) -> list:
        """(jitted function, abstract arguments) of the passes a group of k prompts of m0's shape runs (the
        members' starts are `Prefill.programs`'): for `precompile.compile_all`."""
        target, drafter = m0.target, m0.drafter
        i32k = jax.ShapeDtypeStruct((k,), jnp.int32)
        caches, dcaches = jax.eval_shape(lambda: init_many(target, drafter, m0._S, k))
        fn = target.prefill_many_fn(m0.plan.feature_layers, "last")
        args = (target.leaves, caches, jax.ShapeDtypeStruct((k, 1, m0.shape[0]), jnp.int32), i32k)
        _, _, feats, _ = precompile_lib.shape_of(fn, *args)
        jobs = [(fn, args)]
        if drafter is not None:
            blank = jax.ShapeDtypeStruct((1, drafter.config.block_size, target.config.hidden_size), drafter.dtype)
            jobs.append((drafter.forward_many_fn(), (drafter.params, drafter.config, dcaches, feats, i32k, blank)))
        return jobs


def init_many(target: Target, drafter, S: int, k: int):
    """k requests' zeroed batch-1 caches stacked on a leading axis (the target's; the drafter's or None), made on the
    device by one jitted call per (S, k)."""
    cfg, dtype = target.config, target.dtype
    dcfg, ddtype = (drafter.config, drafter.dtype) if drafter is not None else (None, None)

    def stack(tree):
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (k,) + x.shape), tree)

    def make():
        return stack(init_cache(cfg, S, dtype)), (stack(init_draft_cache(dcfg, 1, S, ddtype)) if dcfg else None)
    return target.bind(("init_many", S, k, dcfg, jnp.dtype(ddtype).name if ddtype else None),
                       lambda: jax.jit(make))()


def make_plan(target: Target, dcfg, method: str, budget: int = 0, *, inject: bool = False,
              budgets: tuple[int, ...] = ()) -> Plan:
    """The Plan of a generation of `method` on `target` (dcfg: the drafter's config, None for AR). The budget only
    shapes DDTree rounds: normalised to 0 for the others so that it does not split their compilations."""
    return Plan(method=method, budget=budget if method == "ddtree" else 0,
                kernels=target.kernels, conv_kernel=target.config.linear_conv_kernel_dim,
                feature_layers=tuple(dcfg.target_layer_ids) if dcfg else (), inject=inject, mesh=target.mesh,
                budgets=budgets)


def check_request(cfg, prompt_len: int, max_new, temperature, top_k, top_p, min_p, stop_ids,
                  max_new_name: str = "max_new_tokens"):
    """A request's host values checked (ValueError, one line each) -> (max_new, temperature, top_k, top_p, min_p,
    stop_mask [V] bool numpy)."""
    n = int(max_new)
    if n < 1:
        raise ValueError(f"{max_new_name} must be >= 1, got {max_new}")
    t = float(temperature)
    if not 0 <= t < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    top_k, top_p, min_p = tree_lib.check_truncation(top_k, top_p, min_p)
    stops = sorted({int(s) for s in (stop_ids or ())})
    if stops and not (0 <= stops[0] and stops[-1] < cfg.vocab_size):
        raise ValueError(f"stop_ids must lie in [0, {cfg.vocab_size}); got {stops}")
    if prompt_len + n > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({prompt_len} tokens) + {max_new_name} ({n}) exceeds the model's "
                         f"max_position_embeddings ({cfg.max_position_embeddings})")
    stop_mask = np.zeros((cfg.vocab_size,), bool)
    stop_mask[stops] = True
    return n, t, top_k, top_p, min_p, stop_mask


def capacity(target: Target, dcfg, method: str, budget: int, prompt_len: int, max_new: int) -> tuple[int, int]:
    """(prefill chunk, cache positions) for a prompt of prompt_len tokens + max_new new ones: the prompt's chunks
    written whole, plus the widest verify block; bucketed to 256 so that nearby lengths share one compilation.
    A server sizes its caches once as capacity(..., max_context, 0) (every request fits in them)."""
    P = dcfg.block_size if dcfg else 1
    n_tree = (budget + 1) if method == "ddtree" else P
    chunk = chunk_size(prompt_len)
    return chunk, round_up(prompt_len + max_new + max(chunk, n_tree, P) + P, 256)


def cache_positions(target: Target, drafter, method: str, tree_budget, prompt_len: int, max_new: int,
                    budget_costs=None) -> int:
    """The cache capacity `generate` gives a request by default (`capacity` at its widest tree): pass it as
    `cache_len` to runs that must share compiled programs (a warm-up on a shorter prompt, a pool's requests)."""
    dcfg = drafter.config if (drafter is not None and method != "ar") else None
    widest = resolve_budget(tree_budget, method, target.config.vocab_size, dcfg, budget_costs)[0]
    return capacity(target, dcfg, method, widest, prompt_len, max_new)[1]


def resolve_budget(tree_budget, method: str, vocab_size: int, dcfg, budget_costs=None):
    """(budget, cost table) of a generation: tree_budget="auto" (DDTree) -> (the largest candidate, its
    `budget_lib.CostTable` resolved from `budget_costs`); an int -> (it, None); "auto" for AR / DFlash -> (0, None)
    (unused). ValueError (one line) for anything else or a DDTree budget outside [1, vocab_size)."""
    if isinstance(tree_budget, str) and tree_budget.strip().lower() == "auto":
        if method != "ddtree":
            return 0, None
        table = budget_lib.resolve_costs(budget_costs, vocab_size, dcfg.block_size)
        return max(table.candidates), table
    try:
        budget = int(tree_budget)
    except (TypeError, ValueError):
        raise ValueError(f"tree_budget must be an int or 'auto', got {tree_budget!r}") from None
    if method == "ddtree" and not 1 <= budget < vocab_size:
        raise ValueError(f"tree_budget must be in [1, vocab_size={vocab_size}), got {tree_budget}")
    return budget, None


def _nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def check_memory(target: Target, drafter, max_len: int, prompt_len: int, max_new: int, chunk: int, device=None):
    """ValueError (one line, before any work) when the caches for `max_len` positions plus a working reserve do
    not fit in the device's free memory. Devices that report no memory statistics (the CPU) are not checked."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return
    cache = target.cache_bytes(max_len) // target.tp  # split by heads
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
             tree_budget: int | str = "auto", temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, seed: int = 0, stop_ids=None,
             loop: str = "host", sync_every: int = 1, on_tokens: Callable[[list[int]], None] | None = None,
             cache_len: int | None = None, budget_costs=None,
             on_prefill: Callable[[int, int], None] | None = None, prefix_cache=None, precompile: bool = True,
             _oracle_tokens=None, _compile_only: bool = False) -> Generation | None:
    """Generate up to `max_new_tokens` new tokens after `prompt_ids`.

    method: "ar" (autoregressive), "dflash" (chain of the drafter's block) or "ddtree" (best tree of `tree_budget`
    drafted nodes; "auto", the default: each round picks the budget, or the chain, with the most expected tokens per
    second, see `jaxddtree.speculative.budget`; `budget_costs`: its round-time table, a `budget.CostTable`, a dict or a
    JSON file; None: the default). At temperature 0 all three give identical tokens in fp32 (in bf16, see README
    "Exactness"); at T > 0 they sample exactly from the target's distribution at that temperature, truncated by `top_k`
    (the k most probable tokens; 0 = off), `top_p` (the nucleus: the smallest most-probable set with mass >= top_p; 1 =
    off) and `min_p` (tokens with p >= min_p * p_max; 0 = off), renormalised (`speculative.tree.truncate`; the
    speculative methods too: their acceptance samples every tree node from the truncated target distribution). The
    truncation values are data (one compilation for all of them). `stop_ids` end generation after their first occurrence
    (inclusive). `on_tokens` receives newly emitted tokens as the host reads them back (streaming: every `sync_every`
    rounds with loop="host", once at the end with loop="device").
    `cache_len`: the caches' capacity in positions (default: the prompt + max_new_tokens, bucketed); a server
    passes one capacity for all its requests so that every request reuses one compiled round.
    `on_prefill(done, total)`: called after each prefill chunk has run (prompt tokens in the cache, prompt length),
    for progress on long prompts; each chunk is then waited for (without it the chunks are enqueued back to back).
    `prefix_cache`: a `speculative.prefix_cache.PrefixCache(target, drafter or None for "ar")` shared by calls: the
    prompt resumes its prefill from the deepest cached prefix (a copy; the last prompt token is always recomputed)
    and its end (and grid points) are snapshotted for later calls; `stats["cached_tokens"]`: the prompt tokens
    taken from it (0 without one). A call whose prompt extends an earlier call's prompt (e.g. prompt + its tokens +
    new ones) skips that prefix's prefill; at temperature 0 in fp32 it returns what a call without the cache does.
    `precompile`: a first call (its rounds not compiled yet; one device) compiles its programs side by side in
    threads (`speculative.precompile`); the rounds go on compiling while the prefill runs and the first token is
    streamed (`stats["compile_wait_s"]`: how long the first round then waited for them; `decode_s` starts after);
    False: each compiles at its first call, in turn (a call whose rounds run, even if its first token ends it:
    generate.py's warm-up on several devices).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method '{method}' (choose one of {', '.join(METHODS)})")
    if method != "ar" and drafter is None:
        raise ValueError(f"method '{method}' needs a drafter (load one with jaxddtree.load_drafter)")
    if loop not in ("host", "device"):
        raise ValueError(f"loop must be 'host' or 'device', got '{loop}'")
    if int(sync_every) < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")
    cfg = target.config
    ids = check_ids(prompt_ids, "prompt_ids")
    check_vocab(target, ids, "prompt_ids")
    max_new, temperature, top_k, top_p, min_p, stop_mask = check_request(
        cfg, len(ids), max_new_tokens, temperature, top_k, top_p, min_p, stop_ids)
    if drafter is not None:
        check_compatible(drafter.config, target, draft_vocab=drafter.draft_vocab)
    dcfg = drafter.config if (drafter is not None and method != "ar") else None
    budget, table = resolve_budget(tree_budget, method, cfg.vocab_size, dcfg, budget_costs)
    auto = table is not None
    chunk, need = capacity(target, dcfg, method, budget, len(ids), max_new)
    if cache_len is None:
        S = need
    else:
        S = int(cache_len)
        if S < need:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) needs caches of {need} "
                             f"positions, cache_len is {S}")
    out_len = round_up(max_new, 256) if cache_len is None else S  # buffer sizes: one compilation per bucket
    check_memory(target, drafter if dcfg else None, S, len(ids), max_new, chunk)
    plan = make_plan(target, dcfg, method, budget, inject=_oracle_tokens is not None, budgets=table.candidates if auto else ())
    pc = prefix_cache
    if pc is not None:
        if pc.target is not target or pc.drafter is not (drafter if dcfg else None):
            raise ValueError("prefix_cache holds another model's caches: make it as PrefixCache(target, drafter) "
                             "(drafter None for method 'ar') with this call's target and drafter")
        if target.mesh is not None:
            raise ValueError("prefix_cache needs a target on one device (tp=1)")
        if S % pc.block:
            raise ValueError(f"with a prefix_cache, cache_len must be a multiple of {pc.block}, got {S}")

    t0 = time.perf_counter()
    dparams = drafter.params if dcfg else None
    start = on_chunk = hit = None
    if pc is not None:  # resume from the deepest cached prefix (a copy); snapshot this prompt's end and grid points
        hit = pc.lookup(ids)
        start = pc.build(hit, S) if hit is not None else None
        on_chunk = pc.recorder(ids)
    pre = Prefill(target, drafter if dcfg else None, plan, ids, chunk, S, out_len, seed=seed, stop_mask=stop_mask,
                  temperature=temperature, max_new=max_new, top_k=top_k, top_p=top_p, min_p=min_p,
                  costs=budget_lib.padded(table) if auto else None, start=start,
                  start_len=hit.p if hit is not None else None,
                  grid=pc.grid if pc is not None else 0, on_chunk=on_chunk)
    oracle = (jnp.asarray(np.asarray(_oracle_tokens, np.int32)) if _oracle_tokens is not None
              else jnp.zeros((1,), jnp.int32))
    rounds = loop_fn(target, dcfg, plan, None if loop == "device" else int(sync_every))
    fresh = getattr(rounds, "_cache_size", lambda: 1)() == 0  # (a jitted function never called)
    early = (precompile and target.mesh is None and fresh) or _compile_only
    if early:  # a first call: its programs side by side
        jobs, state = pre.programs()
        extra = (jax.ShapeDtypeStruct((), jnp.int32),) if loop == "device" else ()
        # the rounds last and not waited for: the first token needs only the prefill's programs, lowered first (one
        # GIL: the rounds' 7-9 s of lowering at 27B would delay theirs); the rounds compile while the prefill runs
        # and its token is streamed
        jobs.append((rounds, (target.leaves, dparams, state, precompile_lib.abstract(oracle), *extra)))
        precompile_lib.compile_all(jobs, background=(rounds,))
        if _compile_only:
            return None
    while not pre.advance():  # enqueued back to back: nothing is read until the first token
        if on_prefill is not None:
            pre.wait()
            on_prefill(pre._end, len(ids))
    state = pre.state
    state = sharding.place(state, target.mesh)
    first_np = int(np.asarray(state.root)[0])
    ttft = time.perf_counter() - t0
    if on_tokens:
        on_tokens([first_np])

    t_wait = t1 = time.perf_counter()
    if early and (max_new == 1 or stop_mask[first_np]):  # the first token ends it: no round runs, none waited for
        n_out, n_rounds, tokens = 1, 0, [first_np]
    else:
        precompile_lib.ready(rounds)  # a first call: its rounds may still be compiling
        t1 = time.perf_counter()
        if loop == "device":
            state, prog = rounds(target.leaves, dparams, state, oracle, jnp.int32(NO_LIMIT))
        else:
            run = functools.partial(rounds, target.leaves, dparams)
            state, prog = _host_loop(run, state, oracle, int(sync_every), max_new, on_tokens)
        n_out, n_rounds = (int(x) for x in jax.device_get((prog.n_out, prog.n_rounds)))
        tokens = np.asarray(prog.out)[0, :n_out].tolist()
        if on_tokens and loop == "device" and n_out > 1:
            on_tokens(tokens[1:])
    t2 = time.perf_counter()
    acc = np.asarray(state.acc)[:n_rounds].tolist()
    decode_s = t2 - t1
    stats = {
        "method": method, "rounds": n_rounds, "new_tokens": n_out,
        "time_to_first_token_s": ttft, "decode_s": decode_s, "compile_wait_s": t1 - t_wait,
        "tokens_per_s": (n_out - 1) / decode_s if decode_s > 0 and n_out > 1 else 0.0,
        "mean_acceptance_length": float(np.mean(acc)) if acc else 0.0,
        "tree_budget": ("auto" if auto else budget) if method == "ddtree" else None,
        "cached_tokens": hit.p if hit is not None else 0,
    }
    if auto:  # the candidate chosen per round (budget_lib.CHAIN = 0: chain DFlash) and the cost table used
        chosen = np.asarray(state.auto.chosen)[:n_rounds].tolist()
        stats.update(budget_per_round=chosen, budget_counts=budget_lib.summary(chosen),
                     budget_predicted_mean=float(np.mean(np.asarray(state.auto.predicted)[:n_rounds]))
                     if n_rounds else 0.0, budget_costs=table.source)
    return Generation(tokens=tokens, acceptance_lengths=acc, stats=stats)


def compile_call(target: Target, prompt_ids, **kw) -> None:
    """Compile, side by side, the programs `generate(target, prompt_ids, **kw)` runs, and run nothing. The target
    and the drafter may be abstract (`model.target.abstract_target`, `model.drafter.abstract_params`: the weights'
    shapes only): scripts/generate.py compiles its warm-up's programs this way while the weights load; the
    `generate` call that follows then finds them compiled (when the loaded pair has the predicted structure;
    otherwise it compiles as usual)."""
    generate(target, prompt_ids, **kw, _compile_only=True)


def _copy_to_host(prog: Progress, with_out: bool):
    for x in (prog.done, prog.n_out, prog.n_rounds) + ((prog.out,) if with_out else ()):
        x.copy_to_host_async()


def _host_loop(run, state, oracle, k: int, max_new: int, on_tokens):
    """k rounds per call (`loop_fn(..., chunk=k)`: no host synchronisation inside a call) until done, the next
    call enqueued before the host waits for the previous one's progress (copied to the host asynchronously), so
    the GPU does not wait on Python between calls. No call is enqueued once the calls in flight are certain to
    end the generation (every round emits at least one token): only a stop id can leave rounds that run after
    `done` (at most one call's; they change nothing). -> (final state, its Progress)."""
    stream = on_tokens is not None
    shown = 1
    pending = collections.deque()

    def enqueue(st):
        st, prog = run(st, oracle)
        _copy_to_host(prog, stream)
        pending.append(prog)
        return st

    state = enqueue(state)
    latest = pending[-1]
    while True:
        if shown + k * len(pending) < max_new:  # the calls in flight may not reach max_new: one more
            state = enqueue(state)
            latest = pending[-1]
        prog = pending.popleft()
        done, n_out = bool(np.asarray(prog.done)), int(np.asarray(prog.n_out))
        if stream and n_out > shown:
            on_tokens(np.asarray(prog.out)[0, shown:n_out].tolist())
        shown = max(shown, n_out)
        if done:  # (not done implies n_out < max_new: the rule above has a call in flight)
            return state, latest
