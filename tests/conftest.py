"""Shared fixtures: tiny random transformers models (the reference), saved once per session in HF layouts,
and our targets loaded from them.

Run with `JAX_PLATFORMS=cpu`. Everything is session-scoped and built lazily, and the tests share a few
fixed jit shapes (cache `MAX_LEN`, padded prefill `PAD_T`, ...), so a shape compiled by one test is reused
by the others.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, HERE, os.path.join(ROOT, "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

# The tools' persistent compilation cache is on by default (jaxddtree/compile_cache.py): off in the tests and their
# subprocesses, which stay hermetic (a test that wants it passes --compile-cache DIR).
os.environ.setdefault("JAXDDTREE_COMPILE_CACHE", "none")

# torch (the transformers reference; OpenMP + MKL) on one intra-op thread, set before it is imported: with its default
# of one OpenMP thread per core, its threads spin-wait after every parallel region and take the CPU from XLA (the
# other xdist worker's compiles, this process's own threads). 2-core VM, 2026-12-06, tests/test_verify.py alone beside
# a one-core busy loop (the other worker's stand-in), back to back, twice: 256 s wall / 194 CPU-s and 84 s / 109 CPU-s
# with torch's default, 98 s / 71 CPU-s and 63 s / 81 CPU-s with one thread (quiet machine: 47 / 49 s, the same). Also
# the test subprocesses' (and numpy's BLAS); XLA's CPU thread pool does not read it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# transformers logs a fallback notice for every GDN layer without fla / causal_conv1d: silence it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

# CPU runs: most of the suite's time is XLA compiling the tiny models' jits. LLVM optimisation level 0
# halves that; the HLO passes are unchanged and results differ only at fp32 rounding level (e.g. FMA
# contraction; XLA CPU enables no fast-math at any level). Only for JAX_PLATFORMS=cpu (GPU kernels keep
# their codegen), and only if the caller did not choose a level.
if os.environ.get("JAX_PLATFORMS") == "cpu" and "xla_backend_optimization_level" not in os.environ.get(
        "XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# Before anything compiles: registers Pallas's jit-key option (kernels_pallas/__init__.py says why).
import kernels_pallas  # noqa: E402,F401

import hf_models  # noqa: E402
from crash_rerun import (  # noqa: E402,F401  (hooks: a crashed xdist worker's test runs once more)
    pytest_handlecrashitem, pytest_report_teststatus, pytest_terminal_summary, pytest_xdist_make_scheduler)
from map_budget import pytest_runtest_teardown  # noqa: E402,F401  (hook: compiled programs dropped between files
#                                                                 when the process nears vm.max_map_count)


@pytest.fixture(autouse=True)
def _background_compiles_end_with_their_test():
    """A first `generate` call whose first token ends it leaves its rounds compiling in the background
    (`speculative.precompile`), a script may leave its early compile thread running (an error after it started):
    wait for them, so that no test's compilation counts see another test's."""
    yield
    import threading
    for t in threading.enumerate():  # a script's thread compiling while its weights load (serve.py, generate.py)
        if t.name.startswith("precompile-early"):
            t.join()
    pre = sys.modules.get("jaxddtree.speculative.precompile")
    if pre is not None and pre.in_flight():
        pre.ready()


class Zoo:
    """Lazily built, cached: transformers models, their saved checkpoints, and our targets."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._hf, self._paths, self._targets = {}, {}, {}

    def hf(self, variant: str = "base", seed: int = 0):
        key = (variant, seed)
        if key not in self._hf:
            self._hf[key] = (hf_models.causal_lm_bf16(seed) if variant == "bf16"
                             else hf_models.causal_lm(seed, **hf_models.VARIANTS[variant]))
        return self._hf[key]

    def path(self, variant: str = "base", seed: int = 0) -> str:
        """Text-only single-file checkpoint of `hf(variant, seed)`."""
        key = (variant, seed)
        if key not in self._paths:
            d = str(self._tmp.mktemp(f"ckpt_{variant}_{seed}"))
            hf_models.save_text_only(self.hf(variant, seed), d)
            self._paths[key] = d
        return self._paths[key]

    def target(self, variant: str = "base", seed: int = 0, dtype: str = "float32"):
        import jaxddtree
        key = (variant, seed, dtype)
        if key not in self._targets:
            self._targets[key] = jaxddtree.load_target(self.path(variant, seed), dtype)
        return self._targets[key]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory)


