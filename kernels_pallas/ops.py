"""Kernel dispatch: the model calls these with `kernels="xla"` (plain jnp references, the spec) or
`kernels="pallas"` (the GPU kernels in `kernels_pallas/`, same signatures, same results; benchmarks also pass
its `VARIANTS`). A projection's kernel is chosen in one place, `pick` (weight format, rows, output width,
kernels), and `dense` / `decode_row` run what it chose."""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kernels_pallas import gdn_reference
from kernels_pallas.numerics import f32, rms_norm_1p, rounded

KERNELS = ("xla", "pallas")


class Fusions(NamedTuple):
    """What a Pallas-path variant runs: the decode-step fusions (AR step, bf16, kernels_pallas/dense.py's GEMV) and
    how the XLA GEMMs of more rows hand over their output."""
    parts: bool = True  # the gate in the GEMV's prologue, the residual in its epilogue; the attention layer's q/k
    #                     norm + RoPE + gate + KV-cache write as one kernel (`attention_decode_prep`)
    partials: bool = True  # the GEMV's split-K partials unsummed into the GDN / attention decode kernels
    unroll: int = 1  # layer groups per iteration of the model's scan (`scan_unroll`)
    tree_unroll: int = 2  # the same in a tree verify only
    swiglu: bool = True  # the MLP's SwiGLU in its gate|up GEMM's epilogue (`mlp`; variant "pallas:split_mlp": off)


# kernels="pallas" and its benchmark-only variants: decode-step fusions off (A/B timing: benchmarks/ab_kernels.py;
# the same kernels otherwise). Both lost on the H200 (AR step, 27B, 4K, 2026-11-30: 17.68 ms default, 17.97
# no_partials, 18.14 unfused; BENCHMARKS.md session 4, run B). Removed (git history), lost too: the RMSNorm in the
# GEMV prologue and the MLP as two GEMVs with the SwiGLU in the down GEMV's prologue (20.63 ms with the MLP chain):
# both delay the weight stream; the verify's XLA GEMM outputs behind an optimization barrier ("pallas:materialised":
# round(64) 21.771 vs 21.738 ms, AR 14.166 vs 13.964, 2026-12-04, BENCHMARKS.md session 21); a Mosaic GPU GEMM's
# input norm as XLA's slice, norm and pad fusions instead of `rms_norm.rms_norm_rows` ("pallas:xla_norm": round(64)
# 21.722 vs 21.502 ms, AR 13.918 vs 13.928, 2026-12-06, BENCHMARKS.md session 29). Made defaults after an A/B (H100,
# 4K, 2026-12-07, BENCHMARKS.md session 30: round(64) 27.66 ms "pallas"): the GDN out_proj's gated input norm as
# `gated_rms_norm_rows` (was "pallas:gated_norm", 27.55) and the tree selection's depth scan unrolled (was
# "pallas:tree_unroll", 27.59). Lost and removed (H100, 2026-12-07, session 30): the GDN tree verify's conv, l2norms,
# beta / g and key grams as one Pallas-Triton kernel per layer (`gdn_tree_prep`, "pallas:tree_prep": round(64)
# +0.86 ms with the grams in it, 33 µs a call vs XLA's 20; −0.01 ms without them). Made defaults after an A/B (H100,
# 4K, 2026-12-07, BENCHMARKS.md session 31; round(64) 26.94 ms "pallas"): the MLP's SwiGLU in the gate|up GEMM's
# epilogue ("pallas:split_mlp": 27.25) and, once the serve's cold start was timed with it, the tree verify's
# layer-group scan unrolled by 2 (Fusions.tree_unroll; H100, 4K, 2026-12-07, session 32: round(64) 26.60 vs 26.85 ms
# rolled, AR step the same; serve ready cold 89.7 vs 83.4 s at --max-batch 11: it doubles the auto round's verify
# bodies, the cold start's critical path). Removed: "pallas:unroll2", both scans unrolled (round −0.28 ms, AR step
# +0.19 on the H200, session 29). Made defaults after an A/B (H100, 4K, 2026-12-07, BENCHMARKS.md session 34; two
# passes, round(64) 25.88 / 25.87 ms "pallas"): a tree verify's residual adds in the next input norm's kernel
# (`add_norm_fuses`, was "pallas:addnorm": 25.72 / 25.73) and the GDN tree conv's taps gathered without the
# concatenation (`gdn_reference.tree_conv`, was "pallas:conv_gather": 25.69 / 25.72); all three of session 33's
# candidates 25.48 / 25.57. Lost and removed: a verify's feature taps as the scan's per-group outputs
# ("pallas:taps_stacked": 25.78 / 25.91, and 42.6 MB more per slot at 27B).
VARIANTS = {"pallas": Fusions(), "pallas:no_partials": Fusions(partials=False),
            "pallas:unfused": Fusions(parts=False, partials=False),
            "pallas:unroll4": Fusions(unroll=4, tree_unroll=4), "pallas:unroll16": Fusions(unroll=16, tree_unroll=16),
            "pallas:split_mlp": Fusions(swiglu=False)}


def scan_unroll(kernels: str, tree: bool = False) -> int:
    """How many layer groups one iteration of the model's `lax.scan` runs (`jax.lax.scan(unroll=...)`) in a pass
    (tree: a tree verify's): `Fusions.unroll` / `tree_unroll` of the Pallas path (by default 1, and
    2 in a tree verify; the benchmark variants "pallas:unrollN" time the scan's own cost), 1 on XLA's."""
    f = _fusions(kernels)
    if f is None:
        return 1
    return f.tree_unroll if tree else f.unroll


def add_norm_fuses(kernels: str) -> bool:
    """A tree verify's projections hand the next input norm over (`dense` / `mlp` with then_norm; the model's
    decoder layers ask for it where this holds): the Pallas path (its Mosaic GPU GEMMs hand their split-K partials to
    `rms_norm.add_rms_norm_rows`; elsewhere h is XLA's norm of y)."""
    return _fusions(kernels) is not None


def _fusions(kernels: str) -> Fusions | None:
    """The decode-step fusions of `kernels` (None: "xla"); ValueError for an unknown name."""
    if kernels == "xla":
        return None
    if not isinstance(kernels, str) or kernels not in VARIANTS:
        raise ValueError(f"unknown kernels '{kernels}' (choose one of {KERNELS})")
    return VARIANTS[kernels]


def _check(kernels: str) -> str:
    """The path of `kernels`, "xla" or "pallas" (a benchmark variant counts as "pallas"); ValueError if unknown."""
    return "xla" if _fusions(kernels) is None else "pallas"


