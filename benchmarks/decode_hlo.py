#!/usr/bin/env python
"""Kernels per decode step from the compiled HLO, without a GPU: the AR decode step (kernels="pallas", bf16,
27B shapes, abstract weights) compiled by XLA:CPU with every Pallas kernel stubbed by an opaque host callback
(an unfusable custom call, as the Triton call is on the GPU), with the decode-step fusions
(`kernels_pallas.ops.FUSED_DECODE`) on and off. Counts the ENTRY computation's kernel-like instructions
(fusions, custom calls, unfused compute ops; not parameters / tuples / bitcasts) for models of 1 and 2
layers of each type, so per-layer numbers are the difference. XLA:CPU's fusion pass is not XLA:GPU's: read
the numbers as the structure (which ops can share a kernel), the H200 profile (profile_gpu.py) as the truth.

    python benchmarks/decode_hlo.py [--out decode_hlo.json] [--show]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import sys

try:
    import jaxddtree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import pallas as pl

from kernels_pallas import ops
from jaxddtree.model import layout as layout_lib
from jaxddtree.model.cache import init_cache
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.qwen35 import Qwen35
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import QWEN36_27B  # noqa: E402

FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "reshape", "after-all"}


def _stub_pallas_call(kernel, *, out_shape, name=None, **kw):
    """pl.pallas_call stand-in: the outputs come from one opaque host callback on all the inputs."""
    del kernel, kw
    multi = isinstance(out_shape, (list, tuple))
    shapes = tuple(out_shape) if multi else (out_shape,)

    def call(*args):
        res = jax.pure_callback(lambda *a: tuple(np.zeros(s.shape, s.dtype) for s in shapes), shapes, *args)
        return list(res) if multi else res[0]
    return call


def entry_ops(hlo: str) -> collections.Counter:
    """Opcode counts of the kernel-like instructions of the ENTRY computation (fusions by kind)."""
    body = hlo[hlo.index("\nENTRY "):]
    body = body[:body.index("\n}")]
    c = collections.Counter()
    for line in body.splitlines()[1:]:
        m = re.search(r"=\s*\S+(?:\[[^\]]*\])?(?:\{[^}]*\})?\s+([a-z][a-z0-9-]*)\(", line)
        if not m:
            m = re.search(r"=\s*\(.*?\)\s+([a-z][a-z0-9-]*)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op in FREE:
            continue
        if op == "fusion":
            k = re.search(r"kind=(k\w+)", line)
            op = f"fusion:{k.group(1) if k else '?'}"
        c[op] += 1
    return c


def count(layer_types: tuple, fused: bool, context: int = 256, show: bool = False) -> collections.Counter:
    d = dict(QWEN36_27B, num_hidden_layers=len(layer_types))
    d.pop("full_attention_interval")
    d["layer_types"] = list(layer_types)
    cfg = text_config_from_dict(d)
    model = nnx.eval_shape(lambda: Qwen35(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    gd, state = nnx.split(model)
    leaves, td = jax.tree.flatten(state)
    leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    cache = jax.eval_shape(lambda: init_cache(cfg, context, jnp.bfloat16))
    K = cfg.linear_conv_kernel_dim

    @functools.partial(jax.jit, donate_argnames=("cache",))
    def decode(leaves, cache, tok):
        m = nnx.merge(gd, jax.tree.unflatten(td, leaves))
        lay = layout_lib.sequence(cache.length, 1, K, kernels="pallas")
        logits, cache, _, _ = m(tok, cache, lay, logits="all")
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None], cache

    with ops.fused_decode(fused):
        hlo = decode.lower(leaves, cache, jax.ShapeDtypeStruct((1, 1), jnp.int32)).compile().as_text()
    c = entry_ops(hlo)
    if show:
        print(f"--- {layer_types} fused={fused}\n" + hlo[hlo.index("\nENTRY "):])
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--show", action="store_true", help="print the ENTRY computations")
    args = ap.parse_args()
    pl.pallas_call = _stub_pallas_call  # every kernel module calls it through this module attribute
    G, A = "linear_attention", "full_attention"
    res = {}
    for fused in (False, True):
        key = "fused" if fused else "unfused"
        base = count((G,), fused, show=args.show)
        two_g = count((G, G), fused, show=args.show)
        ga = count((G, A), fused, show=args.show)
        per_g, per_a = two_g - base, ga - base
        res[key] = {
            "per_gdn_layer": sum(per_g.values()), "per_attention_layer": sum(per_a.values()),
            "rest": sum(base.values()) - sum(per_g.values()),
            "step_64_layers": sum(base.values()) + 47 * sum(per_g.values()) + 16 * sum(per_a.values()),
            "gdn_ops": dict(per_g), "attention_ops": dict(per_a), "one_gdn_layer_model": dict(base)}
        print(key, json.dumps({k: v for k, v in res[key].items()}), flush=True)
    if args.out:
        json.dump(res, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