@pytest.fixture(scope="session")
def hf_base(zoo):
    return zoo.hf("base")


@pytest.fixture(scope="session")
def target_base(zoo):
    return zoo.target("base")


# ----------------------------------------------------------------------------- JAX-side helpers

MAX_LEN = 256  # cache rows of every fp32 test cache (one jit shape for all tests)
PAD_T = 136  # padded prefill width (prompts/remainders up to 136 real tokens: one jit shape)


class JaxHelpers:
    """Shared JAX-side helpers (the `jx` fixture). Caches passed in are copied first: `Target.prefill`
    donates its cache argument."""

    MAX_LEN = MAX_LEN
    PAD_T = PAD_T

    @staticmethod
    def copy(cache):
        import jax
        import jax.numpy as jnp
        return jax.tree.map(jnp.copy, cache)

    @classmethod
    def prefill(cls, target, cache, ids, width=None, feature_layers=()):
        """Prefill real tokens `ids` [n] as one call of jit width `width` (default: exactly n, else padded
        with num_valid=n). Returns (logits [n, V] numpy, new cache, features or None)."""
        import jax.numpy as jnp
        import numpy as np
        ids = np.asarray(ids, np.int32).reshape(-1)
        n = len(ids)
        width = n if width is None else width
        tok = np.zeros((1, width), np.int32)
        tok[0, :n] = ids
        logits, cache, feats, _ = target.prefill(cls.copy(cache), jnp.asarray(tok), num_valid=n,
                                                 feature_layers=tuple(feature_layers), logits="all")
        # slice on the host: an eager device slice would compile once per length n
        return np.asarray(logits)[0, :n], cache, (None if feats is None else np.asarray(feats)[0, :n])

    @classmethod
    def decode(cls, target, cache, token):
        """One T == 1 step (the recurrent GDN path). Returns (logits [V] numpy, new cache)."""
        import jax.numpy as jnp
        import numpy as np
        logits, cache, _, _ = target.prefill(cls.copy(cache), jnp.asarray([[int(token)]], jnp.int32),
                                             logits="all")
        return np.asarray(logits)[0, 0], cache

    @staticmethod
    def states(cache, batch_row: int = 0):
        """Per layer, numpy: attention {'k','v': [Hkv, length, hd]} (committed rows only), GDN
        {'conv': [K-1, conv_dim], 'recurrent': [Hv, dk, dv]}; plus the committed length."""
        import numpy as np
        from jaxddtree.model.cache import KVCache
        n = int(cache.length)
        out = []
        for e in cache.layers:
            if isinstance(e, KVCache):
                out.append({"k": np.asarray(e.k)[batch_row, :, :n], "v": np.asarray(e.v)[batch_row, :, :n]})
            else:
                out.append({"conv": np.asarray(e.conv)[batch_row], "recurrent": np.asarray(e.recurrent)[batch_row]})
        return out, n

    @staticmethod
    def hf_states_as_ours(hf_layers, batch_row: int = 0):
        """transformers' cache (hf_models.hf_prefill_state) in our layout: conv [C, K] -> last K-1
        columns, transposed to [K-1, C]; recurrent as is [Hv, dk, dv]; k/v [Hkv, T, hd]."""
        out = []
        for e in hf_layers:
            if "conv" in e:
                out.append({"conv": e["conv"][batch_row, :, 1:].T, "recurrent": e["recurrent"][batch_row]})
            else:
                out.append({"k": e["k"][batch_row], "v": e["v"][batch_row]})
        return out

    @staticmethod
    def state_errors(ours, ref) -> dict[str, float]:
        """Max rel error per kind over layers: {'k','v','conv','recurrent'} -> max|a-b|/max|b|."""
        errs: dict[str, float] = {}
        for a, b in zip(ours, ref):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
                errs[k] = max(errs.get(k, 0.0), hf_models.rel_err(a[k], b[k]))
        return errs


@pytest.fixture(scope="session")
def jx() -> type[JaxHelpers]:
    return JaxHelpers


@pytest.fixture(scope="module")
def demo_pair():
    """The shipped demo pair (demo/) in float32, loaded once per test module; skips when demo/ is absent."""
    from jaxddtree.checkpoint import builtin

    if builtin.demo_dirs() is None:
        pytest.skip("the demo pair (demo/) is absent")
    return builtin.load("float32")
