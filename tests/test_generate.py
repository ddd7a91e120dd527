"""generate(): AR / DFlash / DDTree end to end on tiny fp32 models (CPU).

  * lossless at T = 0: dflash and ddtree (budgets 1, 2, 7, 32, 64) give exactly the AR tokens, with and
    without stop ids (inclusive stop, exact max_new_tokens), over several prompts / seeds;
  * long accepted paths (the `_oracle_tokens` test hook ranks the AR continuation high in the draft
    logits): rounds accepting 8 tokens (the whole block) occur and the output is still the AR output,
    host and device loops alike;
  * T > 0: the empirical joint distribution of the first three tokens under DDTree (and AR, as a sanity
    check) matches the target's exact distribution, enumerated with `jaxddtree.score` (chi-square);
  * a round needs no host transfer (run inside `jax.transfer_guard("disallow")`), and repeated calls
    with other prompts / seeds / stop ids of the same bucket reuse one compilation per configuration.

Compile time dominates on CPU, so every test reuses a few static configurations: MAX_NEW new tokens,
prompt lengths 17..24 (one prefill width, one cache bucket) and fixed-length oracles.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(HERE), HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402

import helpers_dflash  # noqa: E402
import hf_models  # noqa: E402
import jaxddtree  # noqa: E402
from jaxddtree.speculative import loop as loop_lib  # noqa: E402
from jaxddtree.speculative import precompile  # noqa: E402

V = 97
BLOCK = 8  # drafter block size: a round accepts at most BLOCK tokens (root + BLOCK - 1 drafts)
MAX_NEW = 40
BUDGETS = (1, 2, 7, 32, 64)
PROMPTS = {(seed, n): np.random.RandomState(seed).randint(0, V - 1, n).tolist()
           for seed, n in ((0, 17), (1, 20), (2, 24))}  # one prefill width (64), one cache bucket
SPEC = [("dflash", 64)] + [("ddtree", b) for b in BUDGETS]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return helpers_dflash.tiny_pair(tmp_path_factory, "gen", V, BLOCK)


def run(pair, prompt, method, budget=64, **kw):
    target, drafter = pair
    kw.setdefault("max_new_tokens", MAX_NEW)
    return jaxddtree.generate(target, prompt, drafter=drafter, method=method, tree_budget=budget, **kw)


@pytest.fixture(scope="module")
def ar_ref(pair):
    """AR tokens (no stop ids) per prompt."""
    out = {}
    for key, prompt in PROMPTS.items():
        g = run(pair, prompt, "ar", seed=key[0])
        assert len(g.tokens) == MAX_NEW and g.acceptance_lengths == [1] * (MAX_NEW - 1)
        out[key] = g.tokens
    return out


def truncate(tokens, stops):
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


def stop_cases(ar):
    """Stop sets drawn from the AR output so that they trigger: first token, early, late, two ids."""
    return [{ar[0]}, {ar[5]}, {ar[23]}, {ar[31], ar[12]}]


def check_rounds(g, max_acc=BLOCK):
    """Bookkeeping: every round emits its acceptance length (the last one possibly cut by a stop id or
    max_new_tokens); the first token comes from the prefill."""
    n, acc = len(g.tokens), g.acceptance_lengths
    assert g.stats["rounds"] == len(acc) and g.stats["new_tokens"] == n
    assert all(1 <= a <= max_acc for a in acc), acc
    if acc:
        assert sum(acc[:-1]) < n - 1 <= sum(acc), (n, acc)
    else:
        assert n == 1


# ------------------------------------------------------------------------- compilation / host sync
def test_one_compilation_per_configuration(pair):
    """Different prompts (same bucket), seeds and stop ids reuse the compiled round of a (method, budget,
    max_new_tokens) configuration. (First in the file: when it runs first, the counts are exact.)"""
    fresh = loop_lib.TRACES["rounds"] == 0
    start = loop_lib.TRACES["rounds"]
    for method, budget in (("ar", 64), ("ddtree", 7)):
        before = loop_lib.TRACES["rounds"]
        sizes = []
        for i, (key, prompt) in enumerate(PROMPTS.items()):
            for seed, stops in ((key[0], None), (key[0] + 10, [5, 7]), (key[0] + 20, list(range(0, V, 3)))):
                run(pair, prompt, method, budget, seed=seed, stop_ids=stops)
                sizes.append(loop_lib.TRACES["rounds"])
        assert sizes[0] - before in (0, 1)  # 0: another test compiled this configuration already
        assert sizes == [sizes[0]] * len(sizes), f"{method}: recompiled across calls: {sizes}"
    if fresh:
        assert loop_lib.TRACES["rounds"] - start == 2


def test_round_runs_without_host_transfers(pair, ar_ref, monkeypatch):
    """The bound round (host loop: a few rounds per call; device loop: one call to the end) called on a
    prepared state inside transfer_guard("disallow"): any host<->device transfer inside a round (or a Python scalar smuggled into the call) would raise."""
    calls = []
    bound = loop_lib.loop_fn
    probe = jax.jit(lambda x: x + 1)  # one program for every call's check that the guard bites (its argument's
    #                                   transfer is refused on every call, compiled or not)

    def guarded(*a, **k):
        fn = bound(*a, **k)

        def wrapper(*args, **kw):
            with jax.transfer_guard("disallow"):
                with pytest.raises(Exception, match="[Dd]isallowed"):  # the guard bites
                    probe(np.ones(2, np.float32))
                out = fn(*args, **kw)
                jax.block_until_ready(out)
            calls.append("rounds")
            return out
        return wrapper

    monkeypatch.setattr(loop_lib, "loop_fn", guarded)
    key, prompt = next(iter(PROMPTS.items()))
    g = run(pair, prompt, "ddtree", 7, seed=3)
    assert g.tokens == ar_ref[key] and "rounds" in calls
    n = len(calls)
    g = run(pair, prompt, "ddtree", 32, loop="device", _oracle_tokens=ar_ref[key])
    assert g.tokens == ar_ref[key] and len(calls) == n + 1  # the whole generation in one call


# ------------------------------------------------------------------------------------ lossless, T = 0
def test_ar_stop_ids_and_max_new(pair, ar_ref):
    for key, prompt in PROMPTS.items():
        for stops in stop_cases(ar_ref[key]):
            g = run(pair, prompt, "ar", stop_ids=stops)
            assert g.tokens == truncate(ar_ref[key], stops)
            check_rounds(g, max_acc=1)


@pytest.mark.parametrize("method,budget", SPEC, ids=[f"{m}-{b}" for m, b in SPEC])
def test_lossless_greedy(pair, ar_ref, method, budget):
    for key, prompt in PROMPTS.items():
        ar = ar_ref[key]
        g = run(pair, prompt, method, budget, seed=key[0] + 1)
        assert g.tokens == ar, f"{method} budget {budget} prompt {key}"
        assert len(g.tokens) == MAX_NEW
        check_rounds(g)
        for stops in stop_cases(ar):
            g = run(pair, prompt, method, budget, stop_ids=stops)
            assert g.tokens == truncate(ar, stops), f"{method} budget {budget} prompt {key} stops {stops}"
            assert g.tokens[-1] in stops
            check_rounds(g)


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_long_accepted_paths(pair, ar_ref, method):
    """Oracle draft logits (the AR continuation ranked first 80% of the time, else boosted less; noise
    elsewhere): whole blocks get accepted and the output is unchanged; stops inside a long accepted
    round cut it at the stop id."""
    longest = []
    for key, prompt in PROMPTS.items():
        ar = ar_ref[key]
        g = run(pair, prompt, method, 32, _oracle_tokens=ar)
        assert g.tokens == ar
        check_rounds(g)
        assert g.stats["rounds"] < MAX_NEW // 2  # far fewer rounds than tokens
        longest.append(max(g.acceptance_lengths))
        for stops in ({ar[20]}, {ar[33]}):
            gs = run(pair, prompt, method, 32, _oracle_tokens=ar, stop_ids=stops)
            assert gs.tokens == truncate(ar, stops)
            check_rounds(gs)
        if method == "ddtree" and key == (0, 17):
            gd = run(pair, prompt, method, 32, _oracle_tokens=ar, loop="device")
            assert gd.tokens == ar and gd.acceptance_lengths == g.acceptance_lengths
    assert max(longest) >= BLOCK, longest  # a whole block (7 drafts + the bonus) accepted in one round


# ------------------------------------------------------------------------------------ distribution, T > 0
VS = 8  # tiny vocabulary: the joint law of 3 tokens has VS**3 = 512 cells
T_SAMPLE = 1.0
SMALL_PROMPT = [1, 2, 3, 4, 5]
N_DDTREE, N_AR = 1000, 300


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    tdir = str(tmp_path_factory.mktemp("gen_small_target"))
    hf_models.save_text_only(hf_models.causal_lm(1, vocab_size=VS), tdir)
    target = jaxddtree.load_target(tdir, "float32")
    ddir = str(tmp_path_factory.mktemp("gen_small_drafter"))
    cfg = helpers_dflash.tiny_config(hidden=64, vocab=VS, mask_token_id=VS - 1, num_target_layers=4,
                                     target_layer_ids=(1, 2), block_size=4)
    helpers_dflash.write_checkpoint(ddir, cfg, helpers_dflash.random_weights(cfg, seed=2))
    return target, jaxddtree.load_drafter(ddir, target, "float32")


def _softmax(x):
    z = np.exp((x - x.max(-1, keepdims=True)) / T_SAMPLE)
    return z / z.sum(-1, keepdims=True)


@pytest.fixture(scope="module")
def joint_logits(small_pair):
    """L[t1, t2] = the target's logits [3, V] predicting t1, t2, t3 after SMALL_PROMPT + [t1, t2]."""
    target, _ = small_pair
    n = len(SMALL_PROMPT)
    return np.stack([[np.asarray(jaxddtree.score(target, SMALL_PROMPT + [t1, t2]), np.float64)[n - 1:n + 2]
                      for t2 in range(VS)] for t1 in range(VS)])  # [VS, VS, 3, V]


