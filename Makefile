# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
# Where the system Python already has torch (a GPU machine), the venv sees it and keeps it (also where that
# Python is itself a venv, as on GPU images: --system-site-packages alone would reach only its base
# interpreter's packages, so a .pth file adds its own site-packages);
# otherwise the CPU build is installed pinned, never an unpinned torch (that would pull CUDA wheels).
# Either way every later install is constrained to the torch the venv then has, so no extra's dependency
# (megatron-core, transformers...) can upgrade it to another (CUDA) build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Stamps, named by pyproject.toml's checksum: the venv with torch; then the `dev` + `sft` extras for the tests,
# or only `sft` for the demo (a first `make demo` does not wait for the test tools: triton, megatron, trl...).
PYPROJECT_SUM := $(shell cat pyproject.toml | cksum | cut -d' ' -f1)
BASE_STAMP := $(VENV)/.torch-$(PYPROJECT_SUM)
STAMP := $(VENV)/.installed-dev-$(PYPROJECT_SUM)
DEMO_STAMP := $(VENV)/.installed-sft-$(PYPROJECT_SUM)
# The CPU build, from PyTorch's CPU index (PyPI's Linux torch is the CUDA build). Elsewhere (macOS, or an
# offline mirror) override both, e.g. `make TORCH_PIN=torch==2.13.0 TORCH_INDEX= venv`.
TORCH_PIN ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CONSTRAINT := $(VENV)/torch-constraint.txt
# verl's actor losses are the reference of tests/test_rl_verl.py. verl's own requirements (ray[default], a
# transformers older than the one trl needs, wandb, peft...) would be minutes of install and replace packages
# of this venv, so verl is installed without them; so are tensordict and pyvers (pyvers would downgrade
# packaging). What verl.trainer.ppo.core_algos imports besides is in the dev extra (omegaconf, codetiming,
# cloudpickle, orjson); ray is stubbed by tests/verl_support.py.
VERL_NO_DEPS := verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0

.PHONY: venv test demo lint bench clean

venv: $(STAMP)

# The constraint takes torch's version from its metadata: `import torch` before numpy is installed (the extras
# bring it) would print torch's "Failed to initialize NumPy" warning during the build.
$(BASE_STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "torch found in $(PYTHON): the venv reuses it"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV) && \
	  $(PYTHON) -c "import site; print('\n'.join(site.getsitepackages()))" \
	    > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/_lmloss_parent_site.pth"; \
	else \
	  $(PYTHON) -m venv $(VENV) && \
	  $(PY) -m pip install -q --retries 1 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_PIN)"; \
	fi
	$(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > $(TORCH_CONSTRAINT)
	@rm -f $(VENV)/.torch-* $(VENV)/.installed-*; touch $@

$(STAMP): $(BASE_STAMP)
	$(PY) -m pip install -q -c $(TORCH_CONSTRAINT) -e ".[dev,sft]"
	$(PY) -m pip install -q -c $(TORCH_CONSTRAINT) --no-deps $(VERL_NO_DEPS)
	@touch $@ $(DEMO_STAMP)

$(DEMO_STAMP): $(BASE_STAMP)
	$(PY) -m pip install -q -c $(TORCH_CONSTRAINT) -e ".[sft]"
	@touch $@

test: venv
	LMLOSS_FULL_MEMORY_TEST=1 $(PY) -m pytest -q tests

demo: $(DEMO_STAMP)
	$(VENV)/bin/lmloss sft --nproc 2 --cp 2 --head-memory-vocab 151936 --out runs/demo --overwrite

lint: venv
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
