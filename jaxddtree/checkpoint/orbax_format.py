"""Converted (orbax) checkpoints: written by `python -m convert`, restored by `load_target` / `load_drafter`.

On-disk layout of a converted directory DST::

    DST/config.json                 the source's config.json, byte for byte
    DST/<tokenizer files>           copied from the source when present (tokenizer.json, ...)
    DST/params/                     an orbax-checkpoint PyTree checkpoint (OCDBT + zarr3, uncompressed)
    DST/jaxddtree_checkpoint.json   marker: {"format", "format_version", "kind", "dtype", ...} (MARKER)

The params tree holds the parameters already in the model's layout (transposed / reshaped, cast to the
marker's dtype), nested dicts keyed by the parameter path with layer indices as strings, e.g.
`{"layers": {"3": {"mixer": {"w_qkv": [D, H*2hd + 2*Hkv*hd]}}}, "embed": [V, D], ...}` for a target and
`{"fc": ..., "layers": {"0": {"w_qkv": ...}}, ...}` (the `DrafterParams` fields) for a drafter. Since
format_version 2 a target's same-input projections are fused (GDN `w_in`, MLP `w_gate_up`, attention `w_qkv`;
see `jaxddtree.checkpoint.hf_target`), since 3 a drafter's too (`w_qkv`, `w_gate_up`; see
`jaxddtree.checkpoint.hf_drafter`); an older directory is refused with the command that reconverts it.

It is written incrementally with orbax's partial-save API (`ocp.partial.save` per batch of tensors, then
`ocp.partial.finalize`), so the writer never holds more than one batch (about one largest tensor) in host
memory. Every array is stored uncompressed as one zarr3 chunk (several along its largest axis past orbax's
2 GiB chunk limit), i.e. contiguous byte ranges of OCDBT data files;
`restore_flat` reads those ranges directly into the final buffers (see "restoring" below; `ocp.load` is
the fallback). Any orbax reader restores it too: `ocp.load(DST/params)` gives the nested dict of numpy
arrays.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import logging
import warnings
from typing import Any

import numpy as np

from jaxddtree.checkpoint.params import CheckpointError

MARKER = "jaxddtree_checkpoint.json"
FORMAT = "jaxddtree-orbax"
# 2: fused same-input projections (GDN `w_in`, MLP `w_gate_up`, attention `w_qkv`) in target checkpoints.
# 3: fused drafter projections (`w_qkv`, `w_gate_up`); the target's layout did not change.
# 4: FP8 targets' block scales in the compact grid [ceil(K / block_in), ceil(N / block_out)] (marker "fp8"
#    entries gain "block_out"); version-3 FP8 targets (per-column scales [K / block_in, *output axes]) are
#    compacted on load (`_fp8_params` / `restore_target`: exact), nothing else changed.
# 5: FP8 targets in the checkpoint's layout: `q` [N, K] (the nn.Linear rows, K-major: what fp8 wgmma reads) and
#    `scale` [ceil(N / block_out), C] (C: the input blocks padded to 128-byte rows, `w8a8_mgpu.scale_cols`);
#    marker "fp8" entries {block_in, block_out, shape} (the parameter's logical shape). Version-3/4 FP8 targets
#    (q in the model's layout [K.., N..], scales [K blocks, N blocks]) are transposed on load (exact).
FORMAT_VERSION = 5
# The oldest version each kind can be read from: version-1 targets hold the unfused projections (w_qkv, w_z,
# w_b, w_a; w_gate, w_up; wq, wk, wv), version-1/2 drafters theirs (wq, wk, wv; w_gate, w_up); both must be
# reconverted.
MIN_FORMAT_VERSION = {"target": 2, "drafter": 3}
PARAMS_DIR = "params"
KINDS = ("target", "drafter")
DTYPE_NAMES = ("bfloat16", "float32")

_ALIASES = {"bf16": "bfloat16", "fp32": "float32"}


def dtype_name(dtype) -> str:
    """'bfloat16' | 'float32' for a dtype-like (string, numpy / jax dtype or scalar type)."""
    if isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype)
    else:
        import jax.numpy as jnp
        name = jnp.dtype(dtype).name
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype '{dtype}' (use bfloat16 or float32)")
    return name


def np_dtype(name: str) -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if dtype_name(name) == "bfloat16" else np.dtype(np.float32)


def stored_np_dtype(name: str) -> np.dtype:
    """A stored array's dtype: the marker's dtypes, or float8_e4m3fn (the q of an FP8 parameter)."""
    import ml_dtypes
    return np.dtype(ml_dtypes.float8_e4m3fn) if name == "float8_e4m3fn" else np_dtype(name)


# --------------------------------------------------------------------------------------------- marker
def is_converted(path: str) -> bool:
    return os.path.exists(os.path.join(path, MARKER))


def read_marker(path: str, kind: str | None = None) -> dict:
    """The marker of a converted directory, validated; CheckpointError naming the file otherwise."""
    file = os.path.join(path, MARKER)
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: unreadable marker ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} marker")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise CheckpointError(f"{file}: format_version {version!r} is not supported (this jaxddtree reads "
                   f"versions 1..{FORMAT_VERSION}; re-run `python -m convert`)")
    if meta.get("kind") not in KINDS:
        raise CheckpointError(f"{file}: unknown kind {meta.get('kind')!r}")
    if kind is not None and meta["kind"] != kind:
        raise CheckpointError(f"{path}: holds a converted {meta['kind']} checkpoint, not a {kind}")
    if version < MIN_FORMAT_VERSION[meta["kind"]]:
        src = meta.get("source")
        src = src if isinstance(src, str) and src and "\n" not in src else "SRC"
        raise CheckpointError(f"{path} was converted by an older jaxddtree (format_version {version}, this one "
                              f"reads {FORMAT_VERSION}): re-run `python -m convert {src} {path} --overwrite`")
    if meta.get("dtype") not in DTYPE_NAMES:
        raise CheckpointError(f"{file}: unsupported dtype {meta.get('dtype')!r}")
    return meta


def write_marker(path: str, kind: str, dtype: str, **extra) -> dict:
    import orbax.checkpoint as ocp0
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "kind": kind, "dtype": dtype_name(dtype),
            "params": PARAMS_DIR, "orbax_checkpoint": getattr(ocp0, "__version__", "unknown"), **extra}
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    return meta


# --------------------------------------------------------------------------------------------- trees
def to_tree(flat: dict[tuple, Any]) -> dict:
    """{("layers", 3, "mixer", "w_qkv"): x} -> {"layers": {"3": {"mixer": {"w_qkv": x}}}} (string keys)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return out


