#!/usr/bin/env bash
# Times each stage of the pipeline in this repo (run after `pip install -r requirements.txt`),
# then a no-op `dvc repro`, and prints the evaluation metrics. Usage: bash scripts/time-stages.sh [LOG]
# (`train` is every fold's stage, train@0, train@1, ...; LOG receives the stages' output, the log
# `dvc repro` would print, in which each stage's last line says how long it took).
set -euo pipefail
log="$(realpath -m "${1:-/dev/null}")"
cd "$(dirname "$0")/.."
for stage in fetch preprocess tokenize split train evaluate; do
  TIMEFORMAT="$stage: %R s"
  time dvc repro -s "$stage" >>"$log" 2>&1
done
TIMEFORMAT="no-op dvc repro: %R s"
time dvc repro >/dev/null
dvc metrics show --json | python -c 'import json, sys
m = json.load(sys.stdin)[""]["data"]["reports/evaluate/metrics.json"]["data"]
print({split: {k: v[k] for k in v if k in ("accuracy", "f1_macro", "f1_macro_mean", "f1_macro_std")}
       for split, v in m.items()})'
