"""`python -m convert`: HF safetensors -> orbax, via the CLI in subprocesses.

Round trips (bit-identical logits / drafter params), every error path (one stderr line naming the thing, no
traceback, nothing left behind), Ctrl-C, bounded RSS while streaming ~40 tensors of 8-16 MB, progress bar.
The conversions are independent processes, so each group of them is launched concurrently.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # conftest.py puts ROOT and HERE on sys.path
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxddtree  # noqa: E402

IDS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRANSFORMERS_VERBOSITY="error")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def cli(*args, **popen_kw) -> subprocess.Popen:
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    kw.update(popen_kw)
    return subprocess.Popen([sys.executable, "-m", "convert", *map(str, args)], **kw)


def run_all(jobs: dict[str, tuple], timeout: float = 240) -> dict[str, types.SimpleNamespace]:
    """Run several `python -m convert` commands concurrently: name -> (rc, stdout, stderr)."""
    procs = {k: cli(*args) for k, args in jobs.items()}
    out = {}
    for k, p in procs.items():
        so, se = p.communicate(timeout=timeout)
        out[k] = types.SimpleNamespace(rc=p.returncode, stdout=so, stderr=se)
    return out


def leftovers(parent: str) -> list[str]:
    return [e for e in os.listdir(parent) if ".jaxddtree-tmp-" in e or ".jaxddtree-old-" in e]


def assert_one_line_error(r, *needles: str):
    assert r.rc not in (0, None), (r.rc, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# --------------------------------------------------------------------------------------------- fixtures
def shared(tmp_path_factory, name: str, build) -> str:
    """A directory filled once per test run by `build(path)`, also across pytest-xdist workers (they share
    the run's base temp dir; a file lock serialises the build)."""
    import fcntl
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / f"convert-{name}"
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / ".done").exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            build(path)
            (path / ".done").touch()
    return str(path)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The same tiny random model saved as the sharded multimodal wrapper (vision tower + mtp extras) and
    text-only (single file)."""
    def build(d):
        import hf_models
        model = hf_models.causal_lm(0)
        hf_models.save_wrapper(model, str(d / "wrapper"))
        hf_models.save_text_only(model, str(d / "text"))
    d = shared(tmp_path_factory, "hf", build)
    return {"wrapper": os.path.join(d, "wrapper"), "text": os.path.join(d, "text")}


@pytest.fixture(scope="module")
def drafter_src(tmp_path_factory):
    def build(d):
        from helpers_dflash import random_weights, tiny_config, write_checkpoint
        cfg = tiny_config()
        write_checkpoint(str(d / "hf"), cfg, random_weights(cfg, seed=7, prefix="model."), shards=2)
    return os.path.join(shared(tmp_path_factory, "drafter", build), "hf")


JOBS = {  # name -> extra CLI args; source = the key's first part
    ("wrapper", "float32"): ("--dtype", "float32"),
    ("wrapper", "bfloat16"): (),  # default dtype
    ("text", "bfloat16"): ("--dtype", "bf16", "--quiet"),
    ("drafter", "float32"): ("--dtype", "float32"),  # kind auto-detected
    ("drafter", "bfloat16"): ("--kind", "drafter"),
}


@pytest.fixture(scope="module")
def converted(hf, drafter_src, tmp_path_factory):
    """All successful conversions, run concurrently. The text-only fp32 one gets a pseudo-terminal for
    stderr (progress bar); everything else is piped (no bar)."""
    srcs = dict(hf, drafter=drafter_src)

    def build(out):
        import fcntl
        import pty
        import struct
        import termios
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 120-column terminal
        tty_proc = cli(srcs["text"], out / "text-float32", "--dtype", "float32", stderr=slave)
        os.close(slave)
        res = run_all({k: (srcs[k[0]], out / f"{k[0]}-{k[1]}", *args) for k, args in JOBS.items()})
        so, _ = tty_proc.communicate(timeout=240)
        chunks = []
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:
                break
            if not b:
                break
            chunks.append(b)
        os.close(master)
        res[("text", "float32")] = types.SimpleNamespace(rc=tty_proc.returncode, stdout=so,
                                                         stderr=b"".join(chunks).decode(errors="replace"))
        with open(out / "results.json", "w") as f:
            json.dump([[list(k), vars(r)] for k, r in res.items()], f)

    out = shared(tmp_path_factory, "converted", build)
    res = {tuple(k): types.SimpleNamespace(**r) for k, r in json.load(open(os.path.join(out, "results.json")))}
    paths = {k: os.path.join(out, f"{k[0]}-{k[1]}") for k in res}
    return {"results": res, "paths": paths, "dir": out}


# --------------------------------------------------------------------------------------------- CLI basics
def test_help_explains_every_flag():
    p = cli("--help")
    so, se = p.communicate(timeout=60)
    assert p.returncode == 0, se
    for flag in ("SRC", "DST", "--dtype", "--kind", "--overwrite", "--quiet", "bfloat16", "float32", "drafter"):
        assert flag in so, flag


def test_conversions_succeed(converted):
    for key, r in converted["results"].items():
        assert r.rc == 0, (key, r.stderr)
        path = converted["paths"][key]
        meta = json.load(open(os.path.join(path, "jaxddtree_checkpoint.json")))
        from jaxddtree.checkpoint import orbax_format
        assert meta["kind"] == ("drafter" if key[0] == "drafter" else "target")  # drafter kind auto-detected
        assert meta["dtype"] == key[1] and meta["format_version"] == orbax_format.FORMAT_VERSION
        assert os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(os.path.join(path, "params"))
        assert not leftovers(converted["dir"])
    quiet = converted["results"][("text", "bfloat16")]
    assert quiet.stdout == "" and quiet.stderr == ""
    piped = converted["results"][("wrapper", "float32")]
    assert "wrote" in piped.stdout and piped.stderr == ""  # no bar, no library noise when not a terminal
    tty = converted["results"][("text", "float32")].stderr
    assert "tensors" in tty and "100%" in tty, tty  # tqdm bar: bytes with a tensor count


def test_config_copied_verbatim(hf, converted):
    for layout in ("wrapper", "text"):
        a = open(os.path.join(hf[layout], "config.json"), "rb").read()
        b = open(os.path.join(converted["paths"][(layout, "float32")], "config.json"), "rb").read()
        assert a == b


# --------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_bit_identical(hf, converted, dtype):
    """Both layouts: every leaf bitwise equal and `score` logits bit-identical to loading the HF directory.
    (One test per dtype so that `score` compiles once per dtype, also under xdist.)"""
    import jax
    for layout in ("wrapper", "text"):
        ref = jaxddtree.load_target(hf[layout], dtype)
        got = jaxddtree.load_target(converted["paths"][(layout, dtype)], dtype)
        assert got.treedef == ref.treedef
        for a, b in zip(jax.tree.leaves(ref.leaves), jax.tree.leaves(got.leaves)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), layout
        la, lb = jaxddtree.score(ref, IDS), jaxddtree.score(got, IDS)
        assert la.dtype == lb.dtype == np.float32
        assert np.array_equal(la, lb), layout
    if dtype == "bfloat16":  # an fp32 store loaded as bf16 == the HF directory loaded as bf16 (same cast)
        got = jaxddtree.load_target(converted["paths"][("wrapper", "float32")], "bfloat16")
        assert np.array_equal(jaxddtree.score(ref, IDS), jaxddtree.score(got, IDS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafter_round_trip(drafter_src, converted, dtype):
    import jax
    from jaxddtree import load_drafter
    target = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64, num_hidden_layers=6,
                                                                vocab_size=101))
    ref = load_drafter(drafter_src, target, dtype)
    got = load_drafter(converted["paths"][("drafter", dtype)], target, dtype)
    assert got.config == ref.config
    ra, rb = jax.tree.flatten(ref.params), jax.tree.flatten(got.params)
    assert ra[1] == rb[1]
    for a, b in zip(ra[0], rb[0]):
        assert a.dtype == b.dtype == np.dtype(dtype) and a.shape == b.shape
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_converted_round_compiles_once(hf, converted, tmp_path, monkeypatch):
    """Converted parameters are placed as the HF loader places them (uncommitted; committed ones once made
    the decode state change placement after the first round call: a second compilation inside the
    timed generation). The first generate on a converted pair compiles its round once, and converted and HF
    targets / drafters mix freely on that one compilation."""
    import jax

    import helpers_dflash
    from convert import convert
    from jaxddtree.speculative import loop
    cfg = helpers_dflash.tiny_config(vocab=97, mask_token_id=96, num_target_layers=4, target_layer_ids=(1, 2))
    helpers_dflash.write_checkpoint(str(tmp_path / "hf"), cfg, helpers_dflash.random_weights(cfg, seed=3))
    convert(str(tmp_path / "hf"), str(tmp_path / "conv"), dtype="float32")
    targets = {"conv": jaxddtree.load_target(converted["paths"][("text", "float32")], "float32"),
               "hf": jaxddtree.load_target(hf["text"], "float32")}
    drafters = {k: jaxddtree.load_drafter(str(tmp_path / k), targets["hf"], "float32") for k in ("conv", "hf")}
    monkeypatch.setenv("JAXDDTREE_RESTORE", "orbax")  # the fallback reader places its arrays the same way
    fallback = jaxddtree.load_target(converted["paths"][("text", "float32")], "float32")
    for x in jax.tree.leaves((targets["conv"].leaves, drafters["conv"].params, fallback.leaves)):
        assert not x.committed
    kw = dict(method="dflash", max_new_tokens=29, sync_every=1)  # a configuration no other test compiles
    before = loop.TRACES["rounds"]
    first = jaxddtree.generate(targets["conv"], IDS, drafter=drafters["conv"], **kw)
    assert first.stats["rounds"] >= 3  # several round calls
    once = loop.TRACES["rounds"]
    assert once - before <= 1  # (0 when another test file's pair of these shapes ran first in this process)
    for t, d in (("conv", "hf"), ("hf", "conv"), ("hf", "hf")):
        assert jaxddtree.generate(targets[t], IDS, drafter=drafters[d], **kw).tokens == first.tokens, (t, d)
    assert loop.TRACES["rounds"] == once


def test_direct_reader_matches_ocp_load(converted, monkeypatch):
    """Restore reads the orbax checkpoint's bytes directly (orbax_format's direct reader); what it returns is
    bitwise what plain `ocp.load` returns (the directory stays an ordinary orbax checkpoint), and
    JAXDDTREE_RESTORE=orbax (the fallback reader) restores the same leaves."""
    import jax
    import orbax.checkpoint.experimental.v1 as ocp

    from jaxddtree.checkpoint import orbax_format
    for key in (("wrapper", "float32"), ("text", "bfloat16")):
        path = converted["paths"][key]
        got = jaxddtree.load_target(path, key[1])
        assert orbax_format.last_restore["reader"] == "direct", orbax_format.last_restore
        plain = orbax_format.from_tree(ocp.load(os.path.join(path, "params")))  # no jaxddtree code involved
        direct = orbax_format.restore_flat(path, orbax_format.stored_abstract(path, orbax_format.read_marker(path)),
                                       orbax_format.read_marker(path))
        assert set(plain) == set(direct)
        for p, x in plain.items():
            y = np.asarray(direct[p])
            assert x.dtype == y.dtype and x.shape == y.shape
            assert np.array_equal(np.asarray(x).view(np.uint8), y.view(np.uint8)), p
        monkeypatch.setenv("JAXDDTREE_RESTORE", "orbax")
        ref = jaxddtree.load_target(path, key[1])
        monkeypatch.delenv("JAXDDTREE_RESTORE")
        assert orbax_format.last_restore["reader"] == "orbax"
        for a, b in zip(jax.tree.leaves(ref.leaves), jax.tree.leaves(got.leaves)):
            assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_direct_reader_damage(converted, tmp_path):
    """A truncated data file is a CheckpointError naming it; a damaged shard index is left to orbax."""
    from jaxddtree.checkpoint import orbax_format
    src = converted["paths"][("text", "float32")]
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    layout = orbax_format._layout(str(cut / "params"))
    e = max(layout.values(), key=lambda e: e.nbytes)
    (_, (file, off, length)), = e.chunks
    with open(file, "r+b") as fh:
        fh.truncate(off + length // 2)
    with pytest.raises(jaxddtree.CheckpointError, match="truncated checkpoint data file"):
        jaxddtree.load_target(str(cut), "float32")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    big = max(layout, key=lambda p: layout[p].nbytes)
    (_, (file, off, length)), = orbax_format._layout(str(bad / "params"))[big].chunks
    with open(file, "r+b") as fh:  # flip a bit of the index's crc32c: the direct reader declines
        fh.seek(off + length - 1)
        b = fh.read(1)
        fh.seek(off + length - 1)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(jaxddtree.CheckpointError):
        jaxddtree.load_target(str(bad), "float32")
    assert orbax_format.last_restore["reader"] == "orbax" and "checksum" in orbax_format.last_restore["reason"]


def test_direct_reader_chunked_arrays(tmp_path):
    """orbax splits arrays past its chunk byte limit (2 GiB by default: the 27B embedding and lm_head) into
    several chunks along different axes; the direct reader reads them (bitwise equal), no orbax fallback."""
    import ml_dtypes
    import orbax.checkpoint.experimental.v1 as ocp

    from jaxddtree.checkpoint import orbax_format
    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal((37, 50)).astype(np.float32),
            "b": rng.standard_normal((8, 300)).astype(ml_dtypes.bfloat16),
            "c": rng.standard_normal((5, 6, 70)).astype(np.float32),
            "d": rng.standard_normal((33,)).astype(np.float32),
            "e": np.full((), 3.5, np.float32)}
    ctx = orbax_format._context()
    ctx.array.saving.storage_options.chunk_byte_size = 1024  # force chunking at test sizes
    with ctx:
        ocp.save_pytree(str(tmp_path / "p"), tree)
    layout = orbax_format._layout(str(tmp_path / "p"))
    assert len(layout[("a",)].chunks) > 1 and len(layout[("b",)].chunks) > 1 and len(layout[("c",)].chunks) > 1
    assert layout[("b",)].chunk_shape[1] < 300  # split along a trailing axis (read via a scratch buffer)
    keys, out = list(layout), {}
    orbax_format._read_direct([layout[k] for k in keys], lambda i, arr: out.__setitem__(keys[i], arr), 4, 1 << 30)
    for k in keys:
        want = np.asarray(tree[k[0]])
        assert out[k].shape == want.shape and out[k].dtype == want.dtype
        assert np.array_equal(want.reshape(-1).view(np.uint8), out[k].reshape(-1).view(np.uint8)), k


def test_kind_mismatch_is_reported(converted):
    with pytest.raises(jaxddtree.CheckpointError, match="drafter"):
        jaxddtree.load_target(converted["paths"][("drafter", "float32")], "float32")


def test_damaged_converted_dir(converted, tmp_path):
    """A converted directory whose marker or params are damaged fails with a CheckpointError naming it."""
    src = converted["paths"][("text", "bfloat16")]
    newer = tmp_path / "newer"
    shutil.copytree(src, newer)
    meta = json.load(open(newer / "jaxddtree_checkpoint.json"))
    json.dump(dict(meta, format_version=99), open(newer / "jaxddtree_checkpoint.json", "w"))
    with pytest.raises(jaxddtree.CheckpointError, match="format_version 99"):
        jaxddtree.load_target(str(newer), "bfloat16")
    gone = tmp_path / "gone"
    shutil.copytree(src, gone)
    shutil.rmtree(gone / "params")
    with pytest.raises(jaxddtree.CheckpointError, match="params"):
        jaxddtree.load_target(str(gone), "bfloat16")


def test_format_version_1_target_is_refused(converted, tmp_path):
    """A target converted by an older jaxddtree (format_version 1: unfused projections) is refused with one
    line naming the version found and the command that reconverts it; likewise a version-2 drafter (unfused
    drafter projections); a version-2 target (layout unchanged since) still loads."""
    from jaxddtree.checkpoint import orbax_format
    old = tmp_path / "old"
    shutil.copytree(converted["paths"][("text", "bfloat16")], old)
    meta = json.load(open(old / "jaxddtree_checkpoint.json"))
    json.dump(dict(meta, format_version=1), open(old / "jaxddtree_checkpoint.json", "w"))
    with pytest.raises(jaxddtree.CheckpointError) as e:
        jaxddtree.load_target(str(old), "bfloat16")
    msg = str(e.value)
    assert "\n" not in msg
    assert f"format_version 1, this one reads {orbax_format.FORMAT_VERSION}" in msg, msg
    assert f"python -m convert {meta['source']} {old} --overwrite" in msg, msg
    json.dump(dict(meta, format_version=2), open(old / "jaxddtree_checkpoint.json", "w"))
    jaxddtree.load_target(str(old), "bfloat16")

    from jaxddtree import load_drafter
    d_old = tmp_path / "d_old"
    shutil.copytree(converted["paths"][("drafter", "float32")], d_old)
    meta = json.load(open(d_old / "jaxddtree_checkpoint.json"))
    json.dump(dict(meta, format_version=2), open(d_old / "jaxddtree_checkpoint.json", "w"))
    target = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64, num_hidden_layers=6,
                                                                vocab_size=101))
    with pytest.raises(jaxddtree.CheckpointError) as e:
        load_drafter(str(d_old), target, "float32")
    msg = str(e.value)
    assert "\n" not in msg and f"format_version 2, this one reads {orbax_format.FORMAT_VERSION}" in msg, msg
    assert f"python -m convert {meta['source']} {d_old} --overwrite" in msg, msg


def test_overwrite(hf, converted, tmp_path):
    """--overwrite replaces an earlier converted checkpoint (or an empty dir), never anything else."""
    conv = tmp_path / "conv"
    shutil.copytree(converted["paths"][("wrapper", "bfloat16")], conv)
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    res = run_all({"replace": (hf["text"], conv, "--overwrite", "--dtype", "float32", "-q"),
                   "refuse": (hf["text"], other, "--overwrite", "-q")})
    assert res["replace"].rc == 0, res["replace"].stderr
    assert json.load(open(conv / "jaxddtree_checkpoint.json"))["dtype"] == "float32"
    assert_one_line_error(res["refuse"], str(other))
    assert (other / "keep.txt").read_text() == "precious"
    assert not leftovers(str(tmp_path))


# --------------------------------------------------------------------------------------------- errors
def _shard_with(path: str, prefix: str) -> str:
    idx = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    name = sorted(n for n in idx if n.startswith(prefix))[0]
    return os.path.join(path, idx[name])


def _rewrite(file: str, mutate):
    from safetensors.numpy import load_file, save_file
    w = load_file(file)
    mutate(w)
    save_file(w, file)


def test_errors(hf, tmp_path):
    """Each broken source / bad destination: non-zero exit, ONE stderr line naming the file or tensor,
    no traceback, no DST, no temporary directory."""
    srcs, jobs, expect = {}, {}, {}

    def case(name, base, needles, src=None):
        s = src or str(tmp_path / "src" / name)
        if src is None:
            shutil.copytree(hf[base], s)
        srcs[name] = s
        (tmp_path / "out" / name).mkdir(parents=True)
        jobs[name] = (s, tmp_path / "out" / name / "dst", "--dtype", "float32")
        expect[name] = needles
        return s

    s = case("truncated", "wrapper", [])  # cut a shard in half
    f = _shard_with(s, "model.language_model.layers.1.")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    expect["truncated"] = [os.path.basename(f)]

    s = case("corrupt", "wrapper", [])  # overwrite header bytes
    f = _shard_with(s, "model.language_model.layers.2.")
    with open(f, "r+b") as fh:
        fh.seek(9)
        fh.write(b"#corrupt#{[")
    expect["corrupt"] = [os.path.basename(f)]

    s = case("missing_tensor", "text", ["model.layers.1.mlp.up_proj.weight", "layers.1.mlp.w_gate_up"])
    _rewrite(os.path.join(s, "model.safetensors"), lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))

    s = case("missing_in_shard", "wrapper", ["model.language_model.norm.weight"])  # index lists it, file lacks it
    f = _shard_with(s, "model.language_model.norm.weight")
    _rewrite(f, lambda w: w.update({"model.language_model.norm.weight_x": w.pop("model.language_model.norm.weight")}))

    s = case("wrong_shape", "text", ["model.layers.0.mlp.down_proj.weight", "(64, 97)"])
    _rewrite(os.path.join(s, "model.safetensors"),
             lambda w: w.update({"model.layers.0.mlp.down_proj.weight": np.zeros((64, 97), np.float32)}))

    s = case("bad_config", "text", ["config.json"])
    with open(os.path.join(s, "config.json"), "w") as fh:
        fh.write('{"model_type": "qwen3_5_text", ')

    s = case("config_field", "text", ["config.json", "hidden_size"])
    cfg = json.load(open(os.path.join(s, "config.json")))
    del cfg["hidden_size"]
    json.dump(cfg, open(os.path.join(s, "config.json"), "w"))

    case("src_missing", None, [str(tmp_path / "nowhere")], src=str(tmp_path / "nowhere"))

    case("dst_exists", None, ["dst", "--overwrite"], src=hf["text"])
    (tmp_path / "out" / "dst_exists" / "dst").mkdir()
    (tmp_path / "out" / "dst_exists" / "dst" / "mine.txt").write_text("keep")

    res = run_all(jobs)
    for name, r in res.items():
        line = assert_one_line_error(r, *expect[name])
        assert line.startswith("convert: error:"), line
        assert r.rc == (2 if name in ("src_missing", "dst_exists") else 1), (name, r.rc)  # bad argument vs failure
        parent = tmp_path / "out" / name
        assert sorted(os.listdir(parent)) == (["dst"] if name == "dst_exists" else []), (name, os.listdir(parent))
    assert (tmp_path / "out" / "dst_exists" / "dst" / "mine.txt").read_text() == "keep"


def test_bad_arguments_exit_2(tmp_path):
    """Missing or unusable arguments (a missing SRC, SRC a file, a missing DST, a bad --dtype): exit status 2, as
    the help says, with one line; a conversion that fails is 1 (test_errors)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = run_all({"missing": (tmp_path / "nowhere", tmp_path / "dst"), "file": (afile, tmp_path / "dst"),
                   "no_dst": (tmp_path,), "dtype": (tmp_path, tmp_path / "dst", "--dtype", "int4")})
    needles = {"missing": [str(tmp_path / "nowhere"), "not found"], "file": [str(afile)], "no_dst": ["DST"],
               "dtype": ["--dtype", "int4"]}
    for name, r in res.items():
        line = assert_one_line_error(r, *needles[name])
        assert r.rc == 2 and line.startswith("convert: error:"), (name, r.rc, line)
    assert sorted(os.listdir(tmp_path)) == ["afile"]


