# jaxddtree developer / CI entry points.
#   make venv   -> .venv (Python >= 3.12) with `-e .[test]` and torch==$(TORCH_VERSION)
#   make test   -> pytest on CPU (what CI runs via .ci/run)
#   make demo   -> scripts/generate.py
#   make clean  -> remove venv and build artefacts

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

VENV          ?= .venv
PY            := $(VENV)/bin/python
# Interpreter for the venv; empty = auto-detect (see .ci/find-python).
PYTHON        ?=
# Extras to install, e.g. `make venv EXTRAS=test,cuda` on the GPU box.
EXTRAS        ?= test
# torch is only the test reference (transformers' Qwen3_5ForCausalLM); 2.11 = GPU box.
# PyPI's x86_64 torch is a CUDA build (~4.5 GB installed incl. nvidia-* wheels); it runs fine on CPU.
TORCH_VERSION ?= 2.11.0
# uv (bootstrapped from PyPI into the venv) installs ~4x faster than pip; INSTALLER=pip also works.
INSTALLER     ?= uv
# pytest-xdist workers; 0 disables xdist. Whole test files go to one worker (--dist loadfile): a file's module
# fixtures (the server's warm-up) and the programs its tests share compile once, not once per worker that runs
# some of its tests (2-core VM, 2026-12-03: 1,559 s of CPU for the suite instead of 1,827; workers 771 / 774 s).
PYTEST_WORKERS ?= 2
PYTEST_DIST   ?= loadfile
PYTEST_ARGS   ?=
DEMO_ARGS     ?=

STAMP := $(VENV)/.jaxddtree-installed
# Re-run the install when deps change or a top-level package appears (editable finder maps them at install time).
STAMP_DEPS := pyproject.toml .ci/find-python $(wildcard jaxddtree/__init__.py kernels_pallas/__init__.py convert/__init__.py)

# Bytecode of every imported module (jax, torch, transformers, the project) cached under $(VENV)/pycache, never
# next to the sources: the venv is installed without .pyc files, and with PYTHONDONTWRITEBYTECODE=1 in the
# environment each of the suite's Python processes (2 workers, the CLI / script / converter subprocesses)
# compiled every module it imported from source again (2-core VM, 2026-12-06: `import torch, transformers` 17.5 s
# -> 7 s, `import jax, jaxddtree` 3.2 s -> 1 s once cached).
PYCACHE  := $(abspath $(VENV))/pycache
TEST_ENV := JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
            PYTHONPYCACHEPREFIX=$(PYCACHE) PYTHONDONTWRITEBYTECODE=
XDIST    := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist $(PYTEST_DIST),)

.PHONY: venv test demo clean

venv: $(STAMP)

$(STAMP): $(STAMP_DEPS)
	@start=$$SECONDS; \
	if [ ! -x "$(PY)" ] || ! "$(PY)" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then \
	  base="$$(PYTHON='$(PYTHON)' .ci/find-python)"; \
	  echo "==> creating $(VENV) with $$base ($$("$$base" -V 2>&1))"; \
	  rm -rf "$(VENV)"; \
	  "$$base" -m venv "$(VENV)"; \
	fi; \
	if [ "$(INSTALLER)" = uv ] && "$(PY)" -m pip install -q --disable-pip-version-check "uv>=0.5"; then \
	  echo "==> uv pip install -e .[$(EXTRAS)] torch==$(TORCH_VERSION)"; \
	  "$(VENV)/bin/uv" pip install --python "$(PY)" -e ".[$(EXTRAS)]" "torch==$(TORCH_VERSION)"; \
	else \
	  echo "==> pip install -e .[$(EXTRAS)] torch==$(TORCH_VERSION)"; \
	  "$(PY)" -m pip install --disable-pip-version-check -e ".[$(EXTRAS)]" "torch==$(TORCH_VERSION)"; \
	fi; \
	"$(PY)" -c 'import jax, torch, transformers; print("==> jax", jax.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)'; \
	touch "$@"; \
	echo "==> venv ready in $$((SECONDS - start)) s"

test: venv
	@start=$$SECONDS; \
	rc=0; $(TEST_ENV) "$(PY)" -m pytest -q $(XDIST) --durations=15 $(PYTEST_ARGS) || rc=$$?; \
	echo "==> tests finished in $$((SECONDS - start)) s (exit $$rc)"; \
	exit $$rc

demo: venv
	"$(PY)" scripts/generate.py $(DEMO_ARGS)

clean:
	rm -rf "$(VENV)" build dist *.egg-info .pytest_cache
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
