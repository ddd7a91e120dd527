"""Run the Pallas GEMVs (bf16 `dense`, W8A8 fp8 `w8a8_mgpu`) a few times at one 27B shape, for Nsight Compute:

    ncu --kernel-name regex:'dense|mosaic' --launch-skip 2 --launch-count 2 --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy python benchmarks/ncu_dense.py
    ncu --kernel-name regex:mosaic --metrics sm__inst_executed_pipe_tensor_op_gmma.sum,\\
        sm__inst_executed_pipe_tensor_op_hmma.sum,dram__bytes_read.sum,gpu__time_duration.sum \\
        python benchmarks/ncu_dense.py             # which tensor pipe the fp8 kernel runs on

(the bf16 GEMV is named dense_dot, the Mosaic GPU kernel anonymous_mosaic_gpu; each runs 3 times, bf16 first;
NCU_K / NCU_N / NCU_M pick the shape, default the GDN in-projection at M = 1). Not a timing: ncu serialises and
replays each kernel."""

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels_pallas import dense, w8a8_mgpu  # noqa: E402

K, N, M = int(os.environ.get("NCU_K", 5120)), int(os.environ.get("NCU_N", 16384)), int(os.environ.get("NCU_M", 1))
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
w = jax.random.normal(k[1], (K, N), jnp.bfloat16)
q = (w.T * 64).astype(w8a8_mgpu.FP8)
s = w8a8_mgpu.pad_scale(jax.random.uniform(k[2], (N // 128, K // 128), jnp.float32, 0.5, 1.5) / 64)
if M == 1:
    for _ in range(3):
        jax.block_until_ready(dense.dense(x, w))
for _ in range(3):
    jax.block_until_ready(w8a8_mgpu.w8a8_mgpu(x, q, s))
print("done", w8a8_mgpu.plan(M, K, N))
