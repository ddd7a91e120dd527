"""HF safetensors -> target parameters: a key map with shape asserts and a strict coverage check.

Accepts the multimodal wrapper layout (`model.language_model.*`, Qwen3.6-27B as shipped) and the
text-only layout (`model.*`), single-file or sharded (`model.safetensors.index.json`). `model.visual.*`
and `mtp.*` tensors are skipped.

Key map (`_rules`): one rule per model parameter, listing the HF tensors ("parts") it is assembled from.
Same-input projections are fused into one parameter (GDN `w_in` = in_proj_qkv | in_proj_z | in_proj_b |
in_proj_a, MLP `w_gate_up` = gate_proj | up_proj, attention `w_qkv` = q_proj | k_proj | v_proj): HF stores
every projection as [out, in], so the parts of a fused parameter are stacked along their row (output) axis
in the listed order, and the rule's transform turns the stacked [sum of rows, D] matrix into the model's
layout (a transpose, plus a reshape for `w_gate_up [D, 2, F]`). Each HF tensor fills exactly one row block
of one parameter (CheckpointError naming it if it is unknown, duplicated or misshapen, or if any part of a
parameter is missing). Parameters are assembled one at a time: the parts of a fused one are copied into
one host buffer in the checkpoint's dtype, then moved to the device, transformed and cast there, so host
memory stays near the size of the largest parameter.
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterator, NamedTuple

import jax
import numpy as np
import safetensors

from jaxddtree.checkpoint.params import CheckpointError
from jaxddtree.model.config import ATTENTION, GDN, TextConfig


SKIP = re.compile(r"^(model\.visual\.|mtp\.|model\.mtp\.|visual\.)")
PREFIXES = ("model.language_model.", "model.")


class Rule(NamedTuple):
    """One parameter: the layer type it exists in ("*": every layer, None: not per layer), its path (after
    ("layers", i)), its parts [(HF name template with {i} for the layer, HF shape)] stacked along axis 0 in
    this order, and the transform of the stacked HF array into the model's layout (None: as is)."""
    kind: str | None
    path: tuple
    parts: tuple
    fn: Callable | None


class Part(NamedTuple):
    name: str  # HF tensor name
    file: str  # safetensors file holding it
    shape: tuple  # its HF shape (asserted when read)


class ParamPlan(NamedTuple):
    """How to build one parameter: read `parts` (in order), stack them along axis 0, apply `fn`."""
    path: tuple
    parts: tuple  # of Part
    fn: Callable | None

    @property
    def shape(self) -> tuple:
        """Shape of the stacked HF array (the single part's shape when not fused)."""
        first = tuple(self.parts[0].shape)
        if len(self.parts) == 1:
            return first
        return (sum(int(p.shape[0]) for p in self.parts),) + first[1:]


def _rules(c: TextConfig) -> list[Rule]:
    D, V, F = c.hidden_size, c.vocab_size, c.intermediate_size
    H, Hkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    Hv, dv, K = c.linear_num_value_heads, c.linear_value_head_dim, c.linear_conv_kernel_dim
    T = lambda x: x.T
    L, A, G = "layers.{i}.", "layers.{i}.self_attn.", "layers.{i}.linear_attn."
    return [
        Rule(None, ("embed",), (("embed_tokens.weight", (V, D)),), None),
        Rule(None, ("final_norm", "weight"), (("norm.weight", (D,)),), None),
        Rule(None, ("lm_head",), (("lm_head.weight", (V, D)),), T),
        Rule("*", ("input_norm", "weight"), ((L + "input_layernorm.weight", (D,)),), None),
        Rule("*", ("post_norm", "weight"), ((L + "post_attention_layernorm.weight", (D,)),), None),
        # [D, 2, F]: gate = [:, 0], up = [:, 1]
        Rule("*", ("mlp", "w_gate_up"), ((L + "mlp.gate_proj.weight", (F, D)), (L + "mlp.up_proj.weight", (F, D))),
             lambda x: x.T.reshape(D, 2, F)),
        Rule("*", ("mlp", "w_down"), ((L + "mlp.down_proj.weight", (D, F)),), T),
        # [D, H*2hd | Hkv*hd | Hkv*hd]: q_proj's rows are per head [query | gate], h-major
        Rule(ATTENTION, ("mixer", "w_qkv"), ((A + "q_proj.weight", (H * 2 * hd, D)),
                                             (A + "k_proj.weight", (Hkv * hd, D)),
                                             (A + "v_proj.weight", (Hkv * hd, D))), T),
        Rule(ATTENTION, ("mixer", "wo"), ((A + "o_proj.weight", (D, H * hd)),), lambda x: x.T.reshape(H, hd, D)),
        Rule(ATTENTION, ("mixer", "q_norm"), ((A + "q_norm.weight", (hd,)),), None),
        Rule(ATTENTION, ("mixer", "k_norm"), ((A + "k_norm.weight", (hd,)),), None),
        # [D, conv_dim (q|k|v, the conv's channel order) | Hv*dv (z, head-major) | Hv (b) | Hv (a)]
        Rule(GDN, ("mixer", "w_in"), ((G + "in_proj_qkv.weight", (c.conv_dim, D)),
                                      (G + "in_proj_z.weight", (Hv * dv, D)),
                                      (G + "in_proj_b.weight", (Hv, D)),
                                      (G + "in_proj_a.weight", (Hv, D))), T),
        Rule(GDN, ("mixer", "conv"), ((G + "conv1d.weight", (c.conv_dim, 1, K)),), lambda x: x[:, 0, :].T),
        Rule(GDN, ("mixer", "dt_bias"), ((G + "dt_bias", (Hv,)),), None),
        Rule(GDN, ("mixer", "A_log"), ((G + "A_log", (Hv,)),), None),
        Rule(GDN, ("mixer", "norm"), ((G + "norm.weight", (dv,)),), None),
        Rule(GDN, ("mixer", "w_out"), ((G + "out_proj.weight", (D, Hv * dv)),), lambda x: x.T.reshape(Hv, dv, D)),
    ]


