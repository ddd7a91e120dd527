#!/usr/bin/env python
"""Micro-benchmark: skinny GEMMs in the two weight layouts ([in, out] vs [out, in]) on the device."""
import statistics, time, json, sys
import jax, jax.numpy as jnp


def med(fn, n=50):
    for _ in range(5):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(n):
        t = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


res = {}
for (din, dout) in [(5120, 65536), (5120, 17408), (17408, 5120), (5120, 10240), (5120, 248320)]:
    W_io = jax.random.normal(jax.random.key(0), (din, dout), jnp.bfloat16)
    W_oi = jax.random.normal(jax.random.key(1), (dout, din), jnp.bfloat16)
    for m in (1, 16, 65, 128):
        x = jax.random.normal(jax.random.key(2), (m, din), jnp.bfloat16)
        f_io = jax.jit(lambda x, w: jnp.einsum("md,df->mf", x, w))
        f_oi = jax.jit(lambda x, w: jnp.einsum("md,fd->mf", x, w))
        a, b = med(lambda: f_io(x, W_io)), med(lambda: f_oi(x, W_oi))
        gb = din * dout * 2 / 1e9
        res[f"{din}x{dout} M={m}"] = {"in_out_ms": round(a, 4), "out_in_ms": round(b, 4),
                                      "in_out_tb_s": round(gb / a, 2), "out_in_tb_s": round(gb / b, 2)}
        print(f"{din}x{dout} M={m}: [in,out] {a:.4f} ms ({gb/a:.2f} TB/s)  [out,in] {b:.4f} ms ({gb/b:.2f} TB/s)", flush=True)
    del W_io, W_oi
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "layouts.json", "w"), indent=1)
