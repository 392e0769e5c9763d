# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
# Where the system Python already has torch (a GPU machine), the venv sees it and keeps it;
# otherwise the CPU build is installed pinned, never an unpinned torch (that would pull CUDA wheels).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
TORCH_PIN := torch==2.13.0

.PHONY: venv test demo lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "torch found in $(PYTHON): the venv reuses it"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q $(TORCH_PIN); \
	fi
	$(PY) -m pip install -q -e ".[dev,sft]"
	@rm -f $(VENV)/.installed-*; touch $@

test: venv
	LMLOSS_FULL_MEMORY_TEST=1 $(PY) -m pytest -q tests

demo: venv
	$(VENV)/bin/lmloss sft --nproc 2 --cp 2 --head-memory-vocab 151936 --out runs/demo

lint: venv
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
