"""Tensor parallelism (jaxddtree/model/sharding.py) on 2 CPU devices: tp=2 == tp=1.

The comparisons run in one subprocess with `XLA_FLAGS=--xla_force_host_platform_device_count=2` (the device
count is fixed when JAX starts), on a tiny random fp32 model whose head counts, intermediate size and vocab
divide by 2 (kernels="xla"): logits of a prefill and of a tree verify within 1e-5, AR / DFlash / DDTree
tokens equal to tp=1's AR tokens with long accepted paths (oracle drafts) and with a draft vocabulary (its head
gathered from the split lm_head, replicated), every split weight and cache
really halved per device, and the collectives of a compiled round (2 all-reduces per layer). The abstract
2-H200 lowering checks that the Pallas kernels lower per shard at 27B shapes inside the shard_map.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


_COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(?:-start)?\(")


def collectives_by_path(hlo: str) -> dict:
    """Collectives of a compiled module, split into those every call runs ("main") and those inside the branches
    of a conditional ("branches": the sampling classes of `tree.posterior_by_mode`, of which one runs)."""
    from collections import Counter
    comps, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    names = set(comps)
    calls = {c: set(re.findall(r"%([\w.\-]+)", "\n".join(lines))) & names - {c} for c, lines in comps.items()}
    branch_roots = {b for lines in comps.values() for line in lines
                    for spec in re.findall(r"(?:branch_computations=\{[^}]*\}|(?:true|false)_computation=%?[\w.\-]+)", line)
                    for b in re.findall(r"%?([\w.\-]+)", spec.split("=", 1)[1]) if b in names}
    in_branch, todo = set(), list(branch_roots)
    while todo:
        c = todo.pop()
        if c not in in_branch:
            in_branch.add(c)
            todo.extend(calls.get(c, ()))
    count = {"main": Counter(), "branches": Counter()}
    for c, lines in comps.items():
        for op in _COLLECTIVE.findall("\n".join(lines)):
            count["branches" if c in in_branch else "main"][op] += 1
    return {k: dict(v) for k, v in count.items()}


def tiny_config(**kw):
    from jaxddtree.model.config import ATTENTION, GDN, TextConfig
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                layer_types=(GDN, ATTENTION), num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rope_theta=1e4, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                max_position_embeddings=512)
    base.update(kw)
    return TextConfig(**base)


def worker() -> dict:
    """Runs in the 2-device subprocess; returns the measurements as a dict."""

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxddtree.api import score, score_tree
    from jaxddtree.checkpoint.builtin import random_drafter_params
    from jaxddtree.model import sharding
    from jaxddtree.model.drafter import Drafter
    from jaxddtree.model.drafter_config import DrafterConfig
    from jaxddtree.model.target import random_target
    from jaxddtree.speculative import loop

    out = {"devices": len(jax.devices())}
    cfg = tiny_config()
    t1 = random_target(cfg, "float32", seed=0)
    t2 = t1.shard(2)
    ids = np.random.default_rng(0).integers(0, 95, 21)
    a, b = score(t1, ids), score(t2, ids)
    out["score_err"] = float(np.abs(a - b).max())
    out["score_scale"] = float(np.abs(a).max())
    parents, toks = [-1, 0, 1, 1, 0, 4, 2], [5, 7, 9, 11, 13, 15, 17]
    out["tree_err"] = float(np.abs(score_tree(t1, ids, toks, parents) - score_tree(t2, ids, toks, parents)).max())

    names = {}
    for path, x in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(t2.treedef, t2.leaves))[0]:
        name = ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path[1:]  # less "inner"
                        if getattr(k, "name", "") != "value")
        names[name] = {"global": list(x.shape), "shards": [list(s.data.shape) for s in x.addressable_shards],
                       "devices": sorted(str(s.device) for s in x.addressable_shards)}
    out["params"] = names
    cache = t2.init_cache(64)
    out["cache"] = [{"global": list(x.shape), "shards": [list(s.data.shape) for s in x.addressable_shards]}
                    for x in jax.tree.leaves(cache.layers)]

    dcfg = DrafterConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=32,
                         rms_norm_eps=1e-6, rope_theta=1e4, block_size=8, target_layer_ids=(0, 1), mask_token_id=95,
                         vocab_size=96, num_target_layers=2, layer_windows=(None,))
    drafter = Drafter(dcfg, sharding.replicate(random_drafter_params(dcfg, jnp.float32, 1), t2.mesh))
    ar = loop.generate(t1, ids, method="ar", max_new_tokens=24)
    out["tokens"] = {"ar1": ar.tokens}
    out["acc"] = {}
    rounds = loop.loop_fn
    compiled, collectives = {}, {}

    def aot(target, dcfg, plan, chunk=None):  # each tp=2 round compiled once, ahead of time: a later call whose
        fn = rounds(target, dcfg, plan, chunk)  # changed state layout would be refused (AOT checks input shardings)

        def call(*args):
            if plan.method not in compiled:
                compiled[plan.method] = fn.lower(*args).compile()
                collectives[plan.method] = collectives_by_path(compiled[plan.method].as_text())
            return compiled[plan.method](*args)
        return call

    loop.loop_fn = aot
    try:
        for m in ("ar", "dflash", "ddtree"):
            g = loop.generate(t2, ids, drafter=drafter, method=m, max_new_tokens=24, tree_budget=12,
                              _oracle_tokens=ar.tokens)
            out["tokens"][m] = g.tokens
            out["acc"][m] = g.acceptance_lengths
    finally:
        loop.loop_fn = rounds
    out["collectives"] = collectives
    # a draft vocabulary gathered from the vocab-split lm_head: replicated like the drafter, the same columns
    keep = np.arange(0, 96, 3)
    sub = drafter.with_draft_vocab(keep, t2)
    out["draft_vocab"] = {"replicated": all(x.sharding.is_fully_replicated for x in jax.tree.leaves(sub.draft_vocab)),
                          "head_err": float(np.abs(np.asarray(sub.draft_vocab.head)[:, :len(keep)]
                                                   - np.asarray(t1.lm_head)[:, keep]).max())}
    for m in ("dflash", "ddtree"):
        out["tokens"][m + "_draft_vocab"] = loop.generate(t2, ids, drafter=sub, method=m, max_new_tokens=24,
                                                          tree_budget=12).tokens
    errors = {}
    for label, fn in (("heads", lambda: t1.shard(4)),  # kv heads 2
                      ("devices", lambda: random_target(tiny_config(num_key_value_heads=4, linear_num_key_heads=4),
                                                        "float32", tp=4))):
        try:
            fn()
        except ValueError as e:
            errors[label] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def tp_run() -> dict:
    # XLA's cheap CPU settings (as tests/test_cli.py's FAST_COMPILE; conftest.py's level 0 would be overwritten
    # here): LLVM optimisation off changes speed, not fp32 results (no fast-math either way)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0 "
               "--xla_llvm_disable_expensive_passes=true", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_logits_match_tp1(tp_run):
    assert tp_run["devices"] == 2
    assert tp_run["score_scale"] > 0.5
    assert tp_run["score_err"] <= 1e-5, tp_run["score_err"]
    assert tp_run["tree_err"] <= 1e-5, tp_run["tree_err"]


def test_tokens_match_tp1(tp_run):
    ref = tp_run["tokens"]["ar1"]
    assert len(ref) == 24
    for m in ("ar", "dflash", "ddtree", "dflash_draft_vocab", "ddtree_draft_vocab"):
        assert tp_run["tokens"][m] == ref, m
    assert tp_run["draft_vocab"] == {"replicated": True, "head_err": 0.0}
    for m in ("dflash", "ddtree"):  # the paths were long: multi-token commits exercised the sharded stash
        assert max(tp_run["acc"][m]) >= 4, tp_run["acc"][m]


def test_weights_and_caches_are_split(tp_run):
    p = tp_run["params"]
    # (the 2 layers are one layer group: groups.j holds layer j stacked [1, ...], the split axis one later)
    halved = {"groups.0.mixer.w_in": 2, "groups.0.mixer.conv": 2, "groups.0.mixer.w_out": 1,
              "groups.0.mixer.A_log": 1, "groups.1.mixer.w_qkv": 2, "groups.1.mixer.wo": 1,
              "groups.0.mlp.w_gate_up": 3, "groups.1.mlp.w_down": 1, "lm_head": 1}
    for name, axis in halved.items():
        g, shards = p[name]["global"], p[name]["shards"]
        assert len(shards) == 2 and len(set(p[name]["devices"])) == 2, name
        want = list(g)
        want[axis] //= 2
        assert shards == [want, want], (name, g, shards)
    for name in ("embed", "final_norm.weight", "groups.1.mixer.q_norm"):  # replicated
        assert p[name]["shards"] == [p[name]["global"]] * 2, name
    for c in tp_run["cache"]:  # KV [B, Hkv, S, hd] / GDN state [B, Hv, dk, dv] by heads, conv by channels
        axis = 2 if len(c["global"]) == 3 else 1
        want = list(c["global"])
        want[axis] //= 2
        assert c["shards"] == [want, want], c


def test_round_collectives(tp_run):
    # 2 layers x (mixer + MLP) all-reduces of the residual stream, plus the small vocab-sharded argmax /
    # sampling reductions; no all-gather of a cache, weight or stash
    # reductions on the path every round runs; the sampling classes' reductions (one branch runs) apart
    ar = tp_run["collectives"]["ar"]
    assert 4 <= ar["main"].get("all-reduce", 0) <= 6, ar
    for m in ("ar", "dflash", "ddtree"):
        for path in ("main", "branches"):
            assert set(tp_run["collectives"][m][path]) <= {"all-reduce", "all-gather"}, tp_run["collectives"][m]


def test_invalid_tp_errors(tp_run):
    e = tp_run["errors"]
    assert "tp=4 must divide" in e["heads"] and "valid values: 1, 2" in e["heads"], e["heads"]
    assert "tp=4 needs 4 devices" in e["devices"] and "2 cpu device(s)" in e["devices"], e["devices"]


def test_check_tp_lists_valid_values():
    from jaxddtree.model.sharding import check_tp, valid_tp
    from jaxddtree.model.config import ATTENTION, GDN
    big = tiny_config(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=4,
                      layer_types=(GDN, GDN, GDN, ATTENTION), num_attention_heads=24, num_key_value_heads=4,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48)
    assert valid_tp(big) == [1, 2, 4]
    with pytest.raises(ValueError, match=r"tp=3 must divide .*num_key_value_heads=4.*valid values: 1, 2, 4"):
        check_tp(big, 3)
    with pytest.raises(ValueError, match="valid values"):
        check_tp(big, 0)


def test_pallas_kernels_lower_per_shard_for_two_h200():
    """27B shapes (one GDN + one attention layer), tp=2 over an abstract 2-H200 mesh: the decode step, a
    65-node verify + commit and a prefill chunk lower for CUDA with the Pallas kernels inside the shard_maps,
    2 all-reduces per layer."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxddtree.model import layout as layout_lib, sharding
    from jaxddtree.model.cache import init_cache
    from jaxddtree.model.config import ATTENTION, GDN
    from jaxddtree.model.qwen35 import Qwen35
    from jaxddtree.speculative.verify import commit
    from kernels_pallas._common import H200

    cfg = tiny_config(vocab_size=248320, hidden_size=5120, intermediate_size=17408, layer_types=(GDN, ATTENTION),
                      num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                      linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                      partial_rotary_factor=0.25, max_position_embeddings=262144)
    mesh = jax.sharding.AbstractMesh((2,), (sharding.AXIS,), abstract_device=jax.sharding.AbstractDevice(**H200))
    model = lambda c: Qwen35(c, jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(nnx.eval_shape(lambda: sharding.TensorParallel(model(sharding.local_config(cfg, 2)),
                                                                               mesh)))
    treedef = jax.tree.structure(state)
    glob = jax.tree.leaves(nnx.split(nnx.eval_shape(lambda: model(cfg)))[1])
    sds = lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
    leaves = [sds(g, s) for g, s in zip(glob, sharding.leaf_specs(state))]
    cache = jax.eval_shape(lambda: init_cache(cfg, 4096, jnp.bfloat16))
    cache = jax.tree.map(sds, cache, sharding.cache_specs(cache), is_leaf=lambda x: isinstance(x, P))
    scalar = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, P()))

    def step(leaves, cache, tokens, parents):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        if parents is None:
            return m(tokens, cache, layout_lib.sequence(cache.length, tokens.shape[1], 4, kernels="pallas"))
        logits, _, _, stashes = m(tokens, cache, layout_lib.tree(cache.length, parents, 4, kernels="pallas"))
        path = jnp.arange(16, dtype=jnp.int32)[None]  # a chain's first 16 nodes, committed per shard
        return logits, commit(cache, stashes, path, jnp.asarray([5], jnp.int32), kernels="pallas", mesh=mesh)

    # the decode step's attention (1 row, a 4K cache) on the Triton kernel, the verify's and the prefill's (65 / 128
    # rows) on the Mosaic GPU ones (ops._mgpu_attention)
    for tokens, parents, kernels, mgpu in (
            (scalar((1, 1)), None, {"dense_dot", "gdn_decode_fused", "tree_attention"}, False),
            (scalar((1, 65)), scalar((65,)), {"gdn_tree_block"}, True),
            (scalar((1, 128)), None, {"gdn_prefill_inter_chunk"}, True)):
        with jax.sharding.use_abstract_mesh(mesh):
            txt = jax.jit(step).trace(leaves, cache, tokens, parents).lower(lowering_platforms=("cuda",)).as_text()
        assert txt.count("all_reduce") == 4  # 2 layers x (mixer + MLP)
        assert kernels <= set(re.findall(r'name\s*=\s*\\?"([a-z_0-9]+)', txt)), kernels  # the Pallas kernels
        assert ("custom_call @mosaic_gpu" in txt) == mgpu


if __name__ == "__main__":
    print(json.dumps(worker()))


def test_allreduce_modes_set_xla_flags(monkeypatch):
    """`sharding.use_allreduce` appends the mode's XLA_FLAGS entries (kept: what was there), refuses others."""
    from jaxddtree.model import sharding

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    sharding.use_allreduce("nccl")
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"
    sharding.use_allreduce("graphs_oneshot")
    flags = os.environ["XLA_FLAGS"].split()
    assert flags[0] == "--xla_dump_to=/tmp/x" and len(flags) == 3
    assert set(flags[1:]) == set(sharding.ALLREDUCE_MODES["graphs"] + sharding.ALLREDUCE_MODES["oneshot"])
    with pytest.raises(ValueError, match="unknown all-reduce mode 'ring'.*nccl"):
        sharding.use_allreduce("ring")
