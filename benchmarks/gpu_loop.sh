#!/usr/bin/env bash
# The distillation loop on one GPU, more than 8 minutes on an H200 at full size (a first, cut-off
# run: docs/results/performance.md, GPU): SmolLM2-135M-Instruct and
# GSM8K train/test from ../shared/data. Each step is the README's command:
#   0. generate   K chains for each of N_GEN train questions; each question's shortest right
#                 one is kept (how many are right is itself a result: a 135M model gets few)
#   1. compress   N_TRAIN of GSM8K's own train solutions (right by construction), three ways:
#                 MIST and H2O at the budgets 0.5,0.7 (the job's default --sft-mix all
#                 writes each chain at both and whole: 3 records a chain, 3x the training
#                 of the control), and full chains only (budget 1.0: the control)
#   2. train      a fresh copy of the model on each arm's sft/ records
#   3. solve      N_TEST test questions greedily under γ = 0.5, 0.7, 1.0 for each arm
# Writes under ${OUT:-outputs/gpu_loop}/: <step>/<arm>/…, each solve's summary.json, and
# loop.json (every arm's accuracy and chain tokens per γ, and the steps' seconds).
# On a CPU, SMALL=1 runs the same steps at toy sizes (a check of the plumbing, minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
OUT=${OUT:-outputs/gpu_loop}
DATA=${DATA:-../shared/data/gsm8k}
MODEL=${MODEL:-smollm2-135m-instruct}
if [ "${SMALL:-0}" = 1 ]; then
  N_GEN=${N_GEN:-2} K=${K:-1} N_TRAIN=${N_TRAIN:-8} N_TEST=${N_TEST:-4} NEW=${NEW:-8} EPOCHS=${EPOCHS:-1}
  DTYPE=${DTYPE:-float32} GEN_BATCH=${GEN_BATCH:-8}
else
  N_GEN=${N_GEN:-256} K=${K:-4} N_TRAIN=${N_TRAIN:-2000} N_TEST=${N_TEST:-300} NEW=${NEW:-256}
  EPOCHS=${EPOCHS:-1} DTYPE=${DTYPE:-bfloat16}
  GEN_BATCH=${GEN_BATCH:-64}  # sequences per generate() call: batch 8 leaves an H200 idle
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>/dev/null || true
declare -A SECONDS_OF
step() {  # step NAME COMMAND…: run it, time it, keep going if it fails
  local name=$1 t0=$SECONDS
  shift
  echo "== $name: $*"
  if "$@"; then SECONDS_OF[$name]=$((SECONDS - t0)); else echo "$name: exit $?"; SECONDS_OF[$name]=-1; fi
}

step generate "$PY" -m pipelines.loop.generate --input "$DATA/train.jsonl" --adapter gsm8k \
    --limit "$N_GEN" --model "$MODEL" --dtype "$DTYPE" --k "$K" --max-new-tokens "$NEW" \
    --batch-size "$GEN_BATCH" --output "$OUT/generate"
for arm in mist h2o full; do
  case $arm in
    full) extra=(--method mist --budgets 1.0) ;;
    *) extra=(--method "$arm" --budgets 0.5,0.7) ;;
  esac
  step "compress_$arm" "$PY" -m pipelines.compress --input "$DATA/train.jsonl" --adapter gsm8k \
      --limit "$N_TRAIN" --model "$MODEL" --dtype "$DTYPE" "${extra[@]}" --mode overwrite \
      --output "$OUT/compress/$arm"
  step "train_$arm" "$PY" -m pipelines.loop.train --sft "$OUT/compress/$arm" --model "$MODEL" \
      --epochs "$EPOCHS" --output "$OUT/train/$arm"
  step "solve_$arm" "$PY" -m pipelines.loop.solve --input "$DATA/test.jsonl" --adapter gsm8k \
      --limit "$N_TEST" --model "$OUT/train/$arm" --dtype "$DTYPE" --budgets 0.5,0.7,1.0 \
      --max-new-tokens "$NEW" --batch-size "$GEN_BATCH" --output "$OUT/solve/$arm"
done

# One file with every arm's numbers and the steps' seconds.
for name in "${!SECONDS_OF[@]}"; do echo "$name ${SECONDS_OF[$name]}"; done > "$OUT/seconds.txt"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
seconds = dict(line.split() for line in (out / "seconds.txt").read_text().splitlines())
result = {"seconds": {k: int(v) for k, v in sorted(seconds.items())}, "arms": {}}
gen = out / "generate" / "_manifest.json"
if gen.is_file():
    result["generate"] = json.loads(gen.read_text()).get("counts")
for arm in ("mist", "h2o", "full"):
    summary = out / "solve" / arm / "summary.json"
    if summary.is_file():
        result["arms"][arm] = json.loads(summary.read_text())
(out / "loop.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1)[:4000])
EOF
