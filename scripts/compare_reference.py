#!/usr/bin/env python
"""Side-by-side comparison of jaxddtree against transformers' PyTorch Qwen3.5/3.6 (and, optionally, against
the published DDTree code run on the same model).

Reports, on the same checkpoint and prompt:
  * logits error per prompt position (jaxddtree.score vs Qwen3_5ForCausalLM, eager attention);
  * greedy tokens over a generation: transformers' AR vs jaxddtree AR (and DFlash/DDTree with --drafter);
  * time per token / per round on this machine.
With --reference-repo DIR (a checkout of github.com/liranringel/ddtree), its own `ddtree_generate` and
`dflash_generate` run on the same inputs, with `DynamicCache()` built from the target config as users
patch it, and their tokens, acceptance lengths and round times are reported next to ours, including where
their output diverges from the target's AR output on the hybrid model. That code is imported from DIR at
run time, never copied.

Examples:
  python scripts/compare_reference.py --target DIR --prompt-len 64 --max-new-tokens 32
  python scripts/compare_reference.py --tiny --json                 # self-contained, tiny random model
  python scripts/compare_reference.py --target T --drafter D --reference-repo ~/src/ddtree
  python scripts/compare_reference.py --scale --device cuda --out benchmarks/results/h200.json

--scale times the reference alone at the real Qwen3.6-27B shapes (or --config's) with random bf16 weights made
on the device (no checkpoint): one AR decode step and one tree verify of N nodes at a --context-token prefix,
transformers' model as the published DDTree code runs it (a [1, 1, N, start + N] additive tree mask), and
merges them into --out under "reference" (our side of the comparison comes from benchmarks/bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import traceback

# the 27B shapes and the random tree live with the benchmarks
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")

try:
    import jaxddtree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np


def _torch_dtype(name):
    import torch
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def build_tiny(path: str, seed: int = 0):
    """A tiny random Qwen3.5-architecture checkpoint (HF layout) for self-contained runs."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8.0, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 1.0, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if "embed" in name else p.shape[-1] ** -0.5))
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_target(path: str, dtype: str, device: str):
    from transformers import AutoConfig, Qwen3_5ForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    if getattr(cfg, "model_type", "") == "qwen3_5":
        cfg = cfg.text_config
    cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM.from_pretrained(path, config=cfg, dtype=_torch_dtype(dtype))
    return model.to(device).eval()


def _sync(device):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reference_at_scale(raw_cfg: dict, device: str, context: int, nodes: list[int], runs: int, attn: str,
                       seed: int = 0, log=print) -> dict:
    """Time transformers' Qwen3_5ForCausalLM (bf16, random weights made on `device`): AR step and tree verify."""
    import copy
    import importlib.util

    import torch
    from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    sys.path.insert(0, BENCHMARKS)
    from bench import random_tree

    raw = dict(raw_cfg.get("text_config", raw_cfg))
    raw.pop("model_type", None)
    cfg = Qwen3_5TextConfig(**raw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen3_5ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    with torch.no_grad():  # keep the GDN decay well-defined (A_log, dt_bias as a trained model's)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16)))
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"reference model: {n_params / 1e9:.2f} B params, bf16, attn={attn}, built in {time.perf_counter() - t0:.1f} s")
    V = cfg.vocab_size
    rng = np.random.RandomState(seed)

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return 1e3 * (time.perf_counter() - t)

    out = {"attn_implementation": attn, "dtype": "bfloat16", "context": context, "params_b": round(n_params / 1e9, 3),
           "fla": importlib.util.find_spec("fla") is not None,
           "causal_conv1d": importlib.util.find_spec("causal_conv1d") is not None,
           "torch": torch.__version__, "runs": runs}
    with torch.inference_mode():
        base = DynamicCache(config=cfg)
        ids = torch.tensor(rng.randint(0, V, size=(1, context)), device=device)
        out["prefill_ms"] = timed(lambda: model(ids, past_key_values=base, use_cache=True, logits_to_keep=1))
        log(f"reference prefill of {context} tokens: {out['prefill_ms']:.0f} ms")

        cache = copy.deepcopy(base)
        tok = torch.tensor([[int(rng.randint(0, V))]], device=device)
        times = [timed(lambda: model(tok, past_key_values=cache, use_cache=True)) for _ in range(runs + 2)][2:]
        out["ar_step_ms"] = float(np.median(times))
        log(f"reference AR step: {out['ar_step_ms']:.1f} ms (median of {runs})")

        out["verify_ms"] = {}
        neg = torch.finfo(torch.bfloat16).min
        for n in nodes:
            L = n + 1
            parents = random_tree(L, 15, seed + n)  # depth <= 15, as DDTree's
            vis = np.zeros((L, L), bool)
            depth = np.zeros(L, np.int64)
            for i in range(L):
                if i:
                    vis[i, :i] = vis[parents[i], :i]
                    depth[i] = depth[parents[i]] + 1
                vis[i, i] = True
            mask = torch.zeros((1, 1, L, context + L), dtype=torch.bfloat16, device=device)
            mask[0, 0, :, context:] = torch.where(torch.tensor(vis, device=device), 0.0, neg).to(torch.bfloat16)
            vids = torch.tensor(rng.randint(0, V, size=(1, L)), device=device)
            pos = torch.tensor((context + depth)[None], device=device)
            times = []
            for r in range(runs + 2):
                c = copy.deepcopy(base)  # the committed 4K state; not timed
                times.append(timed(lambda: model(vids, position_ids=pos, attention_mask=mask, past_key_values=c,
                                                 use_cache=True, output_hidden_states=True)))
            out["verify_ms"][str(L)] = float(np.median(times[2:]))
            log(f"reference verify of {L} nodes: {out['verify_ms'][str(L)]:.1f} ms")
    del model
    return out


