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

FP8 checkpoints (config `quantization_config` of transformers' fine-grained FP8: quant_method "fp8", e4m3,
dynamic activations, `weight_block_size`): a projection part stored as float8_e4m3fn must come with its
`<module>.weight_scale_inv` [ceil(out/bo), ceil(in/bi)] (fp32 or bf16), and a scale only with an fp8 weight;
whether a part is quantized is read from its dtype (modules_to_not_convert is not consulted). A parameter
with fp8 parts becomes a `jaxddtree.model.fp8.Fp8Weight` (fp8 + block scales on device); see `_load_fp8`.
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
    """How to build one parameter: read `parts` (in order), stack them along axis 0, apply `fn`. In an FP8
    checkpoint `scales` has one entry per part: (name, file) of its `weight_scale_inv` when the part is
    stored in float8_e4m3fn, else None; () when no part is quantized."""
    path: tuple
    parts: tuple  # of Part
    fn: Callable | None
    scales: tuple = ()

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
    fp8 = fp8_format(path)
    rules = _rules(c)
    compiled = _compiled(rules)
    slots: dict[tuple, tuple[str, str]] = {}  # (rule, layer, part) -> (tensor name, file)
    scale_slots: dict[tuple, tuple[str, str]] = {}  # same key -> its weight_scale_inv (FP8 checkpoints)
    prefixes = []
    for name, file in files.items():
        if name.endswith(".weight_scale_inv") or name.endswith(".activation_scale"):
            if fp8 is None:
                raise CheckpointError(f"tensor '{name}' ({file}) is an FP8 scale, but config.json has no fp8 "
                                      f"quantization_config")
            if name.endswith(".activation_scale"):
                raise CheckpointError(f"tensor '{name}' ({file}): static FP8 activation scales are not "
                                      f"supported (activation_scheme must be 'dynamic')")
            s = map_name(c, name[:-len("_scale_inv")], rules, compiled)
            if s is None:
                continue
            key = (s.rule, s.layer, s.part)
            if key in scale_slots:
                raise CheckpointError(f"tensor '{name}' ({file}) duplicates '{scale_slots[key][0]}'")
            scale_slots[key] = (name, file)
            continue
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
                scales = tuple(scale_slots.get((r, i, k)) for k in range(len(parts))) if fp8 else ()
                plans.append(ParamPlan(_param_path(rule, i), tuple(parts), rule.fn, scales))
    if missing:
        rule, i, k = missing[0]
        raise CheckpointError(f"{path}: checkpoint lacks tensor '{_part_name(rule, k, i, prefix)}' for parameter "
                              f"{'.'.join(map(str, _param_path(rule, i)))}{_describe_part(rule, k)} "
                              f"({len(missing)} missing in all)")
    if fp8 is not None:
        _check_fp8_plans(plans, rules)
    return sorted(plans, key=lambda e: (e.parts[0].file, e.parts[0].name))


# ------------------------------------------------------------------------------------------------- FP8
# transformers' fine-grained FP8 (integrations/finegrained_fp8.py, quantizers/quantizer_finegrained_fp8.py,
# utils/quantization_config.py FineGrainedFP8Config): see jaxddtree/model/fp8.py for the format.

class Fp8Format(NamedTuple):
    block: tuple  # weight_block_size (rows = output channels, cols = input channels)
    modules_to_not_convert: tuple


