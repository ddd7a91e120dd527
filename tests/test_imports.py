"""The package's import graph: no cycles between files, and every layer imports only the layers below it
(kernels at the bottom import nothing of jaxddtree). Lazy imports inside functions count too."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxddtree", "kernels_pallas", "convert")

# layer -> the layers it may import (besides itself); the flow of data, bottom to top
ALLOWED = {
    "kernels_pallas": set(),
    "jaxddtree.model": {"kernels_pallas"},
    "jaxddtree.speculative": {"kernels_pallas", "jaxddtree.model"},
    "jaxddtree.api": {"kernels_pallas", "jaxddtree.model", "jaxddtree.speculative"},
    "jaxddtree.checkpoint": {"kernels_pallas", "jaxddtree.model"},
    "jaxddtree.training": {"kernels_pallas", "jaxddtree.model", "jaxddtree.speculative", "jaxddtree.checkpoint"},
    "jaxddtree.tokenizer": set(),  # HF tokenizer directories without transformers
    "jaxddtree.text": {"jaxddtree.tokenizer"},  # tokenizers and chat templates: no model code
    "jaxddtree.serving": {"kernels_pallas", "jaxddtree.model", "jaxddtree.speculative", "jaxddtree.checkpoint",
                          "jaxddtree.text"},
    "jaxddtree": {"kernels_pallas", "jaxddtree.model", "jaxddtree.speculative", "jaxddtree.api",
                  "jaxddtree.checkpoint", "jaxddtree.training", "jaxddtree.tokenizer", "jaxddtree.text",
                  "jaxddtree.serving"},
    "convert": {"jaxddtree.checkpoint"},
}


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:  # `import a.b.c` of a name -> its module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].add(t)
    return edges


def layer(mod: str) -> str:
    for key in sorted(ALLOWED, key=len, reverse=True):
        if mod == key or mod.startswith(key + "."):
            return key
    raise AssertionError(f"{mod}: no layer")


def test_graph_sees_imports():  # the checks below are only as good as the graph
    g = graph()
    assert "kernels_pallas.ops" in g["jaxddtree.model.attention"]  # from kernels_pallas import ops
    assert "jaxddtree.checkpoint.load" in g["jaxddtree.checkpoint.builtin"]  # lazy, inside a function
    assert "jaxddtree.checkpoint.convert" in g["convert.cli"]


def test_no_import_cycles():
    edges = graph()
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == "open":
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_layers_import_only_downwards():
    bad = []
    for m, targets in graph().items():
        lm = layer(m)
        for t in targets:
            lt = layer(t)
            # a package's own __init__ (e.g. jaxddtree/__init__) re-exports; submodules never import it
            if lt != lm and lt not in ALLOWED[lm]:
                bad.append(f"{m} -> {t}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_kernels_import_nothing_of_jaxddtree():
    for path in (ROOT / "kernels_pallas").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "jaxddtree" for n in names), f"{path} imports {names}"


def test_the_gpu_allocator_fraction_defaults_to_what_a_27b_model_needs():
    """jax's default (75 % of the card) is less than the 27B bf16 weights on an 80 GB H100: importing jaxddtree sets
    92 % unless the user named a fraction (either variable)."""
    import os
    import subprocess
    import sys
    code = "import os, jaxddtree; print(os.environ.get('XLA_CLIENT_MEM_FRACTION'))"
    env = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                                   check=True).stdout.strip()
    assert run(env) == "0.92"
    assert run(dict(env, XLA_CLIENT_MEM_FRACTION="0.5")) == "0.5"
    assert run(dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION="0.6")) == "None"


def test_a_kernel_trace_does_not_recompile_earlier_programs():
    """A program compiled before the process's first Pallas kernel trace still hits the jit cache after it
    (importing kernels_pallas registers the fuser's jit-key option up front; without it: 2 compilations)."""
    import os
    import subprocess
    import sys
    code = """
import jax, jax.numpy as jnp
import kernels_pallas  # noqa: F401  (what every model module imports first)
from jax.experimental import pallas as pl
f = jax.jit(lambda x: x * 2)
x = jnp.ones((8, 128), jnp.float32)
f(x)
def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)
f(x)
print(f._cache_size())
"""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "1", out.stdout + out.stderr