def _compiled(rules: list[Rule]) -> list[tuple[re.Pattern, int, int]]:
    """(regex of a part's template on the stripped name, rule index, part index)."""
    out = []
    for r, rule in enumerate(rules):
        for k, (template, _) in enumerate(rule.parts):
            out.append((re.compile(re.escape(template).replace(r"\{i\}", r"(\d+)")), r, k))
    return out


def _layers(c: TextConfig, rule: Rule) -> list[int | None]:
    if rule.kind is None:
        return [None]
    return [i for i, t in enumerate(c.layer_types) if rule.kind == "*" or rule.kind == t]


def _param_path(rule: Rule, layer: int | None) -> tuple:
    return rule.path if layer is None else ("layers", layer) + rule.path


def _part_name(rule: Rule, k: int, layer: int | None, prefix: str = "") -> str:
    """The HF name of part k of `rule` for `layer` (with the checkpoint's `prefix`)."""
    template = rule.parts[k][0]
    return template if template == "lm_head.weight" else prefix + template.replace("{i}", str(layer))


def expected_paths(c: TextConfig) -> set[tuple]:
    """Every parameter path the model needs."""
    return {_param_path(rule, i) for rule in _rules(c) for i in _layers(c, rule)}


class Slot(NamedTuple):
    """Where one HF tensor goes: part `part` of the parameter built by `rule` for `layer`."""
    rule: int
    layer: int | None
    part: int
    prefix: str  # the checkpoint's name prefix ("model." or "model.language_model.")


def map_name(c: TextConfig, name: str, rules=None, compiled=None) -> Slot | None:
    """HF tensor name -> its Slot, None if skipped; CheckpointError if unknown."""
    if SKIP.match(name):
        return None
    rules = rules if rules is not None else _rules(c)
    stripped, prefix = name, ""
    if name != "lm_head.weight":
        for p in PREFIXES:
            if name.startswith(p):
                stripped, prefix = name[len(p):], p
                break
        else:
            raise CheckpointError(f"unexpected tensor '{name}' (not a Qwen3.5/3.6 text tensor)")
    for pattern, r, k in compiled or _compiled(rules):
        m = pattern.fullmatch(stripped)
        if not m:
            continue
        kind = rules[r].kind
        if kind is None:
            return Slot(r, None, k, prefix)
        i = int(m.group(1))
        if i >= c.num_hidden_layers:
            raise CheckpointError(f"tensor '{name}' is for layer {i}, but the config has "
                                  f"{c.num_hidden_layers} layers")
        if kind != "*" and c.layer_types[i] != kind:
            raise CheckpointError(f"tensor '{name}' belongs to a {kind} layer, but config.layer_types[{i}] "
                                  f"is {c.layer_types[i]}")
        return Slot(r, i, k, prefix)
    raise CheckpointError(f"unexpected tensor '{name}' (no rule maps it)")


def _describe_part(rule: Rule, k: int) -> str:
    """'' for a single-tensor parameter; else which output channels of the fused parameter part k fills."""
    if len(rule.parts) == 1:
        return ""
    rows = [shape[0] for _, shape in rule.parts]
    lo = sum(rows[:k])
    names = " | ".join(t.rsplit(".", 2)[-2] if t.endswith(".weight") else t.rsplit(".", 1)[-1]
                       for t, _ in rule.parts)
    return f", part {k + 1} of {len(rule.parts)} (output channels {lo}:{lo + rows[k]} of the fused [{names}])"


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, for a single-file or sharded HF directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("'weight_map' is not an object of tensor name -> file name")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e!r})") from None
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
    out = {}
    for fname in files:
        full = os.path.join(path, fname)
        for k in _open(full).keys():
            out[k] = full
    return out