def _joint(L, probs):
    """P[t1, t2, t3] of ancestral sampling with `probs` (logits [3, V] -> [3, V]), by enumeration of (t1, t2)."""
    P = np.zeros((VS, VS, VS))
    for t1 in range(VS):
        for t2 in range(VS):
            p = probs(L[t1, t2])
            P[t1, t2] = p[0, t1] * p[1, t2] * p[2]
    assert abs(P.sum() - 1) < 1e-6
    return P


@pytest.fixture(scope="module")
def exact_joint(joint_logits):
    """P[t1, t2, t3] of the target's ancestral sampling at T_SAMPLE."""
    return _joint(joint_logits, _softmax)


# top_k, top_p and min_p together: on this vocabulary each of them is the binding one for some rows
TRUNC = dict(top_k=5, top_p=0.8, min_p=0.1)


@pytest.fixture(scope="module")
def truncated_joint(joint_logits):
    """P[t1, t2, t3] of ancestral sampling from the truncated target distribution (helpers_sampling)."""
    from helpers_sampling import truncated_probs
    return _joint(joint_logits, lambda lg: truncated_probs(lg, T_SAMPLE, **TRUNC))


def chi_square_p(counts, P):
    from scipy.stats import chi2
    n = counts.sum()
    E, O = n * P.reshape(-1), counts.reshape(-1).astype(np.float64)
    big = E >= 5
    E = np.append(E[big], E[~big].sum())
    O = np.append(O[big], O[~big].sum())
    stat = float(((O - E) ** 2 / E).sum())
    return float(chi2.sf(stat, len(E) - 1)), stat, len(E)


