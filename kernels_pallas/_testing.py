"""Random, realistic inputs for the kernel tests (tests/kernel_tests) and benchmarks/bench_kernels.py (never zeros)."""

from __future__ import annotations

import inspect

import numpy as np
import jax
import jax.numpy as jnp


def l2n(x, scale=1.0):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True) * scale


def random_tree_mask(rng: np.random.Generator, B: int, N: int, n_pad: int = 0):
    """Ancestor-or-self masks [B,N,N] of random trees (parent[i] < i); the last n_pad rows are padding
    (self only). Also returns a valid [B,N] bool (False on padding rows)."""
    masks, valid = [], []
    for _ in range(B):
        n_real = N - n_pad
        m = np.zeros((N, N), bool)
        for i in range(N):
            m[i, i] = True
            if 0 < i < n_real:
                p = int(rng.integers(0, i))
                m[i] |= m[p]
        masks.append(m)
        valid.append(np.arange(N) < n_real)
    return jnp.asarray(np.stack(masks)), jnp.asarray(np.stack(valid))


def gdn_inputs(key, B, N, Hk, Hv, dk, dv, *, valid=None, dtype=jnp.float32):
    """Prepared GDN inputs as the model produces them: q = l2norm·dk^-1/2, k = l2norm, g in [-2, 0),
    beta in (0, 1) (0 on padding rows), a random fp32 state."""
    ks = jax.random.split(key, 6)
    q = l2n(jax.random.normal(ks[0], (B, N, Hk, dk)), dk ** -0.5)
    k = l2n(jax.random.normal(ks[1], (B, N, Hk, dk)))
    v = jax.random.normal(ks[2], (B, N, Hv, dv))
    g = -2.0 * jax.random.uniform(ks[3], (B, N, Hv), minval=1e-3, maxval=1.0)
    beta = jax.random.uniform(ks[4], (B, N, Hv), minval=0.02, maxval=0.98)
    if valid is not None:
        beta = jnp.where(valid[..., None], beta, 0.0)
    state = 0.1 * jax.random.normal(ks[5], (B, Hv, dk, dv))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)) + (state.astype(jnp.float32),)


def gdn_decode_fused_inputs(key, B, Hk, Hv, dk, dv, K=4, *, dtype=jnp.bfloat16):
    """One GDN layer's decode-step inputs as `gdn_decode_fused` takes them (never zeros): the fused
    projection row [B, conv_dim + Hv·dv + 2·Hv], conv state [B, K-1, conv_dim], conv weights [K, conv_dim],
    A_log (decay rates 1..16), dt_bias, gated-norm weight (≈ 1), all in `dtype`, and an fp32 state."""
    cd = 2 * Hk * dk + Hv * dv
    ks = jax.random.split(key, 7)
    proj = jax.random.normal(ks[0], (B, cd + Hv * dv + 2 * Hv)).astype(dtype)
    conv_state = jax.random.normal(ks[1], (B, K - 1, cd)).astype(dtype)
    conv_w = (0.5 * jax.random.normal(ks[2], (K, cd))).astype(dtype)
    A_log = jnp.log(jax.random.uniform(ks[3], (Hv,), minval=1, maxval=16)).astype(dtype)
    dt_bias = jax.random.uniform(ks[4], (Hv,), minval=-1, maxval=1).astype(dtype)
    norm_w = (1.0 + 0.1 * jax.random.normal(ks[5], (dv,))).astype(dtype)
    state = 0.1 * jax.random.normal(ks[6], (B, Hv, dk, dv), jnp.float32)
    return proj, conv_state, conv_w, A_log, dt_bias, norm_w, state


def rel_err(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def attention_inputs(key, rng, B, T, H, Hkv, hd, S, start, *, dtype=jnp.bfloat16, n_pad=0):
    """(q, k_cache, v_cache, start, k_new, v_new, mask) with N = T new rows; mask = random tree
    (ancestor-or-self, last n_pad rows self only) when rng is given, else all-visible (T = N = 1 decode)."""
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (B, T, H, hd)).astype(dtype)
    kc = jax.random.normal(ks[1], (B, Hkv, S, hd)).astype(dtype)
    vc = jax.random.normal(ks[2], (B, Hkv, S, hd)).astype(dtype)
    kn = jax.random.normal(ks[3], (B, T, Hkv, hd)).astype(dtype)
    vn = jax.random.normal(ks[4], (B, T, Hkv, hd)).astype(dtype)
    if rng is not None:
        mask, _ = random_tree_mask(rng, B, T, n_pad)
    else:
        mask = jnp.ones((B, T, T), bool)
    return q, kc, vc, jnp.int32(start), kn, vn, mask


def stack_layers(key, x, L: int, layer: int):
    """x stacked over L layers [L, *x.shape] as a `lax.scan` over layers holds a cache: layer `layer` is x, the
    others random (x's dtype)."""
    return jax.random.normal(key, (L,) + x.shape).astype(x.dtype).at[layer].set(x)


