"""A draft vocabulary (jaxddtree/model/draft_vocab.py, `Drafter.with_draft_vocab`, `load_drafter(draft_vocab=)`,
`generate.py --draft-vocab`) on the demo pair in fp32:

  * the drafter's logits over the subset are the full logits restricted to it (the same values to fp32 rounding),
    -inf for every other id; the padding columns (the head is padded to a multiple of 128) are never mapped back,
    even with sabotaged weights and bias, and a tree with more budget than finite prefixes pads instead of drafting;
  * DDTree (budget 16) and chain DFlash with a draft vocabulary give the AR tokens at T = 0, with rounds that accept
    whole blocks, and never accept a draft outside the vocabulary, also with one that lacks tokens AR emits
    (acceptance must break there; at T > 0 as well);
  * the loader's N (the N most frequent ids of the drafter directory's token_counts.json, which `python -m convert`
    copies) and its errors; the command line's --draft-vocab (a run, and one-line errors); scripts/count_tokens.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import jaxddtree  # noqa: E402
from jaxddtree.model import draft_vocab as dv  # noqa: E402
from jaxddtree.speculative import tree as tree_lib  # noqa: E402

PROMPTS = ("import os\nimport sys\n\n\ndef main(argv):\n    ",
           "def read_config(path):\n    \"\"\"Read a configuration file.\"\"\"\n    with open(path) as f:\n        ")
MAX_NEW = 64
COUNTS = os.path.join(ROOT, "demo", "drafter", dv.COUNTS_FILE)


@pytest.fixture(scope="module")
def pair(demo_pair):
    return demo_pair


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def ar(pair, prompts):
    return [jaxddtree.generate(pair.target, p, method="ar", max_new_tokens=MAX_NEW).tokens for p in prompts]


def accepted_drafts(g) -> list[int]:
    """The drafted tokens a generation accepted: each round emits its accepted drafts, then the target's bonus token
    (tokens[0] comes from the prefill)."""
    out, p = [], 1
    for a in g.acceptance_lengths:
        out += g.tokens[p:p + a - 1]
        p += a
    return out


def draft_inputs(pair, seed=0):
    """A drafter call's inputs: a fresh cache, 5 context rows of random features, a root token."""
    d = pair.drafter
    F = len(d.config.target_layer_ids) * pair.target.config.hidden_size
    feats = jax.random.normal(jax.random.key(seed), (1, 8, F), jnp.float32)
    return d.init_cache(1, 64), feats, 5, jnp.array([7], jnp.int32)


# ------------------------------------------------------------------------------------------------ the logits
def test_subset_logits_are_the_full_logits_restricted(pair):
    t, d = pair.target, pair.drafter
    V = t.config.vocab_size
    ids = np.random.default_rng(0).choice(V, 300, replace=False)  # 300 ids: the head has 384 columns
    sub = d.with_draft_vocab(ids, t)
    voc = sub.draft_vocab
    assert voc.head.shape == (t.config.hidden_size, 384) and voc.size == 300 and d.draft_vocab is None
    assert np.array_equal(np.asarray(voc.ids)[:300], np.sort(ids)) and np.all(np.asarray(voc.ids)[300:] == -1)
    assert np.all(np.asarray(voc.head)[:, 300:] == 0) and np.all(np.isneginf(np.asarray(voc.bias)[300:]))
    cache, feats, n, root = draft_inputs(pair)
    full, _ = d.logits(cache, feats, n, root, t.embedding, t.lm_head)
    cache, feats, n, root = draft_inputs(pair)
    got, _ = sub.logits(cache, feats, n, root, t.embedding, t.lm_head)
    full, got = np.asarray(full[0]), np.asarray(got[0])  # [Bs-1, V]
    assert got.shape == full.shape == (d.config.block_size - 1, V)
    inside = np.zeros(V, bool)
    inside[ids] = True
    # the same values up to fp32 rounding: a GEMM of 384 columns sums in another order than one of 2048
    np.testing.assert_allclose(got[:, inside], full[:, inside], rtol=0, atol=1e-5)
    assert np.all(np.isneginf(got[:, ~inside])) and np.all(np.isfinite(got[:, inside]))
    # the subset's own logits: the same values in column order, padding -inf
    h = jax.random.normal(jax.random.key(1), (3, t.config.hidden_size), jnp.float32)
    s = np.asarray(dv.subset_logits(voc, h))
    np.testing.assert_allclose(s[:, :300], np.asarray(h @ t.lm_head)[:, np.sort(ids)], rtol=0, atol=1e-5)
    assert np.all(np.isneginf(s[:, 300:]))


