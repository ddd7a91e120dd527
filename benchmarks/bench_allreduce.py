"""The all-reduce of tensor parallelism (issue 18) on its own: NCCL vs XLA's one-shot collective kernel.

At tp = N every decoder layer sums two fp32 partial rows over the devices (`jax.lax.psum` inside the model's
shard_map: after the mixer and after the MLP), i.e. 128 small all-reduces per 27B decode step. This times a
chain of `--chain` dependent psums of [rows, 5120] (rows 1 = decode, 65 = verify) inside one jit, for:
  * "nccl":    XLA's default (an NCCL all-reduce thunk);
  * "oneshot": `xla_gpu_unsupported_use_all_reduce_one_shot_kernel` — XLA's Triton one-shot kernel: each device reads the peers' buffers over NVLink (peer access, no multicast);
               XLA falls back to NCCL where it does not apply (too big, no peer access).
  * "graphs": the collectives recorded into XLA's command buffers (CUDA graphs) too;
  * "nccl_sync", "nccl_userbuf", "nccl_symmetric", "oneshot_new": other XLA options (see VARIANTS).
Per variant: µs per all-reduce = (chain time − the same chain without the psum) / chain, wall-clock medians.

    python benchmarks/bench_allreduce.py --out $OUT/allreduce.json      # needs >= 2 GPUs
    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/bench_allreduce.py --smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_timing import log, save_json, wall_ms  # noqa: E402
_GRAPHS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES"}
_ONESHOT = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True}
VARIANTS = {"nccl": {},
            # the newer flag: its HLO keeps the NCCL strategy in this XLA (H200 x2, 2026-11-30); the older one
            # below sets kernel_strategy KERNEL_STRATEGY_TRITON_ONE_SHOT
            "oneshot_new": {"xla_gpu_experimental_use_collective_kernels": "COLLECTIVE_KERNEL_ALL_REDUCE"},
            "oneshot": _ONESHOT,
            "graphs": _GRAPHS,  # the collectives inside the command buffers (CUDA graphs)
            "graphs_oneshot": {**_GRAPHS, **_ONESHOT},
            "nccl_sync": {"xla_gpu_disable_async_collectives": "ALLREDUCE"},  # no async start/done pair
            "nccl_userbuf": {"xla_gpu_enable_nccl_user_buffers": True},  # NCCL-registered buffers
            # NCCL's symmetric-memory kernels (NCCL_NVLS_ENABLE=0 stays set on the GPU hosts: no multicast)
            "nccl_symmetric": {"xla_gpu_experimental_enable_nccl_symmetric_buffers": True}}


def chain_fn(mesh, n: int, with_psum: bool, options: dict):
    def body(x):  # x: this device's [rows, D] partial; a dependent chain so XLA cannot combine the psums
        for _ in range(n):
            y = jax.lax.psum(x, "tp") if with_psum else x
            x = y * 0.5 + x * 0.25
        return x

    f = jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    return jax.jit(f, compiler_options=options or None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--chain", type=int, default=128, help="dependent all-reduces per jitted call")
    ap.add_argument("--rows", default="1,65")
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="CPU check: no compiler options, few runs")
    args = ap.parse_args()
    devs = jax.devices()[:args.tp]
    if len(devs) < args.tp:
        raise SystemExit(f"needs {args.tp} devices, found {len(jax.devices())}")
    mesh = Mesh(devs, ("tp",))
    res = {"device": devs[0].device_kind, "tp": args.tp, "chain": args.chain, "dim": args.dim, "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "env": {k: os.environ.get(k) for k in ("NCCL_PROTO", "NCCL_NVLS_ENABLE", "XLA_FLAGS")}, "us_per_allreduce": {}}
    reps = 3 if args.smoke else 30
    for rows in map(int, args.rows.split(",")):
        for dt in (jnp.float32, jnp.bfloat16):
            x = jax.device_put(jax.random.normal(jax.random.key(rows), (args.tp * rows, args.dim), dt),
                               jax.sharding.NamedSharding(mesh, P("tp")))
            base = None
            for name in args.variants.split(","):
                opts = VARIANTS[name]
                if args.smoke and opts and name != "nccl_sync":
                    continue
                if base is None:
                    base = wall_ms(chain_fn(mesh, args.chain, False, opts), (x,), reps=reps)
                f = chain_fn(mesh, args.chain, True, opts)
                try:
                    hlo = f.lower(x).compile().as_text()
                except Exception as e:  # an option this XLA does not take
                    log(f"{name}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                ar = [ln.strip()[:3000] for ln in hlo.splitlines() if "all-reduce" in ln and "=" in ln]
                res.setdefault("hlo", {})[f"{name}/rows{rows}/{jnp.dtype(dt).name}"] = ar[:2]
                ms = wall_ms(f, (x,), reps=reps)
                us = (ms - base) * 1e3 / args.chain
                key = f"{name}/rows{rows}/{jnp.dtype(dt).name}"
                res["us_per_allreduce"][key] = round(us, 2)
                log(f"{key:28s} {us:8.2f} us per all-reduce (chain {ms:.3f} ms, without psum {base:.3f} ms)")
                save_json(args.out, res)


if __name__ == "__main__":
    main()