def stacked_slots(one, seed: int, V: int | None, layer: int, L: int = 3):
    """Attention test inputs `one(seed)` (a tuple: q, k_cache, v_cache, ...) for V slots (stacked on a new axis; None:
    one request) and their caches stacked over L layers with them at `layer` -> (args, k stack, v stack); with V the
    stacks are [V, L, B, ...] (the slots' batched caches inside a scan over layers)."""
    slots = [one(seed + v) for v in range(V or 1)]
    args = tuple(jnp.stack(xs) for xs in zip(*slots)) if V else slots[0]
    kc, vc = (stack_layers(jax.random.PRNGKey(seed + i), args[i], L, layer) for i in (1, 2))
    if V:
        kc, vc = kc.swapaxes(0, 1), vc.swapaxes(0, 1)
    return args, kc, vc


def assert_kernel_signature(kernel, reference) -> list[str]:
    """The Pallas kernel takes its jnp reference's parameters first, in order, and `interpret=False`; returns the
    reference's parameter names."""
    ref = list(inspect.signature(reference).parameters)
    ker = inspect.signature(kernel).parameters
    assert list(ker)[:len(ref)] == ref and ker["interpret"].default is False, (list(ker), ref)
    return ref


def check_attention(out, reference, args):
    """An attention kernel's output vs its jnp reference on the same args: same shape / dtype, finite; fp32 within
    1e-5; bf16 within 1e-2 of both the bf16 reference (which rounds logits and probabilities) and exact fp32 math
    (the reference on the args upcast)."""
    ref = reference(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    if ref.dtype == jnp.float32:
        assert rel_err(out, ref) < 1e-5, rel_err(out, ref)
    else:
        up = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args)
        assert rel_err(out, reference(*up)) < 1e-2
        assert rel_err(out, ref) < 1e-2, rel_err(out, ref)


def triton_shared_bytes(f, *structs) -> list[tuple[str, int]]:
    """(name, bytes) of shared memory that Triton allocates for each Pallas kernel of jitted `f` lowered for the
    H200 (sm_90): each kernel's Triton IR is run through the installed `triton` package's passes up to its
    shared-memory allocation (no GPU, no PTX). The `triton` package (a dependency of the CUDA torch wheel, a
    test dependency) is not the Triton inside XLA, but allocates the same way: the 27B fp32 attention kernels
    gave 295424 here and on the H200. ImportError without `triton`."""
    import os
    import tempfile

    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptx_version_from_options
    from triton.compiler.compiler import IRSource, make_backend
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.triton import core as triton_core, lowering

    from kernels_pallas._common import lower_for_h200

    captured = []
    rule, platform = pallas_core._backend_lowering_rules[triton_core.CompilerParams]

    def capturing(ctx, *args, compiler_params=None, name=None, **kw):
        orig = lowering.lower_jaxpr_to_triton_module

        def lower(*a, **k):
            res = orig(*a, **k)
            p = compiler_params or triton_core.CompilerParams()
            captured.append((name, p.num_warps or 4, 3 if p.num_stages is None else p.num_stages,
                             res.module.operation.get_asm()))
            return res

        lowering.lower_jaxpr_to_triton_module = lower
        try:
            return rule(ctx, *args, compiler_params=compiler_params, name=name, **kw)
        finally:
            lowering.lower_jaxpr_to_triton_module = orig

    pallas_core._backend_lowering_rules[triton_core.CompilerParams] = (capturing, platform)
    jax.clear_caches()  # a kernel lowered before would come from the lowering cache, uncaptured
    try:
        lower_for_h200(f, *structs)
    finally:
        pallas_core._backend_lowering_rules[triton_core.CompilerParams] = (rule, platform)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    out = []
    for name, warps, stages, asm in captured:
        with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as fh:
            fh.write(asm)
        try:
            ctx = ir.context()
            src = IRSource(fh.name, ctx, backend)
            opts = backend.parse_options(dict(num_warps=warps, num_stages=stages))
            mod = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
        finally:
            os.unlink(fh.name)
        stage_fns = {}
        backend.add_stages(stage_fns, opts, src.language)
        meta = {}
        mod = stage_fns["ttgir"](stage_fns["ttir"](mod, meta), meta)
        pm = ir.pass_manager(mod.context)
        passes.ttgpuir.add_combine_tensor_select_and_if(pm)
        passes.ttgpuir.add_allocate_warp_groups(pm)
        passes.convert.add_scf_to_cf(pm)
        passes.gluon.add_inliner(pm)
        nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, get_ptx_version_from_options(opts, 90))
        pm.run(mod, "shared_memory")
        out.append((name, int(mod.get_int_attr("ttg.shared"))))
    return out