def is_pallas(kernels: str) -> bool:
    """`kernels` names the Pallas path ("pallas" or one of its benchmark VARIANTS)."""
    return _check(kernels) == "pallas"


def _pallas_or(reference, kernel):
    """kernel() (the Pallas call), or reference() where no tile configuration of the kernel fits the GPU's shared
    memory for these shapes / dtypes (`_common.SharedMemoryError`, raised while tracing, before any work): one
    plain line on stderr, once per process and kernel."""
    from kernels_pallas._common import SharedMemoryError, note_once
    try:
        return kernel()
    except SharedMemoryError as e:
        note_once(("smem", str(e).split(":")[0]), f"kernels_pallas: {e}; that call runs on the xla path")
        return reference()


def _hopper() -> bool:
    """The computation is for a Hopper GPU (wgmma, TMA): the first device's compute capability 9.x, or an abstract
    H100 / H200 being lowered for (`_common.abstract_h200`). Elsewhere (a CPU: interpret mode; other GPUs) the
    Triton kernels run."""
    dev = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if dev is not None:
        return dev.platform == "gpu" and any(h in dev.device_kind for h in ("H100", "H200", "H800"))
    d = jax.devices()[0]
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


MGPU_MIN_ROWS = 32  # tree / prefill rows from which the Mosaic GPU attention runs at any cache size ...
MGPU_MIN_CACHE = 16384  # ... and the cache capacity from which it runs fewer rows too


def _mgpu_attention(kernels: str, q, k_cache, k_new, layer=None) -> bool:
    """Tree and prefill attention run on the Mosaic GPU kernels (tree_attention_mgpu.py, prefill_attention_mgpu.py)
    on the Pallas path of a Hopper GPU where they take the inputs (bf16 / fp16, head dim a multiple of 64) and the
    shape is one they won, on the Triton kernels otherwise (fp32; interpret mode on a CPU). H200 A/B (2026-12-01,
    benchmarks/ab_tree_attention.py; BENCHMARKS.md session 9), tree attention over 16 layers: T = 65 at 4K / 32K /
    128K 0.46 / 1.86 / 7.17 ms vs Triton 0.63 / 3.41 / 12.64, T = 32 at 4K 0.39 vs 0.42; T = 16 won at 32K / 128K
    (0.87 / 2.32 vs 1.02 / 3.19) but lost at 4K (0.40 vs 0.35: the jnp fold / merge around the kernel), so below
    MGPU_MIN_ROWS rows (the decode step's 1, a chain's 16, 16 slots' 8) it takes caches of MGPU_MIN_CACHE rows and
    more only. Causal prefill, a 2048-row chunk per layer at start 0 / 32K / 120K: 0.136 / 2.47 / 9.45 vs 0.150 /
    3.74 / 13.56 ms. layer: k_cache is the stacked [L, B, Hkv, S, hd] of every layer (its per-layer S decides)."""
    if not is_pallas(kernels) or not _hopper():
        return False
    if q.shape[1] < MGPU_MIN_ROWS and k_cache.shape[2 if layer is None else 3] < MGPU_MIN_CACHE:
        return False
    from kernels_pallas import tree_attention_mgpu
    return tree_attention_mgpu.supports(q, k_cache) and k_new.dtype == q.dtype


def tree_attention(q, k_cache, v_cache, start, k_new, v_new, mask, kernels="xla", *, layer=None):
    """q [B,T,H,hd] attends to cache rows [0, start) and to new rows j with mask[b,i,j] -> [B,T,H,hd]. layer (an
    int32 scalar): the caches are the stacked [L,B,Hkv,S,hd] of every layer, layer `layer`'s read (in place by the
    kernels: a `lax.scan` over layers passes the whole stack)."""
    args = (q, k_cache, v_cache, start, k_new, v_new, mask)
    from kernels_pallas.attention_reference import tree_attention_reference
    if _check(kernels) == "pallas":
        from kernels_pallas import tree_attention as ta
        if _mgpu_attention(kernels, q, k_cache, k_new, layer):
            from kernels_pallas import tree_attention_mgpu
            return tree_attention_mgpu.tree_attention(*args, layer=layer)
        return _pallas_or(lambda: tree_attention_reference(*args, layer=layer),
                          lambda: ta.tree_attention(*args, layer=layer))
    return tree_attention_reference(*args, layer=layer)


def prefill_attention(q, k_cache, v_cache, start, k_new, v_new, kernels="xla", *, layer=None):
    """Causal sequence pass: q [B,T,H,hd] at positions [start, start+T) attends to cache rows [0, start) and
    to new rows j <= t -> [B,T,H,hd] (= tree_attention with the causal mask; no mask is built or read). layer:
    as in `tree_attention`."""
    args = (q, k_cache, v_cache, start, k_new, v_new)
    from kernels_pallas.attention_reference import prefill_attention_reference
    if _check(kernels) == "pallas":
        from kernels_pallas import prefill_attention as pa
        if _mgpu_attention(kernels, q, k_cache, k_new, layer):
            from kernels_pallas import prefill_attention_mgpu
            return prefill_attention_mgpu.prefill_attention(*args, layer=layer)
        return _pallas_or(lambda: prefill_attention_reference(*args, layer=layer),
                          lambda: pa.prefill_attention(*args, layer=layer))
    return prefill_attention_reference(*args, layer=layer)


def gdn_chunked(q, k, v, g, beta, state, kernels="xla", *, layer=None):
    """layer (an int32 scalar): state is the layers' stacked states [L,B,Hv,dk,dv], read and returned whole with
    layer `layer` updated (`gdn_reference.gdn_chunked`)."""
    if _check(kernels) == "pallas":
        from kernels_pallas import gdn_prefill
        return _pallas_or(lambda: gdn_reference.gdn_chunked(q, k, v, g, beta, state, layer=layer),
                          lambda: gdn_prefill.gdn_chunked(q, k, v, g, beta, state, layer=layer))
    return gdn_reference.gdn_chunked(q, k, v, g, beta, state, layer=layer)


def gdn_masked_block(q, k, v, g, beta, mask, state, kernels="xla", max_depth: int | None = None, *, layer=None):
    """max_depth (optional, static): no root path of `mask` has more nodes (DDTree: the drafter's block
    size); the Pallas kernel uses it only to bound its solve loop. The result does not depend on it.
    layer (an int32 scalar): state is the layers' stacked states [L,B,Hv,dk,dv], of which layer `layer` is read."""
    if _check(kernels) == "pallas":
        from kernels_pallas import gdn_tree
        return _pallas_or(lambda: gdn_reference.gdn_masked_block(q, k, v, g, beta, mask, state, layer=layer),
                          lambda: gdn_tree.gdn_masked_block(q, k, v, g, beta, mask, state, layer=layer,
                                                            max_depth=max_depth))
    return gdn_reference.gdn_masked_block(q, k, v, g, beta, mask, state, layer=layer)


