"""Synthetic Qwen3.5/3.6 checkpoints (numpy, any size) and the converter's measurements.

`python benchmarks/bench_convert.py [--dir DIR] [--size small|medium] [--repeat N]` writes a synthetic text-only
checkpoint (random weights with the real key names and shapes; fp32 and bf16 copies), converts it, and
prints (a) peak RSS growth of the conversion against the largest tensor and (b) `load_target` times from
the HF directory vs from the converted directory (direct reader, and `ocp.load` via JAXDDTREE_RESTORE=orbax)
plus raw read times into host numpy (safetensors vs ocp.load vs the direct reader); `--json` saves them.
The figures in NOTES.md ("Converter") come from this script.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Synthetic model sizes (fp32 bytes): "tiny" 1 MiB, "rss" 349 MiB (34 tensors of 8-16 MiB among 109),
# "medium" 947 MiB, "large" 4.3 GiB.
SIZES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
    "rss": dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128),
    "large": dict(vocab_size=65536, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=128, linear_num_key_heads=8,
                  linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128),
    "medium": dict(vocab_size=32768, hidden_size=1024, intermediate_size=3584, num_hidden_layers=12,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                   linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128),
}


def text_config(dims: dict) -> dict:
    """A text-only (`qwen3_5_text`) config.json dict for `dims` (full attention every 4th layer)."""
    n = dims["num_hidden_layers"]
    return dict(dims, model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
                linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
                hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def tensor_shapes(cfg: dict) -> dict[str, tuple]:
    """HF tensor name -> shape, text-only layout."""
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    H, Hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv = 2 * Hk * dk + Hv * dv
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i, t in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                    p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                    p + "mlp.down_proj.weight": (D, F)})
        if t == "full_attention":
            a = p + "self_attn."
            out.update({a + "q_proj.weight": (H * 2 * hd, D), a + "k_proj.weight": (Hkv * hd, D),
                        a + "v_proj.weight": (Hkv * hd, D), a + "o_proj.weight": (D, H * hd),
                        a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        else:
            g = p + "linear_attn."
            out.update({g + "in_proj_qkv.weight": (conv, D), g + "in_proj_z.weight": (Hv * dv, D),
                        g + "in_proj_b.weight": (Hv, D), g + "in_proj_a.weight": (Hv, D),
                        g + "conv1d.weight": (conv, 1, K), g + "dt_bias": (Hv,), g + "A_log": (Hv,),
                        g + "norm.weight": (dv,), g + "out_proj.weight": (D, Hv * dv)})
    return out


def write_synthetic(path: str, size: str = "rss", dtype: str = "float32", shard_bytes: int = 64 << 20,
                    seed: int = 0) -> dict:
    """Write config.json + sharded safetensors (+ index) of random weights; returns the config dict.
    Shards are written one at a time, so this needs about `shard_bytes` of memory."""
    import ml_dtypes
    from safetensors.numpy import save_file

    cfg = text_config(SIZES[size])
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(seed)
    shapes = tensor_shapes(cfg)
    shards: list[list[str]] = [[]]
    acc = 0
    for name, shape in shapes.items():
        nb = int(np.prod(shape)) * np_dt.itemsize
        if shards[-1] and acc + nb > shard_bytes:
            shards.append([])
            acc = 0
        shards[-1].append(name)
        acc += nb
    weight_map = {}
    for s, names in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        part = {}
        for n in names:
            shape = shapes[n]
            scale = 1.0 if "embed" in n or len(shape) == 1 else shape[-1] ** -0.5
            x = rng.random(shape, dtype=np.float32)
            x -= 0.5
            x *= 2 * scale
            if len(shape) == 1 and "A_log" not in n and "dt_bias" not in n:
                x += 1.0
            part[n] = x.astype(np_dt, copy=False)
        save_file(part, os.path.join(path, fname))
        weight_map.update({n: fname for n in names})
        del part
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    return cfg


def largest_tensor_bytes(path: str) -> int:
    from jaxddtree.checkpoint.convert import _header
    from jaxddtree.checkpoint.hf_target import checkpoint_files
    best = 0
    for file in set(checkpoint_files(path).values()):
        for info in _header(file)[1].values():
            best = max(best, info["data_offsets"][1] - info["data_offsets"][0])
    return best


# --------------------------------------------------------------------------------------------- RSS
RSS_DRIVER = r"""
import json, os, sys, threading, time
sys.path.insert(0, {root!r})
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jaxddtree.checkpoint.convert as core
import jaxddtree.checkpoint.orbax_format, orbax.checkpoint.experimental.v1, safetensors  # imports are not conversion

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

warm = {warm!r}
if warm:  # first-use library state (orbax/tensorstore thread pools, caches) is not data-proportional
    core.convert(warm, {warm_dst!r}, dtype={dtype!r})
