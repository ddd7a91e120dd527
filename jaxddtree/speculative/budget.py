"""`tree_budget="auto"`: each round's tree budget chosen to maximise expected tokens per second.

Per round (inside the jitted round, so `loop="device"` needs no host decision):

1. The drafter's block is drafted once and the DDTree is built once, at the largest candidate budget B.
2. Expected accepted length per candidate, under the draft marginals. The build returns its nodes ordered
   by (path log-prob desc, depth asc) (`kernels_pallas/tree_build.py`): a node's path probability is at most
   its parent's and ties put the parent first, so the first b drafted nodes are the best b-node tree (the tree
   the build at budget b returns, up to ties) and truncating the tree to its first b + 1 rows is a valid tree.
   A node is accepted iff its whole path is, so E[tokens emitted](b) = 1 (the bonus) + Σ of the first b nodes'
   path probabilities: one prefix sum gives every budget. Chain DFlash: 1 + Σ_d Π_{k<=d} p_max(k).
3. Calibration: drafter probabilities are not calibrated (the demo drafter's predict about 20 % fewer tokens
   per round than it gets, the same share for every candidate, CPU 2026-12-01), so the drafted part of every
   estimate is scaled by one running factor s = (A + W) / (P + W) (A: drafted tokens actually accepted so far
   in this generation, P: what the chosen candidates' estimates predicted, W = `PRIOR_TOKENS` pseudo-tokens at
   s = 1; s clipped to [`S_MIN`, `S_MAX`]): E'(b) = 1 + s (E(b) - 1).
4. Round cost c(b, L): a table of round times (ms) per candidate × committed length L (`CostTable`),
   interpolated linearly in L (extrapolated linearly past the ends, floored at 1 µs). The table is data in the
   decode state, so any table shares one compilation.
5. b* = argmax E'(b) - λ c(b, L), λ = the generation's rate so far in tokens per ms (`choose` says why not
   the per-round ratio E'/c; the first round takes the best ratio; `decide`); a `lax.switch` in
   `loop._spec_round` runs the round's `verify_stage` + `commit_stage` on the tree truncated to b* + 1 rows
   (static shapes per branch; the chain is one branch), then `record` updates the statistics. Every branch
   updates the caches.

Exact: the choice changes which tree is verified, never the verification, so at T = 0 the tokens are the AR
tokens, and at T > 0 the choice depends only on the draft and on earlier rounds, not on this round's samples.

Cost tables (`resolve_costs`): an explicit table (a `CostTable`, a dict, or a JSON file holding the
`round_ms_by_budget_context` key: {"chain" | "16" | ...: {"<context>": ms}}, as `benchmarks/bench.py` writes
into benchmarks/results/h200.json); else, on an H200, that shipped file if it holds the key; else the
documented default `model_costs` (linear in tree rows and in L, fitted to the 27B H200 round times of issue 27).
Where no table fits the device (the CPU), scripts/generate.py's warm-up times each candidate (`calibrate`) and
plain AR, passes the measured table, and decodes with AR when no candidate beat it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxddtree.model import draft_vocab as draft_vocab_lib
from jaxddtree.speculative import tree as tree_lib

CHAIN = 0  # candidate id of chain DFlash (its tree: the drafter's argmax block, block_size rows)
CANDIDATES = (CHAIN, 15, 31, 63, 127)  # tree rows 16 / 32 / 64 / 128: the GEMMs like them (H200: round(63) 20.03 vs round(64) 20.98 ms)
TABLE_KEY = "round_ms_by_budget_context"  # fixed-budget rounds: {"chain"|"16"|...: {"<context>": ms}}
AUTO_TABLE_KEY = "auto_round_ms_by_budget_context"  # auto rounds forced to one candidate (same layout)
PRIOR_TOKENS = 8.0
S_MIN, S_MAX = 0.05, 2.0
SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200.json"

# default model (ms): c(rows, L) = C0 + C1 L + (rows - 16) (C2 + C3 L), fitted to the H200 27B round times with
# the Mosaic GPU tree attention (device loop, 2026-12-01, BENCHMARKS.md session 9): chain (16 rows) 17.77 / 20.59 ms
# and DDTree(64) (65 rows) 20.83 / 28.14 ms at L = 4096 / 131072 (with the Triton kernel: 20.9 / 33.3).
MODEL = (17.675, 2.2201e-5, 5.9489e-2, 7.2278e-7)


def name(b: int) -> str:
    return "chain" if int(b) == CHAIN else str(int(b))


def parse(value) -> int:
    """A table key ("chain" or a budget) -> candidate id."""
    s = str(value).strip().lower()
    if s in ("chain", "dflash", "0"):
        return CHAIN
    b = int(s)
    if b < 1:
        raise ValueError(f"a budget must be >= 1 or 'chain', got {value!r}")
    return b


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Round time (ms) per candidate (`candidates`, CHAIN = 0) × committed length (`contexts`, ascending)."""
    candidates: tuple[int, ...]
    contexts: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]  # [K][C]
    source: str = "given"

    def __post_init__(self):
        if not self.candidates or not self.contexts:
            raise ValueError("a cost table needs at least one candidate and one context")
        if list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"cost table contexts must be distinct and ascending, got {self.contexts}")
        if len(self.ms) != len(self.candidates) or any(len(r) != len(self.contexts) for r in self.ms):
            raise ValueError("cost table: one row of ms per candidate, one entry per context")
        if not all(np.isfinite(v) and v > 0 for r in self.ms for v in r):
            raise ValueError("cost table: round times must be finite and > 0 ms")

    def at(self, length) -> np.ndarray:
        """Host version of `interpolate`: [K] ms at committed length `length`."""
        return np.asarray(interpolate(jnp.asarray(self.contexts, jnp.float32), jnp.asarray(self.ms, jnp.float32),
                                      jnp.float32(length)))

    def subset(self, candidates) -> "CostTable":
        """The rows of `candidates` (ValueError naming a missing one)."""
        rows = []
        for b in candidates:
            if b not in self.candidates:
                raise ValueError(f"the cost table ({self.source}) has no round time for budget {name(b)}; it has "
                                 f"{', '.join(name(c) for c in self.candidates)}")
            rows.append(self.ms[self.candidates.index(b)])
        return CostTable(tuple(candidates), self.contexts, tuple(rows), self.source)

    def flat(self, length) -> "CostTable":
        """The table at one committed length, constant in L (benchmarks project one context this way)."""
        return CostTable(self.candidates, (int(length),), tuple((float(v),) for v in self.at(length)),
                         f"{self.source} at {int(length)}")


