"""Test-only PyTorch reference for the DFlash drafter forward (written for these tests).

Built from transformers' Qwen3 blocks (Qwen3RMSNorm, Qwen3MLP, Qwen3RotaryEmbedding, apply_rotary_pos_emb) with
explicit eager attention and its own context K/V cache that grows by concatenation. It takes only the REAL
context rows (no padding). The sliding window is formulated like flash_attn (which the published drafter runs):
window_size=(w-1, w-1), causal=False, bottom-right aligned indices, applied only when key_length > w.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding,
                                                      apply_rotary_pos_emb)


class TorchDFlashReference:
    def __init__(self, path: str):
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        self.config = cfg = Qwen3Config(**raw)
        sd = load_file(os.path.join(path, "model.safetensors"))
        sd = {k[len("model."):] if k.startswith("model.") else k: v.float() for k, v in sd.items()}
        self.hd, self.nh, self.nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.block_size = raw["block_size"]
        self.mask_token_id = raw["dflash_config"]["mask_token_id"]

        def norm(dim, name):
            n = Qwen3RMSNorm(dim, eps=cfg.rms_norm_eps)
            n.weight.data.copy_(sd[name])
            return n

        self.fc = sd["fc.weight"]
        self.hidden_norm = norm(cfg.hidden_size, "hidden_norm.weight")
        self.norm = norm(cfg.hidden_size, "norm.weight")
        self.rotary = Qwen3RotaryEmbedding(cfg)
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            mlp = Qwen3MLP(cfg)
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(mlp, n).weight.data.copy_(sd[p + f"mlp.{n}.weight"])
            self.layers.append(dict(
                in_norm=norm(cfg.hidden_size, p + "input_layernorm.weight"),
                post_norm=norm(cfg.hidden_size, p + "post_attention_layernorm.weight"),
                q=sd[p + "self_attn.q_proj.weight"], k=sd[p + "self_attn.k_proj.weight"],
                v=sd[p + "self_attn.v_proj.weight"], o=sd[p + "self_attn.o_proj.weight"],
                q_norm=norm(self.hd, p + "self_attn.q_norm.weight"),
                k_norm=norm(self.hd, p + "self_attn.k_norm.weight"), mlp=mlp,
                window=cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None))
        self.k_cache = [None] * cfg.num_hidden_layers  # [B, nkv, T, hd], grows by concatenation
        self.v_cache = [None] * cfg.num_hidden_layers

    @property
    def cache_len(self) -> int:
        return 0 if self.k_cache[0] is None else self.k_cache[0].shape[2]

    def _attn(self, L, x, ctx, cos, sin, li):
        B, Bs, _ = x.shape
        C = ctx.shape[1]
        q = (x @ L["q"].T).view(B, Bs, self.nh, self.hd)
        q = L["q_norm"](q).transpose(1, 2)  # [B, nh, Bs, hd]
        k = torch.cat([ctx @ L["k"].T, x @ L["k"].T], 1).view(B, C + Bs, self.nkv, self.hd)
        v = torch.cat([ctx @ L["v"].T, x @ L["v"].T], 1).view(B, C + Bs, self.nkv, self.hd)
        k = L["k_norm"](k).transpose(1, 2)  # [B, nkv, C+Bs, hd]
        v = v.transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos[:, C:], sin[:, C:])
        _, k = apply_rotary_pos_emb(k, k, cos, sin)
        if self.k_cache[li] is not None:  # keys: [cached ctx | new ctx | block]
            k = torch.cat([self.k_cache[li], k], 2)
            v = torch.cat([self.v_cache[li], v], 2)
        self.k_cache[li], self.v_cache[li] = k[:, :, : k.shape[2] - Bs], v[:, :, : v.shape[2] - Bs]
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        w = (q @ k.transpose(2, 3)) * self.hd ** -0.5  # [B, nh, Bs, Tk]
        Tk = k.shape[2]
        if L["window"] is not None and Tk > L["window"]:
            qi = torch.arange(Bs)[:, None] + (Tk - Bs)  # bottom-right aligned query index
            kj = torch.arange(Tk)[None, :]
            left, right = L["window"] - 1, L["window"] - 1
            allowed = (kj >= qi - left) & (kj <= qi + right)
            w = w.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        o = (p @ v).transpose(1, 2).reshape(B, Bs, self.nh * self.hd)
        return o @ L["o"].T

    @torch.no_grad()
    def forward(self, target_hidden: torch.Tensor, block_embeds: torch.Tensor) -> torch.Tensor:
        """target_hidden [B, C, nT*H] (real rows only), block_embeds [B, Bs, H] -> hidden [B, Bs, H]."""
        C, Bs = target_hidden.shape[1], block_embeds.shape[1]
        start = self.cache_len
        pos = torch.arange(start, start + C + Bs)[None]
        cos, sin = self.rotary(block_embeds, pos)
        ctx = self.hidden_norm(target_hidden @ self.fc.T)
        h = block_embeds
        for li, L in enumerate(self.layers):
            h = h + self._attn(L, L["in_norm"](h), ctx, cos, sin, li)
            h = h + L["mlp"](L["post_norm"](h))
        return self.norm(h)

    def logits(self, target_hidden, root_token, embed_table, lm_head):
        """root_token [B]; embed_table [V, H]; lm_head [H, V] -> logits [B, Bs-1, V]."""
        B = root_token.shape[0]
        ids = torch.cat([root_token[:, None], torch.full((B, self.block_size - 1), self.mask_token_id)], 1)
        h = self.forward(target_hidden, embed_table[ids])
        return h[:, 1:] @ lm_head