def _open(file: str):
    if not os.path.exists(file):
        raise CheckpointError(f"{file}: missing shard")
    try:
        return safetensors.safe_open(file, framework="numpy")
    except Exception as e:  # truncated or corrupt header
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def plan_tensors(c: TextConfig, path: str) -> list[ParamPlan]:
    """The checkpoint's parameters as ParamPlans, sorted by (file, name) of their first part, after the key
    map, duplicate and coverage checks (shapes are checked when read)."""
    files = checkpoint_files(path)
    rules = _rules(c)
    compiled = _compiled(rules)
    slots: dict[tuple, tuple[str, str]] = {}  # (rule, layer, part) -> (tensor name, file)
    prefixes = []
    for name, file in files.items():
        s = map_name(c, name, rules, compiled)
        if s is None:
            continue
        key = (s.rule, s.layer, s.part)
        if key in slots:
            rule = rules[s.rule]
            raise CheckpointError(f"tensor '{name}' ({file}) maps to parameter "
                                  f"{'.'.join(map(str, _param_path(rule, s.layer)))}"
                                  f"{_describe_part(rule, s.part)}, already provided by "
                                  f"'{slots[key][0]}'")
        slots[key] = (name, file)
        if s.prefix and s.prefix not in prefixes:
            prefixes.append(s.prefix)
    prefix = prefixes[0] if prefixes else PREFIXES[-1]
    plans, missing = [], []
    for r, rule in enumerate(rules):
        for i in _layers(c, rule):
            parts = []
            for k, (_, shape) in enumerate(rule.parts):
                got = slots.get((r, i, k))
                if got is None:
                    missing.append((rule, i, k))
                else:
                    parts.append(Part(got[0], got[1], tuple(shape)))
            if len(parts) == len(rule.parts):
                plans.append(ParamPlan(_param_path(rule, i), tuple(parts), rule.fn))
    if missing:
        rule, i, k = missing[0]
        raise CheckpointError(f"{path}: checkpoint lacks tensor '{_part_name(rule, k, i, prefix)}' for parameter "
                              f"{'.'.join(map(str, _param_path(rule, i)))}{_describe_part(rule, k)} "
                              f"({len(missing)} missing in all)")
    return sorted(plans, key=lambda e: (e.parts[0].file, e.parts[0].name))


class _Files:
    """Reads tensors, keeping at most one safetensors file open (a fused parameter's parts are normally in
    one file; the plan is sorted by file)."""

    def __init__(self):
        self.file, self.handle = None, None

    def read(self, file: str, name: str, shape: tuple) -> np.ndarray:
        if file != self.file:
            self.close()
            self.handle, self.file = _open(file).__enter__(), file
        try:
            arr = self.handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor '{name}' ({e})") from None
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"{file}: tensor '{name}' has shape {tuple(arr.shape)}, "
                                  f"expected {tuple(shape)}")
        return arr

    def close(self):
        if self.handle is not None:
            self.handle.__exit__(None, None, None)
        self.file, self.handle = None, None


def iter_params(plans: list[ParamPlan]) -> Iterator[tuple[ParamPlan, np.ndarray]]:
    """Yield (plan, host array of the stacked HF tensors) one parameter at a time, after the shape asserts;
    raises CheckpointError for missing/unknown/duplicated/misshapen tensors. A fused parameter's parts are
    copied into one buffer (their common dtype); a single tensor is yielded as read."""
    files = _Files()
    try:
        for plan in plans:
            if len(plan.parts) == 1:
                p = plan.parts[0]
                yield plan, files.read(p.file, p.name, p.shape)
                continue
            out, row = None, 0
            for p in plan.parts:
                arr = files.read(p.file, p.name, p.shape)
                if out is None:
                    out = np.empty(plan.shape, arr.dtype)
                elif arr.dtype != out.dtype:  # mixed dtypes (unusual): widen losslessly
                    wide = np.empty(plan.shape, np.result_type(out.dtype, arr.dtype))
                    wide[:row] = out[:row]
                    out = wide
                out[row:row + arr.shape[0]] = arr
                row += arr.shape[0]
                del arr
            assert row == plan.shape[0], (plan.path, row, plan.shape)  # every row of the slot filled
            yield plan, out
            del out
    finally:
        files.close()


def load_params(c: TextConfig, path: str, dtype, progress: bool = False) -> dict[tuple, jax.Array]:
    """param path -> device array in `dtype`, parameter by parameter (transform and cast on device);
    `progress`: a tqdm bar (parameters) on stderr."""
    from tqdm.auto import tqdm

    plans = plan_tensors(c, path)
    out = {}
    with tqdm(total=len(plans), unit=" params", desc=f"loading {os.path.basename(os.path.normpath(path))}",
              disable=not progress, dynamic_ncols=True) as bar:
        for plan, arr in iter_params(plans):
            x = jax.device_put(arr)
            x = (plan.fn(x) if plan.fn is not None else x).astype(dtype)
            out[plan.path] = x
            bar.update()
            del arr
    return out
