#!/usr/bin/env bash
# MIST scoring speed on one GPU: a Qwen2.5-1.5B-shaped model with random weights, bf16,
# ~350-token chains. Prints chains/s, tokens/s and model FLOPs utilisation; writes JSON to
# ${OUT:-.}/gpu_bench.json. Needs this project installed with a CUDA build of torch
# (make TORCH=torch test, or pip install -e . on a machine that has torch already).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
"$PY" -m pipelines.bench --model random:qwen2.5-1.5b --synthetic "${CHAINS:-1024}" --chain-tokens 350 \
    --device cuda --dtype bfloat16 --tf32 --batch-tokens "${BATCH_TOKENS:-16384}" --batch-size 256 \
    --repeats 3 --exact-chains 0 --json "${OUT:-.}/gpu_bench.json"
