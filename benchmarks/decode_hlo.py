#!/usr/bin/env python
"""Kernels per decode step from the compiled HLO, without a GPU: the AR decode step (kernels="pallas", bf16,
27B shapes, abstract weights) compiled by XLA:CPU with every Pallas kernel stubbed by an opaque host callback
(an unfusable custom call, as the Triton call is on the GPU), with the decode-step fusions on and off
(kernels "pallas" / the benchmark variant "pallas:unfused", `kernels_pallas.ops.VARIANTS`). Counts the ENTRY
computation's kernel-like instructions (fusions, custom calls, unfused compute ops; not parameters / tuples /
bitcasts) for models of 1 and 2 layers of each type, so per-layer numbers are the difference. XLA:CPU's fusion
pass is not XLA:GPU's: read the numbers as the structure (which ops can share a kernel), the H200 profile
(profile_gpu.py) as the truth.

    python benchmarks/decode_hlo.py [--out decode_hlo.json] [--show]
    python benchmarks/decode_hlo.py --hashes [--out hashes.json]
    python benchmarks/decode_hlo.py --mosaic-kernels auto,63 [--out mosaic.json]

--hashes: instead, a short sha256 of the StableHLO text (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`
for an abstract H200, Pallas kernels included) of the AR decode step (alone and vmapped over 2 slots) and of a
17-node verify, kernels "pallas" and "xla", bf16 / fp8 weights at 27B widths (4 layers, vocab 8192) and fp32 /
bf16 at bench.py's smoke shapes: equal hashes before / after a refactor = byte-identical programs. The Triton IR
names its source files: the checkout root is masked (compare checkouts whose root paths have the same length).

--mosaic-kernels BUDGETS: per tree budget (or "auto"), the distinct Mosaic GPU kernels (custom calls' kernel_hash)
in each program of a first `generate` call (its prefill, drafter pass, start and rounds, as `speculative.precompile`
gets them) at 27B widths (4 layers: the kernels do not depend on the depth), lowered for an abstract H200. Each
program lowers its kernels in Python (≈ 0.36 s each on the 2-core VM), cold and warm (the persistent cache's key is
the lowered module), and jaxlib compiles each distinct kernel once per process when an executable is loaded
(≈ 0.2–0.5 s on the H200, one process-wide mutex: jaxlib/mosaic/gpu/custom_call.cc, `CachedCompile`).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
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

from jaxddtree.model import layout as layout_lib
from jaxddtree.model.cache import init_cache
from jaxddtree.model.config import text_config_from_dict
from jaxddtree.model.qwen35 import Qwen35
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import DFLASH_27B, QWEN36_27B, SMOKE_TARGET, decode_step  # noqa: E402

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
    decode = jax.jit(decode_step(gd, td, cfg.linear_conv_kernel_dim, "pallas" if fused else "pallas:unfused"),
                     donate_argnames=("cache",))
    hlo = decode.lower(leaves, cache, jax.ShapeDtypeStruct((1, 1), jnp.int32)).compile().as_text()
    c = entry_ops(hlo)
    if show:
        print(f"--- {layer_types} fused={fused}\n" + hlo[hlo.index("\nENTRY "):])
    return c


def lowered_hash(raw: dict, dtype: str, weights: str, kernels: str, part: str, slots: int = 0) -> str:
    """sha256 (16 hex digits) of the StableHLO of the AR step (`slots` > 0: vmapped over that many slots) or of a
    17-node verify ("verify") of an abstract random target, lowered for an abstract H200 (module docstring)."""
    from kernels_pallas._common import abstract_h200
    from jaxddtree.model.target import random_target
    from jaxddtree.speculative.verify import verify
    cfg, S = text_config_from_dict(raw), jax.ShapeDtypeStruct
    held = {}
    leaves = jax.eval_shape(lambda: held.setdefault("t", random_target(cfg, dtype, 0, weights=weights)).leaves)
    gd, td, K = held["t"].graphdef, held["t"].treedef, cfg.linear_conv_kernel_dim
    cache = jax.eval_shape(lambda: init_cache(cfg, 256, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32))
    if part == "ar":
        f, tok = decode_step(gd, td, K, kernels), S((1, 1), jnp.int32)
        if slots:
            f = jax.vmap(f, in_axes=(None, 0, 0))
            cache, tok = jax.tree.map(lambda x: S((slots,) + x.shape, x.dtype), (cache, tok))
        args = (leaves, cache, tok)
    else:
        parents = jnp.asarray([-1] + [max(0, i - 1 - i % 3) for i in range(1, 17)], jnp.int32)

        def f(leaves, cache, tokens):
            m = nnx.merge(gd, jax.tree.unflatten(td, leaves))
            logits, feats, stash = verify(m, cache, tokens, layout_lib.tree(cache.length, parents, K, kernels=kernels),
                                          feature_layers=(0, 1))
            return jnp.argmax(logits, -1), feats, stash
        args = (leaves, cache, S((1, 17), jnp.int32))
    with abstract_h200():
        txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return hashlib.sha256(txt.replace(root, "#" * len(root)).encode()).hexdigest()[:16]


def hashes() -> dict:
    big = dict(QWEN36_27B, num_hidden_layers=4, vocab_size=8192,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
    big.pop("full_attention_interval")
    small = dict(QWEN36_27B, **SMOKE_TARGET)
    cases = {}
    for kernels in ("pallas", "xla"):
        for part in ("ar", "verify"):
            cases.update({f"27b4_bf16_{kernels}_{part}": (big, "bfloat16", "bf16", kernels, part),
                          f"27b4_fp8_{kernels}_{part}": (big, "bfloat16", "fp8", kernels, part),
                          f"smoke_fp32_{kernels}_{part}": (small, "float32", "bf16", kernels, part),
                          f"smoke_bf16_{kernels}_{part}": (small, "bfloat16", "bf16", kernels, part)})
        for w in ("bf16", "fp8"):
            cases[f"27b4_{w}_{kernels}_ar_vmap2"] = (big, "bfloat16", w, kernels, "ar", 2)
    out = {}
    for name, case in cases.items():
        out[name] = lowered_hash(*case)
        print(name, out[name], flush=True)
    return out


def mosaic_kernels(budget, layers: int = 4, prompt: int = 64, vocab: int = 248320) -> dict:
    """{program name: distinct kernel hashes} of generate's first call at `budget` ("auto" or an int), plus "all"
    (the distinct kernels over the programs) (module docstring)."""
    from jaxddtree.model.drafter import Drafter, abstract_params
    from jaxddtree.model.drafter_config import DrafterConfig
    from jaxddtree.model.target import abstract_target
    from jaxddtree.speculative import loop, precompile
    from kernels_pallas import mgpu_kernel_hash
    from kernels_pallas._common import abstract_h200
    mgpu_kernel_hash.install()  # (as the kernels' modules do on a GPU: identical kernels, identical hashes)
    raw = dict(QWEN36_27B, num_hidden_layers=layers, vocab_size=vocab,
               layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
    raw.pop("full_attention_interval")
    cfg = text_config_from_dict(raw)
    dcfg = DrafterConfig(**dict(DFLASH_27B, num_target_layers=layers, target_layer_ids=(1, layers - 1), vocab_size=vocab,
                                 mask_token_id=min(DFLASH_27B["mask_token_id"], vocab - 1)))
    jobs = []
    real, precompile.compile_all = precompile.compile_all, lambda js, **_: jobs.extend(js) or 0
    try:
        with abstract_h200():
            target = abstract_target(cfg, "bfloat16")
            target.kernels = "pallas"
            drafter = Drafter(config=dcfg, params=abstract_params(dcfg, jnp.bfloat16), path="abstract")
            loop.compile_call(target, list(range(1, prompt + 1)), drafter=drafter, method="ddtree", max_new_tokens=32,
                              tree_budget=budget, stop_ids=range(cfg.vocab_size), cache_len=4096)
    finally:
        precompile.compile_all = real
    out, every = {}, set()
    for fn, args in jobs:
        with abstract_h200():
            txt = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        hashes = sorted(set(re.findall(r'kernel_hash = "([^"]+)"', txt)))
        name = getattr(fn, "__name__", "program")
        out[name if name not in out else f"{name}_{len(out)}"] = hashes
        every.update(hashes)
    out["all"] = sorted(every)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--show", action="store_true", help="print the ENTRY computations")
    ap.add_argument("--hashes", action="store_true", help="hash the lowered programs instead (module docstring)")
    ap.add_argument("--mosaic-kernels", default=None, metavar="BUDGETS",
                    help="comma list of budgets (or auto): Mosaic GPU kernels per program (module docstring)")
    args = ap.parse_args()
    if args.mosaic_kernels:
        res = {}
        for b in args.mosaic_kernels.split(","):
            got = mosaic_kernels(b if b == "auto" else int(b))
            res[b] = {k: len(v) for k, v in got.items()}
            print(f"budget {b}: distinct Mosaic GPU kernels {json.dumps(res[b])}", flush=True)
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)
        return
    if args.hashes:
        res = hashes()
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)
        return
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
