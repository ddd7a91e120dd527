"""--budget auto's warm-up measurement (scripts/generate.py on a device without a round-time table), kept on disk
beside the persistent compilation cache so that a later start with the same inputs reuses it instead of timing AR
and every candidate again (≈ 4 s of a 9 s demo start on the 2-core CPU), and compiles only the method it chose.

One JSON file per key under `<compilation cache>/budget-auto/`. The key is a hash of everything the measurement
depends on: the device (backend, kind, count, CPU cores), jax / jaxlib, the XLA flags, jaxddtree's own source
files (contents), the target and drafter (paths, each file's size and mtime), dtype, kernels, tp, the warm-up
prompt, the cache capacity and the sampling / loop settings. Anything that changes gives another key: the stale
file is never read. A file that cannot be read or parsed counts as absent (the measurement runs again and
rewrites it). Delete the directory (or pass --compile-cache none) to measure afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile

from jaxddtree.speculative import budget as budget_lib

SUBDIR = "budget-auto"
VERSION = 1
_PACKAGES = ("jaxddtree", "kernels_pallas")


def _code_digest() -> str:
    """sha256 over the model code's source files (jaxddtree and kernels_pallas, where importable)."""
    import importlib.util
    h = hashlib.sha256()
    for pkg in _PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            for p in sorted(pathlib.Path(root).rglob("*.py")):
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def _dir_identity(path) -> list | str | None:
    """A checkpoint directory: its absolute path and each file's (relative path, size, mtime_ns)."""
    if path is None:
        return None
    path = os.path.abspath(path)
    files = []
    for root, dirs, names in os.walk(path):
        dirs.sort()
        for n in sorted(names):
            p = os.path.join(root, n)
            st = os.stat(p)
            files.append([os.path.relpath(p, path), st.st_size, st.st_mtime_ns])
    return [path, files]


def key(*, target_dir, drafter_dir, settings: dict) -> dict:
    """The measurement's identity (JSON-able): the device, the software, the models and `settings` (dtype, kernels,
    tp, the warm-up prompt ids, cache capacity, sampling and loop settings: whatever the caller's timed runs use)."""
    import jax
    import jaxlib
    dev = jax.devices()[0]
    return {
        "version": VERSION,
        "device": [jax.default_backend(), getattr(dev, "device_kind", ""), jax.device_count(), os.cpu_count()],
        "jax": [jax.__version__, jaxlib.__version__], "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "code": _code_digest(), "target": _dir_identity(target_dir) or "built-in random",
        "drafter": _dir_identity(drafter_dir) or "built-in random", "settings": settings,
    }


def path_for(cache_dir: str, k: dict) -> str:
    digest = hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(cache_dir, SUBDIR, f"{digest}.json")


def load(path: str, k: dict):
    """-> (CostTable, {candidate: tokens/s}, AR tokens/s) stored at `path` for key `k`, or None (absent, another
    key, unreadable)."""
    try:
        with open(path) as f:
            obj = json.load(f)
        if obj.get("key") != json.loads(json.dumps(k)):
            return None
        table = budget_lib.from_dict(obj["table"], f"measured by an earlier run ({path})")
        rates = {budget_lib.parse(c): float(r) for c, r in obj["rates"].items()}
        ar = float(obj["ar"])
        if set(rates) != set(table.candidates) or not all(r > 0 for r in (ar, *rates.values())):
            return None
        return table, rates, ar
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save(path: str, k: dict, table, rates: dict, ar: float) -> bool:
    """Write the measurement atomically (a temporary file renamed); False (and nothing written) on an OSError."""
    obj = {"key": k, "ar": ar, "rates": {budget_lib.name(b): r for b, r in rates.items()},
           "table": {budget_lib.name(b): {str(c): v for c, v in zip(table.contexts, row)}
                     for b, row in zip(table.candidates, table.ms)}}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
        return True
    except OSError:
        return False