def gdn_decode_fused(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, kernels="xla", *,
                     num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int,
                     eps: float, layer=None):
    """One GDN decode step (T = 1) from the layer's fused projection row [q|k|v pre-conv | z | b | a] (or its
    unsummed split-K partials [S, B, P], `decode_row`) to the gated-norm output: conv + SiLU, l2norm, beta/g, the
    recurrent step, gated RMSNorm; -> (o [B,Hv,dv],
    conv_state [B,K-1,conv_dim], state [B,Hv,dk,dv]). See `gdn_reference.gdn_decode_fused`.
    layer (an int32 scalar): conv_state / state are the layers' stacked caches [L, ...], updated in place at
    `layer` and returned whole; conv_w / A_log / dt_bias / norm_w each the layer's own or (one more leading axis,
    by ndim) the layers' stack, read at `layer` (in the kernel: no slice copied)."""
    dims = dict(num_k_heads=num_k_heads, num_v_heads=num_v_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                conv_kernel=conv_kernel, eps=eps, layer=layer)
    if _check(kernels) == "pallas":
        from kernels_pallas import gdn_decode_fused as fused
        args = (proj, conv_state, conv_w, A_log, dt_bias, norm_w, state)
        return _pallas_or(lambda: gdn_reference.gdn_decode_fused(*args, **dims),
                          lambda: fused.gdn_decode_fused(*args, **dims))
    return gdn_reference.gdn_decode_fused(proj, conv_state, conv_w, A_log, dt_bias, norm_w, state, **dims)


def gdn_commit(state, conv, k, W, g, x, path, path_len, kernels="xla"):
    """One GDN layer's commit of the accepted path from the verify stash -> (state, conv) (see
    `gdn_reference.gdn_commit`), on XLA for both paths: a one-kernel-per-layer Pallas commit lost to it on the H200
    (3.94 vs 1.43 ms per round, 2026-11-30) and was removed (git history: kernels_pallas/gdn_commit.py)."""
    _check(kernels)
    return gdn_reference.gdn_commit(state, conv, k, W, g, x, path, path_len)


def tree_select(top_lp, top_id, budget: int, kernels="xla"):
    """DDTree node selection from the per-depth top-K log-probs top_lp / tokens top_id [D, K] -> (tokens,
    parents, depths, valid) [budget] of the drafted nodes (`kernels_pallas.tree_build`, XLA on both paths)."""
    _check(kernels)
    from kernels_pallas import tree_build
    return tree_build.tree_select(top_lp, top_id, budget)


def attention_decode_prep(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, start, kernels="xla", *,
                          num_heads: int, num_kv_heads: int, head_dim: int, eps: float, layer=None):
    """An attention layer's decode step (T = 1) from its projection row (or its unsummed split-K partials
    [S, B, C], `decode_row`) to the attention's inputs: q/k norm, RoPE, the output gate's sigmoid, the KV-cache
    write at row `start`; -> (q [B,H,hd], sgate [B,H,hd], k [B,Hkv,hd], v [B,Hkv,hd], k_cache, v_cache). See
    `attention_reference.decode_attention_prep`. One Pallas kernel with kernels="pallas" (`Fusions.parts`), a
    bf16 cache and a power-of-two head_dim ≥ 16; the jnp reference otherwise. layer (an int32 scalar): the caches
    are the stacked [L, B, Hkv, S, hd] of every layer, the row written into layer `layer` (in place), the stacks
    returned whole; q_norm / k_norm may then also be the stacked [L, hd] (2-D), read at row `layer` inside the
    kernel (a slice fed to the custom call would be a copy kernel of its own)."""
    fusions = _fusions(kernels)
    dims = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, eps=eps, layer=layer)
    args = (qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, start)
    from kernels_pallas.attention_reference import decode_attention_prep
    if (fusions is not None and fusions.parts and k_cache.dtype == jnp.bfloat16 and head_dim >= 16
            and head_dim & (head_dim - 1) == 0):
        from kernels_pallas import attention_decode
        return _pallas_or(lambda: decode_attention_prep(*args, **dims),
                          lambda: attention_decode.decode_attention_prep(*args, **dims))
    return decode_attention_prep(*args, **dims)


# ------------------------------------------------------------------------------------ projections: pick, then run
FORMATS = ("bf16", "fp32", "w8a8")


class Choice(NamedTuple):
    """A projection's kernel (`pick`): "gemv" (the Pallas bf16 weight-streaming GEMV, kernels_pallas/dense.py),
    "dense_mgpu" (the bf16 skinny GEMM on wgmma for a stacked weight's layer, kernels_pallas/dense_mgpu.py),
    "xla" (XLA's einsum), "w8a8_mgpu" (the W8A8 block FP8 kernel on Hopper's fp8 wgmma, kernels_pallas/w8a8_mgpu.py),
    "w8a8" (the Pallas-Triton W8A8 kernel, kernels_pallas/w8a8.py: other GPUs) or "w8a8_ref" (their jnp reference:
    the same function on XLA). For "gemv": `fused`, the gate in its prologue and the residual in its
    epilogue (else the same ops as XLA kernels around it); `partials`, its split-K partials go unsummed to the
    consumer kernel of a decode step's first projection (`decode_row`)."""
    kernel: str
    fused: bool = False
    partials: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's weight of a stack, not sliced: layer `index` (an int32 scalar array, traced in a `lax.scan`
    over layers; the same for every slot under vmap) of `stacked` [L, ...]. `dense` / `decode_row` take it as w,
    and as an FP8 weight's q (`Fp8.scale` then a Layer of the scale stack at the same index; `Fp8.tail` None or a
    Layer): the weight kernels ("gemv", "w8a8_mgpu", "w8a8") get the whole stack and read layer `index` in place
    (XLA copies a dynamic slice that feeds a custom call or a cuBLAS GEMM: the whole weight, every layer); XLA's
    einsum and the references take the slice `get()`. shape / dtype / ndim are the layer's; `[...]` is the Layer
    itself (`nnx.Param(layer)[...]` in the modules)."""
    stacked: jax.Array
    index: jax.Array

    @property
    def shape(self) -> tuple:
        return self.stacked.shape[1:]

    @property
    def dtype(self):
        return self.stacked.dtype

    @property
    def ndim(self) -> int:
        return self.stacked.ndim - 1

    def get(self) -> jax.Array:
        """The layer's weight as a plain array: stacked[index] (a slice)."""
        return jax.lax.dynamic_index_in_dim(self.stacked, self.index, keepdims=False)

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("Layer supports only [...]; get() its slice first")