def forcing(candidates, b: int) -> CostTable:
    """A table under which auto always picks `b` (1 ms vs 1e4 ms for the others): benchmarks time the auto round
    forced to each candidate with one compilation (`AUTO_TABLE_KEY`)."""
    return CostTable(tuple(candidates), (0,), tuple((1.0 if c == b else 1e4,) for c in candidates),
                     f"forcing {name(b)}")


def model_costs(candidates, block_size: int, contexts=(4096, 131072)) -> CostTable:
    """The documented default (see `MODEL`): rows = budget + 1 (chain: block_size)."""
    c0, c1, c2, c3 = MODEL
    rows = lambda b: block_size if b == CHAIN else b + 1
    ms = tuple(tuple(max(c0 + c1 * L + (rows(b) - 16) * (c2 + c3 * L), 1e-3) for L in contexts) for b in candidates)
    return CostTable(tuple(candidates), tuple(contexts), ms, "default model (linear in rows and context)")


def from_dict(table: dict, source: str = "given") -> CostTable:
    """{"chain" | "<budget>": {"<context>": ms}} (or a dict holding it under TABLE_KEY) -> CostTable."""
    if TABLE_KEY in table:
        table = table[TABLE_KEY]
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{source}: expected {{'chain'|'<budget>': {{'<context>': ms}}}} under '{TABLE_KEY}'")
    cands = sorted(parse(k) for k in table)
    by = {parse(k): {int(c): float(v) for c, v in row.items()} for k, row in table.items()}
    contexts = sorted({c for row in by.values() for c in row})
    missing = [(name(b), c) for b in cands for c in contexts if c not in by[b]]
    if missing:
        raise ValueError(f"{source}: the cost table lacks (budget, context) entries {missing[:4]}")
    return CostTable(tuple(cands), tuple(contexts), tuple(tuple(by[b][c] for c in contexts) for b in cands), source)


