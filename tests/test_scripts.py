"""The benchmark scripts (run on the H200 by hand) still run end to end: tiny shapes on the CPU."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _run(args, timeout=600):
    p = subprocess.run([sys.executable] + args, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    return p


def _benchmark_module(name: str, as_name: str | None = None):
    """benchmarks/{name}.py imported as a module (its functions called in this process)."""
    spec = importlib.util.spec_from_file_location(as_name or name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_writes_the_h200_record_only_from_an_h200():
    """A CPU smoke run (or an H100's) once overwrote benchmarks/results/h200.json's figures with its own."""
    bench = _benchmark_module("bench", "bench_out")
    assert bench.default_out("NVIDIA H200", smoke=False) == "benchmarks/results/h200.json"
    assert bench.default_out("NVIDIA H100 80GB HBM3", smoke=False) == "benchmarks/results/nvidia_h100_80gb_hbm3.json"
    assert bench.default_out("cpu", smoke=False) == "benchmarks/results/cpu.json"
    assert bench.default_out("NVIDIA H200", smoke=True) is None


def test_bench_smoke_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    _run(["benchmarks/bench.py", "--smoke", "--sections", "bandwidth,ar,verify,parts,round,host", "--verify-nodes",
          "8", "--budgets", "8", "--out", str(out)])
    res = json.loads(out.read_text())
    for key in ("weight_stream_tb_s", "floor_ms", "ar_step_ms", "draft_ms", "tree_build_ms", "commit_ms",
                "chain_round_ms", "host_overhead_ms", "host", "device", "date", "jax"):
        assert key in res, key
    assert res["verify_ms"]["9"] > 0 and res["round_ms"]["8"] > 0 and res["round_ms"]["64"] > 0  # host: budget 64
    assert res["host"]["dispatch_ms"] > 0


def test_bench_context_sweep_times_the_auto_round_forced(tmp_path):
    """bench.py --contexts: the fixed-budget table and generate's auto round forced to each candidate (its
    assertion checks that auto chose the forced one every round), both in bench_auto_budget's layout; the prefill
    timed at two chunk widths in the same run."""
    out = tmp_path / "bench.json"
    _run(["benchmarks/bench.py", "--smoke", "--sections", "none", "--contexts", "64", "--context-budgets", "chain,7",
          "--runs", "1", "--rounds-per-call", "2", "--prefill-chunk", "16,32", "--out", str(out)])
    res = json.loads(out.read_text())
    for key in ("round_ms_by_budget_context", "auto_round_ms_by_budget_context"):
        assert set(res[key]) == {"chain", "7"} and all(v["64"] > 0 for v in res[key].values()), res[key]
    by_chunk = res["prefill_s_by_chunk_context"]
    assert set(by_chunk) == {"16", "32"} and all(set(v) == {"64", "128"} for v in by_chunk.values()), by_chunk
    assert res["prefill_chunk_by_context"] == 16 and res["prefill_s_by_context"] == by_chunk["16"]


def test_mosaic_kernels_per_program():
    """decode_hlo.mosaic_kernels: the distinct Mosaic GPU kernels of a first generate call's programs at 27B widths
    (lowered for an abstract H200): the auto round holds one set of verify GEMM kernels per tree width, a fixed
    budget's round one set (each lowered in Python per program, compiled once per process: NOTES.md)."""
    mod = _benchmark_module("decode_hlo")
    got = mod.mosaic_kernels("auto", vocab=8192)
    assert set(got) == {"_prefill", "drafter_forward", "_start", "run_rounds", "all"}, got.keys()
    pre, rounds = set(got["_prefill"]), set(got["run_rounds"])
    assert len(pre) >= 4  # the stacked GEMMs on wgmma, 64 rows
    assert len(rounds) >= 3 * len(pre)  # a set per verify width (rows 16 / 32 / 64 / 128)
    assert pre & rounds and set(got["all"]) == pre | rounds  # 64-row kernels shared: one compile per process


