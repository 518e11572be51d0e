#!/usr/bin/env bash
# MIST on one GPU, in at most ~9 minutes, models with random weights (speed and memory do not
# depend on the weights); the first H200 run is in docs/results/performance.md (GPU). Each
# length of a sweep builds the 7B model three times (about a minute a length on an H200) and
# the sweep's JSON is written after every length. Writes JSON to ${OUT:-.}/:
#   gpu_bench.json  Qwen2.5-1.5B shape, bf16, 1024 chains of ~350 tokens: chains/s, tokens/s,
#                   forward-equivalents, model FLOPs utilisation
#   gpu_long.json   Qwen2.5-7B shape, bf16, one chain of 8k tokens, then 16k and 32k: the
#                   scorer's cost in plain forwards and its peak memory beyond the model, under
#                   the default cap (the GPU's free memory)
#   gpu_largest.json  the same model under a 24 GB cap (an A10G's worth of activations): the
#                   longest chain it still scores, recomputing
# Needs this project installed with a CUDA build of torch (make TORCH=torch test, or
# pip install -e . on a machine that has torch already).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
timeout 180 "$PY" -m pipelines.bench.scorer --model random:qwen2.5-1.5b --synthetic "${CHAINS:-1024}" --chain-tokens 350 \
    --device cuda --dtype bfloat16 --tf32 --batch-tokens "${BATCH_TOKENS:-16384}" --batch-size 256 \
    --repeats 3 --exact-chains 0 --json "$OUT/gpu_bench.json" || echo "gpu_bench: exit $?"
timeout 240 "$PY" -m pipelines.bench.scorer --sweep 8192,16384,32768 --model random:qwen2.5-7b --device cuda \
    --dtype bfloat16 --batch-tokens auto --repeats 2 --json "$OUT/gpu_long.json" || echo "gpu_long: exit $?"
timeout 120 "$PY" -m pipelines.bench.scorer --sweep 32768,65536 --model random:qwen2.5-7b --device cuda \
    --dtype bfloat16 --batch-tokens auto --max-memory 24GB --repeats 1 --json "$OUT/gpu_largest.json" \
    || echo "gpu_largest: exit $?"
