"""A torch (fp32) emulation of transformers' FP8 forward for `activation_scheme: "dynamic"` checkpoints: the
reference the W8A8 tests compare jaxddtree with (tests/kernel_tests/test_w8a8.py, tests/test_fp8.py).

transformers' `FP8Linear.forward` (integrations/finegrained_fp8.py, 5.x) runs `fp8_linear` -> DeepGEMM or the
kernels-community `finegrained-fp8` Triton kernel `w8a8_block_dynamic_fp8_matmul_kernel`; per 128-wide (block
k) group of each token's features it computes, in fp32,
    a_s = max|a| / 448;  a_fp8 = (a / max(a_s, 1e-12)).to(e4m3)            (`fp8_act_quant_inline`)
    acc += tl.dot(a_fp8, b_fp8) * a_s[:, None] * b_s[None, :]             (b_s: the weight block's scale)
and stores acc in the input's dtype. Here the same steps run on the CPU: the e4m3 casts are torch's (round to
nearest even), each block's dot is an fp32 matmul of exactly representable values.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def act_quant(x: torch.Tensor, block_k: int):
    """x [M, K] -> (x_q fp8 [M, nb·block_k] zero-padded, s fp32 [M, nb])."""
    M, K = x.shape
    nb = -(-K // block_k)
    xp = torch.zeros(M, nb * block_k, dtype=torch.float32)
    xp[:, :K] = x.float()
    g = xp.view(M, nb, block_k)
    s = g.abs().amax(dim=-1) / FP8_MAX
    xq = (g / s.clamp(min=1e-12)[..., None]).to(FP8)
    return xq.view(M, nb * block_k), s


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """transformers' FP8Linear (no bias): x [..., K] (any float dtype), weight fp8 [N, K] (HF layout),
    scale_inv [ceil(N / bo), ceil(K / bi)], block = (bo, bi) -> [..., N] in x's dtype."""
    bo, bi = block
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    xq, s = act_quant(x2, bi)
    sw = scale_inv.float().repeat_interleave(bo, 0)[:N]  # [N, nb]
    w = weight.float()
    acc = torch.zeros(x2.shape[0], N, dtype=torch.float32)
    for b in range(s.shape[1]):
        k0, k1 = b * bi, min((b + 1) * bi, K)
        part = xq[:, k0:k1].float() @ w[:, k0:k1].T
        acc = acc + part * s[:, b:b + 1] * sw[None, :, b]
    return acc.to(x.dtype).reshape(*lead, N)


def patch_fp8_linears(model, fp8_sd: dict, block, skip=()):
    """Make every nn.Linear of `model` whose weight is fp8 in the checkpoint state dict `fp8_sd` (with its
    `weight_scale_inv`) run `w8a8_linear` — transformers' FP8 forward — unless its module name is in `skip`.
    Returns the names patched."""
    names = []
    for name, mod in model.named_modules():
        w = fp8_sd.get(name + ".weight")
        if not isinstance(mod, torch.nn.Linear) or w is None or w.dtype != FP8 or name in skip:
            continue
        inv = fp8_sd[name + ".weight_scale_inv"]
        mod.forward = (lambda w, inv: lambda x: w8a8_linear(x, w, inv, block))(w, inv)
        names.append(name)
    return names
