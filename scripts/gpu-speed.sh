#!/usr/bin/env bash
# Issue 28's GPU measurements in one prepared run on a lent GPU machine, each step under its own
# timeout and all under one deadline, so that a hung step leaves the others their time and the logs
# come back. Prepare here with `bash ../shared/gpu/prepare.sh` (fills .gpu/), then on the machine,
# from the project root, with .gpu carried along:
#   bash scripts/gpu-speed.sh [STEP ...]      # default: every step, in this order
# Steps (the most wanted first):
#   profile-minilm  bench.profile_step --gpu: where a default MiniLM step's time goes, fp32 and bf16
#   profile-base    the same for a bert-base-sized model at an effective batch of 256
#   candidates      bench.candidates --gpu: torch.compile, CUDA graphs, padding-free batches, the full
#                   last layer, each against the defaults side by side (MiniLM, the default batch)
#   repro           the default `dvc repro` (its log holds the train stage's choices and speed)
#   benchmark       python -m bench.benchmark --gpu --compile
# Logs go to $OUT (the device tool's folder), else a new folder under /tmp (its path printed); the deadline is
# GPU_SPEED_SECONDS (default 570: under the device tool's 600 s per command).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$(mktemp -d /tmp/gpu-speed.XXXXXX)}"  # not in the tree, where git would pick the logs up
mkdir -p "$out"
echo "logs: $out"
deadline=$(( $(date +%s) + ${GPU_SPEED_SECONDS:-570} ))
[ -f .gpu/setup.sh ] && . .gpu/setup.sh >"$out/setup.log" 2>&1
nvidia-smi >"$out/nvidia-smi.log" 2>&1

step() {  # step NAME SECONDS COMMAND...: COMMAND's output to $out/NAME.log, within SECONDS and the deadline
  local name=$1 limit=$2 left
  shift 2
  left=$(( deadline - $(date +%s) ))
  (( left < limit )) && limit=$left
  if (( limit < 20 )); then
    echo "$name: skipped, the deadline is near" | tee -a "$out/steps.log"
    return
  fi
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s (limit $limit s)" | tee -a "$out/steps.log"
}

run_step() {
  case $1 in
    profile-minilm) step profile-minilm 120 python -m bench.profile_step --gpu --warmup 5 --steps 10 --top 12 ;;
    profile-base) step profile-base 120 python -m bench.profile_step --gpu --model bert-base \
                    --effective-batch-size 256 --warmup 5 --steps 10 --top 12 ;;
    candidates) step candidates 240 python -m bench.candidates --gpu --steps 40 \
                  --only compile cuda_graphs unpadded full_last_layer ;;
    repro) step repro 150 dvc repro ;;
    benchmark) step benchmark 240 python -m bench.benchmark --gpu --compile ;;
    *) echo "unknown step $1 (profile-minilm, profile-base, candidates, repro, benchmark)" >&2; exit 2 ;;
  esac
}

for name in "${@:-profile-minilm profile-base candidates repro benchmark}"; do
  for one in $name; do run_step "$one"; done
done
