#!/usr/bin/env python
"""End-to-end check on the GPU: the model with kernels="pallas" gives the same tokens as kernels="xla"
(tiny fp32 built-in pair; AR, chain DFlash and DDTree), then prints a JSON summary."""
import json, os, sys, time

try:
    import jaxddtree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dataclasses
import numpy as np
import jax
import jaxddtree
from jaxddtree import builtin


def main():
    m = builtin.load(dtype="float32")
    target, drafter = m.target, m.drafter
    prompt = np.random.RandomState(0).randint(0, 256, 37)
    out = {"device": jax.devices()[0].device_kind}
    for method, kw in [("ar", {}), ("dflash", {"drafter": drafter}), ("ddtree", {"drafter": drafter, "tree_budget": 32})]:
        toks = {}
        for k in ("xla", "pallas"):
            target.kernels = k
            t = time.time()
            g = jaxddtree.generate(target, prompt, method=method, max_new_tokens=48, **kw)
            toks[k] = g.tokens
            out[f"{method}_{k}_s"] = round(time.time() - t, 2)
        out[f"{method}_identical"] = toks["xla"] == toks["pallas"]
        print(method, "identical:", toks["xla"] == toks["pallas"], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