def plain(w):
    """w as a plain array: a Layer's slice (XLA's einsum, the references, XLA ops that fuse the dynamic slice into
    their consumer), anything else itself."""
    return w.get() if isinstance(w, Layer) else w


def stack_at(w, layer):
    """A parameter as a kernel that reads it at `layer` takes it: a Layer view at that layer -> its whole stack
    (read in place: XLA copies a slice that feeds a custom call); with no layer (an unscanned call) or another
    index, `plain(w)`."""
    if isinstance(w, Layer) and layer is not None and w.index is layer:
        return w.stacked
    return plain(w)


def _gemv_weight(w, K: int) -> tuple[jax.Array, dict]:
    """The GEMV's weight operand for w as [K, N] and its keyword arguments: a Layer's whole stack [L, K, N] (a
    reshape, no copy) with layer= (read in place)."""
    if isinstance(w, Layer):
        return w.stacked.reshape(w.stacked.shape[0], K, -1), dict(layer=w.index)
    return w.reshape(K, -1), {}


class Fp8(NamedTuple):
    """The rest of an FP8 weight whose e4m3 values q [N, K] (the checkpoint's layout) `dense` takes as w:
    scale fp32 [ceil(N / block_out), ≥ ceil(K / block_in)] (block scales), tail None or the trailing plain columns
    [K, n_tail] of a 2-D weight, shape the parameter's logical shape (contracted axes first, tail included;
    jaxddtree/model/fp8.py's `Fp8Weight`). With q a `Layer`: scale a Layer of the scale stack [L, Nb, C] at q's
    index (the kernels read it in place; its columns padded as the model stores them), tail None or a Layer."""
    scale: jax.Array
    tail: jax.Array | None
    block_in: int
    block_out: int
    shape: tuple


def weight_format(x_dtype, w_dtype) -> str:
    """The format `pick` reads: "w8a8" (an fp8 e4m3 weight: W8A8 with bf16 / fp32 activations), "bf16" (bf16
    activations and weight), "fp32" (any other plain pair: XLA's einsum in the activations' dtype)."""
    if jnp.dtype(w_dtype) == jnp.float8_e4m3fn:
        if jnp.dtype(x_dtype) not in (jnp.bfloat16, jnp.float32):
            raise ValueError(f"FP8 weights take bf16 or float32 activations, not {jnp.dtype(x_dtype).name}")
        return "w8a8"
    return "bf16" if jnp.dtype(x_dtype) == jnp.dtype(w_dtype) == jnp.bfloat16 else "fp32"


MGPU_DENSE_MAX_ROWS = 256  # stacked bf16 weights: dense_mgpu up to this many rows (one row tile), XLA above


def pick(fmt: str, rows: int, cols: int, kernels: str = "xla", *, block_in: int = 128, block_out: int = 128,
         depth: int = 0, gemv_rows: int = 1, gemv_cols: int = 2048, stacked: bool = False) -> Choice:
    """The one place a projection's kernel is chosen, from the weight format `fmt` (`weight_format`), the rows and
    output columns of the flattened [rows, K] x [K, cols] problem and `kernels` (block_in / block_out: an FP8
    weight's blocks; depth: K); the projection code runs what it returns and reads no other switch.
      w8a8: with kernels="pallas" (any row count: decode, verify, prefill): "w8a8_mgpu" on a Hopper GPU where the
            Mosaic GPU kernel takes the problem (`w8a8_mgpu.supports`: 128-wide input blocks, output blocks and N
            multiples of 64, K of 16: every 27B projection), else "w8a8" (the Triton kernel; a CPU runs it in
            interpret mode) where a power-of-two K chunk ≥ 16 divides block_in (`w8a8.applies`), else
            "w8a8_ref": the same W8A8 numerics everywhere. H200 (2026-12-03, BENCHMARKS.md "Session 16"): the
            Triton kernel's fp8 dots run on f16 mma.sync, the Mosaic one's on fp8 wgmma;
      bf16: "gemv" with kernels="pallas", 1..gemv_rows rows and ≥ gemv_cols outputs (the decode step's
            projections), fused / partials as the kernels' `Fusions` say; else, for a `stacked` weight (a `Layer`
            of the model's layer-group scan, whose slice XLA would copy) with kernels="pallas" and up to
            MGPU_DENSE_MAX_ROWS rows: "dense_mgpu" (kernels_pallas/dense_mgpu.py, bf16 wgmma reading the layer in
            place) on a Hopper GPU where it takes the shape (N and K multiples of 64), else "gemv" (the Triton
            kernel reads the layer in place too); else "xla";
      fp32: "xla".
    gemv_rows / gemv_cols: the H200 sweep (benchmarks/bench_gemv.py, 2026-11-29): 1.04-1.22x XLA's GEMVs for the
    27B projections at M = 1, 0.97x for 1024-wide outputs, 0.79-0.86x at M = 65 (verify); every 27B decode-step
    projection is ≥ 5120 wide (the narrow k / v / b / a are columns of the fused w_qkv / w_in). Tests widen them
    (`functools.partial(pick, gemv_rows=..., gemv_cols=...)` in place of `ops.pick`) to reach the GEMV at tiny
    shapes; nothing else overrides them."""
    fusions = _fusions(kernels)
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format '{fmt}' (one of {FORMATS})")
    if fmt == "w8a8":
        from kernels_pallas import w8a8, w8a8_mgpu
        if fusions is None or rows <= 0 or cols <= 0:
            return Choice("w8a8_ref")
        if _hopper() and w8a8_mgpu.supports(rows, depth, cols, block_in, block_out) is None:
            return Choice("w8a8_mgpu")
        return Choice("w8a8" if w8a8.applies(block_in) else "w8a8_ref")
    if fusions is not None and fmt == "bf16" and 0 < rows <= gemv_rows and cols >= gemv_cols:
        return Choice("gemv", fused=fusions.parts, partials=fusions.parts and fusions.partials)
    if fusions is not None and fmt == "bf16" and stacked and 0 < rows <= MGPU_DENSE_MAX_ROWS:
        from kernels_pallas import dense_mgpu
        if _hopper() and dense_mgpu.supports(rows, depth, cols) is None:
            return Choice("dense_mgpu")
        return Choice("gemv", fused=fusions.parts)
    return Choice("xla")


