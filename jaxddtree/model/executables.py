"""Compiled programs kept on disk, so that a second start neither traces nor lowers them (issue 40: warm starts).

jax's persistent compilation cache is keyed by the lowered program: a warm start still traces and lowers every
program to find its entry, and at 27B that is most of a warm start (H200, session 22: the auto round lowered in
8.7 s and loaded in 1.3 s; the Mosaic GPU kernels' Python lowering is most of it). A `Program` (what `Target.bind`
makes of a jitted function) has a key of its own instead: its static parts (the bind key: graph and tree
definitions, dtype, plan, ...) and its arguments' shapes and dtypes, hashed with the source of jaxddtree and
kernels_pallas, the jax / jaxlib / flax versions, the device kind and count and the XLA_* / JAX_* environment.
`precompile.compile_all` writes each program it compiles (`save`: the serialized executable, jax's
`serialize_executable`, with its input / output trees and shapes) and loads one found (`load`, in its threads: no
trace, no lowering; the executable's Mosaic GPU kernels are compiled by jaxlib as it loads, as for jax's cache);
`precompile.shape_of` reads a stored program's output shapes instead of tracing it. A Program then runs its
executable for arguments of those shapes, and is its jitted function for any other (and under a trace).

Any change of the source makes new keys (the old entries are never read; delete the directory to reclaim them); a
key that does not describe a static part exactly can only miss (a repr with an address), never match two
programs, as long as every static part's repr shows all its fields (dataclasses do). One device only (a
sharded target's programs are not stored), GPUs only (`enable`: jaxlib's CPU client cannot load them into another
process). On by default with the compilation cache: `DIR/executables` (`jaxddtree.compile_cache.enable`); an entry
that fails to load is deleted and the program compiled as usual.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import pickle
import threading

import jax

log = logging.getLogger(__name__)

_DIR: pathlib.Path | None = None  # where programs are kept (None: off)
_PLATFORMS: tuple[str, ...] = ("gpu",)  # where they are: see `enable`
_VERSION: str | None = None
FORMAT = 1  # of the files' contents


def enable(path: str | os.PathLike | None, platforms=("gpu",)) -> pathlib.Path | None:
    """Keep compiled programs in `path` (created; None: off) on devices of `platforms` -> the directory, or None
    when off or not writable. Not on the CPU by default: jaxlib 0.11.2's CPU client crashes (SIGSEGV, or "Function
    ... not found" at a call) compiling or running other programs in a process that loaded a serialized CPU
    executable of ours (2026-12-05); within the process that compiled it, it works (the tests use that)."""
    global _DIR, _PLATFORMS
    _PLATFORMS = tuple(platforms)
    if path is None:
        _DIR = None
        return None
    p = pathlib.Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError:
        _DIR = None
        return None
    _DIR = p if os.access(p, os.W_OK) else None
    return _DIR


def directory() -> pathlib.Path | None:
    return _DIR


def code_version() -> str:
    """sha256 of what a compiled program depends on besides its key: this package's and kernels_pallas' source and
    data files, the jax / jaxlib / flax versions (computed once per process)."""
    global _VERSION
    if _VERSION is None:
        import flax
        import jaxlib

        import kernels_pallas
        h = hashlib.sha256(f"{FORMAT} {jax.__version__} {jaxlib.__version__} {flax.__version__}".encode())
        for root in (pathlib.Path(__file__).resolve().parents[1], pathlib.Path(kernels_pallas.__file__).parent):
            for f in sorted(root.rglob("*")):
                if f.suffix in (".py", ".json") and f.is_file():
                    h.update(str(f.relative_to(root)).encode())
                    h.update(f.read_bytes())
        _VERSION = h.hexdigest()
    return _VERSION


def _environment() -> str:
    devs = jax.devices()
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "TF_", "NVIDIA_TF32")))
    return repr((devs[0].platform, devs[0].device_kind, len(devs), env, jax.config.jax_enable_x64,
                 jax.config.jax_default_matmul_precision))


def signature(args) -> tuple:
    """What tells two calls of one program apart: the arguments' tree and each leaf's shape and dtype."""
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((x.shape, x.dtype) for x in leaves)  # (≈ 40 µs for a round's 100 leaves; str(dtype): 800)


def _mosaic_runtime() -> None:
    """Make a loaded program's Mosaic GPU kernels linkable: jaxlib JIT-links a kernel's host code against the library
    named by MOSAIC_GPU_RUNTIME_LIB_PATH, which `jax.experimental.mosaic.gpu` sets when imported. A process that loads
    before it builds any kernel has not imported it (measured, H200: "Symbols not found: mosaic_gpu_launch_kernel")."""
    try:
        import jax.experimental.mosaic.gpu  # noqa: F401 (sets the variable)
    except ImportError:  # (no Mosaic GPU in this jaxlib: nothing to link)
        pass


class OptionedJit:
    """`jax.jit(fun, compiler_options=options, **kw)` called at the top level; called inside another trace (an outer
    jit, `jax.eval_shape`), the same jit without the options, which jax refuses on a nested jit (the outer program's
    options are the ones that apply there). lower / trace / eval_shape / _cache_size are the optioned jit's."""

    def __init__(self, fun, options: dict | None, **kw):
        self.optioned = jax.jit(fun, compiler_options=options, **kw)
        self.nested = jax.jit(fun, **kw) if options else self.optioned
        self.__name__ = getattr(self.optioned, "__name__", "program")

    def __call__(self, *args, **kwargs):
        if self.nested is not self.optioned and any(isinstance(x, jax.core.Tracer)
                                                    for x in jax.tree.leaves((args, kwargs))):
            return self.nested(*args, **kwargs)
        return self.optioned(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.optioned, name)


