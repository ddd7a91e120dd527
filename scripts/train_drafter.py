"""Train a DFlash drafter for a target (the DFlash recipe, optax AdamW, orbax checkpoints), then measure
τ (mean acceptance length) of chain DFlash and DDTree on held-out prompts.

    JAX_PLATFORMS=cpu nice -n 10 python scripts/train_drafter.py --target demo/target --out demo/drafter

Training data (default): the target's own greedy continuations of prefixes of the training corpus
(stdlib source, the files `jaxddtree.training.tokenizer.stdlib_files` does not hold out), generated here in batches
and cached in --ckpt; anchors are placed only where the next tokens are the target's greedy output.
`--corpus PATH` (a text file or a directory of .py/.txt files) trains on that text instead (anchors anywhere).
Target features: the frozen target's sequence pass over each training row, outputs of the decoder layers
--layer-ids. Rerunning the same command resumes from the latest checkpoint in --ckpt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def corpus_texts(path: str) -> list[str]:
    if os.path.isfile(path):
        return [open(path, encoding="utf-8", errors="replace").read()]
    out = []
    for d, _, files in sorted(os.walk(path)):
        for f in sorted(files):
            if f.endswith((".py", ".txt", ".md")):
                out.append(open(os.path.join(d, f), encoding="utf-8", errors="replace").read())
    return out


def make_generated_data(target, ids: np.ndarray, n_seqs: int, seq_len: int, prompt_lens, batch: int, seed: int):
    """Greedy continuations of random corpus prefixes: (tokens [N, seq_len] int32, prompt_len [N] int32)."""
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from jaxddtree.training.train import greedy_continue

    rng = np.random.default_rng(seed)
    rows, plens = [], []
    for i in tqdm(range(0, n_seqs, batch), desc="generating", dynamic_ncols=True):
        P = int(prompt_lens[(i // batch) % len(prompt_lens)])
        starts = rng.integers(0, len(ids) - P, size=batch)
        prompts = np.stack([ids[s:s + P] for s in starts]).astype(np.int32)
        out = greedy_continue(target.leaves, jnp.asarray(prompts), graphdef=target.graphdef,
                              treedef=target.treedef, n_new=seq_len - P)
        rows.append(np.asarray(out))
        plens.append(np.full((batch,), P, np.int32))
    return np.concatenate(rows)[:n_seqs], np.concatenate(plens)[:n_seqs]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="demo/target")
    ap.add_argument("--out", default="demo/drafter")
    ap.add_argument("--ckpt", default="checkpoints/drafter")
    ap.add_argument("--corpus", default=None, help="train on this text (file or directory) instead of "
                                                   "target-generated continuations")
    ap.add_argument("--corpus-ids", default="checkpoints/corpus/train_ids.npy",
                    help="token ids of the training corpus (written by train_target.py), for prompts")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layer-ids", default="0,1,2,3", help="target decoder layers whose outputs are features")
    ap.add_argument("--gamma", type=float, default=7.0, help="loss weight exp(-(k-1)/gamma) of block slot k")
    ap.add_argument("--n-seqs", type=int, default=4096, help="generated training rows")
    ap.add_argument("--seq", type=int, default=192, help="row length (prompt + continuation)")
    ap.add_argument("--prompt-lens", default="16,32,48,64")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=16, help="blocks per row per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--eval-prompts", type=int, default=8)
    ap.add_argument("--eval-prompt-len", type=int, default=64)
    ap.add_argument("--eval-new", type=int, default=96)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--eval-only", action="store_true")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxddtree import load_drafter, load_target
    from jaxddtree.training import train as tr
    from jaxddtree.model.drafter_config import DrafterConfig
    from jaxddtree.training import tokenizer as tk
    from jaxddtree.training.tokenizer import MASK, load_tokenizer

    target = load_target(args.target, dtype="float32")
    tok = load_tokenizer(args.target)
    tcfg = target.config
    layer_ids = [int(x) for x in args.layer_ids.split(",")]
    ddict = tr.drafter_config_dict(tcfg, layer_ids, tok.convert_tokens_to_ids(MASK), layers=args.layers,
                                   intermediate=args.intermediate, block_size=args.block_size)
    dcfg = DrafterConfig.from_dict(ddict)
    os.makedirs(args.ckpt, exist_ok=True)
    t_start = time.time()

    if not args.eval_only:
        # ---- data
        data_file = os.path.join(args.ckpt, "data.npz")
        if args.corpus:
            ids = np.concatenate([np.asarray(tok(t)["input_ids"] + [tok.eos_token_id], np.int32)
                                  for t in corpus_texts(args.corpus)])
            n = len(ids) // args.seq
            rows, plens = ids[:n * args.seq].reshape(n, args.seq), np.zeros((n,), np.int32)
        elif os.path.exists(data_file):
            d = np.load(data_file)
            rows, plens = d["rows"], d["plens"]
        else:
            t0 = time.time()
            ids = np.load(args.corpus_ids)
            rows, plens = make_generated_data(target, ids, args.n_seqs, args.seq,
                                              [int(x) for x in args.prompt_lens.split(",")], 64, args.seed)
            np.savez(data_file, rows=rows, plens=plens)
            print(f"generated {rows.shape[0]} rows x {args.seq} tokens in {time.time() - t0:.0f}s", flush=True)
        print(f"drafter data: {rows.shape[0]} rows of {args.seq} tokens "
              f"({'corpus ' + args.corpus if args.corpus else 'target-generated'})", flush=True)

        # ---- train
        params = tr.init_drafter(dcfg, seed=args.seed)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        print(f"drafter: {n_params:,} parameters, block {dcfg.block_size}, target layers {layer_ids}", flush=True)
        loss_fn = functools.partial(tr.drafter_loss, cfg=dcfg, graphdef=target.graphdef, treedef=target.treedef,
                                    gamma=args.gamma)
        trainer = tr.Trainer(loss_fn, params, lr=args.lr, steps=args.steps, warmup=args.warmup,
                             ckpt_dir=args.ckpt, save_every=args.save_every)
        rng = np.random.default_rng(args.seed)
        meta = trainer.restore()
        if meta is not None:
            rng.bit_generator.state = meta["rng"]
            print(f"resumed from step {trainer.step}", flush=True)
        leaves = target.leaves

        def next_batch():
            pick = rng.integers(0, rows.shape[0], size=args.batch)
            lo = max(int(plens[pick].max()) - 1, 0)  # anchors where the next tokens are greedy target output
            anchors = tr.sample_anchors(rng, args.batch, args.anchors, lo, args.seq - 2)
            return jnp.asarray(rows[pick].astype(np.int32)), jnp.asarray(anchors), leaves

        t1 = time.time()
        trainer.run(next_batch, args.batch * args.anchors * (args.block_size - 1),
                    meta_fn=lambda: {"rng": rng.bit_generator.state}, desc="drafter")
        train_s = time.time() - t1

        # slot accuracy on fresh rows (last 5 %: rows are random, this is a sanity metric)
        terms = jax.jit(functools.partial(tr.drafter_loss_terms, cfg=dcfg, gamma=args.gamma))
        tk_, an_, _ = next_batch()
        feats = tr.target_features(target.leaves, tk_, graphdef=target.graphdef, treedef=target.treedef,
                                   feature_layers=tuple(layer_ids))
        _, _, hit, cnt = terms(trainer.params, feats=feats, tokens=tk_, anchors=an_, embed=target.embedding,
                               lm_head=target.lm_head)
        slot_acc = (np.asarray(hit) / np.maximum(np.asarray(cnt), 1)).round(3).tolist()
        print("per-slot top-1 accuracy:", slot_acc, flush=True)
        tr.save_drafter_hf(args.out, ddict, dcfg, trainer.params)
        summary = {"steps": trainer.step, "batch": args.batch, "anchors": args.anchors, "lr": args.lr,
                   "gamma": args.gamma, "params": n_params, "train_seconds_this_run": round(train_s, 1),
                   "slot_accuracy": slot_acc, "device": str(jax.devices()[0])}
    else:
        summary = {}

    # ---- evaluate τ on held-out prompts
    drafter = load_drafter(args.out, target, dtype="float32")
    prompts = tk.heldout_prompts(tok, args.eval_prompts, args.eval_prompt_len)
    t0 = time.time()
    ev = tr.evaluate_acceptance(target, drafter, prompts, max_new_tokens=args.eval_new, budget=args.budget)
    ev["eval_seconds"] = round(time.time() - t0, 1)
    summary["eval"] = ev
    summary["total_seconds_this_run"] = round(time.time() - t_start, 1)
    with open(os.path.join(args.ckpt, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
