"""Training tooling (jaxddtree.training.train): loss decreases for the target and the drafter at toy sizes, the drafter's
training forward equals its inference forward, checkpoints resume, exports load back, and the shipped demo
pair decodes exactly (DDTree == DFlash == AR at temperature 0)."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxddtree import generate, load_drafter, load_target, score
from jaxddtree.training import train as tr
from jaxddtree.model.drafter import draft_logits, init_draft_cache
from jaxddtree.model.drafter_config import DrafterConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo")


@pytest.fixture(scope="module")
def tiny():
    cdict = tr.target_config_dict(64, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1, head_dim=16,
                                  lin_k_heads=1, lin_v_heads=2, lin_head_dim=16)
    cfg = tr.text_config(cdict)
    graphdef, treedef, params = tr.init_target(cfg, seed=0)
    ddict = tr.drafter_config_dict(cfg, [1, 3], mask_token_id=1, layers=1, heads=2, kv_heads=1, head_dim=16,
                                   intermediate=64, block_size=4)
    return dict(cdict=cdict, cfg=cfg, graphdef=graphdef, treedef=treedef, params=params, ddict=ddict,
                dcfg=DrafterConfig.from_dict(ddict))


def _data(seed, B, T, V=64):
    # learnable toy text: arithmetic progressions mod V
    rng = np.random.default_rng(seed)
    start, step = rng.integers(2, V, size=(B, 1)), rng.integers(1, 4, size=(B, 1))
    return jnp.asarray(((start + step * np.arange(T)[None]) % (V - 2) + 2).astype(np.int32))


def test_target_loss_decreases(tiny):
    loss_fn = functools.partial(tr.target_loss, graphdef=tiny["graphdef"], treedef=tiny["treedef"])
    t = tr.Trainer(loss_fn, tiny["params"], lr=1e-2, steps=12, warmup=2, ckpt_dir=None)
    batch = _data(0, 4, 17)
    hist = []
    t.run(lambda: batch, 4 * 16, progress=False, log=lambda step, loss: hist.append(loss))
    first = float(jax.jit(loss_fn)(tiny["params"], batch))
    assert hist[-1] < first - 0.5


def test_drafter_training_forward_matches_inference(tiny):
    target = tr.target_of(tiny["cfg"], tiny["graphdef"], tiny["treedef"], tiny["params"])
    dcfg = tiny["dcfg"]
    params = tr.init_drafter(dcfg, seed=3)
    T = 24
    tokens = _data(1, 1, T)
    feats = tr.target_features(target.leaves, tokens, graphdef=target.graphdef, treedef=target.treedef,
                               feature_layers=dcfg.target_layer_ids)
    anchors = jnp.asarray([[0, 5, 17, 22]], jnp.int32)
    got = jax.jit(tr.drafter_train_logits, static_argnums=1)(params, dcfg, feats, tokens, anchors,
                                                             target.embedding, target.lm_head)
    infer = jax.jit(draft_logits, static_argnums=1)
    for k, a in enumerate(np.asarray(anchors[0])):
        cache = init_draft_cache(dcfg, 1, T + 8, jnp.float32)
        want, _ = infer(params, dcfg, cache, feats, jnp.int32(a), tokens[:, a], target.embedding, target.lm_head)
        np.testing.assert_allclose(np.asarray(got[0, k]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)


def test_drafter_loss_decreases_and_checkpoint_resumes(tiny, tmp_path):
    target = tr.target_of(tiny["cfg"], tiny["graphdef"], tiny["treedef"], tiny["params"])
    dcfg = tiny["dcfg"]
    loss_fn = functools.partial(tr.drafter_loss, cfg=dcfg, graphdef=target.graphdef, treedef=target.treedef,
                                gamma=7.0)
    tokens = _data(2, 4, 32)
    anchors = jnp.asarray(tr.sample_anchors(np.random.default_rng(0), 4, 6, 0, 30))
    batch = (tokens, anchors, target.leaves)
    t = tr.Trainer(loss_fn, tr.init_drafter(dcfg, seed=1), lr=1e-2, steps=10, warmup=2,
                   ckpt_dir=str(tmp_path / "ckpt"), save_every=5)
    first = float(jax.jit(loss_fn)(t.params, batch))
    t.run(lambda: batch, 1, meta_fn=lambda: {"rng": "x"}, progress=False)
    assert float(jax.jit(loss_fn)(t.params, batch)) < first - 0.3
    # a fresh trainer on the same directory resumes at the last step with the same weights
    t2 = tr.Trainer(loss_fn, tr.init_drafter(dcfg, seed=9), lr=1e-2, steps=10, warmup=2,
                    ckpt_dir=str(tmp_path / "ckpt"))
    meta = t2.restore()
    assert meta["rng"] == "x" and t2.step == 10
    for a, b in zip(jax.tree.leaves(t.params), jax.tree.leaves(t2.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_exports_load_back(tiny, tmp_path):
    tr.save_target_hf(str(tmp_path / "t"), tiny["cdict"], tiny["cfg"], tiny["graphdef"], tiny["treedef"],
                      tiny["params"])
    loaded = load_target(str(tmp_path / "t"), dtype="float32")
    mine = tr.target_of(tiny["cfg"], tiny["graphdef"], tiny["treedef"], tiny["params"])
    ids = np.asarray(_data(3, 1, 20)[0])
    np.testing.assert_array_equal(score(loaded, ids), score(mine, ids))
    params = tr.init_drafter(tiny["dcfg"], seed=2)
    tr.save_drafter_hf(str(tmp_path / "d"), tiny["ddict"], tiny["dcfg"], params)
    d = load_drafter(str(tmp_path / "d"), loaded, dtype="float32")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(d.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(not os.path.exists(os.path.join(DEMO, "drafter", "model.safetensors")),
                    reason="demo pair not built")
def test_shipped_pair_ddtree_equals_ar():
    from transformers import AutoTokenizer

    target = load_target(os.path.join(DEMO, "target"), dtype="float32")
    drafter = load_drafter(os.path.join(DEMO, "drafter"), target, dtype="float32")
    tok = AutoTokenizer.from_pretrained(os.path.join(DEMO, "target"))
    ids = tok("import os\n\n\ndef main(argv):\n    ")["input_ids"]
    ar = generate(target, ids, method="ar", max_new_tokens=40)
    dd = generate(target, ids, drafter=drafter, method="ddtree", max_new_tokens=40, tree_budget=64)
    assert dd.tokens == ar.tokens
    assert np.mean(dd.acceptance_lengths) > 1.5  # the drafter is real: it speculates successfully
