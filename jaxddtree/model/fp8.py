"""FP8 (e4m3) block-quantized projection weights, kept on device as fp8 + block scales.

Format (transformers' fine-grained FP8, `integrations/finegrained_fp8.py`): an HF linear [out, in] is stored
as `weight` float8_e4m3fn and `weight_scale_inv` [ceil(out/bo), ceil(in/bi)] (fp32 or bf16); the
dequantized weight is `fp8 value * scale of its block`, element (r, c) using scale[r // bo, c // bi]
(partial edge blocks have their own scale), computed in fp32.

`Fp8Weight` holds one model parameter (logical shape `shape`, the model's layout: contracted (input) axes first)
in the checkpoint's own layout:
  q          float8_e4m3fn [N, K]: the nn.Linear rows (output features, the fused parameter's parts stacked in
             column order) by the input features in HF order; K-major, what Hopper's fp8 wgmma reads
             (kernels_pallas/w8a8_mgpu.py) with no transpose anywhere;
  scale      float32 [ceil(N / block_out), C], C = `w8a8_mgpu.scale_cols(ceil(K / block_in))` ≥ the input blocks
             (zero columns pad each row to 128 bytes, one TMA copy): row n of input block b has scale
             scale[n // block_out, b];
  block_out  the row-block width of that grid: the checkpoint's output block bo when every part of a fused
             parameter (GDN `w_in`, attention `w_qkv`, MLP `w_gate_up`) starts at a multiple of bo — true for
             all Qwen3.6-27B shapes (bo = 128) — else the largest width whose row groups never straddle two
             scale blocks (`compact_scales`: a divisor of bo; 1 at worst, one scale per row). Exact either way;
  tail       None, or the trailing output columns of a 2-D fused parameter whose last parts are not quantized
             (GDN `w_in`'s in_proj_b | in_proj_a in the Qwen3.6 FP8 checkpoints), [K, n_tail] in the compute
             dtype (the model's layout).
`dequantize(dtype)` gives exactly the array the plain loader would produce from the same checkpoint
dequantized to fp32 (fp32 product, one cast to `dtype`), in the model's layout. The model's numerics for an
Fp8Weight are W8A8 (`kernels_pallas/w8a8.py`: transformers' dynamic per-token activation quantization + the
block-scaled product).
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
    block_out: int = struct.field(pytree_node=False, default=128)
    shape: tuple = struct.field(pytree_node=False, default=())  # the parameter's logical shape (tail included)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(FP8)

    @property
    def nc(self) -> int:
        """The number of leading contracted axes of `shape` (their product is K)."""
        K = self.q.shape[-1]
        return next(n for n in range(1, len(self.shape) + 1) if math.prod(self.shape[:n]) == K)

    def __getitem__(self, key):  # `param[...]` in the modules
        if key is Ellipsis:
            return self
        raise TypeError("Fp8Weight supports only [...]; dequantize() it first")

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        if self.q.ndim > 2:  # stacked over the layer groups (qwen35.Qwen35): each layer's
            return jax.vmap(lambda w: w.dequantize(dtype))(self)
        N, K = self.q.shape
        nb = -(-K // self.block_in)
        s = jnp.repeat(jnp.repeat(self.scale[:, :nb].astype(jnp.float32), self.block_out, axis=0), self.block_in,
                       axis=1)[:N, :K]
        w = (self.q.astype(jnp.float32) * s).T  # [K, N]
        qshape = self.shape if self.tail is None else self.shape[:-1] + (self.shape[-1] - self.tail.shape[-1],)
        w = w.reshape(qshape).astype(dtype)
        if self.tail is not None:
            w = jnp.concatenate([w, self.tail.astype(dtype)], axis=-1)
        return w

    def astype(self, dtype) -> jax.Array:  # callers that use a weight as `w.astype(x.dtype)`
        return self.dequantize(dtype)


def make(q, row_scales_compact, *, block_in: int, block_out: int, shape: tuple, tail=None) -> Fp8Weight:
    """An Fp8Weight from q [N, K] and the compact scale grid [ceil(N / block_out), ceil(K / block_in)] (padded here
    to the kernel's columns)."""
    nb = -(-q.shape[1] // block_in)
    s = jnp.asarray(row_scales_compact, jnp.float32)
    assert s.shape == (-(-q.shape[0] // block_out), nb), (s.shape, q.shape, block_in, block_out)
    from kernels_pallas.w8a8_mgpu import scale_cols  # here: the module imports Mosaic GPU (≈ 0.5 s on a CPU start)
    cols = scale_cols(nb)
    if cols != nb:
        s = jnp.pad(s, ((0, 0), (0, cols - nb)))
    return Fp8Weight(q=q, scale=s, tail=tail, block_in=block_in, block_out=block_out, shape=tuple(shape))


def quantize(w, nc: int = 1, block: int = 128) -> Fp8Weight:
    """A plain weight in the model's layout (its first nc axes contracted) stored as the FP8 checkpoints store
    theirs (transformers' fine-grained FP8, `Fp8Quantize`): the [N, K] matrix in blocks of block × block, each
    block's scale its largest magnitude / 448 (e4m3's largest value; 1 for an all-zero block), the values times
    its reciprocal, clamped to ±448 and rounded to e4m3. For weights that ship in bf16 (the DFlash drafter's, `Drafter.to_fp8`)."""
    shape = tuple(w.shape)
    K, N = math.prod(shape[:nc]), math.prod(shape[nc:])
    wt = jnp.asarray(w, jnp.float32).reshape(K, N).T  # [N, K]
    nbo, nbi = -(-N // block), -(-K // block)
    blocks = jnp.pad(wt, ((0, nbo * block - N), (0, nbi * block - K))).reshape(nbo, block, nbi, block)
    import numpy as np  # the scales' divisions on the host: IEEE-exact as torch's (XLA's CPU division is not)
    amax = np.asarray(jnp.max(jnp.abs(blocks), axis=(1, 3)))  # [nbo, nbi]
    top = np.float32(jnp.finfo(FP8).max)
    scale = np.where(amax > 0, amax / top, np.float32(1)).astype(np.float32)  # weight_scale_inv
    full = jnp.repeat(jnp.repeat(jnp.asarray(np.float32(1) / scale), block, axis=0), block, axis=1)[:N, :K]
    return make(jnp.clip(wt * full, -top, top).astype(FP8), scale, block_in=block, block_out=block, shape=shape)


def compact_scales(rows, max_block: int = 128):
    """A per-row scale grid rows [N, nb] (numpy) -> (compact [ceil(N / g), nb], g): g the widest row group,
    among the divisors of `max_block` (descending), over which every column of `rows` is constant — so
    compact[n // g, b] == rows[n, b] exactly. The checkpoint's output block when the parts of a fused
    parameter start at its multiples (every 27B projection: g = 128), narrower otherwise (1: per row)."""
    import numpy as np
    rows = np.asarray(rows, np.float32)
    N, nb = rows.shape
    for g in [d for d in range(max_block, 0, -1) if max_block % d == 0]:
        ng = -(-N // g)
        padded = np.concatenate([rows, np.repeat(rows[-1:], ng * g - N, axis=0)], axis=0)
        grp = padded.reshape(ng, g, nb)
        if (grp == grp[:, :1]).all():
            return np.ascontiguousarray(grp[:, 0]), g
    raise AssertionError("unreachable: g = 1 always holds")
