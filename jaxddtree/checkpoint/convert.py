"""HF safetensors directory -> converted orbax directory (see `jaxddtree.checkpoint.orbax_format` for the format).

Plan first (the loaders' key maps: `jaxddtree.checkpoint.hf_target`'s for a target,
`jaxddtree.checkpoint.hf_drafter`'s for a DFlash drafter; unknown / duplicate / missing tensors, then every
shard's header and every tensor's shape are checked before anything is written). Then stream parameter by
parameter: read its tensor(s) with positioned reads (no memory map: a mapped shard's pages would count in our
RSS), cast / transpose / reshape on the host with numpy, hand the parameter to an `orbax_format.PartialWriter`
(which saves a batch of at most about one largest parameter per orbax partial save), drop it. A fused
parameter (the target's GDN `w_in`, MLP `w_gate_up`, attention `w_qkv`) is assembled from its HF tensors
first: each is read straight into (or cast into) its row block of one buffer in the output dtype, then the
whole buffer is transformed, so at most about two copies of one parameter are alive. Everything goes into a
temporary directory next to DST, renamed to DST only once complete; any failure or stop request removes it.

numpy's float32 -> bfloat16 cast (ml_dtypes) rounds exactly like XLA's on the CPU (checked on all 2**32
float32 bit patterns), and casts commute with transposes and concatenation, so converted weights are
bit-identical to what the loaders compute on device.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from typing import Callable, Iterator

import numpy as np

TMP_TAG = ".jaxddtree-tmp-"
OLD_TAG = ".jaxddtree-old-"
MIN_FLUSH_BYTES = 4 << 20
MARKER = "jaxddtree_checkpoint.json"  # == jaxddtree.checkpoint.orbax_format.MARKER (not imported here: cheap checks first)
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
# Small files copied along with config.json when the source has them (tokenizer, generation defaults, a drafter's
# token frequency table for draft_vocab=N: jaxddtree.model.draft_vocab.COUNTS_FILE).
EXTRA_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
               "preprocessor_config.json", "video_preprocessor_config.json", "token_counts.json")


class ConvertError(Exception):
    """A conversion that cannot proceed; the message is one line naming the file / tensor."""


class Interrupted(ConvertError):
    pass


def one_line(msg: str, limit: int = 800) -> str:
    msg = " ".join(str(msg).split())
    return msg if len(msg) <= limit else msg[:limit] + " ..."


# ----------------------------------------------------------------------------------------------- config
def read_config(src: str) -> dict:
    file = os.path.join(src, "config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConvertError(f"{file}: not found (expected an HF model directory with config.json)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"{file}: unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise ConvertError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConvertError(f"{file}: expected a JSON object")
    return raw


def detect_kind(raw: dict) -> str:
    """'drafter' for DFlash drafter configs (`dflash_config` / `block_size`), else 'target'."""
    return "drafter" if ("dflash_config" in raw or "block_size" in raw) else "target"


# ----------------------------------------------------------------------------------------------- sources
def _header(file: str) -> tuple[int, dict]:
    """(offset of the data section, tensor name -> {dtype, shape, data_offsets}) of a safetensors file."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 1 << 28:
            raise ValueError("header too large")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return 8 + n, h