def from_tree(tree: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    """Inverse of `to_tree`: digit keys become ints again."""
    out = {}
    for key, value in tree.items():
        k = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(value, dict):
            out.update(from_tree(value, prefix + (k,)))
        else:
            out[prefix + (k,)] = value
    return out


def _context():
    import orbax.checkpoint.experimental.v1 as ocp
    ctx = ocp.Context()
    ctx.array.saving.use_compression = False  # weights barely compress; raw chunks restore faster
    return ctx


# --------------------------------------------------------------------------------------------- writing
class PartialWriter:
    """Write a params tree into `directory` (must not exist) a batch at a time, with orbax partial saves.

    Call `reserve(nbytes)` before materialising a tensor (it saves and drops the buffered batch if the
    tensor would take it past `flush_bytes`), then `add(path, array)`. `finalize` saves the rest and merges
    the partial saves into one orbax checkpoint. The writer holds at most max(flush_bytes, one tensor) of
    host arrays, and orbax briefly copies one batch while saving it.
    """

    def __init__(self, directory: str, flush_bytes: int):
        self.directory = directory
        self.flush_bytes = int(flush_bytes)
        self._buffer: dict[tuple, np.ndarray] = {}
        self._buffered = 0
        self._ctx = _context()
        self.saves = 0
        self.paths: set[tuple] = set()

    def reserve(self, nbytes: int) -> None:
        if self._buffer and self._buffered + int(nbytes) > self.flush_bytes:
            self.flush()

    def add(self, path: tuple, value: np.ndarray) -> None:
        if path in self.paths:
            raise ValueError(f"parameter {'.'.join(map(str, path))} written twice")
        self.reserve(value.nbytes)
        self.paths.add(path)
        self._buffer[path] = value
        self._buffered += int(value.nbytes)

    def flush(self) -> None:
        if not self._buffer:
            return
        import orbax.checkpoint.experimental.v1 as ocp
        tree = to_tree(self._buffer)
        self._buffer, self._buffered = {}, 0
        with self._ctx:
            ocp.partial.save(self.directory, tree)
        self.saves += 1
        del tree

    def finalize(self) -> None:
        import orbax.checkpoint.experimental.v1 as ocp
        self.flush()
        with self._ctx:
            ocp.partial.finalize(self.directory)


# --------------------------------------------------------------------------------------------- restoring
# Restore reads the orbax checkpoint's bytes directly ("direct reader"): tensorstore's public
# `ts.ocdbt.dump` lists the OCDBT B+tree (array name -> zarr.json + the data file, offset and length of each
# chunk: one per array up to orbax's 2 GiB chunk limit, several along the largest axis past it), and every
# array is read with positioned reads straight into its final, 64-byte aligned numpy buffer (large arrays in
# 32 MiB pieces, several threads), i.e. one copy from the page cache / disk, with no decode or re-copy
# (chunks split along a trailing axis go through one scratch buffer). On accelerators each array is `device_put` as soon as it is read (transfers
# overlap the reads; at most RESTORE_WINDOW bytes of host buffers in flight); on CPU one batched
# `device_put` adopts them. Anything this reader does not recognise (another zarr codec chain, compressed
# or multi-chunk shards, an OCDBT/tensorstore representation it does not know) falls back to `ocp.load`, which reads
# every orbax checkpoint; so does JAXDDTREE_RESTORE=orbax. `last_restore` records which reader ran.
READER_ENV = "JAXDDTREE_RESTORE"
PIECE_BYTES = 32 << 20
RESTORE_WINDOW = 2 << 30
_ALIGN = 64
_INDEX_BYTES = 20  # zarr3 sharding_indexed index of one inner chunk: offset u64, nbytes u64, crc32c u32
_MISSING = 2**64 - 1
_SAFE_PATH = re.compile(r"[A-Za-z0-9._/%-]*\Z")
last_restore: dict = {}


class _Unsupported(Exception):
    """The direct reader does not handle this checkpoint (restore_flat falls back to `ocp.load`)."""


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


class _Entry:
    """One array of the checkpoint: shape, numpy dtype, fill value, its zarr chunk shape, and where each of its
    chunks (a zarr3 shard of one inner chunk: data + _INDEX_BYTES index) is: `chunks` = [(grid index, src)],
    src None (never written: all fill), bytes (inlined in the B+tree) or (data file, offset, length). orbax
    writes one chunk per array up to its chunk byte limit and splits larger arrays along their largest axis."""
    __slots__ = ("name", "shape", "dtype", "fill", "chunk_shape", "chunks")

    def __init__(self, name, shape, dtype, fill, chunk_shape, chunks):
        self.name, self.shape, self.dtype, self.fill = name, shape, dtype, fill
        self.chunk_shape, self.chunks = chunk_shape, chunks

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def chunk_nbytes(self) -> int:
        return int(np.prod(self.chunk_shape, dtype=np.int64)) * self.dtype.itemsize

    def region(self, idx: tuple) -> tuple[slice, ...]:
        """The part of the array that chunk `idx` covers (edge chunks are stored full-size, zarr style)."""
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, self.chunk_shape, self.shape))