class Program:
    """A jitted function (`Target.bind`) that also runs executables compiled or loaded for given argument shapes
    (`precompile.compile_all`); any other call is the jitted function's. key: the static parts' repr (None: never
    stored, e.g. a sharded target's)."""

    def __init__(self, jitted, key: str | None):
        self.jitted = jitted
        self.key = key
        self.executables: dict = {}  # signature -> jax.stages.Compiled
        self.__name__ = getattr(jitted, "__name__", "program")
        self.__wrapped__ = jitted

    def __call__(self, *args, **kwargs):
        if self.executables and not kwargs:
            leaves, treedef = jax.tree.flatten(args)
            if not any(isinstance(x, jax.core.Tracer) for x in leaves):
                exe = self.executables.get((treedef, tuple((x.shape, x.dtype) for x in leaves)))
                if exe is not None:
                    return exe(*args)
        return self.jitted(*args, **kwargs)

    def __getattr__(self, name):  # lower, trace, eval_shape, _cache_size, ... of the jitted function
        return getattr(self.jitted, name)

    def _cache_size(self) -> int:
        return self.jitted._cache_size() + len(self.executables)

    def has(self, args) -> bool:
        return signature(args) in self.executables

    def add(self, args, compiled) -> None:
        self.executables[signature(args)] = compiled

    # ---- the store
    def path(self, args) -> pathlib.Path | None:
        """The file of this program at args' shapes (None: not stored: off, no key, or sharded arguments)."""
        if _DIR is None or self.key is None or jax.devices()[0].platform not in _PLATFORMS:
            return None
        for x in jax.tree.leaves(args):
            s = getattr(x, "sharding", None)
            if s is not None and len(s.device_set) > 1:
                return None
        h = hashlib.sha256("\n".join((code_version(), _environment(), self.key, repr(signature(args)))).encode())
        return _DIR / f"{self.__name__}-{h.hexdigest()[:40]}.exe"

    def stored(self, args) -> dict | None:
        """The stored entry for args (read once; cached on the Program), or None."""
        p = self.path(args)
        if p is None or not p.is_file():
            return None
        cache = self.__dict__.setdefault("_read", {})
        if p not in cache:
            try:
                entry = pickle.loads(p.read_bytes())
                if entry.get("format") != FORMAT:
                    raise ValueError("format")
            except Exception as e:  # noqa: BLE001 (a bad entry is replaced by the next compilation)
                log.warning("dropping a stored program (%s: %s)", p.name, e)
                p.unlink(missing_ok=True)
                return None
            cache[p] = entry
        return cache[p]

    def out_shapes(self, args):
        """The stored program's outputs as ShapeDtypeStructs (unplaced), or None."""
        entry = self.stored(args)
        if entry is None:
            return None
        return jax.tree.unflatten(entry["out_tree"], [jax.ShapeDtypeStruct(s, d) for s, d in entry["out"]])

    def load(self, args) -> bool:
        """Load the stored executable for args (`add`) -> whether it was there and loaded."""
        from jax.experimental import serialize_executable
        entry = self.stored(args)
        if entry is None:
            return False
        _mosaic_runtime()
        try:
            exe = serialize_executable.deserialize_and_load(entry.pop("exe"), entry["in_tree"], entry["out_tree"])
        except Exception as e:  # noqa: BLE001
            log.warning("dropping a stored program that did not load (%s: %s)", self.__name__, e)
            self.path(args).unlink(missing_ok=True)
            return False
        finally:
            self._read.pop(self.path(args), None)  # (its bytes: read again if ever needed)
        self.add(args, exe)
        return True

    def save(self, args, compiled) -> bool:
        """Write compiled (this program at args' shapes) to the store -> whether it was written."""
        p = self.path(args)
        if p is None:
            return False
        from jax.experimental import serialize_executable
        try:
            exe, in_tree, out_tree = serialize_executable.serialize(compiled)
            out = [(tuple(o.shape), o.dtype) for o in jax.tree.leaves(compiled.out_info)]  # (dtypes pickle)
            blob = pickle.dumps(dict(format=FORMAT, exe=exe, in_tree=in_tree, out_tree=out_tree, out=out))
            tmp = p.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(blob)
            os.replace(tmp, p)  # whole or absent, for a concurrent reader
        except Exception as e:  # noqa: BLE001 (not stored: compiled again next time)
            log.warning("could not store %s (%s)", self.__name__, e)
            return False
        return True