def sample_counts(pair, method, n, **truncation):
    target, drafter = pair
    counts = np.zeros((VS, VS, VS), np.int64)
    first_round = []
    for seed in range(n):
        g = jaxddtree.generate(target, SMALL_PROMPT, drafter=drafter, method=method, tree_budget=4,
                               max_new_tokens=3, temperature=T_SAMPLE, seed=seed, **truncation)
        assert len(g.tokens) == 3
        counts[tuple(g.tokens)] += 1
        first_round.append(g.acceptance_lengths[0])
    return counts, np.asarray(first_round)


@pytest.mark.parametrize("method,n", [("ddtree", N_DDTREE), ("ar", N_AR)])
def test_sampling_distribution(small_pair, exact_joint, method, n):
    before = loop_lib.TRACES["rounds"]
    counts, first_round = sample_counts(small_pair, method, n)
    assert loop_lib.TRACES["rounds"] - before <= 1  # one compilation for all the seeds
    p, stat, bins = chi_square_p(counts, exact_joint)
    assert p > 1e-3, f"{method}: chi2 = {stat:.1f} over {bins} bins, p = {p:.2e}"
    if method == "ddtree":
        # the tree path matters: often t2 is a drafted child, so t3 comes from a verified tree node
        assert (first_round >= 2).mean() > 0.2, np.bincount(first_round)
        # and the test has power: the same samples reject a slightly wrong law (t3 drawn given t2 + 1)
        wrong = exact_joint.sum(-1, keepdims=True) * (exact_joint / exact_joint.sum(-1, keepdims=True))[
            :, (np.arange(VS) + 1) % VS]
        assert chi_square_p(counts, wrong)[0] < 1e-3


