"""Prompts into the cache: token-id validation and the fixed-size chunked prefill (one compilation per
chunk size) that scoring and generation share."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxddtree.model.target import Target

PREFILL_CHUNK = 256
# Shorter prompts are padded to one of these widths (one compilation each, so a server can compile every width
# before it listens); at 27B a 64- or 256-row chunk streams the same weights as a 16-row one.
SHORT_WIDTHS = (64, PREFILL_CHUNK)
# Prompts longer than LONG_PROMPT are prefilled in chunks of LONG_PREFILL_CHUNK: at 27B a 256-row chunk streams
# all 51 GB of weights for 256 tokens (≈ 12 ms of weights per 3.4 TFLOP), a 2048-row chunk for 2048 (compute-bound
# GEMMs); the padding of the last chunk costs at most one chunk.
LONG_PROMPT = 8192
LONG_PREFILL_CHUNK = 2048


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def check_ids(token_ids, name="token_ids") -> np.ndarray:
    """`token_ids` as a flat int64 array; TypeError for text or non-integer values (never truncated)."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError(f"{name} must be integer token ids, not a string (tokenize the text first)")
    ids = np.asarray(token_ids)
    if ids.size and ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integers, got {ids.dtype} values")
    if ids.size == 0:
        raise ValueError(f"{name} is empty")
    return ids.astype(np.int64).reshape(-1)


def check_vocab(target: Target, ids: np.ndarray, name: str):
    if ids.min() < 0 or ids.max() >= target.config.vocab_size:
        raise ValueError(f"{name} must lie in [0, {target.config.vocab_size}); got {ids.min()}..{ids.max()}")


def chunk_size(n_tokens: int, chunk: int | None = None) -> int:
    """Rows per prefill call for a prompt of n_tokens (one compilation per size): `chunk` if given (or the prompt
    rounded up to 8 when shorter); by default LONG_PREFILL_CHUNK past LONG_PROMPT tokens, else the smallest of
    SHORT_WIDTHS that holds the prompt (PREFILL_CHUNK-row chunks past it)."""
    if chunk:
        return min(chunk, round_up(n_tokens, 8))
    if n_tokens > LONG_PROMPT:
        return LONG_PREFILL_CHUNK
    return next((w for w in SHORT_WIDTHS if n_tokens <= w), PREFILL_CHUNK)


def warmup_length(n_tokens: int) -> int:
    """The shortest prompt length (<= n_tokens) whose chunks have the width of an n_tokens-token prompt's
    (`chunk_size`): a warm-up run on that many tokens compiles the same prefill programs (the committed length is
    data) at a fraction of the prefill (a 128K-token prompt: 5 chunks of 2048 instead of 64); pass the real run's
    cache capacity to both."""
    w = chunk_size(n_tokens)
    return next((n for width, n in chunk_widths(n_tokens) if width == w), n_tokens)


def prompt_shape(n_tokens: int) -> tuple[int, int]:
    """(chunk width, chunks) of a prompt's default prefill (`chunk_size`): prompts of one shape can prefill
    together."""
    w = chunk_size(n_tokens)
    return w, -(-n_tokens // w)


def chunk_widths(max_tokens: int) -> list[tuple[int, int]]:
    """(width, a prompt length that uses it) for every default chunk width a prompt of <= max_tokens tokens can
    use: what a server compiles before it listens."""
    out, lo = [], 1
    for w in SHORT_WIDTHS + (LONG_PREFILL_CHUNK,):
        n = lo if w != LONG_PREFILL_CHUNK else LONG_PROMPT + 1
        if n <= max_tokens and chunk_size(n) == w:
            out.append((w, n))
        lo = w + 1
    return out


def chunk_bounds(n_tokens: int, size: int, start: int = 0, grid: int = 0) -> list[tuple[int, int]]:
    """[(a, b)] the prefill chunks of positions [start, n_tokens): they end at every multiple of `size` (counted
    from position 0, so a prefill resumed at `start` keeps a cold prefill's chunk ends), at every multiple of
    `grid` (> 0: forced ends, where a prefix cache snapshots the state) and at n_tokens; each at most `size`."""
    ends = set(range(start - start % size + size, n_tokens, size)) | {n_tokens}
    if grid > 0:
        ends |= set(range(start - start % grid + grid, n_tokens, grid))
    out, a = [], start
    for b in sorted(ends):
        if b > a:
            out.append((a, b))
            a = b
    return out


def padded_chunks(ids: np.ndarray, size: int | None = None, start: int = 0, grid: int = 0):
    """Yield (tokens [1, size] int32, n real) for `ids[start:]` cut into chunks of one fixed size (one compilation
    per size; `chunk_bounds`): `size` as given (a `chunk_size`), default chunk_size(len(ids)); a chunk shorter
    than `size` is zero-padded."""
    size = size or chunk_size(len(ids))
    for a, b in chunk_bounds(len(ids), size, start, grid):
        padded = np.zeros((1, size), np.int32)
        padded[0, :b - a] = ids[a:b]
        yield jnp.asarray(padded), b - a


def prefill_ids(target: Target, cache, ids: np.ndarray, feature_layers=(), logits="last",
                chunk: int | None = None):
    """Prefill a prompt in fixed-size chunks (one compilation per chunk size). Returns the last chunk's
    logits, the cache, and the features of every prompt position (concatenated) or None."""
    T = len(ids)
    size = chunk_size(T, chunk)
    # every chunk is written whole (padding included): a write past the cache end would be clamped by
    # dynamic_update_slice onto earlier rows, silently corrupting the cache
    need = int(cache.length) + round_up(T, size)
    if need > cache.max_len:
        raise ValueError(f"cache too small: prefilling {T} tokens in chunks of {size} after "
                         f"{int(cache.length)} committed tokens writes {need} rows, the cache has {cache.max_len}")
    feats, out = [], None
    for padded, n in padded_chunks(ids, size):
        out, cache, f, _ = target.prefill(cache, padded, num_valid=n, feature_layers=feature_layers, logits=logits)
        if f is not None:
            feats.append(f[:, :n])
    return out, cache, (jnp.concatenate(feats, axis=1) if feats else None)