def _st_dtypes() -> dict:
    import ml_dtypes
    return {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
            "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class Shard:
    """One safetensors file. The header is validated by `safetensors.safe_open` (truncated / corrupt files
    fail here, with the loaders' message); tensors are then read with plain positioned reads into fresh
    arrays, never through a memory map, so a shard's pages do not accumulate in our RSS."""

    def __init__(self, file: str):
        from jaxddtree.checkpoint.hf_target import _open
        from jaxddtree.checkpoint.params import CheckpointError
        self.file = file
        with _open(file) as f:  # CheckpointError naming the file if missing / truncated / corrupt
            names = set(f.keys())
        try:
            self.base, self.entries = _header(file)
        except Exception as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None
        if set(self.entries) != names:
            raise CheckpointError(f"{file}: inconsistent safetensors header")
        self._err = CheckpointError

    def info(self, name: str) -> tuple[np.dtype, tuple, int, int]:
        """(dtype, shape, byte offset, nbytes) of tensor `name`."""
        e = self.entries.get(name)
        if e is None:
            raise self._err(f"{self.file}: tensor '{name}' listed in the index is absent from the file")
        dt = _st_dtypes().get(e["dtype"])
        if dt is None:
            raise self._err(f"{self.file}: tensor '{name}' has unsupported dtype {e['dtype']}")
        start, stop = (int(x) for x in e["data_offsets"])
        return np.dtype(dt), tuple(int(d) for d in e["shape"]), self.base + start, stop - start

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """Tensor `name` as a fresh array, or read into `out` (C-contiguous, its dtype and shape)."""
        dt, shape, offset, nbytes = self.info(name)
        if out is None:
            arr = np.empty(shape, dt)
        else:
            assert out.flags.c_contiguous and out.dtype == dt and out.shape == shape, (out.shape, shape)
            arr = out
        if arr.nbytes != nbytes:
            raise self._err(f"{self.file}: tensor '{name}' spans {nbytes} bytes, expected {arr.nbytes} "
                            f"for {dt.name}{list(shape)}")
        view = memoryview(arr.reshape(-1).view(np.uint8))
        try:
            with open(self.file, "rb", buffering=0) as f:
                f.seek(offset)
                got = 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise EOFError(f"file ends after {got} of {nbytes} bytes")
                    got += n
        except OSError as e:
            raise self._err(f"{self.file}: cannot read tensor '{name}' ({e})") from None
        except EOFError as e:
            raise self._err(f"{self.file}: cannot read tensor '{name}' ({e})") from None
        return arr


Plan = list  # [hf_target.ParamPlan(param path, parts [(tensor name, file, HF shape)], transform)], reading order


def plan_target(cfg, src: str) -> Plan:
    """The target's parameters with `jaxddtree.checkpoint.hf_target`'s key map, coverage and duplicate checks (the
    same ones `iter_params` applies; the shape check happens per tensor, before anything is read)."""
    from jaxddtree.checkpoint.hf_target import plan_tensors

    return plan_tensors(cfg, src)


def plan_drafter(cfg, src: str) -> Plan:
    """The drafter's parameters with the drafter loader's key map (`jaxddtree.checkpoint.hf_drafter._GLOBAL/_LAYER`:
    fused `w_qkv` / `w_gate_up` stacked from their HF tensors) and its checks (unexpected, duplicate, missing)."""
    from jaxddtree.checkpoint.hf_drafter import _GLOBAL, _HF_GLOBAL, _HF_LAYER, _LAYER, _LAYER_RE
    from jaxddtree.checkpoint.hf_target import ParamPlan, Part, checkpoint_files
    from jaxddtree.checkpoint.params import CheckpointError

    files = checkpoint_files(src)
    slots: dict[tuple, tuple] = {}  # (param path, part) -> (tensor name, file)
    for name, file in files.items():
        short = name[len("model."):] if name.startswith("model.") else name
        m = _LAYER_RE.match(short)
        if m and m.group(2) in _HF_LAYER and int(m.group(1)) < cfg.num_layers:
            field, j = _HF_LAYER[m.group(2)]
            path = ("layers", int(m.group(1)), field)
        elif not m and short in _HF_GLOBAL:
            field, j = _HF_GLOBAL[short]
            path = (field,)
        else:
            raise CheckpointError(f"unexpected tensor '{name}' in {file} (not a drafter weight for a "
                                  f"{cfg.num_layers}-layer DFlash drafter)")
        if (path, j) in slots:
            raise CheckpointError(f"tensor '{name}' in {file} duplicates '{slots[path, j][0]}' in "
                                  f"{slots[path, j][1]}")
        slots[path, j] = (name, file)
    specs = [((f,), spec) for f, spec in _GLOBAL.items()] + [
        (("layers", i, f), spec) for i in range(cfg.num_layers) for f, spec in _LAYER.items()]
    plan = []
    for path, (parts, fn) in specs:
        for j, (hf, _) in enumerate(parts):
            if (path, j) not in slots:
                name = hf if len(path) == 1 else f"layers.{path[1]}.{hf}"
                n = sum((p, k) not in slots for p, (ps, _) in specs for k in range(len(ps)))
                raise CheckpointError(f"{src}: drafter checkpoint lacks tensor '{name}' ({n} missing in all)")
        plan.append(ParamPlan(path, tuple(Part(*slots[path, j], tuple(shape_fn(cfg)))
                                          for j, (_, shape_fn) in enumerate(parts)),
                              (lambda w, t=fn: t(w, cfg))))
    return sorted(plan, key=lambda e: (e.parts[0].file, e.parts[0].name))


def assemble(shards: dict, plan, out_dtype: np.dtype) -> np.ndarray:
    """The stacked HF array of a fused parameter: its parts read into consecutive row blocks of one buffer in
    `out_dtype` (straight into the buffer when the dtypes match, else read and cast into it)."""
    out = np.empty(plan.shape, out_dtype)
    row = 0
    for part in plan.parts:
        shard = shards[part.file]
        n = int(part.shape[0])
        if shard.info(part.name)[0] == out_dtype:
            shard.read(part.name, out=out[row:row + n])
        else:
            arr = shard.read(part.name)
            out[row:row + n] = arr  # numpy's cast, as `transform` does it
            del arr
        row += n
    assert row == plan.shape[0], (plan.path, row, plan.shape)  # every row of the parameter filled
    return out


def transform(arr: np.ndarray, fn, out_dtype: np.dtype) -> np.ndarray:
    """fn(arr) cast to out_dtype, C-contiguous. Narrowing casts go first (cast and transpose / reshape
    commute exactly), so at most the input plus one smaller copy are alive at a time."""
    if fn is None:
        return np.asarray(arr, dtype=out_dtype, order="C")
    if out_dtype.itemsize <= arr.dtype.itemsize:
        return np.asarray(fn(np.asarray(arr, dtype=out_dtype)), order="C")
    return np.asarray(fn(arr), dtype=out_dtype, order="C")


# ----------------------------------------------------------------------------------------------- dirs
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: str, name: str) -> None:
    """Remove leftovers of earlier runs for the same DST whose process is gone (e.g. killed -9)."""
    for tag in (TMP_TAG, OLD_TAG):
        prefix = f".{name}{tag}"
        try:
            entries = os.listdir(parent)
        except OSError:
            return
        for entry in entries:
            if not entry.startswith(prefix):
                continue
            pid = entry[len(prefix):].split("-")[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _makedirs(path: str) -> list[str]:
    """mkdir -p; returns the directories it created (deepest last)."""
    created = []
    head = path
    while head and not os.path.exists(head):
        created.append(head)
        head = os.path.dirname(head)
    for d in reversed(created):
        os.mkdir(d)
    return list(reversed(created))


def _inside(child: str, parent: str) -> bool:
    child, parent = os.path.realpath(child), os.path.realpath(parent)
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_paths(src: str, dst: str, overwrite: bool) -> None:
    if not os.path.exists(src):
        raise ConvertError(f"{src}: source directory not found")
    if not os.path.isdir(src):
        raise ConvertError(f"{src}: not a directory (expected an HF model directory)")
    if _inside(src, dst):
        raise ConvertError(f"{dst}: destination is (or contains) the source directory {src}")
    if os.path.lexists(dst):
        if not overwrite:
            raise ConvertError(f"{dst}: already exists (pass --overwrite to replace it)")
        if not os.path.isdir(dst) or os.path.islink(dst) or not (
                os.path.exists(os.path.join(dst, MARKER)) or not os.listdir(dst)):
            raise ConvertError(f"{dst}: exists and is not a converted checkpoint or an empty directory; "
                               "refusing to replace it even with --overwrite")


# ----------------------------------------------------------------------------------------------- convert
def convert(src: str, dst: str, *, dtype: str = "bfloat16", kind: str | None = None, overwrite: bool = False,
            progress: bool = False, should_stop: Callable[[], bool] | None = None,
            flush_bytes: int | None = None) -> dict:
    """Convert HF directory `src` into a converted directory `dst` (atomically). Returns a summary dict.

    Raises ConvertError (one-line message) on any problem, Interrupted if `should_stop()` turns true;
    in both cases nothing is left at `dst` (an existing `dst` is untouched) and no temporary directory
    remains."""
    t0 = time.perf_counter()
    src, dst = os.path.abspath(src), os.path.abspath(dst.rstrip(os.sep) or dst)
    check_paths(src, dst, overwrite)  # cheap checks first: no jax import before them
    raw = read_config(src)
    kind = kind or detect_kind(raw)
    if kind not in ("target", "drafter"):
        raise ConvertError(f"unknown kind '{kind}' (use target or drafter)")
    quant = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        if method != "fp8" or kind != "target":
            raise ConvertError(f"{src}: quantized checkpoints (quant_method {method!r}) are not supported"
                               + (" for a drafter" if method == "fp8" else ""))
    if dtype not in DTYPES:
        raise ConvertError(f"unsupported dtype '{dtype}' (use bfloat16 or float32)")
    dname = DTYPES[dtype]

    from jaxddtree.checkpoint import orbax_format
    from jaxddtree.model.config import ConfigError, load_config
    from jaxddtree.checkpoint.params import CheckpointError

    assert orbax_format.MARKER == MARKER
    out_dtype = orbax_format.np_dtype(dname)
    stop = should_stop or (lambda: False)
    fp8 = None  # (Fp8Format, headers) for an FP8 target
    fp8_params = {}  # marker "fp8": {dotted param path: {"block_in", "block_out", "shape"}}

    try:
        if kind == "target":
            cfg = load_config(src)
            plan = plan_target(cfg, src)
            if quant is not None:
                from jaxddtree.checkpoint.hf_target import _Headers, fp8_format
                fp8 = (fp8_format(src), _Headers())
        else:
            from jaxddtree.model.drafter_config import DrafterConfig
            cfg = DrafterConfig.from_dict(raw, source=os.path.join(src, "config.json"))
            plan = plan_drafter(cfg, src)
        shards = {file: Shard(file) for file in sorted({p.file for e in plan for p in e.parts})}  # every header
        sizes = []
        for e in plan:
            src_bytes = 0
            for tname, file, shape in e.parts:
                _, got, _, nbytes = shards[file].info(tname)
                if got != tuple(shape):
                    raise CheckpointError(f"{file}: tensor '{tname}' has shape {got}, expected {tuple(shape)}")
                src_bytes += nbytes
            sizes.append((src_bytes, int(np.prod(e.shape, dtype=np.int64)) * out_dtype.itemsize))
    except (ConfigError, ValueError, NotImplementedError) as e:  # CheckpointError is a ValueError
        raise ConvertError(one_line(e)) from None
    num_tensors = sum(len(e.parts) for e in plan)
    total = sum(s for s, _ in sizes)
    flush = flush_bytes or max(MIN_FLUSH_BYTES, max((o for _, o in sizes), default=0))

    parent, name = os.path.dirname(dst), os.path.basename(dst)
    created = _makedirs(parent)
    tmp = None
    bar = None
    try:
        _remove_stale(parent, name)
        tmp = tempfile.mkdtemp(prefix=f".{name}{TMP_TAG}{os.getpid()}-", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; DST gets the usual permissions
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=total or None, unit="B", unit_scale=True, unit_divisor=1024, disable=None,
                       desc=f"convert {os.path.basename(src)} -> {name}", dynamic_ncols=True)
        writer = orbax_format.PartialWriter(os.path.join(tmp, orbax_format.PARAMS_DIR), flush)
        out_bytes = done = 0
        for e, (src_bytes, nbytes) in zip(plan, sizes):
            writer.reserve(nbytes)  # flush the batch first if this parameter would overflow it
            if fp8 is not None and any(sc is not None for sc in e.scales):
                out_bytes += _add_fp8(writer, e, fp8, out_dtype, fp8_params)
            else:
                try:
                    if len(e.parts) == 1:
                        arr = shards[e.parts[0].file].read(e.parts[0].name)
                    else:
                        arr = assemble(shards, e, out_dtype)
                except CheckpointError as err:
                    raise ConvertError(one_line(err)) from None
                y = transform(arr, e.fn, out_dtype)
                del arr
                out_bytes += y.nbytes
                writer.add(e.path, y)
                del y
            done += len(e.parts)
            if bar is not None:
                bar.update(src_bytes)
                bar.set_postfix_str(f"{done}/{num_tensors} tensors", refresh=False)
            if stop():
                raise Interrupted("interrupted")
        writer.finalize()
        if stop():
            raise Interrupted("interrupted")
        for fname in ("config.json",) + EXTRA_FILES:
            if os.path.isfile(os.path.join(src, fname)):
                shutil.copyfile(os.path.join(src, fname), os.path.join(tmp, fname))
        extra = {"fp8": fp8_params} if fp8_params else {}
        meta = orbax_format.write_marker(tmp, kind, dname, source=src, num_tensors=num_tensors,
                                         num_params=len(plan), num_bytes=out_bytes, orbax_partial_saves=writer.saves,
                                         **extra)
        if bar is not None:
            bar.close()
            bar = None
        if stop():
            raise Interrupted("interrupted")
        _install(tmp, dst)
        tmp = None
    except BaseException:
        if bar is not None:
            bar.close()
        if tmp is not None:
            _rmtree(tmp)
        for d in reversed(created):  # parents we made, if still empty
            try:
                os.rmdir(d)
            except OSError:
                break
        raise
    return dict(meta, dst=dst, seconds=time.perf_counter() - t0)


def _add_fp8(writer, e, fp8, out_dtype: np.dtype, fp8_params: dict) -> int:
    """An FP8 target parameter through the loader's `_load_fp8` (on the host CPU): an `Fp8Weight` is written as
    its leaves `<path>.q` (float8_e4m3fn [N, K]), `<path>.scale` (float32 [N blocks, padded K blocks]) and `<path>.tail` (out_dtype, if any) and
    recorded in the marker's "fp8" map; any other mix of fp8 and plain parts comes back dequantized and is
    written as a plain parameter. Returns the bytes written."""
    from jaxddtree.checkpoint.hf_target import _load_fp8
    from jaxddtree.checkpoint.params import CheckpointError
    from jaxddtree.model.fp8 import Fp8Weight

    try:
        w = _load_fp8(e, fp8[0], fp8[1], out_dtype)
    except CheckpointError as err:
        raise ConvertError(one_line(err)) from None
    if not isinstance(w, Fp8Weight):
        y = np.asarray(w)
        writer.add(e.path, y)
        return y.nbytes
    fp8_params[".".join(map(str, e.path))] = {"block_in": w.block_in, "block_out": w.block_out,
                                             "shape": list(w.shape)}
    n = 0
    for leaf in ("q", "scale", "tail"):
        if getattr(w, leaf) is not None:
            y = np.asarray(getattr(w, leaf))
            writer.add(e.path + (leaf,), y)
            n += y.nbytes
    return n


def _rmtree(path: str) -> None:
    for _ in range(3):  # a straggling writer thread could recreate a file; retry
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return
        time.sleep(0.1)


def _install(tmp: str, dst: str) -> None:
    """Rename the finished temporary directory to dst (replacing a previous converted dst)."""
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
        return
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}{OLD_TAG}{os.getpid()}-",
                           dir=os.path.dirname(dst))
    os.rmdir(old)
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    _rmtree(old)