@pytest.mark.parametrize("method,n", [("ddtree", 600), ("dflash", 400), ("ar", 300)])
def test_truncated_sampling_distribution(small_pair, joint_logits, exact_joint, truncated_joint, method, n):
    """With top_k / top_p / min_p, every method samples the truncated target distribution: no sample outside
    its support, chi-square on the rest; one compilation for all the seeds and truncation values."""
    from helpers_sampling import truncated_probs
    full = truncated_probs(joint_logits, T_SAMPLE, **TRUNC) > 0
    for k, v in TRUNC.items():  # each control is the binding one for some conditional
        alone = truncated_probs(joint_logits, T_SAMPLE, **{k: v}) > 0
        others = truncated_probs(joint_logits, T_SAMPLE, **{o: w for o, w in TRUNC.items() if o != k}) > 0
        assert (alone != 1).any() and (others != full).any(), k
    assert (truncated_joint == 0).mean() > 0.5  # the truncation bites
    before = loop_lib.TRACES["rounds"]
    counts, first_round = sample_counts(small_pair, method, n, **TRUNC)
    alt, _ = sample_counts(small_pair, method, 50, top_k=3, top_p=0.5, min_p=0.3)  # other values, same plan
    assert loop_lib.TRACES["rounds"] - before <= 1
    assert counts[truncated_joint == 0].sum() == 0, "a sample outside the truncated support"
    p, stat, bins = chi_square_p(counts, truncated_joint)
    assert p > 1e-3, f"{method}: chi2 = {stat:.1f} over {bins} bins, p = {p:.2e}"
    assert chi_square_p(counts, exact_joint)[0] < 1e-3  # the test has power: the untruncated law is rejected
    if method != "ar":
        # drafted tokens get accepted (the random drafter's chain less often than the tree)
        assert (first_round >= 2).mean() > (0.2 if method == "ddtree" else 0.1), np.bincount(first_round)


# ------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("call,error,match", [
    (lambda t, d: jaxddtree.generate(t, [1, 2], temperature=float("nan")), ValueError, "finite number >= 0"),
    (lambda t, d: jaxddtree.generate(t, [1, 2], temperature=float("inf")), ValueError, "finite number >= 0"),
    (lambda t, d: jaxddtree.generate(t, [1, 2], temperature=-0.5), ValueError, "finite number >= 0"),
    (lambda t, d: jaxddtree.generate(t, [1, 2], temperature=1, top_p=0), ValueError, r"top_p must be in \(0, 1\]"),
    (lambda t, d: jaxddtree.generate(t, [1, 2], top_k=-2), ValueError, "top_k must be an integer >= 0"),
    (lambda t, d: jaxddtree.generate(t, [1, 2], min_p=1.0), ValueError, r"min_p must be in \[0, 1\)"),
    (lambda t, d: jaxddtree.generate(t, "hello"), TypeError, "prompt_ids must be integer token ids, not a string"),
    (lambda t, d: jaxddtree.generate(t, [1.5, 2.7], drafter=d, method="ddtree"), TypeError,
     "prompt_ids must be integers, got float64"),
    (lambda t, d: jaxddtree.score(t, [1.5, 2.7]), TypeError, "token_ids must be integers, got float64"),
    (lambda t, d: jaxddtree.score(t, "hello"), TypeError, "token_ids must be integer token ids, not a string"),
    (lambda t, d: jaxddtree.score(t, [True, False]), TypeError, "token_ids must be integers, got bool"),
    (lambda t, d: jaxddtree.score_tree(t, "hello", [1, 2], [-1, 0]), TypeError, "prefix_ids .* not a string"),
    (lambda t, d: jaxddtree.score_tree(t, [1, 2], [1.0, 2.5], [-1, 0]), TypeError, "tree_tokens must be integers"),
    (lambda t, d: jaxddtree.score_tree(t, [1, 2], [1, 2], [-1, 0.5]), TypeError, "parents must be integers"),
])
def test_bad_values_rejected(pair, call, error, match):
    """Values that once got through (NaN/inf temperature: zeros or uniform noise; float ids: truncated; a
    string: a numpy error) raise one clear error before anything is compiled."""
    with pytest.raises(error, match=match):
        call(*pair)


# ------------------------------------------------------------------------- long prompts, device memory
def test_long_prompts_prefill_in_long_chunks():
    from jaxddtree.model import prefill
    assert prefill.chunk_size(20) == 64 and prefill.chunk_size(100) == 256
    assert prefill.chunk_size(100, 512) == 104
    assert prefill.chunk_widths(100) == [(64, 1), (256, 65)]
    assert prefill.chunk_widths(100_000)[-1] == (prefill.LONG_PREFILL_CHUNK, prefill.LONG_PROMPT + 1)
    assert prefill.chunk_size(prefill.LONG_PROMPT) == prefill.PREFILL_CHUNK
    assert prefill.chunk_size(prefill.LONG_PROMPT + 1) == prefill.LONG_PREFILL_CHUNK
    assert prefill.chunk_size(100_000, 512) == 512
    # generate.py's warm-up prompt: the shortest with the same chunk width
    assert [prefill.warmup_length(n) for n in (5, 64, 65, 8192, 8193, 131072)] == [1, 1, 65, 65, 8193, 8193]


