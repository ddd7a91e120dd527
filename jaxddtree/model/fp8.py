"""FP8 (e4m3) block-quantized projection weights, kept on device as fp8 + block scales.

Format (transformers' fine-grained FP8, `integrations/finegrained_fp8.py`): an HF linear [out, in] is stored
as `weight` float8_e4m3fn and `weight_scale_inv` [ceil(out/bo), ceil(in/bi)] (fp32 or bf16); the
dequantized weight is `fp8 value * scale of its block`, element (r, c) using scale[r // bo, c // bi]
(partial edge blocks have their own scale), computed in fp32.

`Fp8Weight` holds one model parameter in the model's layout, its contracted (input) axes leading:
  q      float8_e4m3fn, the parameter's shape (or its first columns, see `tail`);
  scale  float32 [ceil(K / block_in), *q.shape[nc:]]: per input block (K = prod of the nc contracted axes,
         in HF's input order) and per output channel. The block scales are expanded along the output
         channels, so the parts of a fused parameter (GDN `w_in`, attention `w_qkv`, MLP `w_gate_up`) keep
         their own scale grids (different row-block boundaries) in one array: 4 bytes per output channel
         and input block (3 % of the fp8 bytes at 128-wide blocks);
  tail   None, or the trailing output columns of a 2-D fused parameter whose last parts are not quantized
         (GDN `w_in`'s in_proj_b | in_proj_a in the Qwen3.6 FP8 checkpoints), in the compute dtype.
`dequantize(dtype)` gives exactly the array the plain loader would produce from the same checkpoint
dequantized to fp32 (fp32 product, one cast to `dtype`).
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
        nb = self.scale.shape[0]
        s = jnp.repeat(self.scale.reshape(nb, -1).astype(jnp.float32), self.block_in, axis=0)[:K]
        w = (self.q.astype(jnp.float32).reshape(K, -1) * s).reshape(self.q.shape).astype(dtype)
        if self.tail is not None:
            w = jnp.concatenate([w, self.tail.astype(dtype)], axis=-1)
        return w

    def astype(self, dtype) -> jax.Array:  # callers that use a weight as `w.astype(x.dtype)`
        return self.dequantize(dtype)


def is_fp8(w) -> bool:
    return isinstance(w, Fp8Weight)