def test_padding_is_never_drafted(pair):
    """Padding columns with sabotaged weights (huge logits, no -inf bias) still never reach the full logits: no id
    maps to them. A 1-id vocabulary under a budget of 64 gives a tree of one 15-token chain, the rest padding
    nodes (token -1): a -inf prefix is never drafted."""
    t = pair.target
    V = t.config.vocab_size
    voc = dv.make([5, 9, 700], t.lm_head, jnp.float32)
    assert np.array_equal(np.asarray(voc.column)[[5, 9, 700]], [0, 1, 2])
    assert np.all(np.asarray(voc.column)[np.setdiff1d(np.arange(V), [5, 9, 700])] == 128)
    bad = dv.DraftVocab(ids=voc.ids, head=voc.head.at[:, 3:].set(1e3), bias=jnp.zeros_like(voc.bias),
                        column=voc.column)
    h = jax.random.normal(jax.random.key(2), (15, t.config.hidden_size), jnp.float32)
    assert float(jnp.max(dv.subset_logits(bad, h)[:, 3:])) > 100  # the sabotage bites in column space
    full = np.asarray(dv.logits(bad, h))
    assert np.all(np.isfinite(full[:, [5, 9, 700]])) and np.sum(np.isfinite(full)) == 15 * 3
    one = dv.make([42], t.lm_head, jnp.float32)
    tree = tree_lib.build_tree(jnp.int32(3), dv.logits(one, h), 64)
    valid, tokens = np.asarray(tree.valid), np.asarray(tree.tokens)
    assert valid.sum() == 16 and np.all(tokens[1:16] == 42) and np.all(tokens[16:] == tree_lib.PAD_TOKEN)
    assert np.array_equal(np.asarray(tree.depths)[:16], np.arange(16))