def test_prefill_progress_and_a_shorter_warmup_compile_the_same_programs(pair):
    """on_prefill(done, total) after each chunk of a long prompt; a warm-up on `warmup_length` tokens with the run's
    cache capacity (what generate.py does) leaves the run nothing to compile, and the tokens are those of a run
    without either."""
    from jaxddtree.model import prefill
    target, drafter = pair
    prompt = np.random.RandomState(5).randint(0, V - 1, 600).tolist()  # 256-token chunks: 3
    S = loop_lib.capacity(target, drafter.config, "ddtree", 7, len(prompt), MAX_NEW)[1]
    plain = run(pair, prompt, "ddtree", 7)
    seen = []
    run(pair, prompt[:prefill.warmup_length(len(prompt))], "ddtree", 7, cache_len=S, stop_ids=range(V))
    precompile.ready()  # (its rounds compile in the background: no round runs after a stop at the first token)
    compiles = []

    def count(event, secs, fun_name=None, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append((fun_name, round(secs, 2)))
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        g = run(pair, prompt, "ddtree", 7, cache_len=S, on_prefill=lambda d, t: seen.append((d, t)))
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []  # the warm-up compiled every program the run uses
    assert seen == [(256, 600), (512, 600), (600, 600)]
    assert g.tokens == plain.tokens


class _FakeGPU:
    device_kind = "FakeGPU 1G"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": self.limit // 4}


def test_a_cache_that_does_not_fit_is_refused_before_any_work(pair):
    """The caches of prompt + max_new_tokens must fit in the device's free memory; otherwise one line that
    states the need and what is free (checked against a fake device that reports memory statistics)."""
    target, drafter = pair
    with pytest.raises(ValueError, match=r"100000 tokens.*does not fit on FakeGPU 1G: the caches for \d+ positions "
                                         r"need [\d.]+ GiB .* GiB of 1.0 GiB are free"):
        loop_lib.check_memory(target, drafter, 131072, 100000, 64, 2048, device=_FakeGPU(1 << 30))
    loop_lib.check_memory(target, drafter, 131072, 100000, 64, 2048, device=_FakeGPU(1 << 40))  # fits
    loop_lib.check_memory(target, drafter, 131072, 100000, 64, 2048)  # the CPU reports no statistics


def test_every_temperature_above_zero_shares_one_compilation(pair):
    """The temperature is data in the jitted loop: a server's requests at 0.3, 0.7, 1.3 reuse one round."""
    # test_one_compilation_per_configuration's ddtree-7 configuration (sampling classes are data too: its greedy
    # round is the sampled one), so that the first call below compiles nothing new either
    prompt = PROMPTS[(0, 17)]
    run(pair, prompt, "ddtree", 7, temperature=0.5)
    before = loop_lib.TRACES["rounds"]
    outs = [run(pair, prompt, "ddtree", 7, temperature=t, seed=1).tokens for t in (0.3, 0.7, 1.3)]
    assert loop_lib.TRACES["rounds"] == before
    assert all(len(o) == MAX_NEW for o in outs)


def test_round_calls_pass_only_arrays(pair, ar_ref, monkeypatch):
    """The static parts of a round are bound once (loop.loop_fn): after the first generation, further ones
    (host loop, one round per call) compile nothing and never hash the target's graph definition — the
    per-call cost that made every jitted round call pay milliseconds of host time (issue 24)."""
    target, drafter = pair
    key, prompt = next(iter(PROMPTS.items()))
    kw = dict(method="ddtree", budget=7, loop="host", sync_every=1)
    first = run(pair, prompt, **kw)
    assert first.tokens == ar_ref[key]
    gd_type = type(target.graphdef)
    hashes = []
    original = gd_type.__hash__
    monkeypatch.setattr(gd_type, "__hash__", lambda self: hashes.append(1) or original(self))
    traces = dict(loop_lib.TRACES)
    again = run(pair, prompt, **kw)
    assert again.tokens == first.tokens and again.stats["rounds"] == first.stats["rounds"] > 3
    assert dict(loop_lib.TRACES) == traces
    assert not hashes, f"the graph definition was hashed {len(hashes)} times"