def load(path) -> CostTable:
    """A JSON file holding TABLE_KEY (e.g. benchmarks/results/h200.json) -> CostTable."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the round-time table {path}: {e}") from None
    if not isinstance(obj, dict) or TABLE_KEY not in obj:
        raise ValueError(f"{path} has no '{TABLE_KEY}' (run benchmarks/bench.py to measure it)")
    return from_dict(obj[TABLE_KEY], path)


def resolve_costs(costs, vocab_size: int, block_size: int, device=None) -> CostTable:
    """The cost table of an auto generation (see the module docstring); its candidates are the table's own
    (default: CANDIDATES) that the vocabulary allows (`candidates_for`)."""
    if isinstance(costs, CostTable):
        table = costs
    elif isinstance(costs, dict):
        table = from_dict(costs)
    elif costs is not None:
        table = load(costs)
    else:
        table = shipped(device)
        if table is None:
            return model_costs(candidates_for(vocab_size), block_size)
    return table.subset(candidates_for(vocab_size, table.candidates))


def shipped(device=None) -> CostTable | None:
    """benchmarks/results/h200.json's table on an H200 when it exists and covers CANDIDATES, else None."""
    device = device or jax.devices()[0]
    if "H200" not in getattr(device, "device_kind", "") or not SHIPPED.exists():
        return None
    try:
        table = load(SHIPPED)
    except ValueError:
        return None
    return table.subset(CANDIDATES) if set(CANDIDATES) <= set(table.candidates) else None


def calibrate(run, candidates, device_kind: str) -> tuple[CostTable, dict[int, float]]:
    """Round times measured on this device, for one without a table (`shipped`: the H200 only; on others the
    default model is the H200's shape, which made auto slower than plain decoding on the CPU). `run(table)` ->
    (rounds, new tokens, decode seconds) of a short generation whose auto rounds `table` forces to one candidate
    (`forcing`: the table is data, so every candidate shares the compiled round). -> (the measured table, flat
    in the context; tokens/s per candidate on that generation)."""
    ms, rates = {}, {}
    for b in candidates:
        rounds, new, secs = run(forcing(candidates, b))
        if rounds < 1 or secs <= 0:
            raise ValueError(f"budget {name(b)}: no round to time ({rounds} rounds in {secs:.3g} s)")
        ms[b], rates[b] = 1e3 * secs / rounds, max(new - 1, 0) / secs
    cands = tuple(sorted(ms))
    return CostTable(cands, (0,), tuple((ms[b],) for b in cands), f"measured at warm-up ({device_kind})"), rates


def candidates_for(vocab_size: int, candidates=CANDIDATES) -> tuple[int, ...]:
    """The candidates a model allows (tree budgets < vocab_size), chain first, budgets ascending."""
    out = tuple(sorted({int(b) for b in candidates if b == CHAIN or 1 <= b < vocab_size}))
    if not any(b != CHAIN for b in out):
        raise ValueError(f"tree_budget='auto' needs a candidate budget in [1, vocab_size={vocab_size}), got "
                         f"{', '.join(name(b) for b in candidates)}")
    return out


# ---------------------------------------------------------------------------------------------- traced


@struct.dataclass
class AutoState:
    """Carried in DecodeState.auto: the cost table as data, the chosen candidate per round, the calibration."""
    contexts: jax.Array  # [C] f32
    ms: jax.Array  # [K, C] f32
    chosen: jax.Array  # [max_new] int32: candidate id per round (CHAIN = 0)
    sums: jax.Array  # [4] f32: drafted tokens accepted, predicted (uncalibrated), tokens emitted, table ms
    predicted: jax.Array  # [max_new] f32: the chosen candidate's calibrated E per round


COLUMNS = 8  # tables of up to this many contexts are padded to it: every such table shares one compilation