# --------------------------------------------------------------------------------------------- big: RSS, Ctrl-C
@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """Synthetic fp32 checkpoint: 109 tensors (34 of 8-16 MB), 349 MiB in 64 MiB shards; plus a tiny one."""
    import bench_convert as bench

    def build(d):
        bench.write_synthetic(str(d / "rss"), "rss")
        bench.write_synthetic(str(d / "tiny"), "tiny")
    d = shared(tmp_path_factory, "big", build)
    return {"rss": os.path.join(d, "rss"), "tiny": os.path.join(d, "tiny"),
            "largest": bench.largest_tensor_bytes(os.path.join(d, "rss"))}


def test_peak_rss_bounded(big, tmp_path_factory):
    """Streaming: peak RSS growth while converting ~350 MB stays within 3x the largest tensor (16 MiB).
    Measured in a fresh process after a warm-up conversion of a tiny checkpoint (library start-up state is
    not data), from the kernel's VmHWM (reset just before) and a 2 ms RSS poll."""
    import bench_convert as bench
    out = tmp_path_factory.mktemp("rss")
    r = bench.measure_rss(big["rss"], str(out / "rss-jax"), dtype="float32", warm=big["tiny"],
                          warm_dst=str(out / "tiny-jax"))
    assert big["largest"] == 16 << 20
    ratio = r["growth"] / big["largest"]
    print(f"peak RSS growth {r['growth'] / 2**20:.1f} MiB = {ratio:.2f}x largest tensor, {r['seconds']:.1f} s")
    assert ratio <= 3.0, r
    meta = json.load(open(out / "rss-jax" / "jaxddtree_checkpoint.json"))
    assert meta["num_tensors"] == 109 and meta["orbax_partial_saves"] > 10  # really written in batches


