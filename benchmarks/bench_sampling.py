"""Cost of the posterior sampling per round (speculative/tree.posterior_tokens) on one GPU: plain sampling (no
truncation: what a request without top_k / top_p / min_p runs) vs truncated, with each `truncate` method ("sort":
the default, one sort of the vocabulary per row; "bisect": 32 passes over the row, no sort), the values traced as
in the decode loop, at the verify row counts of AR (1), DFlash (16) and DDTree 64 (65). The methods' kept sets
are checked equal on the benchmark's logits.

    PYTHONUNBUFFERED=1 python benchmarks/bench_sampling.py --out $OUT/sampling.json
    JAX_PLATFORMS=cpu python benchmarks/bench_sampling.py --smoke --out /tmp/sampling.json   # tiny shapes

Per rows: wall ms per call of one jitted sampling step over [rows, vocab] fp32 logits (median of --reps timed
calls after a warm-up; each call's result is waited for): plain_ms, sort_ms, bisect_ms. Compare with the
round times in BENCHMARKS.md (e.g. ~26-39 ms per DDTree-64 round on the 27B) to see what truncation adds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxddtree.speculative.tree import posterior_tokens, truncate  # noqa: E402

VOCAB = 248320  # Qwen3.6-27B's padded vocabulary


def _time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the script)")
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    vocab, rows, reps = (4096, (1, 16), 3) if args.smoke else (VOCAB, (1, 16, 65), args.reps)

    plain = jax.jit(lambda lg, t, k: posterior_tokens(lg, t, k))

    def sampler(method):
        def f(lg, t, key, tk, tp, mp):
            z = truncate(lg / t, tk, tp, mp, method=method)
            return jax.random.categorical(key, z, axis=-1), jnp.isfinite(z).sum(-1)
        return jax.jit(f)

    methods = {m: sampler(m) for m in ("sort", "bisect")}
    results = []
    for n in rows:
        logits = jax.random.normal(jax.random.key(n), (n, vocab), jnp.float32) * 3.0
        key, t = jax.random.key(0), jnp.float32(0.6)
        vals = (jnp.int32(0), jnp.float32(0.95), jnp.float32(0.0))  # top_p alone: no top-k shortcut possible
        row = {"rows": n, "vocab": vocab, "plain_ms": _time(plain, (logits, t, key), reps)}
        kept = {}
        for m, f in methods.items():
            row[f"{m}_ms"] = _time(f, (logits, t, key, *vals), reps)
            kept[m] = np.asarray(f(logits, t, key, *vals)[1])
        row["kept_tokens_per_row"] = kept["sort"].tolist()
        row["methods_agree"] = bool((kept["sort"] == kept["bisect"]).all())
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "smoke": args.smoke,
           "setting": "temperature 0.6, top_p 0.95 (traced)", "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