def _problem(spec: str, x, w_shape) -> tuple[int, int, int, int]:
    """(nc, rows, K, N) of einsum(spec, x, w) flattened to [rows, K] x [K, N]: nc contracted axes, x's trailing
    ones against w's leading ones in order, the rest kept in order (every projection of the model); ValueError
    for any other spec."""
    lhs, out = spec.split("->")
    xs, ws = lhs.split(",")
    contracted = "".join(c for c in xs if c in ws and c not in out)
    nc = len(contracted)
    if not (len(ws) == len(w_shape) and len(xs) == x.ndim and xs.endswith(contracted) and ws.startswith(contracted)
            and out == xs[:len(xs) - nc] + ws[nc:]):
        raise ValueError(f"projection spec '{spec}' must contract x's trailing axes with w's leading ones")
    return nc, math.prod(x.shape[:x.ndim - nc]), math.prod(w_shape[:nc]), math.prod(w_shape[nc:])


def dense(spec: str, x, w, kernels="xla", *, norm=None, gate=None, residual=None, reduce=None,
          fp8: Fp8 | None = None, gated_norm=None, normed=None, then_norm=None):
    """einsum(spec, x, W) accumulated in fp32, rounded once to x's dtype, for specs that contract x's trailing
    axes with W's leading ones (every projection of the model: "btd,dc->btc", "bthe,hed->btd", ...). W = w (bf16 /
    fp32), or the FP8 weight of e4m3 values w and `fp8` (scales, tail), with transformers' W8A8 block FP8
    numerics (kernels_pallas/w8a8.py). The kernel is `pick`'s, chosen for the rows the call sees.

    Parts of a decoder layer around the projection (the same ops and roundings on every kernel):
      norm = (w_n, eps): x -> rms_norm_1p(x, w_n, eps) first (the layer's input / post / final norm);
      gate (x's shape): x -> rounded(x · gate) first (attention's output gate);
      gated_norm = (z, w_n, eps): x -> gated_rms_norm(rounded(x, z.dtype), z, w_n, eps) first, over x's last axis
        (the GDN mixer's norm of its core's output x [..., H, E], any float dtype, with its gate z [..., H, E]; the
        activations' dtype is then z's); or (zrows, w_n, eps, z_offset): z the columns [z_offset, z_offset + H·E) of
        the wider zrows [..., P] (x's leading axes; the GDN's fused input projection: `gated_rms_norm_rows` reads
        them in place, XLA's ops slice them);
      residual (the output's shape): y -> rounded(residual + y);
      reduce: a mesh axis (tensor parallelism): the fp32 partial products are summed over it (`psum`: one
        all-reduce) before the rounding and the residual add (plain weights only).
    The GEMV with `Choice.fused` computes the gate in its prologue and the residual in its epilogue.

    The next projection's input norm (the Pallas path's verify, issue 41):
      then_norm = (w_n, eps) (with residual; plain weights, no reduce): returns (y, h), h = the rows of
        rms_norm_1p(y, w_n, eps) as `rms_norm.rms_norm_rows` writes them ([rows rounded up to 8, N], zero rows after
        y's), for the next projection's `normed=`. On dense_mgpu the GEMM's split-K partials go
        unsummed into ONE kernel that adds them and the residual and norms the sum (`rms_norm.add_rms_norm_rows`:
        no XLA fusion between the kernels); elsewhere h is XLA's ops on y (dead unless a consumer reads it);
      normed (with norm; x its value): those rows, read by a dense_mgpu GEMM in place of its norm kernel (every
        other kernel, and a batched round's folded call, norms x itself).

    w (or an FP8 weight's q) may be a `Layer` (one layer of a stack, in a scan over layers): the weight kernels
    read it in place, XLA's einsum and the references take its slice.

    Under jax.vmap (the slot axis of batched rounds, speculative/batch.py) with kernels="pallas": one call on the
    rows of all slots (`fold_rows`), its kernel picked for them, so the weights are streamed once."""
    if then_norm is not None and (residual is None or reduce is not None):
        raise ValueError("then_norm needs a residual and no reduce")
    if gated_norm is not None and len(gated_norm) == 3:
        gated_norm = (*gated_norm, None)
    if fp8 is not None and gated_norm is not None:
        x, gated_norm = _gated_norm(x, gated_norm), None
    if fp8 is not None:
        return _then(_dense_fp8(spec, x, w, fp8, kernels, norm=norm, gate=gate, residual=residual, reduce=reduce),
                     then_norm)
    act = x.dtype if gated_norm is None else gated_norm[0].dtype
    res = None if reduce is not None else residual  # tensor parallelism: added once, after the sum
    if _check(kernels) == "pallas":
        nw, eps = norm if norm is not None else (None, None)
        z, gw, geps, zoff = gated_norm if gated_norm is not None else (None, None, None, None)
        tw, teps = then_norm if then_norm is not None else (None, None)

        def f(acts, weights):
            x_, gate_, residual_, z_, normed_ = acts
            w_, nw_, gw_, tw_ = weights
            return _project(spec, x_, w_, kernels, None if nw_ is None else (nw_, eps), gate_, residual_,
                            partial=reduce is not None, gated_norm=None if z_ is None else (z_, gw_, geps, zoff),
                            normed=normed_, then_norm=None if tw_ is None else (tw_, teps))
        y = fold_rows(f, (x, gate, res, z, normed), (w, nw, gw, tw),
                      rule=None if normed is None and then_norm is None else _fold_normed(f, teps))
    else:
        y = _project(spec, x, w, kernels, norm, gate, res, partial=reduce is not None, gated_norm=gated_norm,
                     then_norm=then_norm)
    if then_norm is not None:
        return rounded(y[0], act), y[1]
    if reduce is None:
        return rounded(y, act)
    y = rounded(jax.lax.psum(y, reduce), act)
    return y if residual is None else rounded(f32(residual) + f32(y), residual.dtype)


