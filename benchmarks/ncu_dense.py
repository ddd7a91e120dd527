"""Run the Pallas GEMVs (bf16 `dense`, W8A8 fp8 `w8a8`) a few times at one 27B shape, for Nsight Compute:

    ncu --kernel-name regex:'dense|w8a8' --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy python benchmarks/ncu_dense.py

(kernels named dense_dot / w8a8_fp8_dot; each runs 3 times, bf16 first). Not a timing: ncu serialises and
replays each kernel."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels_pallas import dense, w8a8  # noqa: E402

K, N, M = int(os.environ.get("NCU_K", 5120)), int(os.environ.get("NCU_N", 16384)), int(os.environ.get("NCU_M", 1))
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
w = jax.random.normal(k[1], (K, N), jnp.bfloat16)
q = (w * 64).astype(w8a8.FP8)
s = jax.random.uniform(k[2], (K // 128, N // 128), jnp.float32, 0.5, 1.5) / 64
for _ in range(3):
    jax.block_until_ready(dense.dense(x, w))
for _ in range(3):
    jax.block_until_ready(w8a8.w8a8(x, q, s, block_in=128, block_out=128))
print("done")
