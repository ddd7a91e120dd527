"""Pallas kernels (Triton and Mosaic GPU back ends) beside their plain-jnp references; `ops` picks one per call.

Pallas registers a jax option that is part of every jit's cache key (`pallas_fuser_disable_nested_fuse`) when
`jax.experimental.pallas.fuser` is first imported, which Pallas's einshape does lazily, the first time a kernel is
traced: every program compiled before that moment in the process (a prefill, a sampler, the server's warm-up)
missed the cache afterwards and compiled again. Every model module imports this package, so importing the fuser
here registers the option before anything compiles."""

import jax.experimental.pallas.fuser  # noqa: F401