def decode_row(x, w, kernels="xla", *, norm=None, fp8: Fp8 | None = None):
    """A decode step's first projection x [B, 1, K] @ W [K, N] ("btd,dc->btc"; W as in `dense`) for the layer's
    consumer kernel (`gdn_decode_fused`, `attention_decode_prep`, which take either form): where `pick` chooses the
    GEMV with partials, its split-K partial sums unsummed, [S, B, N] (fp32; S = 1: already rounded to x's dtype),
    which the consumer adds up in order (no XLA kernel between the two); else the rows [B, N] (`dense`). norm as
    in `dense` (applied before the kernel)."""
    spec = "btd,dc->btc"
    _, rows, K, N = _problem(spec, x, w.shape if fp8 is None else fp8.shape)
    fmt = weight_format(x.dtype, w.dtype)
    if fp8 is not None or not pick(fmt, rows, N, kernels).partials:
        return dense(spec, x, w, kernels, norm=norm, fp8=fp8)[:, 0]
    nw, eps = norm if norm is not None else (None, 1e-6)

    def f(acts, weights):
        x_, = acts
        w_, nw_ = weights
        if nw_ is not None:
            x_ = rms_norm_1p(x_, plain(nw_), eps)
        from kernels_pallas import dense as dense_kernel
        w2, layer = _gemv_weight(w_, K)
        return dense_kernel.dense(x_.reshape(-1, K), w2, reduce=False, **layer)

    def folded(acts, weights, like):
        # the rows of all slots (no longer one row: not the GEMV's domain for the consumer's fused op): `dense`
        # on them, handed over in the partials' layout (the sum as partial 0, zeros after it: the same sum)
        x_, = acts
        w_, nw_ = weights
        y = _project(spec, x_.reshape(1, -1, K), w_, kernels, None if nw_ is None else (nw_, eps), None, None)
        y = rounded(y[0], x_.dtype)
        return jnp.zeros(like.shape[:1] + y.shape, like.dtype).at[0].set(y.astype(like.dtype))
    return fold_rows(f, (x,), (w, nw), out_axis=1, rule=folded)


def swiglu_fuses(x, w_gate_up, w_down, kernels="xla") -> bool:
    """`mlp` runs the MLP of x [..., D] with the SwiGLU in its gate|up GEMM's epilogue: the Pallas path, plain
    bf16 weights of a stack (`Layer`s, the model's scan) and `pick` choosing dense_mgpu for x's rows (the verify's
    65; not a decode step's one row, whose GEMVs keep the MLP as `dense`, SwiGLU, `dense`)."""
    f = _fusions(kernels)
    if not (f is not None and f.swiglu and isinstance(w_gate_up, Layer) and isinstance(w_down, Layer)):
        return False
    D, _, F = w_gate_up.shape
    return _swiglu_mgpu(x.dtype, w_gate_up.dtype, math.prod(x.shape[:-1]), D, 2 * F, kernels)


def _swiglu_mgpu(dtype, w_dtype, rows: int, K: int, N: int, kernels: str) -> bool:
    """The gate|up projection of `rows` rows runs on dense_mgpu's SwiGLU GEMM (`dense_mgpu.swiglu_supports`)."""
    if pick(weight_format(dtype, w_dtype), rows, N, kernels, depth=K, stacked=True).kernel != "dense_mgpu":
        return False
    from kernels_pallas import dense_mgpu
    return dense_mgpu.swiglu_supports(-(-rows // 8) * 8, K, N) is None


def mlp(x, w_gate_up, w_down, kernels="xla", *, norm=None, residual=None, normed=None, then_norm=None):
    """The SwiGLU MLP down(swiglu(gate_up(x))) of x [..., D] (jaxddtree/model/mlp.py; `swiglu_fuses` says when
    the model calls it): w_gate_up a `Layer` of [D, 2, F] weights, w_down of [F, D]; norm = (w_n, eps) and
    residual as in `dense`. On dense_mgpu the input norm writes whole 8-row groups (`rms_norm.rms_norm_rows`),
    the gate|up GEMM rounds both halves and writes silu(gate) · up in its epilogue (`dense_mgpu.swiglu_mgpu`) and
    the down GEMM reads those rows as they are: no XLA kernel between the GEMMs (the SwiGLU + pad fusion was
    64 × 4.0 µs of an H100 round, session 30). Where `pick` chooses another kernel for the rows (a batched
    round's folded slots past the kernel's rows), `dense`, SwiGLU, `dense`: the same values either way. normed /
    then_norm as in `dense` (the down GEMM's residual add in the next norm's kernel)."""
    from kernels_pallas.numerics import swiglu
    if then_norm is not None and residual is None:
        raise ValueError("then_norm needs a residual")
    nw, eps = norm if norm is not None else (None, None)
    tw, teps = then_norm if then_norm is not None else (None, None)
    act = x.dtype

    def f(acts, weights):
        x_, res_, normed_ = acts
        wgu, wd, nw_, tw_ = weights
        lead, D = x_.shape[:-1], x_.shape[-1]
        rows, F = math.prod(lead), wd.shape[0]
        norm_ = None if nw_ is None else (nw_, eps)
        then_ = None if tw_ is None else (tw_, teps)
        if not _swiglu_mgpu(act, wgu.dtype, rows, D, 2 * F, kernels):
            gu = dense("btd,dgf->btgf", x_.reshape(1, rows, D), wgu, kernels, norm=norm_, normed=normed_)
            h = swiglu(gu[..., 0, :], gu[..., 1, :], act)
            res2 = None if res_ is None else res_.reshape(1, rows, D)
            out = dense("btf,fd->btd", h, wd, kernels, residual=res2, then_norm=then_)
            return out.reshape(x_.shape) if then_ is None else (out[0].reshape(x_.shape), out[1])
        from kernels_pallas import dense_mgpu
        x2 = normed_ if normed_ is not None and norm_ is not None else _norm_rows(x_.reshape(rows, D), norm_)
        if x2.shape[0] % 8:  # (no norm) the SwiGLU GEMM takes whole 8-row groups
            x2 = jnp.pad(x2, ((0, -rows % 8), (0, 0)))
        wgu2, lg = _gemv_weight(wgu, D)
        h = dense_mgpu.swiglu_mgpu(x2, wgu2, **lg)  # [rows rounded up to 8, F]
        wd2, ld = _gemv_weight(wd, F)
        res2 = None if res_ is None else res_.reshape(rows, D)
        if then_ is not None:
            y, hn = _add_norm(dense_mgpu.dense_mgpu(h, wd2, rows=rows, partials=True, **ld), res2, then_)
            return y.reshape(x_.shape), hn
        return _then(_finish(dense_mgpu.dense_mgpu(h, wd2, rows=rows, **ld), act, res2, False).reshape(x_.shape),
                     then_)
    y = fold_rows(f, (x, residual, normed), (w_gate_up, w_down, nw, tw),
                  rule=None if normed is None and then_norm is None else _fold_normed(f, teps))
    return rounded(y, act) if then_norm is None else (rounded(y[0], act), y[1])


def fold_rows(f, acts, weights, out_axis: int = 0, rule=None):
    """f(acts, weights) for one projection: acts (a tuple of activations or None: x and what has its rows, e.g.
    gate / residual) lead with the rows' axes, weights (a tuple of arrays or None) do not. Under jax.vmap
    (a batched round's slot axis, in front of every batched activation) with unbatched weights: ONE call of f on
    the slot axis folded into the activations' first axis (its kernel then picked for the B·rows; pallas_call's
    own batching rule would run the kernel once per slot and stream the weights B times); the output's axis
    `out_axis` holds the rows. `rule(acts, weights, like)` (optional) computes the folded call instead (like: the
    per-slot output's ShapeDtypeStruct, or a tuple of them: each folded output is then unfolded by its own per-slot
    shape). Batched weights: plain vmap of f (a `Layer` counts as batched when its stack or its index is; a scan's
    layer index is the same for every slot)."""
    fn = jax.custom_batching.custom_vmap(f)

    @fn.def_vmap
    def _rule(axis_size, in_batched, acts, weights):
        acts_b, weights_b = in_batched
        if any(jax.tree.leaves(weights_b)):
            axes = jax.tree.map(lambda b: 0 if b else None, in_batched)
            return jax.vmap(f, in_axes=tuple(axes))(acts, weights), True
        per_slot = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape[1:] if b else a.shape, a.dtype)
                         for a, b in zip(acts, acts_b))

        def fold(a, b):
            if a is None:
                return None
            a = a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            return a.reshape((axis_size * a.shape[1],) + a.shape[2:])
        folded = tuple(fold(a, b) for a, b in zip(acts, acts_b))
        if rule is None:  # one output, its rows on axis out_axis: as many per slot as the acts' first axis
            y = f(folded, weights)
            lead = next(a.shape[0] for a in per_slot if a is not None)
            y = y.reshape(y.shape[:out_axis] + (axis_size, lead) + y.shape[out_axis + 1:])
            return jnp.moveaxis(y, out_axis, 0), True
        like = jax.eval_shape(f, per_slot, weights)
        y = rule(folded, weights, like)

        def unfold(o, l):  # a folded output -> [slots, its per-slot shape] (its rows on axis out_axis)
            o = o.reshape(l.shape[:out_axis] + (axis_size, l.shape[out_axis]) + l.shape[out_axis + 1:])
            return jnp.moveaxis(o, out_axis, 0)
        return jax.tree.map(unfold, y, like), jax.tree.map(lambda _: True, y)
    return fn(acts, weights)