def test_ab_kernels_smoke(tmp_path):
    """ab_kernels.py: every variant's AR step and rounds in one process, medians and differences to the first."""
    out = tmp_path / "ab.json"
    _run(["benchmarks/ab_kernels.py", "--smoke", "--variants", "pallas,pallas:unfused", "--budgets", "chain,7",
          "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["ran_as"] == {"pallas": "xla", "pallas:unfused": "xla"}  # the CPU: both as xla
    assert set(res["median_ms"]["pallas"]) == {"ar", "chain", "7"}
    assert all(v > 0 for d in res["median_ms"].values() for v in d.values())
    assert set(res["minus_first_ms"]) == {"pallas:unfused"}


def test_profile_round_smoke(tmp_path):
    """profile_gpu.py's round (draft, tree build, verify, accept, commit) at bench.py's smoke shapes."""
    out = tmp_path / "prof.json"
    _run(["benchmarks/profile_gpu.py", "--smoke", "--parts", "round,prefill", "--prefill-chunk", "64", "--out",
          str(out)])
    res = json.loads(out.read_text())
    assert res["round"]["wall_ms_per_step_profiled"] > 0 and res["budget"] == 64
    assert res["prefill"]["wall_ms_per_step_profiled"] > 0
    assert "kernel_event_stats" in res["round"]


def test_profile_parts_from_the_optimized_hlo(tmp_path):
    """profile_gpu.hlo_parts: a kernel named after its fusion / custom call gets the part of that instruction's op
    name in the dumped optimized HLO; names of two parts in two modules are dropped; part_of reads op-name stats
    first, then the names."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import profile_gpu as pg
    a, b = tmp_path / "m1_gpu_after_optimizations.txt", tmp_path / "m2_gpu_after_optimizations.txt"
    a.write_text('  %loop_add_fusion.47 = f32[8]{0} fusion(%p), kind=kLoop, calls=%fc, metadata={op_type="add" '
                 'op_name="jit(run_rounds)/while/body/verify/add" source_file="x.py"}\n'
                 '  ROOT %custom-call.3 = f32[8]{0} custom-call(%q), custom_call_target="__gpu$xla.gpu.triton", '
                 'metadata={op_name="jit(run_rounds)/while/body/draft/pallas_call"}\n'
                 '  %copy.1 = f32[8]{0} copy(%r), metadata={op_name="jit(run_rounds)/while/body/tree_build/x"}\n')
    b.write_text('  %copy.1 = f32[8]{0} copy(%r), metadata={op_name="jit(run_slots)/accept_commit/y"}\n')
    names = pg.hlo_parts([str(a), str(b)])
    assert names == {"loop_add_fusion_47": "verify", "custom_call_3": "draft"}

    class Ev:
        def __init__(self, name, stats):
            self.name, self.stats = name, stats
    assert pg.part_of(Ev("loop_add_fusion_47", []), names) == "verify"
    assert pg.part_of(Ev("gdn_tree_block", [("hlo_op", "custom-call.3")]), names) == "draft"
    assert pg.part_of(Ev("loop_add_fusion_47", [("tf_op", "jit(f)/accept_commit/z")]), names) == "accept_commit"
    assert pg.part_of(Ev("nvjet_sm90", []), names) is None
    ops = pg.hlo_op_names([str(a), str(b)])
    assert ops == {"loop_add_fusion_47": "jit(run_rounds)/while/body/verify/add",
                   "custom_call_3": "jit(run_rounds)/while/body/draft/pallas_call"}  # copy.1: two op names, dropped
    assert pg.op_of(Ev("gdn_tree_block", [("hlo_op", "custom-call.3")]), ops).endswith("draft/pallas_call")
    assert pg.op_of(Ev("x", [("tf_op", "jit(f)/accept_commit/z")]), ops) == "jit(f)/accept_commit/z"
    assert pg.op_of(Ev("nvjet_sm90", []), ops) is None
    # the pool's batched round: its scopes under jax.vmap read "vmap(verify)" (the CPU dump of run_slots)
    assert pg.scope_part("jit(run_slots)/while/body/eval_jaxpr/vmap(verify)/btd,dv->btv/dot_general") == "verify"
    assert pg.scope_part("jit(g)/vmap(vmap(accept_commit))") == "accept_commit"
    assert pg.scope_part("jit(g)/verify_x/add") is None and pg.scope_part("jit(g)/vmap(draft_y)/add") is None


def test_profile_fusion_bodies_from_the_optimized_hlo(tmp_path):
    """profile_gpu.hlo_fusion_bodies: a fusion's result and operand shapes (operands resolved by name) and the
    opcodes of the computation it calls, parameters left out; a name with two bodies in two modules is dropped."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import profile_gpu as pg
    a, b = tmp_path / "m1_gpu_after_optimizations.txt", tmp_path / "m2_gpu_after_optimizations.txt"
    a.write_text(
        "HloModule jit_f\n\n"
        "%fused_transpose (param_0: f32[2,3,4]) -> bf16[2,4,3] {\n"
        "  %param_0 = f32[2,3,4]{2,1,0} parameter(0)\n"
        "  %reduce-precision.1 = f32[2,3,4]{2,1,0} reduce-precision(%param_0), exponent_bits=8, mantissa_bits=7\n"
        "  ROOT %transpose.2 = bf16[2,4,3]{2,1,0} transpose(%reduce-precision.1), dimensions={0,2,1}\n"
        "}\n\n"
        "ENTRY %main.9 (x.1: f32[2,3,4]) -> bf16[2,4,3] {\n"
        "  %x.1 = f32[2,3,4]{2,1,0} parameter(0)\n"
        "  ROOT %input_transpose_fusion.48 = bf16[2,4,3]{2,1,0} fusion(%x.1), kind=kInput, calls=%fused_transpose, "
        'metadata={op_name="jit(_prefill)/reduce_precision"}\n'
        "}\n")
    b.write_text("ENTRY %main (y: f32[8]) -> f32[8] {\n  %y = f32[8]{0} parameter(0)\n"
                 "  ROOT %input_transpose_fusion.48 = f32[8]{0} fusion(%y), kind=kLoop, calls=%other\n}\n")
    bodies = pg.hlo_fusion_bodies([str(a)])
    assert bodies == {"input_transpose_fusion_48": "bf16[2,4,3] <- (f32[2,3,4]): reduce-precision f32[2,3,4], "
                                                   "transpose bf16[2,4,3]"}, bodies
    assert pg.hlo_fusion_bodies([str(a), str(b)]) == {}


def _errors(res, where=""):
    """Every error a kernel benchmark's JSON records: keys "error" / "wall_error" / "<section>_section_error" /
    "<shape>@<M>_error" at any depth (a variant or a section that raised is recorded, not fatal, in the script)."""
    out = []
    if isinstance(res, dict):
        for k, v in res.items():
            if k == "error" or k.endswith("_error"):
                out.append((f"{where}/{k}", str(v)[:300]))
            out += _errors(v, f"{where}/{k}")
    return out


# bench_kernels.py --dry: every section in ONE run (tree, attention, prefill, decode_fused, tree_slots, commit, conv,
# addnorm, and the long-context attn_long / prefill_attn). Interpret mode checks the script, not the tuning: each sweep is cut
# to the default variant (--select; the reference always runs), except decode_fused's, which --dry already cuts to 2.
KERNEL_SECTIONS = "tree,attn,prefill,decode_fused,tree_slots,commit,conv,addnorm,attn_long,prefill_attn"
KERNEL_SELECT = ("^(tree|tree_attn|decode_attn|tree_slots_[0-9]+x[0-9]+|addnorm_s[23]):default$"
                 "|^prefill:bv64_w4_tf32x3$"
                 "|^decode_fused:|^attn_long_40:default$|^prefill_attn_T16_.*:default$")


@pytest.fixture(scope="module")
def kernel_benches(tmp_path_factory):
    d = tmp_path_factory.mktemp("kernels")
    _run(["benchmarks/bench_kernels.py", "--dry", "--sections", KERNEL_SECTIONS, "--select", KERNEL_SELECT,
          "--out", str(d / "k.json")])
    return json.loads((d / "k.json").read_text())


def test_kernel_benches_dry(kernel_benches, tmp_path):
    k = kernel_benches
    assert k["dry"] is True and not _errors(k), _errors(k)  # no section and no variant raised
    for rec, variants in ((k["gdn_tree"], {"xla_reference", "default"}),
                          (k["tree_attention"], {"xla_reference", "default"}),
                          (k["decode_attention"], {"xla_reference", "default"}),
                          (k["gdn_prefill"], {"xla_reference", "bv64_w4_tf32x3"})):
        ran = {n for n, r in rec.items() if "skipped" not in r}
        assert ran == variants and all("rel_err" in rec[n] for n in ran), rec  # each ran and was checked
    assert k["gdn_tree_verify_best_variant"] == "default" and k["gdn_prefill_best_variant"] == "bv64_w4_tf32x3"
    assert k["gdn_tree_slots_2x8_best_variant"] is not None  # the vmapped GDN tree kernel ran and matched
    assert all("rel_err" in k[s]["xla_reference"] for s in ("gdn_commit", "gdn_conv_tree", "gdn_conv_prefill"))  # they ran
    assert all(k[f"add_rms_norm_s{s}"]["default"]["rel_err"] == {"x": 0.0, "normed": 0.0} for s in (2, 3))
    fused = k["gdn_decode_fused"]
    assert len(fused) == 3 and all("rel_err" in r for r in fused.values()), fused  # --dry's reference + 2
    assert k["gdn_decode_fused_best_variant"] is not None
    _run(["benchmarks/bench_gemv.py", "--dry", "--select", "default", "--out", str(tmp_path / "g.json")])
    g = json.loads((tmp_path / "g.json").read_text())
    assert g["dry"] is True and not _errors(g), _errors(g)
    assert g["shapes"] and all(r.get("best") == "default" for r in g["shapes"].values()), g["shapes"]


def test_long_attention_benches_dry(kernel_benches):
    k = kernel_benches
    assert "attn_long_section_error" not in k and "prefill_attn_section_error" not in k
    assert k["attn_long"]["40"]["variants"]["default"]["tflops"] > 0
    assert all(k["prefill_attn"][f"T16_start{s}"]["variants"]["default"]["tflops"] > 0 for s in (0, 40))
    assert k["prefill_attention_projected_s_72_tokens_2_layers_by_chunk"]["default"]


def test_bench_sampling_smoke(tmp_path):
    out = tmp_path / "s.json"
    _run(["benchmarks/bench_sampling.py", "--smoke", "--out", str(out)])
    res = json.loads(out.read_text())["results"]
    assert res and all(r["methods_agree"] and r["plain_ms"] > 0 and r["sort_ms"] > 0 and r["bisect_ms"] > 0
                       for r in res)


def test_gpu_check_smoke(tmp_path):
    """gpu_check.py's long-prompt section at smoke shapes (on a CPU its "pallas" runs, a benchmark variant's too,
    use xla): the JSON summary."""
    out = tmp_path / "gpu_check.json"
    p = _run(["benchmarks/gpu_check.py", "--smoke", "--quick", "--sections", "long", "--long-prompt", "40",
              "--kernels", "pallas:split_mlp", "--out", str(out)])
    res = json.loads(out.read_text())
    assert json.loads(p.stdout.strip().splitlines()[-1]) == res
    assert res["ok"] and res["long"]["prompt"] == 40 and res["kernels_under_test"] == "xla"
    assert res["long"]["ar_pallas_vs_xla_first_divergence"] is None


def test_decode_hlo_variants_reach_the_model():
    """decode_hlo.py --hashes' lowering (abstract H200, Pallas kernels included): the benchmark variants of
    kernels="pallas" (ops.VARIANTS, the decode-fusion A/B) reach the AR step's projections, the verify is theirs."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    mod = _benchmark_module("decode_hlo")
    raw = dict(mod.QWEN36_27B, num_hidden_layers=2, vocab_size=4096, layer_types=["linear_attention", "full_attention"])
    raw.pop("full_attention_interval")
    ar = {k: mod.lowered_hash(raw, "bfloat16", "bf16", k, "ar") for k in ("pallas", "pallas:no_partials",
                                                                           "pallas:unfused", "xla")}
    assert len(set(ar.values())) == 4, ar
    assert mod.lowered_hash(raw, "bfloat16", "bf16", "pallas", "ar") == ar["pallas"]  # deterministic
    assert (mod.lowered_hash(raw, "bfloat16", "bf16", "pallas", "verify")
            == mod.lowered_hash(raw, "bfloat16", "bf16", "pallas:unfused", "verify"))  # 17 rows: no GEMV


@pytest.mark.parametrize("argv,message", [(["--layers", "1,8"], "at least 2"), (["--layers", "8,x"], "integers"),
                                           (["--repeats", "0"], "at least 1")])
def test_bench_startup_argument_errors(argv, message, capsys):
    """bench_startup.py's argument errors are one line and exit 2 before any depth runs (each depth runs in fresh
    processes, so a bad depth would otherwise surface from a child)."""
    mod = _benchmark_module("bench_startup")
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
