"""The persistent XLA compilation cache of the command-line tools (generate.py, serve.py, serve_bench.py): on by
default, so that a second start with the same shapes loads its programs instead of compiling them.

Demo pair on a 2-core CPU (2026-12-02): the server's warm-up took 68.7 s with an empty cache and 22.0 s with the cache
of the first start (what is left is tracing and lowering, ≈ 10 s, and programs under the 0.5 s threshold then).
Every program is written now, however fast it compiles: generate.py's warm demo start compiled ≈ 30 small programs
(the loader's transposes and stacks, the decode start: 10–270 ms each, 0.5 s in all) where loading them takes
0.14 s (2026-12-03); the entries are a few KB.

Where: `--compile-cache DIR`, else $JAXDDTREE_COMPILE_CACHE, else $XDG_CACHE_HOME/jaxddtree/xla (~/.cache/...); the
value "none" turns it off. JAX keys each entry by the program, the compile options, the devices and the jax/jaxlib
versions, so a stale entry is never used; past 8 GiB the least recently used entries are deleted. The cache is trusted code: keep it in a directory only you can write.
DIR/executables holds the heavy programs (prefills, starts, rounds) as whole executables with keys of their own
(`jaxddtree.model.executables`): a second start loads them without tracing or lowering them. Its entries are
never evicted; a new version of the source makes new ones (delete the directory to reclaim the old).
"""

from __future__ import annotations

import os
import sys

ENV = "JAXDDTREE_COMPILE_CACHE"
OFF = ("none", "off", "")
MIN_COMPILE_SECS = 0.0  # programs compiling faster than this are not written (0: all are)
MAX_BYTES = 8 << 30  # past this the least recently used entries go (JAX's LRU file cache)


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxddtree", "xla")


def resolve(arg: str | None) -> str | None:
    """The cache directory for a --compile-cache value (None: not given) -> a path, or None when off."""
    value = arg if arg is not None else os.environ.get(ENV)
    if value is None:
        return default_dir()
    value = value.strip()
    return None if value.lower() in OFF else os.path.abspath(os.path.expanduser(value))


def enable(arg: str | None, prog: str) -> str | None:
    """Turn the cache on for this process at `resolve(arg)` (before anything compiles) -> the directory, or None
    when it is off or cannot be created (then one line on stderr, and the run goes on without it)."""
    path = resolve(arg)
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        print(f"{prog}: warning: no compilation cache ({e}); pass --compile-cache DIR or none", file=sys.stderr,
              flush=True)
        return None
    import jax

    from jaxddtree.model import executables
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    executables.enable(os.path.join(path, "executables"))  # the heavy programs, loaded without tracing
    return path
