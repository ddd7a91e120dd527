"""A host (numpy, float64) restatement of the truncated sampling distribution (`speculative.tree.truncate`),
written from its definition, for the tests of AR and speculative sampling."""

from __future__ import annotations

import numpy as np


def truncated_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """[..., V] logits -> [..., V] probabilities: softmax(logits / T) restricted to the kept set, renormalised.

    Kept set of a row: walk the tokens from the most probable down; token r (0-based rank) is in the top-k
    prefix iff top_k == 0 or r < top_k, in the nucleus iff top_p == 1 or the mass of the tokens ranked before
    it is < top_p, and passes min_p iff p >= min_p * p_max. The kept prefix ends at the first rank failing one
    of them (at least one token); then every token tied with the last kept one joins it.
    """
    x = np.asarray(logits, np.float64) / temperature
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros_like(flat)
    for row, z in enumerate(flat):
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-z, kind="stable")
        n, mass = 0, 0.0
        for r, i in enumerate(order):
            ok = (top_k == 0 or r < top_k) and (top_p >= 1 or mass < top_p) and p[i] >= min_p * p[order[0]]
            if not ok:
                break
            n, mass = n + 1, mass + p[i]
        n = max(n, 1)
        keep = z >= z[order[n - 1]]
        q = np.where(keep, p, 0.0)
        out[row] = q / q.sum()
    return out.reshape(x.shape)