def test_ctrl_c(big, tmp_path):
    dst = tmp_path / "dst"
    p = cli(big["rss"], dst, "--dtype", "float32")
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:  # wait until it is writing into its temp dir
        tmp = leftovers(str(tmp_path))
        if tmp and os.path.exists(os.path.join(tmp_path, tmp[0], "params.partial_save")):
            break
        time.sleep(0.02)
    assert p.poll() is None, "conversion finished before it could be interrupted"
    p.send_signal(signal.SIGINT)
    so, se = p.communicate(timeout=120)
    r = types.SimpleNamespace(rc=p.returncode, stdout=so, stderr=se)
    assert r.rc == 130
    assert_one_line_error(r, "interrupted")
    assert os.listdir(tmp_path) == []


def test_bf16_dir_loaded_as_float32_says_one_plain_line(converted, monkeypatch, caplog):
    """A bf16-converted target + drafter loaded as float32: one plain log line (no Python warning with its source
    line), for the pair."""
    import logging
    import warnings

    import jax
    from jaxddtree import load_drafter
    from jaxddtree.checkpoint import orbax_format
    monkeypatch.setattr(orbax_format, "_UPCAST_NOTED", [])
    target = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=64, num_hidden_layers=6,
                                                                vocab_size=101))
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="jaxddtree"):
        warnings.simplefilter("always")
        t = jaxddtree.load_target(converted["paths"][("text", "bfloat16")], "float32")
        d = load_drafter(converted["paths"][("drafter", "bfloat16")], target, "float32")
    assert not [w for w in caught if issubclass(w.category, UserWarning)], [str(w.message) for w in caught]
    recs = [r.getMessage() for r in caplog.records if r.name == "jaxddtree"]
    assert len(recs) == 1 and "\n" not in recs[0], recs
    assert "bfloat16" in recs[0] and "python -m convert --dtype float32" in recs[0], recs[0]
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(t.leaves) + jax.tree.leaves(d.params))
