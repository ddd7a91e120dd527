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

    def patched_cache(*a, **kw):  # users build the cache from the target config for hybrid models
        return DynamicCache(config=target.config)

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
    args = ap.parse_args(argv)

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
        _sync(args.device)
        t = time.perf_counter()
        out = ref.generate(torch.tensor(prompt[None], device=args.device), max_new_tokens=n, do_sample=False,
                           min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        _sync(args.device)
        ref_time = time.perf_counter() - t
    ref_tokens = out[0, len(prompt):].tolist()
    report["transformers_ar"] = {"tokens": ref_tokens, "time_per_token_ms": 1e3 * ref_time / n}
    gens = {"ar": jaxddtree.generate(ours, prompt, method="ar", max_new_tokens=n)}
    drafter = None
    if args.drafter:
        drafter = jaxddtree.load_drafter(args.drafter, ours, dtype=args.dtype)
        gens["dflash"] = jaxddtree.generate(ours, prompt, drafter=drafter, method="dflash", max_new_tokens=n)
        gens["ddtree"] = jaxddtree.generate(ours, prompt, drafter=drafter, method="ddtree", max_new_tokens=n,
                                            tree_budget=args.budget)
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


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