def _fold_normed(f, eps):
    """`fold_rows`' rule for `dense` / `mlp` (acts end with normed, weights with then_norm's w_n, eps its epsilon):
    the folded call on the rows of all slots norms x itself (the per-slot `normed` rows, 8-row groups per slot, are
    not the folded GEMM's rows) and, with then_norm, returns each slot's h from XLA's ops on its y (dead unless
    read)."""
    def rule(acts, weights, like):
        out = f(acts[:-1] + (None,), weights[:-1] + (None,))
        if weights[-1] is None:
            return out
        y_like, h_like = like
        slots = out.shape[0] // y_like.shape[0]
        hs = jax.vmap(lambda y1: _norm_rows_ref(y1, (weights[-1], eps)))(out.reshape((slots,) + y_like.shape))
        return out, hs.reshape((slots * h_like.shape[0],) + h_like.shape[1:])
    return rule


def _norm_rows(x2, norm):
    """A dense_mgpu GEMM's input x2 [rows, K]: with norm = (w_n, eps) the norm kernel's output, whole 8-row groups
    (`rms_norm.rms_norm_rows`, w_n read from its stack: no slice, no pad before the GEMM), else x2."""
    if norm is None:
        return x2
    from kernels_pallas import rms_norm
    nw, lw = _stack_of(norm[0])
    return rms_norm.rms_norm_rows(x2, nw, eps=norm[1], rows_to=8, **lw)


def _norm_rows_ref(y, norm):
    """`rms_norm.rms_norm_rows_reference` of y [..., N] (its rows flattened) with norm = (w_n, eps): XLA's ops."""
    from kernels_pallas import rms_norm
    return rms_norm.rms_norm_rows_reference(y.reshape(-1, y.shape[-1]), plain(norm[0]), eps=norm[1])


def _add_norm(parts, residual2, norm):
    """A GEMM's unsummed partials [S, rows, N] + the residual [rows, N], then the next input norm = (w_n, eps), in one
    kernel (`rms_norm.add_rms_norm_rows`, w_n read from its stack) -> (the new residual [rows, N], the normed rows)."""
    from kernels_pallas import rms_norm
    nw, lw = _stack_of(norm[0])
    return rms_norm.add_rms_norm_rows(parts, residual2, nw, eps=norm[1], rows_to=8, **lw)


def _stack_of(w) -> tuple[jax.Array, dict]:
    """A small parameter as a kernel reads it: a Layer's whole stack and layer= (read in place), else w."""
    return (w.stacked, dict(layer=w.index)) if isinstance(w, Layer) else (w, {})


def _gated_norm(x, gated_norm):
    """`dense`'s gated_norm part on XLA's ops (module docstring of `dense`; gated_norm with its z_offset or None)."""
    z, gw, eps, zoff = gated_norm
    if zoff is not None:
        z = z[..., zoff:zoff + math.prod(x.shape[-2:])].reshape(x.shape)
    return gdn_reference.gated_rms_norm(rounded(x, z.dtype), z, plain(gw), eps)