def padded(table: CostTable) -> tuple[np.ndarray, np.ndarray]:
    """(contexts [C'], ms [K, C']) with C' = max(C, COLUMNS): the extra columns lie past the last context on
    the table's own extrapolation (the last segment's line; one column: constant), so `interpolate` is
    unchanged."""
    x = np.asarray(table.contexts, np.float64)
    y = np.asarray(table.ms, np.float64)
    extra = COLUMNS - len(x)
    if extra <= 0:
        return x.astype(np.float32), y.astype(np.float32)
    slope = (y[:, -1] - y[:, -2]) / (x[-1] - x[-2]) if len(x) > 1 else np.zeros(len(y))
    step = max(x[-1], 1.0)
    xs = x[-1] + step * np.arange(1, extra + 1)
    ys = y[:, -1:] + slope[:, None] * (xs - x[-1])[None, :]
    return np.concatenate([x, xs]).astype(np.float32), np.concatenate([y, ys], axis=1).astype(np.float32)


def init_state(contexts, ms, out_len: int) -> AutoState:
    """The auto state of a new generation (traceable: `loop._start` builds it in its one call) from `padded`'s
    arrays; per-round buffers of `out_len` rounds (the decode state's acceptance buffer)."""
    return AutoState(contexts=jnp.asarray(contexts, jnp.float32), ms=jnp.asarray(ms, jnp.float32),
                     chosen=jnp.zeros((out_len,), jnp.int32), sums=jnp.zeros((4,), jnp.float32),
                     predicted=jnp.zeros((out_len,), jnp.float32))


def interpolate(contexts, ms, length) -> jax.Array:
    """ms [K, C] at committed length `length`: linear in L between the table's contexts, linear past the
    ends (the two nearest columns), floored at 1e-3 ms; one column: constant."""
    length = jnp.asarray(length, jnp.float32)
    if contexts.shape[0] == 1:
        return ms[:, 0]
    i = jnp.clip(jnp.searchsorted(contexts, length, side="right") - 1, 0, contexts.shape[0] - 2)
    x0, x1 = contexts[i], contexts[i + 1]
    w = (length - x0) / (x1 - x0)
    return jnp.maximum(ms[:, i] + w * (ms[:, i + 1] - ms[:, i]), 1e-3)


def log_norm(draft_logits) -> tuple[jax.Array, jax.Array]:
    """[D, V] -> (m, lse) [D]: log_softmax(x)[d, v] = (x[d, v] - m[d]) - lse[d] (`build_tree`'s formula, fp32),
    without forming the [D, V] log-probs."""
    x = draft_logits.astype(jnp.float32)
    m = jnp.max(x, axis=-1)
    return m, jnp.log(jnp.sum(jnp.exp(x - m[:, None]), axis=-1))


def tree_expectation(tree: tree_lib.Tree, draft_logits, mask, vocab=None) -> jax.Array:
    """[N-1]: entry b-1 = expected tokens emitted by the tree truncated to its first b drafted nodes
    (1 + Σ path probabilities), for a tree in `build_tree`'s order; draft_logits [D, V], or [D, Vp] over the
    columns of the draft vocabulary `vocab`."""
    n = tree.num_nodes
    idx = jnp.arange(n)
    drafted = tree.valid & (idx > 0)
    m, lse = log_norm(draft_logits)
    d = jnp.clip(tree.depths - 1, 0)
    col = draft_vocab_lib.columns_of(vocab, jnp.maximum(tree.tokens, 0))  # (a drafted node's id is in the subset)
    x = draft_logits[d, col].astype(jnp.float32)  # [N]
    lp = jnp.where(drafted, (x - m[d]) - lse[d], 0.0)  # [N]
    path = jnp.sum(jnp.where(mask, lp[None, :], 0.0), axis=-1)  # [N]: Σ over the node and its ancestors
    p = jnp.where(drafted, jnp.exp(path), 0.0)
    return 1.0 + jnp.cumsum(p[1:])


def chain_expectation(draft_logits) -> jax.Array:
    """Expected tokens emitted by the argmax chain: 1 + Σ_d Π_{k<=d} p_max(k) (log p_max(d) = -lse[d])."""
    _, lse = log_norm(draft_logits)
    return 1.0 + jnp.sum(jnp.exp(jnp.cumsum(-lse)))


def truncate(tree: tree_lib.Tree, n: int) -> tree_lib.Tree:
    """The first n rows (parents precede children in `build_tree`'s order, so it is a tree)."""
    return tree_lib.Tree(tokens=tree.tokens[:n], parents=tree.parents[:n], depths=tree.depths[:n],
                         valid=tree.valid[:n], max_depth=tree.max_depth)


