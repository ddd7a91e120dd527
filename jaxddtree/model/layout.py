"""How the tokens of one forward pass relate to each other and to the committed cache.

- `sequence(...)`: T new tokens continuing the cache causally (prefill chunk or decode step); the first
  `num_valid` are real, the rest padding. The pass writes them into the cache.
- `tree(...)`: the N nodes of a draft tree (`parents[i] < i`, node 0 the root). Nothing is written;
  the pass returns a stash that `verify.commit` turns into the cache of the accepted path.

`mask[b, i, j]` = j is i or an ancestor of i (a chain: the lower triangle). `conv_src[b, i, s]` is the
row of `concat(conv_state, x)` (conv_state has K-1 rows) that feeds conv tap s of token i (s = K-2 is the
nearest predecessor, s = 0 the farthest), falling back to conv-state rows above the root.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct



@struct.dataclass
class TokenLayout:
    positions: jax.Array  # [B, T] int32: RoPE positions
    start: jax.Array  # int32 scalar: committed length before this pass
    num_valid: jax.Array  # int32 scalar: real tokens (sequence) / real nodes (tree)
    mask: jax.Array  # [B, T, T] bool: ancestor-or-self
    conv_src: jax.Array  # [B, T, K-1] int32: conv tap rows into concat(conv_state, x)
    is_tree: bool = struct.field(pytree_node=False, default=False)
    kernels: str = struct.field(pytree_node=False, default="xla")  # "xla" | "pallas" (kernels_pallas.ops)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[1]


def sequence(start, num_tokens: int, conv_kernel: int, num_valid=None, batch: int = 1,
             kernels: str = "xla") -> TokenLayout:
    start = jnp.asarray(start, jnp.int32)
    nv = jnp.asarray(num_tokens if num_valid is None else num_valid, jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    km1 = conv_kernel - 1
    # token t sits at row t + K-1 of concat(conv_state, x); its taps are the K-1 rows before it
    src = t[:, None] + jnp.arange(km1, dtype=jnp.int32)[None, :]
    bc = lambda x: jnp.broadcast_to(x, (batch,) + x.shape)
    return TokenLayout(positions=bc(start + t), start=start, num_valid=nv,
                       mask=bc(jnp.tril(jnp.ones((num_tokens, num_tokens), bool))), conv_src=bc(src),
                       kernels=kernels)


def ancestor_mask(parents: jax.Array, valid: jax.Array, max_depth: int) -> jax.Array:
    """M [N, N] bool: M[i, j] iff j == i or j is an ancestor of i (parents [N], root -1; nodes with
    valid False are padding: self only; no path has more than max_depth + 1 nodes).

    Pointer doubling: after step s, row i holds i and its ancestors at distance < 2**s, and
    up[i] is its 2**s-th ancestor (the root and padding nodes point to themselves).
    """
    n = parents.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    up = jnp.where(valid & (idx > 0), parents, idx)  # [N]
    m = idx[:, None] == idx[None, :]                           # [N, N] eye
    for _ in range(max(0, math.ceil(math.log2(min(n, max_depth + 1))))):
        m = m | m[up]  # M[i] |= M[up[i]]
        up = up[up]
    return m & (valid[None, :] | (idx[:, None] == idx[None, :]))


def ancestor_steps(parents: jax.Array, steps: int) -> jax.Array:
    """parents [N] (root -1) -> [steps, N]: the s+1-th ancestor of each node, -1 above the root."""
    out, cur = [], parents
    for _ in range(steps):
        out.append(cur)
        cur = jnp.where(cur >= 0, parents[jnp.maximum(cur, 0)], -1)
    return jnp.stack(out)


def tree(start, parents: jax.Array, conv_kernel: int, num_valid=None, batch: int = 1,
         mask: jax.Array | None = None, depths: jax.Array | None = None, kernels: str = "xla") -> TokenLayout:
    """Layout of a tree given `parents` [N] (parents[0] = -1, parents[i] < i; padding nodes may point
    to any earlier node but must be excluded from real nodes' ancestry, e.g. parent 0 with a
    self-only mask row: pass `mask` explicitly then). Without `mask`, every node is real; without
    `depths`, a node's depth is its number of ancestors in the mask."""
    start = jnp.asarray(start, jnp.int32)
    n = parents.shape[0]
    parents = parents.astype(jnp.int32)
    if mask is None:
        mask = ancestor_mask(parents, jnp.ones((n,), bool), n - 1)
    depths = (mask.sum(axis=-1) - 1 if depths is None else depths).astype(jnp.int32)
    km1 = conv_kernel - 1
    anc = ancestor_steps(parents, km1)  # [K-1, N]: 1st..(K-1)th ancestor
    s = jnp.arange(1, km1 + 1, dtype=jnp.int32)[:, None]  # how far back
    # inside the tree: ancestor row; above the root: conv-state row K-1 + (depth - s)
    rows = jnp.where(anc >= 0, anc + km1, km1 + depths[None, :] - s)  # [K-1, N], nearest first
    src = rows[::-1].T  # [N, K-1], oldest first
    nv = jnp.asarray(n if num_valid is None else num_valid, jnp.int32)
    bc = lambda x: jnp.broadcast_to(x, (batch,) + x.shape)
    return TokenLayout(positions=bc(start + depths), start=start, num_valid=nv, mask=bc(mask),
                       conv_src=bc(src), is_tree=True, kernels=kernels)