base = status("VmRSS")
peak = [base]
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM (the kernel's peak RSS) to now
    hwm = True
except OSError:
    hwm = False
stop = threading.Event()
def poll():  # fallback / cross-check: sample RSS every 2 ms
    while not stop.is_set():
        peak[0] = max(peak[0], status("VmRSS"))
        time.sleep(0.002)
t = threading.Thread(target=poll, daemon=True); t.start()
t0 = time.perf_counter()
core.convert({src!r}, {dst!r}, dtype={dtype!r})
secs = time.perf_counter() - t0
stop.set(); t.join()
print(json.dumps(dict(base=base, peak_hwm=status("VmHWM") if hwm else None, peak_poll=peak[0],
                      seconds=secs)))
"""


def measure_rss(src: str, dst: str, dtype: str = "float32", warm: str | None = None,
                warm_dst: str | None = None) -> dict:
    """Convert in a fresh subprocess; returns {base, peak_hwm, peak_poll, growth, seconds} (bytes).
    `warm`: first convert that (small) checkpoint to `warm_dst` (default warm + "-jax") in the same process."""
    code = RSS_DRIVER.format(root=ROOT, src=src, dst=dst, dtype=dtype, warm=warm,
                             warm_dst=warm_dst or (warm or "") + "-jax")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    peak = max(r["peak_poll"], r["peak_hwm"] or 0)
    r["growth"] = peak - r["base"]
    return r


# --------------------------------------------------------------------------------------------- timing
def _time(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def evict(path: str) -> None:
    """Drop `path`'s files from the page cache (posix_fadvise DONTNEED): the next read comes from disk."""
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def time_loads(hf: str, conv: str, dtype: str, repeat: int, cold: bool = False, orbax: bool = True) -> dict:
    """load_target from the HF dir vs the converted dir (blocking until every leaf is ready), alternated;
    `cold`: both directories are evicted from the page cache before every load. `orbax`: also time the
    converted dir through `ocp.load` (JAXDDTREE_RESTORE=orbax, the fallback reader) as "converted_orbax"."""
    import jax
    import jaxddtree
    from jaxddtree.checkpoint import orbax_format

    def load(p, env=None):
        if cold:
            evict(p)
        old = os.environ.get(orbax_format.READER_ENV)
        if env:
            os.environ[orbax_format.READER_ENV] = env
        try:
            t0 = time.perf_counter()
            t = jaxddtree.load_target(p, dtype)
            jax.block_until_ready(t.leaves)
            secs = time.perf_counter() - t0
        finally:
            if env:
                os.environ.pop(orbax_format.READER_ENV) if old is None else os.environ.update({orbax_format.READER_ENV: old})
        del t
        return secs

    variants = {"hf": (hf, None), "converted": (conv, None)}
    if orbax:
        variants["converted_orbax"] = (conv, "orbax")
    out = {k: [] for k in variants}
    for k, (p, env) in variants.items():  # warm: imports, jit of the casts/transposes, page cache
        load(p, env)
        if k == "converted":
            out["reader"] = dict(orbax_format.last_restore)
    for _ in range(repeat):
        for k, (p, env) in variants.items():
            out[k].append(load(p, env))
    return out


def time_raw(hf: str, conv: str, repeat: int) -> dict:
    """Just reading the bytes into host numpy arrays: safetensors (copied out of its memory map) vs one
    orbax load vs the direct reader (orbax_format._read_direct)."""
    import orbax.checkpoint.experimental.v1 as ocp
    import safetensors

    from jaxddtree.checkpoint import orbax_format
    from jaxddtree.checkpoint.hf_target import checkpoint_files

    def st():
        files = checkpoint_files(hf)
        by = {}
        for n, f in files.items():
            by.setdefault(f, []).append(n)
        for f, names in by.items():
            with safetensors.safe_open(f, "numpy") as h:
                for n in names:
                    np.array(h.get_tensor(n))  # get_tensor maps the file lazily: force the read

    def ob():
        with orbax_format._context():
            ocp.load(os.path.join(conv, orbax_format.PARAMS_DIR))

    def direct():
        entries = list(orbax_format._layout(os.path.join(conv, orbax_format.PARAMS_DIR)).values())
        orbax_format._read_direct(entries, lambda i, a: None, min(32, max(8, os.cpu_count() or 1)), 1 << 62)

    st(), ob(), direct()
    out = {"safetensors": [], "orbax": [], "direct": []}
    for _ in range(repeat):
        out["safetensors"] += _time(st, 1)
        out["orbax"] += _time(ob, 1)
        out["direct"] += _time(direct, 1)
    return out


def rss_report(d: str) -> None:
    """Peak RSS growth converting the "rss" synthetic checkpoint (~40 tensors of 8-16 MB), cold and warm."""
    for name, size in (("tiny", "tiny"), ("rss", "rss")):
        if not os.path.exists(os.path.join(d, name, "config.json")):
            write_synthetic(os.path.join(d, name), size)
    for p in ("rss-jax", "tiny-jax"):
        shutil.rmtree(os.path.join(d, p), ignore_errors=True)
    big = largest_tensor_bytes(os.path.join(d, "rss"))
    n = len(tensor_shapes(text_config(SIZES["rss"])))
    cold = measure_rss(os.path.join(d, "rss"), os.path.join(d, "rss-jax"))
    shutil.rmtree(os.path.join(d, "rss-jax"))
    warm = measure_rss(os.path.join(d, "rss"), os.path.join(d, "rss-jax"), warm=os.path.join(d, "tiny"))
    shutil.rmtree(os.path.join(d, "tiny-jax"), ignore_errors=True)
    total = sum(os.path.getsize(os.path.join(d, "rss", f)) for f in os.listdir(os.path.join(d, "rss")))
    print(f"RSS: {n} tensors, {total / 2**20:.0f} MiB fp32, largest {big / 2**20:.1f} MiB")
    for label, r in (("cold process", cold), ("after a warm-up conversion", warm)):
        print(f"  {label}: peak RSS growth {r['growth'] / 2**20:.1f} MiB = {r['growth'] / big:.2f}x largest "
              f"(hwm {((r['peak_hwm'] or 0) - r['base']) / 2**20:.1f} MiB, polled "
              f"{(r['peak_poll'] - r['base']) / 2**20:.1f} MiB); conversion {r['seconds']:.1f} s")


def _fmt(xs):
    return f"median {statistics.median(xs):.2f} s (min {min(xs):.2f}, n={len(xs)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_convert.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/jaxddtree-convert-bench", help="scratch directory (reused)")
    ap.add_argument("--size", default="medium", choices=sorted(SIZES), help="synthetic model for timing")
    ap.add_argument("--repeat", type=int, default=5, help="timed repetitions per measurement")
    ap.add_argument("--skip-rss", action="store_true", help="only the load timings")
    ap.add_argument("--sources", default="float32,bfloat16", help="source checkpoint dtypes to time")
    ap.add_argument("--skip-raw", action="store_true", help="skip the raw host-read timings")
    ap.add_argument("--json", help="also write every timing (seconds) to this JSON file")
    ap.add_argument("--no-orbax", action="store_true", help="skip timing the ocp.load fallback reader")
    ap.add_argument("--cold", default="warm,cold", help="page-cache states to time (warm,cold)")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    from jaxddtree.checkpoint.convert import convert

    d = args.dir
    os.makedirs(d, exist_ok=True)

    if not args.skip_rss:
        rss_report(d)

    # (b) restore vs safetensors.
    import jax
    print(f"jax backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), {os.cpu_count()} CPUs")
    results: list = []

    def save_json():  # after every cell, so that a run cut short still leaves its figures
        if args.json:
            import orbax.checkpoint as ocp0
            info = dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, cpus=os.cpu_count(),
                        jax=jax.__version__, orbax=getattr(ocp0, "__version__", "?"), loadavg=os.getloadavg())
            with open(args.json, "w") as f:
                json.dump(dict(info, results=results), f, indent=1)
    for sdt in args.sources.split(","):
        hf = os.path.join(d, f"{args.size}-{sdt}")
        if not os.path.exists(os.path.join(hf, "config.json")):
            write_synthetic(hf, args.size, dtype=sdt)
        mib = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf)) / 2**20
        for ldt in (("float32", "bfloat16") if sdt == "float32" else ("bfloat16",)):
            conv = os.path.join(d, f"{args.size}-{sdt}-jax-{ldt}")
            if not os.path.exists(conv):
                t = time.perf_counter()
                convert(hf, conv, dtype=ldt)
                print(f"converted {sdt} {mib:.0f} MiB -> {ldt}: {time.perf_counter() - t:.1f} s")
            for state in args.cold.split(","):
                r = time_loads(hf, conv, ldt, args.repeat, cold=state == "cold", orbax=not args.no_orbax)
                med = {k: statistics.median(v) for k, v in r.items() if k != "reader"}
                extra = (f" | via ocp.load {_fmt(r['converted_orbax'])}" if "converted_orbax" in r else "")
                print(f"load_target {args.size} source {sdt} ({mib:.0f} MiB) as {ldt}, {state} page cache: "
                      f"HF {_fmt(r['hf'])} | converted {_fmt(r['converted'])} | speed-up "
                      f"{med['hf'] / med['converted']:.2f}x{extra} [reader {r['reader'].get('reader')}]",
                      flush=True)
                results.append(dict(size=args.size, source=sdt, loaded_as=ldt, cache=state, mib=round(mib, 1),
                                    median=med, speedup=med["hf"] / med["converted"], **r))
                save_json()
            if sdt == ldt and not args.skip_raw:
                raw = time_raw(hf, conv, args.repeat)
                print(f"  raw read to host: safetensors {_fmt(raw['safetensors'])} | ocp.load {_fmt(raw['orbax'])} | "
                      f"direct {_fmt(raw['direct'])}")
                results.append(dict(size=args.size, source=sdt, raw=raw))
                save_json()
    return 0


if __name__ == "__main__":
    sys.exit(main())