@pytest.mark.parametrize("budget", [16, 64])
def test_the_tree_over_the_subset_columns_is_the_full_vocabularys(pair, budget):
    """The round builds its tree, chain and auto-budget expectations from the subset's Vp columns (`draft_stage`,
    `build_tree(ids=)`): the same trees (every field, padding included) and expectations as from the
    full-vocabulary logits with -inf outside, also with tied logits (rounded to 0.5: many ties inside the top-K)
    and with fewer finite prefixes than the budget (3 ids)."""
    from jaxddtree.speculative import budget as budget_lib
    from jaxddtree.speculative import loop as loop_lib
    t = pair.target
    h = jax.random.normal(jax.random.key(4), (15, t.config.hidden_size), jnp.float32)
    for ids in (np.random.default_rng(1).choice(t.config.vocab_size, 300, replace=False), [5, 9, 700]):
        voc = dv.make(ids, t.lm_head, jnp.float32)
        for sub in (dv.subset_logits(voc, h), jnp.round(dv.subset_logits(voc, h) * 2) / 2):
            sub = jnp.where(jnp.isfinite(sub), sub, -jnp.inf)
            full = jnp.take(sub, voc.column, axis=-1, mode="fill", fill_value=-jnp.inf)
            a = tree_lib.build_tree(jnp.int32(3), full, budget)
            b = tree_lib.build_tree(jnp.int32(3), sub, budget, ids=voc.ids)
            for name in ("tokens", "parents", "depths", "valid"):
                assert np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name))), name
            assert int(np.asarray(a.valid).sum()) > 15
            ca, cb = loop_lib.chain_tree(jnp.int32(3), full), loop_lib.chain_tree(jnp.int32(3), sub, voc)
            assert np.array_equal(np.asarray(ca.tokens), np.asarray(cb.tokens))
            mask = tree_lib.ancestor_mask(a)
            np.testing.assert_allclose(np.asarray(budget_lib.tree_expectation(b, sub, mask, voc)),
                                       np.asarray(budget_lib.tree_expectation(a, full, mask)), rtol=1e-6)
            np.testing.assert_allclose(np.asarray(budget_lib.chain_expectation(sub)),
                                       np.asarray(budget_lib.chain_expectation(full)), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ generation
def vocabularies(ar_tokens, V):
    """'frequent': the 512 most frequent ids of the demo's table; 'lacking': 500 of the most frequent ids without
    every other id that AR emits (so AR emits tokens the drafter cannot draft; 500 ids: padded columns, and the
    512-column head of 'frequent': one compilation for both)."""
    counts = dv.load(COUNTS)
    emitted = sorted({t for toks in ar_tokens for t in toks})
    drop = set(emitted[::2])
    lacking = [i for i in dv.frequent_ids(counts, V)[:500 + len(drop)] if i not in drop][:500]
    return {"frequent": dv.frequent_ids(counts, 512), "lacking": np.asarray(lacking)}


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_greedy_equals_ar_with_a_draft_vocab(pair, prompts, ar, method):
    t, d = pair.target, pair.drafter
    vocs = vocabularies(ar, t.config.vocab_size)
    assert len(vocs["lacking"]) % 128 and set(sum(ar, [])) - set(vocs["lacking"].tolist())
    base = [jaxddtree.generate(t, p, drafter=d, method=method, tree_budget=16, max_new_tokens=MAX_NEW)
            for p in prompts]
    for name, ids in vocs.items():
        sub = d.with_draft_vocab(ids, t)
        allowed = set(ids.tolist())
        rounds, base_drafts = 0, set()
        for p, want, g0 in zip(prompts, ar, base):
            g = jaxddtree.generate(t, p, drafter=sub, method=method, tree_budget=16, max_new_tokens=MAX_NEW)
            assert g.tokens == want, (name, method)
            drafts = accepted_drafts(g)
            assert set(drafts) <= allowed, (name, method, set(drafts) - allowed)
            if name == "frequent":
                assert max(g.acceptance_lengths) >= 12, (method, g.acceptance_lengths)  # long accepted paths
            rounds += len(g.acceptance_lengths) - len(g0.acceptance_lengths)
            base_drafts |= set(accepted_drafts(g0))
        if name == "lacking":  # without it, tokens outside were drafted and accepted; with it, more rounds
            assert not base_drafts <= allowed and rounds > 0, (method, rounds)


def test_sampling_never_drafts_outside(pair, prompts, ar):
    """T > 0: the acceptance samples every node from the target (its rule never reads the draft's probabilities),
    so the draft vocabulary only decides which nodes exist; none outside it is ever accepted."""
    t = pair.target
    ids = vocabularies(ar, t.config.vocab_size)["lacking"]
    sub = pair.drafter.with_draft_vocab(ids, t)
    for seed in (0, 1):
        g = jaxddtree.generate(t, prompts[0], drafter=sub, method="ddtree", tree_budget=16, max_new_tokens=MAX_NEW,
                               temperature=1.0, seed=seed)
        assert set(accepted_drafts(g)) <= set(ids.tolist()) and max(g.acceptance_lengths) > 1


def test_batched_slots_with_a_draft_vocab(pair, prompts, ar):
    """The slot pool (the server's batched rounds) reads the drafter's params as they are: 2 slots, the AR tokens."""
    from jaxddtree.speculative import batch as batch_lib

    t = pair.target
    ids = vocabularies(ar, t.config.vocab_size)["lacking"]
    sub = pair.drafter.with_draft_vocab(ids, t)
    reqs = [batch_lib.Request(p, MAX_NEW) for p in prompts]
    gens = batch_lib.generate_many(t, reqs, drafter=sub, method="ddtree", max_batch=2, tree_budget=16)
    assert [g.tokens for g in gens] == ar
    # the vocabulary is in effect (without it these prompts average over 6 tokens per round at budget 16)
    assert all(1 < g.stats["mean_acceptance_length"] < 3 for g in gens), [g.stats for g in gens]


# ------------------------------------------------------------------------------------------------ loading
def test_load_drafter_draft_vocab(pair, tmp_path):
    t = pair.target
    ddir = os.path.join(ROOT, "demo", "drafter")
    want = np.sort(dv.frequent_ids(dv.load(COUNTS), 256))
    d = jaxddtree.load_drafter(ddir, t, "float32", draft_vocab=256)
    assert np.array_equal(np.asarray(d.draft_vocab.ids), want)
    d = jaxddtree.load_drafter(ddir, t, "float32", draft_vocab=want[::-1].tolist())
    assert np.array_equal(np.asarray(d.draft_vocab.ids), want)
    assert jaxddtree.load_drafter(ddir, t, "float32").draft_vocab is None
    bare = tmp_path / "drafter"
    shutil.copytree(ddir, bare, ignore=shutil.ignore_patterns(dv.COUNTS_FILE))
    for value, match in ((0, r"n must be in \[1, 2048\]"), (5000, r"n must be in \[1, 2048\]"),
                         ([5, 5], r"ids \[5\] given more than once"), ([-1, 3], "outside the vocabulary"),
                         ([2048], "outside the vocabulary"), ([], "non-empty"), ([1.5], "non-empty 1-D list"),
                         (True, "non-empty 1-D list")):
        with pytest.raises(ValueError, match=match):
            jaxddtree.load_drafter(ddir, t, "float32", draft_vocab=value)
    with pytest.raises(ValueError, match="token_counts.json"):
        jaxddtree.load_drafter(str(bare), t, "float32", draft_vocab=64)
    other = dataclasses.replace(d.draft_vocab, column=d.draft_vocab.column[:100])  # made for another vocabulary
    with pytest.raises(ValueError, match="made for a vocabulary of 100 ids, the target has 2048"):
        jaxddtree.generate(t, [5, 6, 7], drafter=dataclasses.replace(
            d, params=dataclasses.replace(d.params, vocab=other)), method="dflash", max_new_tokens=4)


def test_converted_drafter_keeps_its_table(pair, tmp_path):
    """`python -m convert` copies token_counts.json: draft_vocab=N works on the converted drafter too."""
    from jaxddtree.checkpoint.convert import convert

    dst = str(tmp_path / "converted")
    convert(os.path.join(ROOT, "demo", "drafter"), dst, dtype="float32")
    d = jaxddtree.load_drafter(dst, pair.target, "float32", draft_vocab=256)
    assert np.array_equal(np.asarray(d.draft_vocab.ids), np.sort(dv.frequent_ids(dv.load(COUNTS), 256)))


# ------------------------------------------------------------------------------------------------ tools
def load_generate_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_script", os.path.join(ROOT, "scripts", "generate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cli_draft_vocab(pair, prompts, ar, tmp_path, capsys):
    """A run with --draft-vocab N (the demo's frequency table) gives the AR tokens and reports the vocabulary; each
    bad value is one error line (exit code 2), before any weights load."""
    mod = load_generate_script()
    ids = ",".join(map(str, prompts[0]))
    rc = mod.main(["--prompt-ids", ids, "--draft-vocab", "512", "--method", "dflash", "--max-new-tokens",
                   str(MAX_NEW), "--stop-ids", "none", "--no-warmup", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    res = json.loads(out.strip().splitlines()[-1])
    assert res["tokens"] == ar[0] and res["stats"]["draft_vocab"] == 512
    bare = tmp_path / "drafter"
    shutil.copytree(os.path.join(ROOT, "demo", "drafter"), bare, ignore=shutil.ignore_patterns(dv.COUNTS_FILE))
    (tmp_path / "dup.json").write_text("[3, 3]")
    (tmp_path / "big.json").write_text("[3, 4096]")
    (tmp_path / "text.json").write_text("not json")
    np.save(tmp_path / "float.npy", np.ones(3))
    demo_target = os.path.join(ROOT, "demo", "target")
    cases = [(["--draft-vocab", "0"], "argument --draft-vocab: must be >= 1, got 0"),
             (["--draft-vocab", "x"], "expected an integer N >= 1 or a file of token ids, got 'x' (no such file)"),
             (["--draft-vocab", "5000"], "must be <= the vocabulary size 2048, got 5000"),
             (["--draft-vocab", tmp_path / "dup.json"], "ids [3] given more than once"),
             (["--draft-vocab", tmp_path / "big.json"], "ids [4096] outside the vocabulary [0, 2048)"),
             (["--draft-vocab", tmp_path / "text.json"], "not a JSON list of integers"),
             (["--draft-vocab", tmp_path / "float.npy"], "expected a non-empty 1-D list of integers"),
             (["--draft-vocab", "64", "--method", "ar"], "needs --method dflash or ddtree"),
             (["--target", demo_target, "--drafter", bare, "--prompt-ids", "1,2", "--draft-vocab", "64"],
              "needs a token frequency table")]
    for args, needle in cases:
        assert mod.main([str(a) for a in args]) == 2, args
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("generate.py: error: ") and needle in lines[0], (args, lines)


def test_cli_drafter_fp8(pair, prompts, ar, capsys):
    """generate.py --drafter-fp8: the drafter's projections in FP8 (`Drafter.to_fp8`); the AR tokens, reported in
    the stats; with --method ar one error line."""
    mod = load_generate_script()
    ids = ",".join(map(str, prompts[0]))
    rc = mod.main(["--prompt-ids", ids, "--drafter-fp8", "--method", "ddtree", "--budget", "16", "--max-new-tokens",
                   str(MAX_NEW), "--stop-ids", "none", "--no-warmup", "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["tokens"] == ar[0] and res["stats"]["drafter_fp8"] is True
    assert res["stats"]["mean_acceptance_length"] > 1.5  # still drafting well
    assert mod.main(["--drafter-fp8", "--method", "ar", "--prompt-ids", "1,2"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--drafter-fp8" in lines[0] and "needs --method dflash or ddtree" in lines[0], lines


def test_count_tokens_script(pair, tmp_path):
    text = "def f(x):\n    return x + 1\n"
    (tmp_path / "a.py").write_text(text)
    (tmp_path / "b.txt").write_text(text * 2)
    out = tmp_path / "counts.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "count_tokens.py"), "--target",
                        os.path.join(ROOT, "demo", "target"), "--out", str(out), str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr
    counts = dv.load(str(out))
    ids = pair.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert counts.shape == (2048,) and np.array_equal(counts, 3 * np.bincount(ids, minlength=2048))
    assert "of 2 files" in p.stdout and "cover" in p.stdout