def _array_spec(name: str, zarr_json: bytes) -> tuple[tuple, np.dtype, float, tuple]:
    """(shape, dtype, fill, chunk shape) of an array whose zarr.json the direct reader understands: a regular
    chunk grid whose chunks are each one sharding_indexed shard of ONE inner chunk of raw little-endian bytes
    with a crc32c'd index at the end (what orbax writes without compression). _Unsupported otherwise."""
    try:
        z = json.loads(zarr_json)
        shape = tuple(int(n) for n in z["shape"])
        dtype = stored_np_dtype(z["data_type"])  # ValueError unless bfloat16 / float32 / float8_e4m3fn
        fill = float(z.get("fill_value") or 0.0)
        grid = z["chunk_grid"]
        cs = tuple(int(n) for n in grid["configuration"]["chunk_shape"])
        ok = (z.get("zarr_format") == 3 and z.get("node_type") == "array" and grid["name"] == "regular"
              and len(cs) == len(shape) and all(c > 0 for c in cs)
              and z.get("chunk_key_encoding", {}).get("name") == "default"
              and z.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/") == "/")
        codecs = z["codecs"]
        ok = ok and len(codecs) == 1 and codecs[0]["name"] == "sharding_indexed"
        c = codecs[0]["configuration"]
        little = {"name": "bytes", "configuration": {"endian": "little"}}
        raw = [little] if dtype.itemsize > 1 else [{"name": "bytes"}]  # one-byte types carry no endianness
        ok = (ok and tuple(c["chunk_shape"]) == cs and c["codecs"] == raw
              and c["index_codecs"] == [little, {"name": "crc32c"}] and c.get("index_location", "end") == "end")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise _Unsupported(f"{name}: zarr.json not understood ({type(e).__name__}: {e})") from None
    if not ok:
        raise _Unsupported(f"{name}: zarr layout not handled by the direct reader")
    return shape, dtype, fill, cs


def _layout(params_dir: str) -> dict[tuple, _Entry]:
    """{param path: _Entry} of the orbax checkpoint in `params_dir`, from its tree metadata and its OCDBT
    B+tree (latest version). _Unsupported if anything is not as orbax writes it (with OCDBT, zarr3)."""
    import tensorstore as ts
    from urllib.parse import unquote

    state = os.path.join(os.path.abspath(params_dir), "state")
    try:
        with open(os.path.join(state, "_METADATA")) as f:
            tree_meta = json.load(f)["tree_metadata"]
        names = {}
        for v in tree_meta.values():
            keys = [str(k["key"]) for k in v["key_metadata"]]
            if any("." in k or "/" in k or not k for k in keys):
                raise _Unsupported(f"key path {keys} (orbax's array name would be ambiguous)")
            names[".".join(keys)] = tuple(int(k) if k.isdigit() else k for k in keys)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _Unsupported(f"orbax tree metadata: {type(e).__name__}: {e}") from None
    if not os.path.exists(os.path.join(state, "manifest.ocdbt")):
        raise _Unsupported("no OCDBT manifest")
    try:
        base = ts.KvStore.open({"driver": "file", "path": state + "/"}).result()
        manifest = ts.ocdbt.dump(base).result()
        versions = manifest["versions"]
        root = max(versions, key=lambda v: v["generation_number"])["root"] if versions else None
        leaves: dict[bytes, Any] = {}
        pending = [root["location"]] if root and "location" in root else []
        while pending:
            node = ts.ocdbt.dump(base, pending.pop()).result()
            for e in node["entries"]:
                if node["height"] > 0:
                    pending.append(e["location"])
                else:
                    leaves[bytes(e["key"])] = e["inline_value"] if "inline_value" in e else e["indirect_value"]
    except _Unsupported:
        raise
    except Exception as e:  # tensorstore versions differ in what dump offers; orbax will read it anyway
        raise _Unsupported(f"OCDBT dump: {type(e).__name__}: {e}") from None
    out = {}
    for name, path in names.items():
        zj = leaves.get(f"{name}/zarr.json".encode())
        if not isinstance(zj, (bytes, bytearray)):
            raise _Unsupported(f"{name}: zarr.json missing or not inline")
        shape, dtype, fill, cs = _array_spec(name, bytes(zj))
        chunks = []
        for idx in itertools.product(*(range(-(-n // c)) for n, c in zip(shape, cs))):
            key = "/".join([name, "c"] + [str(i) for i in idx])
            chunk = leaves.get(key.encode())
            if isinstance(chunk, str):
                m = re.fullmatch(r"value:([^:]*):([^:]*):([0-9]+):([0-9]+)", chunk)
                if not m or not _SAFE_PATH.match(m[1] + m[2]):
                    raise _Unsupported(f"{key}: chunk location {chunk!r} not understood")
                rel = unquote(m[1]) + unquote(m[2])
                if ".." in rel.split("/") or rel.startswith("/"):
                    raise _Unsupported(f"{key}: chunk location {chunk!r} not understood")
                chunk = (os.path.join(state, rel), int(m[3]), int(m[4]))
            elif chunk is not None:
                chunk = bytes(chunk)
            chunks.append((idx, chunk))
        out[path] = _Entry(name, shape, dtype, fill, cs, chunks)
    return out


def _check_index(e: _Entry, idx: tuple, index: bytes) -> None:
    """A shard's index must say: one inner chunk at offset 0 of e.chunk_nbytes bytes (crc32c-checked)."""
    if len(index) != _INDEX_BYTES or _crc32c(index[:16]).to_bytes(4, "little") != index[16:]:
        raise _Unsupported(f"{e.name}: shard index checksum mismatch (chunk {idx})")
    off, n = int.from_bytes(index[:8], "little"), int.from_bytes(index[8:16], "little")
    if (off, n) != (0, e.chunk_nbytes):
        raise _Unsupported(f"{e.name}: shard index ({off}, {n}) of chunk {idx} is not one raw chunk of "
                           f"{e.chunk_nbytes} bytes")


def _empty(e: _Entry) -> np.ndarray:
    """An uninitialised, _ALIGN-aligned array of e's shape and dtype (aligned: XLA:CPU can adopt it)."""
    raw = np.empty(e.nbytes + _ALIGN, np.uint8)
    skip = (-raw.ctypes.data) % _ALIGN
    return raw[skip:skip + e.nbytes].view(e.dtype).reshape(e.shape)


def _read_direct(entries: list[_Entry], consume, workers: int, window: int) -> None:
    """Read `entries` in order with a thread pool of positioned reads; call `consume(i, array)` in order on
    the calling thread as each array completes. At most `window` bytes (at least one array) in flight."""
    from concurrent.futures import ThreadPoolExecutor

    fds: dict[str, int] = {}

    def fd(file):
        if file not in fds:
            try:
                fds[file] = os.open(file, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{file}: cannot open checkpoint data file ({e.strerror})") from None
        return fds[file]

    def read(file, buffers, offset):
        want = sum(len(b) for b in buffers)
        got = os.preadv(fds[file], buffers, offset)
        if got != want:  # a short read: only at end of file (preadv of a regular file otherwise completes)
            raise CheckpointError(f"{file}: truncated checkpoint data file (read {got} of {want} bytes at "
                                  f"offset {offset})")

    def start(e: _Entry):
        """Allocate e's array and queue the reads of its chunks -> (array, [(idx, index)], futures, copies).
        A chunk that splits only the leading axis (or is the whole array) is read straight into its rows;
        any other chunk is read whole into a scratch buffer and its valid part copied in afterwards."""
        arr = _empty(e)
        flat = arr.reshape(-1).view(np.uint8)
        cn = e.chunk_nbytes
        leading = e.chunk_shape[1:] == e.shape[1:]
        row = int(np.prod(e.shape[1:], dtype=np.int64)) * e.dtype.itemsize
        indexes, futs, copies = [], [], []
        for idx, src in e.chunks:
            region = e.region(idx)
            valid = tuple(slice(0, r.stop - r.start) for r in region)
            if src is None:
                arr[region] = e.fill
                continue
            if isinstance(src, bytes):
                if len(src) != cn + _INDEX_BYTES:
                    raise _Unsupported(f"{e.name}: inline shard of {len(src)} bytes")
                _check_index(e, idx, src[cn:])
                arr[region] = np.frombuffer(src, e.dtype, count=cn // e.dtype.itemsize).reshape(e.chunk_shape)[valid]
                continue
            file, off, length = src
            if length != cn + _INDEX_BYTES:
                raise _Unsupported(f"{e.name}: shard of {length} bytes for {cn} data bytes (chunk {idx})")
            fd(file)
            index = bytearray(_INDEX_BYTES)
            indexes.append((idx, index))
            futs.append(pool.submit(read, file, [index], off + cn))
            if leading:  # the chunk's valid rows are one contiguous range of the array
                r0 = region[0].start if region else 0
                dst = flat[r0 * row:(r0 * row) + (e.nbytes if not region else (region[0].stop - r0) * row)]
            else:
                scratch = np.empty(cn, np.uint8)
                dst = scratch
                copies.append((region, valid, scratch))
            for lo in range(0, len(dst), PIECE_BYTES):
                futs.append(pool.submit(read, file, [dst[lo:lo + PIECE_BYTES]], off + lo))
        return arr, indexes, futs, copies

    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="jaxddtree-restore") as pool:
            inflight: list = []
            nbytes = 0
            nxt = 0
            done = 0
            while done < len(entries):
                while nxt < len(entries) and (not inflight or nbytes + entries[nxt].nbytes <= window):
                    inflight.append(start(entries[nxt]))
                    nbytes += entries[nxt].nbytes
                    nxt += 1
                arr, indexes, futs, copies = inflight.pop(0)
                try:
                    for f in futs:
                        f.result()
                except BaseException:
                    for _, _, fs, _ in inflight:
                        for f in fs:
                            f.cancel()
                    raise
                e = entries[done]
                for idx, index in indexes:
                    _check_index(e, idx, bytes(index))
                for region, valid, scratch in copies:
                    arr[region] = scratch.view(e.dtype).reshape(e.chunk_shape)[valid]
                nbytes -= e.nbytes
                consume(done, arr)
                done += 1
    finally:
        for f in fds.values():
            os.close(f)


def _check_names(where: str, abstract: dict, got: dict) -> None:
    for label, extra in (("lacks", set(abstract) - set(got)), ("has an unexpected", set(got) - set(abstract))):
        if extra:
            p = sorted(extra, key=str)[0]
            raise CheckpointError(f"{where}: {label} parameter {'.'.join(map(str, p))} ({len(extra)} in all)")
    for p, x in got.items():
        want = abstract[p]
        if tuple(x.shape) != tuple(want.shape) or np.dtype(x.dtype) != np.dtype(want.dtype):
            raise CheckpointError(f"{where}: parameter {'.'.join(map(str, p))} is {np.dtype(x.dtype)}"
                                  f"{list(x.shape)}, expected {np.dtype(want.dtype)}{list(want.shape)}")


def params_dir_of(path: str, meta: dict) -> str:
    """The parameter directory a converted checkpoint's marker `meta` names; CheckpointError when it is missing."""
    params_dir = os.path.join(path, meta.get("params", PARAMS_DIR))
    if not os.path.isdir(params_dir):
        raise CheckpointError(f"{params_dir}: missing (the converted checkpoint is incomplete)")
    return params_dir


def plan_restore(path: str, meta: dict) -> dict[tuple, _Entry] | None:
    """The direct reader's layout of a converted directory, or None (with the reason in `last_restore`)
    where it does not apply and `ocp.load` will be used."""
    params_dir = params_dir_of(path, meta)
    last_restore.clear()
    if os.environ.get(READER_ENV, "direct") == "orbax":
        last_restore.update(reader="orbax", reason=f"{READER_ENV}=orbax")
        return None
    try:
        return _layout(params_dir)
    except _Unsupported as e:
        last_restore.update(reader="orbax", reason=str(e)[:300])
        return None


def restore_flat(path: str, abstract: dict[tuple, Any], meta: dict, layout=False) -> dict[tuple, Any]:
    """Restore the params tree of converted directory `path` into arrays on the default device, shaped like
    `abstract` ({param path: jax.ShapeDtypeStruct in the stored dtype}); CheckpointError on any mismatch.
    `layout`: `plan_restore`'s result when the caller already has it. The arrays are uncommitted, as the HF
    loader's are: with committed parameters, jit outputs are committed, so state that starts from fresh arrays
    changes placement after one call and every jitted loop compiles twice."""
    import jax

    params_dir = params_dir_of(path, meta)
    if layout is False:
        layout = plan_restore(path, meta)
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    if layout is not None:
        _check_names(params_dir, abstract, layout)
        keys = list(layout)
        entries = [layout[k] for k in keys]
        out: list = [None] * len(keys)

        def consume(i, arr):
            out[i] = arr if on_cpu else jax.device_put(arr)  # accelerators: transfer right away

        workers = min(32, max(8, os.cpu_count() or 1))
        try:
            _read_direct(entries, consume, workers, 1 << 62 if on_cpu else RESTORE_WINDOW)
        except _Unsupported as e:  # a shard index not as expected: let orbax read (and judge) it
            last_restore.update(reader="orbax", reason=str(e)[:300])
        else:
            last_restore.update(reader="direct", arrays=len(keys), bytes=sum(e.nbytes for e in entries),
                                workers=workers)
            if on_cpu:
                out = jax.device_put(out)
            return dict(zip(keys, out))
    return _restore_orbax(params_dir, abstract, device)


def _restore_orbax(params_dir: str, abstract: dict[tuple, Any], device) -> dict[tuple, Any]:
    """`ocp.load` (every orbax checkpoint). Accelerators: orbax restores straight into device arrays (committed:
    orbax places by sharding); CPU: host numpy arrays adopted with one batched `jax.device_put` (faster than
    orbax's placement there)."""
    import jax
    import orbax.checkpoint.experimental.v1 as ocp

    on_cpu = device.platform == "cpu"
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = to_tree({p: jax.ShapeDtypeStruct(tuple(s.shape), s.dtype, sharding=sharding)
                      for p, s in abstract.items()})
    try:
        with _context():
            tree = ocp.load(params_dir, None if on_cpu else target)
    except Exception as e:  # orbax / tensorstore errors: missing, misshapen or corrupt arrays
        msg = " ".join(str(e).split())
        if len(msg) > 600:
            msg = msg[:600] + " ..."
        raise CheckpointError(f"{params_dir}: cannot restore the converted parameters "
                              f"({type(e).__name__}: {msg})") from None
    flat = from_tree(tree)
    if not on_cpu:
        return flat
    _check_names(params_dir, abstract, flat)
    keys = list(flat)
    return dict(zip(keys, jax.device_put([flat.pop(k) for k in keys])))


_UPCAST_NOTED: list[str] = []


def _cast(flat: dict[tuple, Any], stored: str, dtype, path: str) -> dict[tuple, Any]:
    want = dtype_name(dtype)
    if want == stored:
        return flat
    if stored == "bfloat16" and want == "float32" and not _UPCAST_NOTED:
        # one plain line (no Python warning with its source line), once per process: a pair says it once
        _UPCAST_NOTED.append(path)
        logging.getLogger("jaxddtree").warning(
            f"jaxddtree: {path} holds bfloat16 weights: loaded as float32 they are upcast bf16 values (convert "
            "with `python -m convert --dtype float32` for full precision; said once per process)")
    import jax.numpy as jnp
    target = jnp.bfloat16 if want == "bfloat16" else jnp.float32
    return {p: x.astype(target) for p, x in flat.items()}


def stored_abstract(path: str, meta: dict, layout=None) -> dict[tuple, Any]:
    """{param path: ShapeDtypeStruct} as recorded in the checkpoint (the direct reader's `layout` when
    given, else orbax's own metadata; both cheap: JSON)."""
    import jax

    if layout is not None:
        return {p: jax.ShapeDtypeStruct(e.shape, e.dtype) for p, e in layout.items()}
    import orbax.checkpoint.experimental.v1 as ocp

    params_dir = os.path.join(path, meta.get("params", PARAMS_DIR))
    try:
        with _context():
            tree = ocp.metadata(params_dir).metadata
        return {p: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype)) for p, m in from_tree(tree).items()}
    except Exception as e:
        raise CheckpointError(f"{params_dir}: unreadable orbax checkpoint metadata "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


def restore_target(path: str, dtype):
    """A `Target` from a converted target directory, in `dtype` (cast on device if it was stored in
    another dtype). Parameter names come from the checkpoint's metadata and must be exactly the config's;
    shapes are checked against the model by `target_from_params`."""
    from jaxddtree.model.config import load_config
    from jaxddtree.checkpoint.hf_target import expected_paths
    from jaxddtree.checkpoint.params import target_from_params
    from jaxddtree.model.target import as_dtype

    meta = read_marker(path, kind="target")
    cfg = load_config(path)
    layout = plan_restore(path, meta)
    abstract = stored_abstract(path, meta, layout)
    want = expected_paths(cfg)
    fp8 = _fp8_params(path, meta)
    have = {p[:-1] if p[:-1] in fp8 and p[-1] in FP8_LEAVES else p for p in abstract}
    for label, extra in (("lacks", want - have), ("has an unexpected", have - want)):
        if extra:
            p = sorted(extra, key=str)[0]
            raise CheckpointError(f"{path}: converted checkpoint {label} parameter {'.'.join(map(str, p))} "
                                  f"({len(extra)} in all)")
    stored = meta["dtype"]
    quantized = {p: stored_np_dtype(FP8_LEAVES[p[-1]]) for p in abstract if p[:-1] in fp8 and p[-1] in ("q", "scale")}
    lacking = [p + (leaf,) for p in fp8 for leaf in ("q", "scale") if p + (leaf,) not in abstract]
    if lacking:
        raise CheckpointError(f"{path}: converted checkpoint lacks parameter {'.'.join(map(str, lacking[0]))}")
    bad = [p for p, a in abstract.items() if np.dtype(a.dtype) != quantized.get(p, np_dtype(stored))]
    if bad:
        raise CheckpointError(f"{path}: parameter {'.'.join(map(str, bad[0]))} is stored as "
                              f"{abstract[bad[0]].dtype}, expected {quantized.get(bad[0], np_dtype(stored))}")
    flat = restore_flat(path, abstract, meta, layout)
    fp8_leaves = {p: flat.pop(p) for p in quantized}
    flat = _cast(flat, stored, dtype, path)
    if fp8:
        import jax
        from jaxddtree.model import fp8 as fp8_weight
        for p, info in fp8.items():
            q, scale, tail = fp8_leaves[p + ("q",)], fp8_leaves[p + ("scale",)], flat.pop(p + ("tail",), None)
            if meta["format_version"] >= 5:
                flat[p] = fp8_weight.Fp8Weight(q=q, scale=scale, tail=tail, block_in=info["block_in"],
                                               block_out=info["block_out"], shape=tuple(info["shape"]))
                continue
            # format_version 3 / 4: q in the model's layout, scales [K blocks, N blocks] (3: one per output column)
            nc, block_out = info["nc"], info.get("block_out")
            K = int(np.prod(q.shape[:nc]))
            q_nk = jax.device_put(np.asarray(q).reshape(K, -1).T)
            rows = np.asarray(scale, np.float32).reshape(scale.shape[0], -1).T  # [N or N blocks, K blocks]
            if block_out is None:
                rows, block_out = fp8_weight.compact_scales(rows)
            shape = tuple(q.shape) if tail is None else tuple(q.shape[:-1]) + (q.shape[-1] + tail.shape[-1],)
            flat[p] = fp8_weight.make(q_nk, jax.device_put(rows), block_in=info["block_in"], block_out=block_out,
                                      shape=shape, tail=tail)
    return target_from_params(cfg, flat, as_dtype(dtype), source=path)


# the leaves of an FP8 parameter (`jaxddtree.model.fp8.Fp8Weight`) in a converted target: name -> stored dtype
# (None: the marker's dtype). The marker's "fp8" map lists those parameters: {dotted path: {block_in, block_out,
# shape}} (format_version 5; 3 / 4: {block_in, nc[, block_out]}).
FP8_LEAVES = {"q": "float8_e4m3fn", "scale": "float32", "tail": None}


def _fp8_params(path: str, meta: dict) -> dict[tuple, dict]:
    fp8 = meta.get("fp8", {})
    new = meta.get("format_version", 0) >= 5
    ok = isinstance(fp8, dict) and all(
        isinstance(v, dict) and isinstance(v.get("block_in"), int) and isinstance(v.get("block_out", 1), int)
        and (isinstance(v.get("block_out"), int) and isinstance(v.get("shape"), list) if new
             else isinstance(v.get("nc"), int)) for v in fp8.values())
    if not ok:
        raise CheckpointError(f"{os.path.join(path, MARKER)}: malformed \"fp8\" entry")
    return {tuple(int(k) if k.isdigit() else k for k in name.split(".")): v for name, v in fp8.items()}


def drafter_abstract(cfg, dtype) -> dict[tuple, Any]:
    """{param path: ShapeDtypeStruct} of a drafter's params in the converted layout."""
    import jax

    from jaxddtree.checkpoint.hf_drafter import _GLOBAL, _LAYER, stacked_shape

    def shape(spec):
        parts, transform = spec
        src = jax.ShapeDtypeStruct(stacked_shape(parts, cfg), np.float32)
        return tuple(jax.eval_shape(lambda w: transform(w, cfg), src).shape)

    out = {}
    for field, spec in _GLOBAL.items():
        out[(field,)] = jax.ShapeDtypeStruct(shape(spec), dtype)
    for i in range(cfg.num_layers):
        for field, spec in _LAYER.items():
            out[("layers", i, field)] = jax.ShapeDtypeStruct(shape(spec), dtype)
    return out


def restore_drafter_params(path: str, cfg, dtype="bfloat16"):
    """`DrafterParams` from a converted drafter directory (cast on device to `dtype` if needed)."""
    import jax.numpy as jnp

    from jaxddtree.model.drafter import DrafterLayer, DrafterParams

    meta = read_marker(path, kind="drafter")
    stored = meta["dtype"]
    stored_dt = jnp.bfloat16 if stored == "bfloat16" else jnp.float32
    flat = _cast(restore_flat(path, drafter_abstract(cfg, stored_dt), meta), stored, dtype, path)
    layers = []
    for i in range(cfg.num_layers):
        fields = {p[2]: x for p, x in flat.items() if p[0] == "layers" and p[1] == i}
        layers.append(DrafterLayer(**fields))
    glob = {p[0]: x for p, x in flat.items() if len(p) == 1}
    return DrafterParams(layers=tuple(layers), **glob)