def fp8_format(path: str) -> Fp8Format | None:
    """The checkpoint's FP8 quantization (config.json's `quantization_config`, top level or in
    `text_config`), None when it has none; CheckpointError for a quantization we cannot load."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None  # load_config reports it
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    if q is None and isinstance(raw.get("text_config"), dict):
        q = raw["text_config"].get("quantization_config")
    if q is None:
        return None
    where = f"{file}: quantization_config"
    if not isinstance(q, dict):
        raise CheckpointError(f"{where} is not an object")
    if q.get("quant_method") != "fp8":
        raise CheckpointError(f"{where}: quant_method {q.get('quant_method')!r} is not supported (only 'fp8', "
                              f"block-wise e4m3)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: fmt {q.get('fmt')!r} is not supported (only 'e4m3')")
    if str(q.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise CheckpointError(f"{where}: activation_scheme {q.get('activation_scheme')!r} is not supported "
                              f"(only 'dynamic')")
    if q.get("scale_fmt", "float") != "float":
        raise CheckpointError(f"{where}: scale_fmt {q.get('scale_fmt')!r} is not supported (only 'float')")
    if q.get("expert_dtype", "fp8") != "fp8" or q.get("modules_to_convert"):
        raise CheckpointError(f"{where}: expert_dtype / modules_to_convert (quantized embeddings) are not "
                              f"supported")
    bs = q.get("weight_block_size", [128, 128])  # FineGrainedFP8Config's default
    if (not isinstance(bs, (list, tuple)) or len(bs) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in bs)):
        raise CheckpointError(f"{where}: weight_block_size {bs!r} is not supported (two positive integers; "
                              f"per-tensor scales are not supported)")
    skip = q.get("modules_to_not_convert", q.get("ignored_layers")) or []
    return Fp8Format(block=(int(bs[0]), int(bs[1])), modules_to_not_convert=tuple(skip))


_ST_FP8 = "F8_E4M3"


def _st_dtype(code: str):
    import ml_dtypes
    table = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F16": np.float16,
             "F32": np.float32, "F64": np.float64}
    return table.get(code)


class _Headers:
    """safetensors headers (data offset, tensor -> {dtype, shape, data_offsets}), read once per file."""

    def __init__(self):
        self.cache = {}

    def get(self, file: str) -> tuple[int, dict]:
        if file not in self.cache:
            _open(file)  # CheckpointError naming the file if missing / corrupt
            import struct
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self.cache[file] = (8 + n, json.loads(f.read(n)))
        return self.cache[file]

    def dtype(self, file: str, name: str) -> str:
        return self.get(file)[1][name]["dtype"]

    def read(self, file: str, name: str, shape: tuple | None = None) -> np.ndarray:
        """A tensor as numpy (float8_e4m3fn and bfloat16 through ml_dtypes), after the shape check."""
        start, header = self.get(file)
        meta = header[name]
        dt = _st_dtype(meta["dtype"])
        if dt is None:
            raise CheckpointError(f"{file}: tensor '{name}' has dtype {meta['dtype']}, not supported in an FP8 "
                                  f"checkpoint")
        if shape is not None and tuple(meta["shape"]) != tuple(shape):
            raise CheckpointError(f"{file}: tensor '{name}' has shape {tuple(meta['shape'])}, "
                                  f"expected {tuple(shape)}")
        lo, hi = meta["data_offsets"]
        with open(file, "rb") as f:
            f.seek(start + lo)
            buf = f.read(hi - lo)
        n = int(np.prod(meta["shape"], dtype=np.int64))
        if len(buf) != n * np.dtype(dt).itemsize:
            raise CheckpointError(f"{file}: tensor '{name}' is truncated")
        return np.frombuffer(buf, dt).reshape(meta["shape"])


def _is_linear(rule: Rule) -> bool:
    return rule.path != ("embed",) and all(len(shape) == 2 for _, shape in rule.parts)


def _check_fp8_plans(plans: list[ParamPlan], rules: list[Rule]) -> None:
    """Every float8_e4m3fn weight has a `weight_scale_inv` and is a projection; every scale has an fp8
    weight (dtypes from the headers; scale shapes are checked when read)."""
    linear_paths = {r.path for r in rules if _is_linear(r)}
    headers = _Headers()
    for plan in plans:
        rel = plan.path[2:] if plan.path[0] == "layers" else plan.path
        for part, scale in zip(plan.parts, plan.scales):
            code = headers.dtype(part.file, part.name)
            if code.startswith("F8") and code != _ST_FP8:
                raise CheckpointError(f"{part.file}: tensor '{part.name}' has dtype {code} (only F8_E4M3 fp8 "
                                      f"weights are supported)")
            if code == _ST_FP8 and scale is None:
                raise CheckpointError(f"{part.file}: fp8 tensor '{part.name}' has no "
                                      f"'{part.name}_scale_inv' (its block scales)")
            if scale is not None and code != _ST_FP8:
                raise CheckpointError(f"{scale[1]}: tensor '{scale[0]}' scales '{part.name}', which is {code}, "
                                      f"not fp8 (F8_E4M3)")
            if code == _ST_FP8 and rel not in linear_paths:
                raise CheckpointError(f"{part.file}: fp8 tensor '{part.name}' is not a projection weight "
                                      f"(only linear layers can be fp8)")


def _load_fp8(plan: ParamPlan, fmt: Fp8Format, headers: _Headers, dtype):
    """One parameter with fp8 parts -> Fp8Weight (its quantized parts are a prefix of the fused parameter,
    and the rest, if any, are the trailing columns of a 2-D one), or, for any other mix of fp8 and plain
    parts, the array dequantized in fp32 and cast to `dtype`."""
    from jaxddtree.model import fp8 as fp8_weight

    bo, bi = fmt.block
    K = int(plan.parts[0].shape[1])
    nbi = -(-K // bi)
    model_shape = tuple(jax.eval_shape(plan.fn or (lambda x: x), jax.ShapeDtypeStruct(plan.shape, np.float32)).shape)
    nc = next(n for n in range(1, len(model_shape) + 1) if int(np.prod(model_shape[:n])) == K)
    qs, rows_scale, plain = [], [], []
    for part, scale in zip(plan.parts, plan.scales):
        w = headers.read(part.file, part.name, part.shape)
        if scale is None:
            plain.append(w)
            continue
        out = int(part.shape[0])
        sname, sfile = scale
        code = headers.dtype(sfile, sname)
        if code not in ("F32", "BF16"):
            raise CheckpointError(f"{sfile}: tensor '{sname}' has dtype {code} (block scales are float32 or "
                                  f"bfloat16)")
        s = headers.read(sfile, sname).astype(np.float32)
        want = (-(-out // bo), nbi)
        if tuple(s.shape) != want:
            raise CheckpointError(f"{sfile}: tensor '{sname}' has shape {tuple(s.shape)}, expected {want} (one "
                                  f"scale per {bo}x{bi} block of '{part.name}' {tuple(part.shape)})")
        qs.append(w)
        rows_scale.append(np.repeat(s, bo, axis=0)[:out])  # [out, nbi]: each output row's block scales
    flags = [s is not None for s in plan.scales]
    nq = len(qs)
    prefix = all(flags[:nq]) and not any(flags[nq:])
    if prefix and (nq == len(flags) or (len(model_shape) == 2 and nc == 1)):
        # q: the parts' rows stacked [Rq, K] (the checkpoint's layout, kept); scales: the compact row grid
        q = jax.device_put(np.concatenate(qs, axis=0) if nq > 1 else qs[0])
        scale, g = fp8_weight.compact_scales(np.concatenate(rows_scale, axis=0), bo)
        tail = None
        if nq < len(flags):
            assert model_shape == (K, plan.shape[0]), (plan.path, model_shape)  # a transposed [K, R] projection
            tail = jax.device_put(np.concatenate([p.astype(np.float32) for p in plain], axis=0)).T.astype(dtype)
        return fp8_weight.make(q, jax.device_put(scale), block_in=bi, block_out=g, shape=model_shape, tail=tail)
    # any other mix: dequantize (fp32 product, as the reference) and store in `dtype`
    full, it_q, it_p = [], iter(zip(qs, rows_scale)), iter(plain)
    for f in flags:
        if f:
            w, sr = next(it_q)
            full.append(w.astype(np.float32) * np.repeat(sr, bi, axis=1)[:, :K])
        else:
            full.append(next(it_p).astype(np.float32))
    x = jax.device_put(np.concatenate(full, axis=0))
    return (plan.fn(x) if plan.fn is not None else x).astype(dtype)


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
            if "float8" in str(e):
                raise CheckpointError(f"{file}: tensor '{name}' is fp8, but config.json has no fp8 "
                                      f"quantization_config") from None
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
    fp8_plans = [p for p in plans if any(s is not None for s in p.scales)]
    plans = [p for p in plans if not any(s is not None for s in p.scales)]
    out = {}
    with tqdm(total=len(plans) + len(fp8_plans), unit=" params",
              desc=f"loading {os.path.basename(os.path.normpath(path))}",
              disable=not progress, dynamic_ncols=True) as bar:
        if fp8_plans:
            fmt, headers = fp8_format(path), _Headers()
            for plan in fp8_plans:
                out[plan.path] = _load_fp8(plan, fmt, headers, dtype)
                bar.update()
        for plan, arr in iter_params(plans):
            x = jax.device_put(arr)
            x = (plan.fn(x) if plan.fn is not None else x).astype(dtype)
            out[plan.path] = x
            bar.update()
            del arr
    return out
