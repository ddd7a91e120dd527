"""`python -m convert SRC DST`: HF safetensors checkpoint -> orbax checkpoint that `jaxddtree.load_target` /
`jaxddtree.load_drafter` restore directly (format: `jaxddtree.orbax_io`). Python API: `convert.convert`."""

from __future__ import annotations


def convert(src: str, dst: str, **kw) -> dict:
    """See `convert.core.convert` (imported lazily so `python -m convert --help` stays fast)."""
    from convert.core import convert as _convert
    return _convert(src, dst, **kw)


__all__ = ["convert"]
