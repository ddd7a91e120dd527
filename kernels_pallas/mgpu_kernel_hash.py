"""One compilation per Mosaic GPU kernel per process, not one per program.

jaxlib compiles a Mosaic GPU kernel (MLIR → LLVM at O3 → PTX → ptxas) when an XLA executable holding it is loaded,
and caches the result by the custom call's `kernel_hash`: the SHA-256 of the serialized kernel module
(jaxlib/mosaic/gpu/custom_call.cc, `CachedCompile`). Every lowering of a kernel, though, stamps its module with a
dump basename made from a process-wide counter ("anonymous_0", "anonymous_1", ...; jaxlib/mosaic/gpu/dump.cc,
`GetOrSetDumpOptionsForModule`; it names the kernel's dump files, nothing else). So the same kernel at the same
shapes lowered in two programs (a prefill width and its groups of 2 / 4 / 8, each batched round) has two hashes and
is compiled twice — and again when an executable comes back from the persistent compilation cache, whose keys
change with the lowering order too. Within one program, identical calls share one lowering (jit's lowering
cache), so this is per program.

`install()` wraps `jax.experimental.mosaic.gpu.core._mosaic_gpu_lowering_rule` (the function Pallas' Mosaic GPU
`pallas_call` lowering calls) so that the basename loses its counter before the module is hashed: identical kernels
then have identical modules and hashes. Nothing else in the module changes (the counter was the only difference
between two lowerings; tests/kernel_tests/mgpu check the hashes, and `benchmarks/decode_hlo.py --hashes` hashes the
lowered text as it is).
A jax without that function or attribute is left as it is.
"""

from __future__ import annotations

import re

_ATTR = "mosaic_gpu.dump_basename"
_installed = False


def stable_basename(name: str) -> str:
    """The dump basename without the lowering counter's "_<n>" suffix."""
    return re.sub(r"_\d+$", "", name)


def install() -> bool:
    """Wrap the Mosaic GPU lowering rule once (idempotent) -> whether it is wrapped."""
    global _installed
    if _installed:
        return True
    try:
        from jax._src.lib.mlir import ir
        from jax.experimental.mosaic.gpu import core
    except ImportError:  # no Mosaic GPU in this jax
        return False
    rule = getattr(core, "_mosaic_gpu_lowering_rule", None)
    if rule is None:
        return False

    def lowering_rule(ctx, *args, module, **kwargs):
        attrs = module.operation.attributes
        if _ATTR in attrs:
            name = ir.StringAttr(attrs[_ATTR]).value
            attrs[_ATTR] = ir.StringAttr.get(stable_basename(name), context=module.context)
        return rule(ctx, *args, module=module, **kwargs)

    lowering_rule.__wrapped__ = rule
    core._mosaic_gpu_lowering_rule = lowering_rule
    _installed = True
    return True
