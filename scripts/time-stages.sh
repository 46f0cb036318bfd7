#!/usr/bin/env bash
# Times each stage of the pipeline in this repo (run after `pip install -r requirements.txt`),
# then a no-op `dvc repro`, and prints the evaluation metrics. Usage: bash scripts/time-stages.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for stage in fetch preprocess tokenize train evaluate; do
  TIMEFORMAT="$stage: %R s"
  time dvc repro -s "$stage" >/dev/null
done
TIMEFORMAT="no-op dvc repro: %R s"
time dvc repro >/dev/null
dvc metrics show --json | python -c 'import json, sys
m = json.load(sys.stdin)[""]["data"]["reports/evaluate/metrics.json"]["data"]
print({split: {k: v[k] for k in ("accuracy", "f1_macro")} for split, v in m.items()})'
