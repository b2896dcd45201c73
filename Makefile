# normscope — the two commands a new user runs: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned here (not in pyproject.toml) so the CPU build is used; users may bring any torch>=2.4.
TORCH  := torch==2.13.0

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.base: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[onnx]"
	touch $@

$(VENV)/.dev: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet "$(TORCH)" -e ".[dev,triton]"
	touch $@ $(VENV)/.base

demo: $(VENV)/.base
	$(BIN)/python examples/demo.py

# the suite on up to 4 worker processes (pytest-xdist; each imports torch, so not one per core on a large machine)
test: $(VENV)/.dev
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4

bench: $(VENV)/.dev
	$(BIN)/python bench/run_all.py

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests bench examples

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
