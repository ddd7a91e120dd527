"""Train the demo target: a small Qwen3.6-style hybrid (Gated-DeltaNet x3 + gated attention) on the Python
standard library's own source, with a byte-level BPE tokenizer trained here.

    JAX_PLATFORMS=cpu nice -n 10 python scripts/train_target.py --steps 1500 --out demo/target

Writes OUT/config.json + OUT/model.safetensors (HF `qwen3_5_text` layout, `jaxddtree.load_target(OUT)`) and
the tokenizer (OUT/tokenizer.json, `transformers.AutoTokenizer.from_pretrained(OUT)`). Checkpoints go to
--ckpt (orbax; rerunning the same command resumes after a crash). Files whose crc32(path) % 25 == 0 are
held out (`jaxddtree.training.tokenizer.stdlib_files`).
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


def encode_corpus(tok, texts, eos_id: int) -> np.ndarray:
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, np.uint16)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo/target")
    ap.add_argument("--ckpt", default="checkpoints/target")
    ap.add_argument("--cache", default="checkpoints/corpus", help="tokenizer + token ids cache")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=100)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxddtree.training import tokenizer as tk
    from jaxddtree.training import train as tr

    t0 = time.time()
    os.makedirs(args.cache, exist_ok=True)
    tok_dir = os.path.join(args.cache, "tokenizer")
    ids_file = os.path.join(args.cache, "train_ids.npy")
    train_files, held_files = tk.stdlib_files()
    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        texts = tk.read_texts(train_files)
        tok = tk.train_tokenizer(texts, args.vocab)
        tk.save_tokenizer(tok, tok_dir)
        print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(train_files)} files "
              f"({len(held_files)} held out), {time.time() - t0:.0f}s", flush=True)
    fast = tk.load_tokenizer(tok_dir)
    if not os.path.exists(ids_file):
        ids = encode_corpus(fast.backend_tokenizer, tk.read_texts(train_files), tk.EOS_ID)
        np.save(ids_file, ids)
        np.save(os.path.join(args.cache, "heldout_ids.npy"),
                encode_corpus(fast.backend_tokenizer, tk.read_texts(held_files), tk.EOS_ID))
    ids = np.load(ids_file)
    print(f"corpus: {len(ids):,} training tokens", flush=True)

    cdict = tr.target_config_dict(len(fast), hidden=args.hidden, layers=args.layers,
                                  intermediate=args.intermediate, eos_token_id=tk.EOS_ID)
    cfg = tr.text_config(cdict)
    graphdef, treedef, params = tr.init_target(cfg, seed=args.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"target: {n_params:,} parameters, layer_types={cfg.layer_types}", flush=True)

    loss_fn = functools.partial(tr.target_loss, graphdef=graphdef, treedef=treedef)
    trainer = tr.Trainer(loss_fn, params, lr=args.lr, steps=args.steps, warmup=args.warmup, ckpt_dir=args.ckpt,
                         save_every=args.save_every)
    rng = np.random.default_rng(args.seed)
    meta = trainer.restore()
    if meta is not None:
        rng.bit_generator.state = meta["rng"]
        print(f"resumed from step {trainer.step}", flush=True)

    T = args.seq + 1

    def next_batch():
        starts = rng.integers(0, len(ids) - T, size=args.batch)
        return jnp.asarray(np.stack([ids[s:s + T] for s in starts]).astype(np.int32))

    t1 = time.time()
    hist = trainer.run(next_batch, args.batch * args.seq, meta_fn=lambda: {"rng": rng.bit_generator.state},
                       desc="target")
    train_s = time.time() - t1

    # held-out loss
    held = np.load(os.path.join(args.cache, "heldout_ids.npy"))
    ev = np.random.default_rng(123)
    loss_j = jax.jit(loss_fn)
    losses = [float(loss_j(trainer.params, jnp.asarray(np.stack(
        [held[s:s + T] for s in ev.integers(0, len(held) - T, size=args.batch)]).astype(np.int32))))
        for _ in range(8)]
    held_loss = float(np.mean(losses))
    tr.save_target_hf(args.out, cdict, cfg, graphdef, treedef, trainer.params)
    fast.save_pretrained(args.out)
    summary = {"steps": trainer.step, "batch": args.batch, "seq": args.seq, "lr": args.lr,
               "params": n_params, "train_loss_last": hist[-1][1] if hist else None,
               "heldout_loss": held_loss, "train_seconds_this_run": round(train_s, 1),
               "device": str(jax.devices()[0]), "train_tokens": len(ids)}
    with open(os.path.join(args.ckpt, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