def run_reference_repo(repo: str, drafter_dir: str, target, input_ids, args, ar_tokens):
    """Run the published ddtree/dflash generate functions from a checkout at `repo`."""
    import torch
    from transformers import DynamicCache

    sys.path.insert(0, os.path.abspath(repo))
    out = {}
    try:
        import dflash as ref_dflash
        import ddtree as ref_ddtree
        from model import DFlashDraftModel
    except Exception as e:  # noqa: BLE001 - report, don't crash
        return {"error": f"cannot import the reference code from {repo}: {type(e).__name__}: {e}"}

    class PublishedCache(DynamicCache):
        """`crop(max_length)` as the published code calls it (keep the first max_length tokens). Newer
        transformers take a negative count instead and refuse to crop linear-attention layers that do not
        record their past; like the transformers the code was written for, only the attention layers are
        cropped and the GDN states stay as the verify left them (no rollback)."""

        def crop(self, max_length):
            try:
                return super().crop(max_length)
            except (ValueError, RuntimeError):
                pass
            for layer in self.layers:
                keys = getattr(layer, "keys", None)
                if isinstance(keys, torch.Tensor) and keys.numel() and keys.shape[-2] > max_length:
                    layer.keys = keys[..., :max_length, :]
                    layer.values = layer.values[..., :max_length, :]

    made = [0]

    def patched_cache(*a, **kw):
        """Users build the TARGET's cache from its config for hybrid models; the published loops create the
        target's cache first and the drafter's (plain attention) second, once per call."""
        made[0] += 1
        return PublishedCache(config=target.config) if made[0] % 2 == 1 else PublishedCache()

    def cpu_time():
        _sync(args.device)
        return time.perf_counter()

    for mod in (ref_dflash, ref_ddtree):
        mod.DynamicCache = patched_cache
        if hasattr(mod, "cuda_time"):
            mod.cuda_time = cpu_time
    drafter = DFlashDraftModel.from_pretrained(drafter_dir, dtype=_torch_dtype(args.dtype)).to(args.device).eval()
    mask_id = drafter.mask_token_id
    block = drafter.config.block_size
    ids = torch.tensor(np.asarray(input_ids)[None], device=args.device)
    for name, fn, kw in [("ref_dflash", ref_dflash.dflash_generate, {}),
                         ("ref_ddtree", ref_ddtree.ddtree_generate, {"tree_budget": args.budget})]:
        made[0] = 0
        try:
            t = time.perf_counter()
            with torch.inference_mode():
                res = fn(model=drafter, target=target, input_ids=ids, mask_token_id=mask_id,
                         max_new_tokens=args.max_new_tokens, block_size=block, stop_token_ids=None,
                         temperature=0.0, **kw)
            wall = time.perf_counter() - t
            toks = res.output_ids[0, len(input_ids):len(input_ids) + args.max_new_tokens].tolist()
            n = min(len(toks), len(ar_tokens))
            div = next((i for i in range(n) if toks[i] != ar_tokens[i]), None)
            out[name] = {"tokens": toks, "acceptance_lengths": list(map(int, res.acceptance_lengths)),
                         "time_per_round_ms": 1e3 * wall / max(1, len(res.acceptance_lengths)),
                         "first_divergence_from_target_ar": div,
                         "matches_target_ar": div is None}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}",
                         "where": traceback.format_exc().strip().splitlines()[-3:]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--target", help="HF checkpoint directory of a Qwen3.5/3.6 model")
    src.add_argument("--tiny", action="store_true", help="build and use a tiny random model (default if no --target)")
    ap.add_argument("--drafter", help="DFlash drafter directory (z-lab layout): also compare dflash/ddtree")
    ap.add_argument("--reference-repo", help="checkout of the published DDTree code to run on the same inputs")
    ap.add_argument("--prompt-ids", help="comma-separated prompt token ids (default: random)")
    ap.add_argument("--prompt-len", type=int, default=48, help="random prompt length (default 48)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens to compare (default 32)")
    ap.add_argument("--budget", type=int, default=16, help="DDTree budget for the speculative runs (default 16)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both sides (default fp32)")
    ap.add_argument("--device", default="cpu", help="torch device for the reference (default cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    scale = ap.add_argument_group("reference timings at scale (--scale)")
    src.add_argument("--scale", action="store_true",
                     help="time the reference alone at 27B shapes (or --config's) with random bf16 weights")
    scale.add_argument("--config", help="HF config.json for --scale (default: the built-in Qwen3.6-27B shapes)")
    scale.add_argument("--context", type=int, default=4096, help="committed prefix for --scale (default 4096)")
    scale.add_argument("--verify-nodes", default="64", help="non-root tree nodes N for --scale (default 64 -> 65)")
    scale.add_argument("--runs", type=int, default=5, help="timed runs per --scale measurement (median)")
    scale.add_argument("--attn", default="eager", choices=["eager", "sdpa"],
                       help="transformers attention for --scale (default eager)")
    scale.add_argument("--out", help="JSON file to merge the --scale results into, under \"reference\"")
    args = ap.parse_args(argv)

    if args.scale:
        return _main_scale(args)

    import torch
    import jaxddtree

    tmp = None
    if not args.target:
        tmp = tempfile.mkdtemp(prefix="jaxddtree_tiny_")
        args.target = build_tiny(tmp, args.seed)
    try:
        ref = hf_target(args.target, args.dtype, args.device)
        ours = jaxddtree.load_target(args.target, dtype=args.dtype)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    V = ours.config.vocab_size
    if args.prompt_ids:
        prompt = np.asarray([int(t) for t in args.prompt_ids.split(",")], np.int64)
    else:
        prompt = np.random.RandomState(args.seed).randint(0, V, size=args.prompt_len)
    report = {"target": args.target, "dtype": args.dtype, "prompt_len": int(len(prompt))}

    # 1. logits per prompt position
    with torch.inference_mode():
        ref_logits = ref(torch.tensor(prompt[None], device=args.device)).logits[0].float().cpu().numpy()
    our_logits = jaxddtree.score(ours, prompt)
    scale = np.abs(ref_logits).max(axis=-1)
    per_pos = np.abs(our_logits - ref_logits).max(axis=-1) / np.maximum(scale, 1e-30)
    report["logits_max_rel_err"] = float(per_pos.max())
    report["logits_rel_err_per_position"] = [float(x) for x in per_pos]
    report["top1_agreement"] = float((our_logits.argmax(-1) == ref_logits.argmax(-1)).mean())

    # 2. greedy generation, transformers vs ours
    n = args.max_new_tokens
    with torch.inference_mode():
        ref.generate(torch.tensor(prompt[None], device=args.device), max_new_tokens=2, do_sample=False,
                     eos_token_id=None, pad_token_id=0)  # warm-up
        _sync(args.device)
        t = time.perf_counter()
        out = ref.generate(torch.tensor(prompt[None], device=args.device), max_new_tokens=n, do_sample=False,
                           min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        _sync(args.device)
        ref_time = time.perf_counter() - t
    ref_tokens = out[0, len(prompt):].tolist()
    report["transformers_ar"] = {"tokens": ref_tokens, "time_per_token_ms": 1e3 * ref_time / n}
    drafter = jaxddtree.load_drafter(args.drafter, ours, dtype=args.dtype) if args.drafter else None
    runs = {"ar": dict(method="ar")}
    if drafter is not None:
        runs["dflash"] = dict(method="dflash", drafter=drafter)
        runs["ddtree"] = dict(method="ddtree", drafter=drafter, tree_budget=args.budget)
    gens = {}
    for name, kw in runs.items():  # the first call compiles; time the second (same tokens)
        jaxddtree.generate(ours, prompt, max_new_tokens=n, **kw)
        gens[name] = jaxddtree.generate(ours, prompt, max_new_tokens=n, **kw)
    for name, g in gens.items():
        agree = float(np.mean([a == b for a, b in zip(g.tokens, ref_tokens)])) if ref_tokens else 0.0
        report[f"jaxddtree_{name}"] = {
            "tokens": g.tokens, "token_agreement_with_transformers": agree,
            "acceptance_lengths": g.acceptance_lengths,
            "time_per_token_ms": 1e3 * g.stats["decode_s"] / max(1, len(g.tokens) - 1),
            "time_per_round_ms": 1e3 * g.stats["decode_s"] / max(1, g.stats["rounds"])}

    # 3. the published code on the same inputs
    if args.reference_repo:
        if not args.drafter:
            print("error: --reference-repo needs --drafter", file=sys.stderr)
            return 2
        report.update(run_reference_repo(args.reference_repo, args.drafter, ref, prompt, args, ref_tokens))

    if not args.json:
        print(f"target {args.target} ({args.dtype}), prompt {len(prompt)} tokens")
        print(f"logits max rel err vs transformers: {report['logits_max_rel_err']:.2e}  "
              f"(top-1 agreement {report['top1_agreement']:.3f})")
        print(f"transformers AR: {report['transformers_ar']['time_per_token_ms']:.2f} ms/token")
        for name in gens:
            r = report[f"jaxddtree_{name}"]
            print(f"jaxddtree {name:7s}: tokens == transformers AR: {r['token_agreement_with_transformers']:.3f}"
                  f"  {r['time_per_token_ms']:.2f} ms/token, {r['time_per_round_ms']:.2f} ms/round")
        if "error" in report:
            print(f"published code: not run: {report['error']}")
        for name in ("ref_dflash", "ref_ddtree"):
            if name in report:
                r = report[name]
                if "error" in r:
                    print(f"published {name[4:]}: failed: {r['error']}")
                else:
                    print(f"published {name[4:]}: matches target AR: {r['matches_target_ar']} "
                          f"(first divergence at {r['first_divergence_from_target_ar']}), "
                          f"{r['time_per_round_ms']:.2f} ms/round")
    else:
        print(json.dumps(report))
    return 0


def _main_scale(args) -> int:
    import datetime

    if args.config:
        try:
            raw = json.load(open(args.config))
        except (OSError, ValueError) as e:
            print(f"error: --config {args.config}: {e}", file=sys.stderr)
            return 2
    else:
        sys.path.insert(0, BENCHMARKS)
        from bench import QWEN36_27B
        raw = dict(QWEN36_27B)
    try:
        nodes = [int(x) for x in args.verify_nodes.split(",") if x]
    except ValueError:
        print(f"error: --verify-nodes must be comma-separated integers, got {args.verify_nodes!r}", file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    rep = reference_at_scale(raw, args.device, args.context, nodes, args.runs, args.attn, args.seed, log=log)
    rep["date"] = datetime.date.today().isoformat()
    if args.device.startswith("cuda"):
        import torch
        rep["device"] = torch.cuda.get_device_name()
    if args.out:
        data = json.load(open(args.out)) if os.path.exists(args.out) else {}
        key = "reference" if args.attn == "eager" else f"reference_{args.attn}"
        data[key] = rep
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
    if args.json:
        print(json.dumps(rep))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
