"""Shared helpers for the Pallas-Triton kernels (jax 0.11.2: `pl.pallas_call` on NVIDIA = Triton backend)."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

# Every Triton lowering warns "jax-pallas-triton" (the backend is deprecated but works in 0.11.2).
warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*[Tt]riton.*")

HIGHEST = jax.lax.Precision.HIGHEST

# fp32 dot algorithms on the GPU. "tf32x3" (three TF32 tensor-core products, ~fp32 accurate) is the
# default of the GDN kernels; "ieee" is plain fp32 FMA (exact, slower); "tf32" is one TF32 product
# (~1e-3 relative error, fastest).
PRECISIONS = {
    "ieee": jax.lax.DotAlgorithmPreset.F32_F32_F32,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
    # bf16 splits of the fp32 operands, products summed in fp32 (3: ~1e-5 relative, 6: ~fp32)
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
}


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def split_tf32(x):
    """x = hi + lo with hi exactly representable in TF32 (low 13 mantissa bits cleared)."""
    xi = jax.lax.bitcast_convert_type(x, jnp.int32)
    hi = jax.lax.bitcast_convert_type(xi & jnp.int32(-8192), jnp.float32)
    return hi, x - hi


def dot_fn(precision: str, interpret: bool):
    """fp32 matmul a @ b inside a kernel. Interpret mode (CPU) always uses exact fp32.

    "tf32x3m" is the 3xTF32 product done by hand (hi·hi + hi·lo + lo·hi, ~1e-6 relative): on the H200
    Triton's own TF32x3 algorithm ran ~25x slower than one TF32 product inside the tree kernel."""
    if interpret:
        return lambda a, b: jnp.dot(a, b, precision=HIGHEST, preferred_element_type=jnp.float32)
    if precision == "tf32x3m":
        tf32 = PRECISIONS["tf32"]

        def dot3(a, b):
            d = lambda x, y: jnp.dot(x, y, precision=tf32, preferred_element_type=jnp.float32)
            ah, al = split_tf32(a)
            bh, bl = split_tf32(b)
            return d(al, bh) + d(ah, bl) + d(ah, bh)
        return dot3
    algo = PRECISIONS[precision]
    return lambda a, b: jnp.dot(a, b, precision=algo, preferred_element_type=jnp.float32)


def split_bf16(x):
    """x ≈ hi + lo, both bf16 (hi = x rounded, lo = the rounded remainder): 16 mantissa bits."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def matmul_fns(precision: str, interpret: bool):
    """(split, dot) for fp32 products inside a kernel: split(x) prepares an operand once and
    dot(sa, sb) = a @ b on prepared operands (fp32 result).

    "bf16x3m": bf16x3 by hand with operands split once (hi·lo + lo·hi + hi·hi in fp32; an operand that
    enters several products is split once, where the "bf16x3" preset re-splits both operands in every
    product). Other precisions: split is the identity and the product is `dot_fn`'s."""
    f32 = jnp.float32
    if precision == "bf16x3m" and not interpret:
        d = lambda a, b: jnp.dot(a, b, preferred_element_type=f32)

        def dot(a, b):
            return d(a[1], b[0]) + d(a[0], b[1]) + d(a[0], b[0])
        return split_bf16, dot
    return (lambda x: x), dot_fn("bf16x3" if precision == "bf16x3m" else precision, interpret)


def compiler_params(num_warps: int = 4, num_stages: int = 2):
    return pltr.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def pad_axis(x, axis: int, size: int, value=0):
    """Pad axis `axis` of x at the end up to `size`."""
    if x.shape[axis] == size:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pads, constant_values=value)


def feature_pad(d: int) -> int:
    """Feature (head) dims must be a power of two and ≥ 16 for Triton blocks and tl.dot."""
    return max(16, next_pow2(d))


# Shared memory of one Triton program on the H200 (sm_90): the opt-in maximum per block, 227 KiB. A kernel whose
# tiles need more fails to launch ("RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested N,
# available: 232448"). Read at trace time (tests lower it to force the small-tile and fallback paths).
SMEM_LIMIT = 232448


class SharedMemoryError(ValueError):
    """No tile configuration of a kernel fits SMEM_LIMIT for this call (ops falls back to the jnp reference)."""


def tile_bytes(shape, dtype) -> int:
    """Bytes of one tile of `shape` (a tuple of ints) in `dtype`."""
    return math.prod(shape) * jnp.dtype(dtype).itemsize


def pipeline_buffers(num_stages: int, async_mma: bool) -> int:
    """Copies Triton's software pipeliner keeps of each tile a loop loads: one per stage it loads ahead
    (num_stages - 1), one more while an asynchronous wgmma may still read the current one (a tensor-core dot
    (bf16, tf32) of >= 64 rows accumulating over the loop); at least one (the staging copy of a dot operand).
    Checked against Triton's own allocation (tests/kernel_tests/test_shared_memory.py)."""
    return max(1, num_stages - 1 + int(async_mma))


def smem_limit(limit: int | None = None) -> int:
    return SMEM_LIMIT if limit is None else int(limit)


def first_fit(candidates, estimate, limit: int | None = None, *, what: str):
    """The first candidate config whose `estimate(config)` (bytes of shared memory) is <= the limit; raises
    SharedMemoryError naming the smallest estimate otherwise."""
    lim, best = smem_limit(limit), None
    for c in candidates:
        b = estimate(c)
        if b <= lim:
            return c
        best = b if best is None else min(best, b)
    raise SharedMemoryError(f"{what}: no tile configuration fits {lim} bytes of shared memory "
                            f"(the smallest needs {best})")


_NOTED: set = set()
log = logging.getLogger("kernels_pallas")


def note_once(key, message: str) -> None:
    """One plain line on stderr (a `logging` warning: no source line), once per process and key."""
    if key in _NOTED:
        return
    _NOTED.add(key)
    log.warning(message)


H200 = dict(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


@contextlib.contextmanager
def abstract_h200():
    """Lower for CUDA without a GPU: `jax.jit(f).trace(*structs).lower(lowering_platforms=("cuda",))`."""
    dev = jax.sharding.AbstractDevice(**H200)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        yield


def lower_for_h200(f, *structs):
    """Trace and lower f for CUDA against an abstract H200; returns the StableHLO text (contains the
    Triton custom call). Raises if a kernel cannot be lowered (non power-of-two blocks, bad dots...)."""
    with abstract_h200():
        lowered = jax.jit(f).trace(*structs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


__all__ = ["pl", "pltr", "HIGHEST", "SMEM_LIMIT", "SharedMemoryError", "tile_bytes", "pipeline_buffers",
           "smem_limit", "first_fit", "note_once", "PRECISIONS", "next_pow2", "is_pow2", "dot_fn", "matmul_fns", "split_bf16", "compiler_params",
           "pad_axis", "feature_pad", "abstract_h200", "lower_for_h200"]
