"""`python -m convert SRC DST`: HF safetensors checkpoint -> orbax checkpoint that `jaxddtree.load_target` /
`jaxddtree.load_drafter` restore directly (format: `jaxddtree.checkpoint.orbax_format`). Python API: `convert.convert`."""

from __future__ import annotations


def convert(src: str, dst: str, **kw) -> dict:
    """See `jaxddtree.checkpoint.convert.convert` (imported lazily so `python -m convert --help` stays fast)."""
    from jaxddtree.checkpoint.convert import convert as _convert
    return _convert(src, dst, **kw)


__all__ = ["convert"]