def _project(spec: str, x, w, kernels: str, norm, gate, residual, partial: bool = False, gated_norm=None,
             normed=None, then_norm=None):
    """A plain-weight projection with its parts on `pick`'s kernel -> y rounded once to the activations' dtype (x's,
    or with gated_norm z's; an XLA GEMM writes it from its fp32 accumulator: round to nearest even, the value
    `rounded` gives, without a fusion of its own), or with residual the rounded sum rounded(residual + y). partial
    (tensor parallelism: a partial product, summed before its rounding): the unrounded fp32 product instead.
    normed / then_norm: `dense`'s (with then_norm: (y, h))."""
    act = x.dtype if gated_norm is None else gated_norm[0].dtype
    nc, rows, K, N = _problem(spec, x, w.shape)
    choice = pick(weight_format(act, w.dtype), rows, N, kernels, depth=K, stacked=isinstance(w, Layer))
    mgpu = choice.kernel == "dense_mgpu"  # its input norms run as one kernel each (module `rms_norm`)
    E = 0 if gated_norm is None else gated_norm[1].shape[-1]
    if gated_norm is not None and not (mgpu and E & (E - 1) == 0):
        x, gated_norm = _gated_norm(x, gated_norm), None  # XLA's ops (the kernel takes E a power of two)
    if norm is not None and not mgpu:
        x = rms_norm_1p(x, plain(norm[0]), norm[1])
    if mgpu:  # the norm weights read from their stacks, the rows written in whole 8-row groups (no pad before it)
        from kernels_pallas import dense_mgpu, rms_norm
        out_shape = x.shape[:x.ndim - nc] + w.shape[nc:]
        if normed is not None and norm is not None:  # the previous GEMM's add + norm kernel wrote them
            x2 = normed
        else:
            x2 = _norm_rows(x.reshape(rows, K), norm)
        if gated_norm is not None:
            z, gw, geps, zoff = gated_norm
            gw, lw = _stack_of(gw)
            x2 = rms_norm.gated_rms_norm_rows(x2, z.reshape(rows, -1), gw, eps=geps, rows_to=8, z_offset=zoff or 0,
                                              **lw)
        if gate is not None:  # whole 8-row groups: the pad inside the product's fusion, not a kernel before the GEMM
            x2 = jnp.pad(rounded(f32(x2[:rows]) * f32(gate.reshape(rows, K)), x2.dtype), ((0, -rows % 8), (0, 0)))
        w2, layer = _gemv_weight(w, K)
        if then_norm is not None:  # no XLA fusion between this GEMM and the next
            parts = dense_mgpu.dense_mgpu(x2, w2, rows=rows, partials=True, **layer)
            y, h = _add_norm(parts, residual.reshape(rows, N), then_norm)
            return y.reshape(out_shape), h
        y = dense_mgpu.dense_mgpu(x2, w2, rows=rows, **layer).reshape(out_shape)
        return _then(_finish(y, act, residual, partial), then_norm)
    if choice.kernel == "gemv":
        from kernels_pallas import dense as dense_kernel
        out_shape = x.shape[:x.ndim - nc] + w.shape[nc:]
        w2, layer = _gemv_weight(w, K)
        if choice.fused:
            y = dense_kernel.dense(x.reshape(rows, K), w2, None if gate is None else gate.reshape(rows, K),
                                   None if residual is None else residual.reshape(rows, -1), **layer)
            return _then(f32(y.reshape(out_shape)) if partial else y.reshape(out_shape), then_norm)
        if gate is not None:
            x = rounded(f32(x) * f32(gate), x.dtype)
        y = dense_kernel.dense(x.reshape(rows, K), w2, **layer).reshape(out_shape)
    else:
        if gate is not None:
            x = rounded(f32(x) * f32(gate), x.dtype)
        prec = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        y = jnp.einsum(spec, x, plain(w).astype(x.dtype), precision=prec,
                       preferred_element_type=jnp.float32 if partial else x.dtype)
    return _then(_finish(y, x.dtype, residual, partial), then_norm)


def _then(y, then_norm):
    """y, or with then_norm (y, its next input norm's rows on XLA's ops)."""
    return y if then_norm is None else (y, _norm_rows_ref(y, then_norm))


def _finish(y, dtype, residual, partial: bool):
    """A projection's output y: with residual the rounded sum rounded(residual + rounded(y)); partial: as fp32."""
    if residual is not None:
        y = rounded(f32(residual) + f32(rounded(y, dtype)), residual.dtype)
    return f32(y) if partial else y


def _dense_fp8(spec: str, x, q, fp8: Fp8, kernels: str, *, norm, gate, residual, reduce):
    """`dense` for an FP8 weight: norm and gate first, the W8A8 product (`_w8a8`; under vmap with kernels="pallas"
    one call on the rows of all slots), rounded, then the residual add."""
    if reduce is not None:
        raise ValueError("tensor parallelism of FP8 weights is not supported (use tp=1)")
    if any(isinstance(a, Layer) != isinstance(q, Layer) for a in (fp8.scale, fp8.tail) if a is not None):
        raise TypeError("an FP8 weight's q, scale and tail are all Layers (one layer of stacks) or none is")
    if norm is not None:
        x = rms_norm_1p(x, plain(norm[0]), norm[1])
    if gate is not None:
        x = rounded(f32(x) * f32(gate), x.dtype)
    if _check(kernels) == "pallas":
        y = fold_rows(lambda acts, ws: _w8a8(spec, acts[0], ws[0], fp8._replace(scale=ws[1], tail=ws[2]), kernels),
                      (x,), (q, fp8.scale, fp8.tail))
    else:
        y = _w8a8(spec, x, q, fp8, kernels)
    y = rounded(y, x.dtype)
    return y if residual is None else rounded(f32(residual) + f32(y), residual.dtype)


def _w8a8(spec: str, x, q, fp8: Fp8, kernels: str):
    """The W8A8 product of x and q [N, K] ⊙ scale [| tail] on `pick`'s kernel -> fp32 (the fp8 columns' values
    already rounded to x's dtype; the tail's an XLA product in fp32, concatenated). A Layer q: the kernel takes
    the stacks and layer= (the reference slices them)."""
    from kernels_pallas import w8a8, w8a8_mgpu
    nc, rows, K, N = _problem(spec, x, fp8.shape)
    Nq = q.shape[0]
    bi, bo = fp8.block_in, fp8.block_out
    choice = pick(weight_format(x.dtype, q.dtype), rows, Nq, kernels, block_in=bi, block_out=bo, depth=K)
    x2 = x.reshape(rows, K)
    kernel = {"w8a8_mgpu": w8a8_mgpu.w8a8_mgpu, "w8a8": w8a8.w8a8}.get(choice.kernel, w8a8.w8a8_reference)
    if isinstance(q, Layer):
        y = kernel(x2, q.stacked, fp8.scale.stacked, layer=q.index, block_in=bi, block_out=bo)
    else:
        y = kernel(x2, q, fp8.scale, block_in=bi, block_out=bo)
    y = y.astype(jnp.float32)
    lead = x.shape[:x.ndim - nc]
    if fp8.tail is not None:
        y = jnp.concatenate([y, jnp.dot(x2, plain(fp8.tail).astype(x.dtype), preferred_element_type=jnp.float32)],
                            axis=-1)
    return y.reshape(lead + tuple(fp8.shape[nc:]))
