"""FP8 (e4m3) block-quantized projection weights, kept on device as fp8 + block scales.

Format (transformers' fine-grained FP8, `integrations/finegrained_fp8.py`): an HF linear [out, in] is stored
as `weight` float8_e4m3fn and `weight_scale_inv` [ceil(out/bo), ceil(in/bi)] (fp32 or bf16); the
dequantized weight is `fp8 value * scale of its block`, element (r, c) using scale[r // bo, c // bi]
(partial edge blocks have their own scale), computed in fp32.

`Fp8Weight` holds one model parameter in the model's layout, its contracted (input) axes leading:
  q          float8_e4m3fn, the parameter's shape (or its first columns, see `tail`);
  scale      float32 [ceil(K / block_in), ceil(N / block_out)], COMPACT: K = prod of the nc contracted axes (HF's
             input order), N = prod of q's output axes; output column n of input block b has scale
             scale[b, n // block_out];
  block_out  the column-block width of that grid: the checkpoint's output block bo when every part of a fused
             parameter (GDN `w_in`, attention `w_qkv`, MLP `w_gate_up`) starts at a multiple of bo — true for
             all Qwen3.6-27B shapes (bo = 128) — else the largest width whose column groups never straddle two
             scale blocks (`compact_scales`: a divisor of bo; 1 at worst, one scale per column). Exact either way;
             tiny test models with odd part sizes get narrow groups, the kernel gathers their scales per column;
  tail       None, or the trailing output columns of a 2-D fused parameter whose last parts are not quantized
             (GDN `w_in`'s in_proj_b | in_proj_a in the Qwen3.6 FP8 checkpoints), in the compute dtype.
`dequantize(dtype)` gives exactly the array the plain loader would produce from the same checkpoint
dequantized to fp32 (fp32 product, one cast to `dtype`). The model's numerics for an Fp8Weight are W8A8
(`kernels_pallas/w8a8.py`: transformers' dynamic per-token activation quantization + the block-scaled product).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

FP8 = jnp.float8_e4m3fn


@struct.dataclass
class Fp8Weight:
    q: jax.Array
    scale: jax.Array
    tail: jax.Array | None = None
    block_in: int = struct.field(pytree_node=False, default=128)
    nc: int = struct.field(pytree_node=False, default=1)  # leading contracted axes
    block_out: int = struct.field(pytree_node=False, default=128)

    @property
    def shape(self) -> tuple:
        s = tuple(self.q.shape)
        return s if self.tail is None else s[:-1] + (s[-1] + self.tail.shape[-1],)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def dtype(self):
        return jnp.dtype(FP8)

    def __getitem__(self, key):  # `param[...]` in the modules
        if key is Ellipsis:
            return self
        raise TypeError("Fp8Weight supports only [...]; dequantize() it first")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        K = math.prod(self.q.shape[:self.nc])
        s = jnp.repeat(jnp.repeat(self.scale.astype(jnp.float32), self.block_in, axis=0), self.block_out, axis=1)
        q2 = self.q.astype(jnp.float32).reshape(K, -1)
        w = (q2 * s[:K, :q2.shape[1]]).reshape(self.q.shape).astype(dtype)
        if self.tail is not None:
            w = jnp.concatenate([w, self.tail.astype(dtype)], axis=-1)
        return w

    def astype(self, dtype) -> jax.Array:  # callers that use a weight as `w.astype(x.dtype)`
        return self.dequantize(dtype)


def compact_scales(cols, max_block: int = 128):
    """A per-column scale grid cols [nb, N] (numpy) -> (compact [nb, ceil(N / g)], g): g the widest column
    group, among the divisors of `max_block` (descending), over which every row of `cols` is constant — so
    compact[b, n // g] == cols[b, n] exactly. The checkpoint's output block when the parts of a fused
    parameter start at its multiples (every 27B projection: g = 128), narrower otherwise (1: per column)."""
    import numpy as np
    cols = np.asarray(cols, np.float32)
    nb, N = cols.shape
    for g in [d for d in range(max_block, 0, -1) if max_block % d == 0]:
        ng = -(-N // g)
        padded = np.concatenate([cols, np.repeat(cols[:, -1:], ng * g - N, axis=1)], axis=1)
        grp = padded.reshape(nb, ng, g)
        if (grp == grp[:, :, :1]).all():
            return np.ascontiguousarray(grp[:, :, 0]), g
    raise AssertionError("unreachable: g = 1 always holds")