def verify_groups(candidates, chain_rows: int) -> list[list[int]]:
    """The indices of `candidates` grouped by the rows their verify takes (a tree budget b: b + 1; the chain:
    `chain_rows`, the drafter's block), in order of first appearance: one `lax.switch` branch per group. The chain
    and the tree of as many rows (budget 15 beside a 16-token block) share one verify, their trees picked as data:
    a branch fewer to compile, the same work when it runs."""
    rows = [chain_rows if b == CHAIN else b + 1 for b in candidates]
    return [[i for i, r in enumerate(rows) if r == n] for n in dict.fromkeys(rows)]


def expectations(candidates, tree, mask, draft_logits, vocab=None) -> jax.Array:
    """[K] uncalibrated expected tokens per round of each candidate."""
    e_tree = tree_expectation(tree, draft_logits, mask, vocab)
    e = [chain_expectation(draft_logits) if b == CHAIN else e_tree[b - 1] for b in candidates]
    return jnp.stack(e)


def scale(sums) -> jax.Array:
    """The calibration factor s of the module docstring."""
    return jnp.clip((sums[0] + PRIOR_TOKENS) / (sums[1] + PRIOR_TOKENS), S_MIN, S_MAX)


def rate(sums, expected, cost) -> jax.Array:
    """λ (tokens per ms) of `choose`: the generation's rate so far (tokens emitted / table ms of the chosen
    rounds); before the first round, this round's best ratio (then `choose` picks the best-ratio candidate)."""
    return jnp.where(sums[3] > 0, sums[2] / jnp.maximum(sums[3], 1e-9), jnp.max(expected / cost))


def choose(expected, cost, lam) -> jax.Array:
    """argmax_b E(b) - λ c(b) (ties: the first listed). The long-run rate of a policy is E[tokens] / E[ms] per
    round (renewal-reward), and a policy is rate-optimal iff every round maximises E(b) - λ* c(b), λ* its own
    rate (Dinkelbach), so λ is the running rate; the per-round ratio E(b) / c(b) is not (it over-weights cheap
    rounds when some rounds are much easier than others)."""
    return jnp.argmax(expected - lam * cost).astype(jnp.int32)


@struct.dataclass
class Decision:
    """One round's choice (`decide`): the index k into the candidates and what `record` keeps of it."""
    k: jax.Array  # int32 index into the candidates
    expected: jax.Array  # f32: the chosen candidate's calibrated E
    raw: jax.Array  # f32: its uncalibrated E
    cost: jax.Array  # f32: its table ms at this committed length


def decide(auto: AutoState, length, candidates, tree, mask, draft_logits, vocab=None) -> Decision:
    """The candidate of this round (module docstring, steps 2-5), from the draft and the tree built at
    max(candidates) (`build_tree`'s order; mask: its ancestor mask) at committed length `length`; vocab: the
    draft vocabulary whose columns draft_logits holds, or None."""
    raw = expectations(candidates, tree, mask, draft_logits, vocab)  # [K]
    s = scale(auto.sums)
    expected = 1.0 + s * (raw - 1.0)
    cost = interpolate(auto.contexts, auto.ms, length)
    k = choose(expected, cost, rate(auto.sums, expected, cost))
    return Decision(k=k, expected=expected[k], raw=raw[k], cost=cost[k])


def record(auto: AutoState, r, n_acc, candidates, d: Decision) -> AutoState:
    """`auto` after round r (0-based) ran candidate d.k and accepted n_acc rows (bonus included)."""
    ids = jnp.asarray(candidates, jnp.int32)
    return auto.replace(
        chosen=auto.chosen.at[r].set(ids[d.k]), predicted=auto.predicted.at[r].set(d.expected),
        sums=auto.sums + jnp.stack([(n_acc - 1).astype(jnp.float32), d.raw - 1.0, n_acc.astype(jnp.float32),
                                    d.cost]))


def summary(chosen) -> dict[str, int]:
    """{"chain" | "<budget>": rounds} of a list of chosen candidate ids."""
    out: dict[str, int] = {}
    for b in chosen:
        out[name(b)] = out.get(name(b), 0) + 1
    return out
