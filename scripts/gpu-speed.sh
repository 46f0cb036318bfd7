#!/usr/bin/env bash
# The GPU measurements in one prepared run on a lent GPU machine, each step under its own timeout and
# all under one deadline, so that a hung step leaves the others their time and the logs come back.
# Prepare here with `bash ../shared/gpu/prepare.sh` (fills .gpu/), then on the machine, from the project
# root, with .gpu carried along:
#   bash scripts/gpu-speed.sh [STEP ...]      # default: every step, in this order
# Steps (the most wanted first), with the seconds each took on an H200 and on an H100 (bench/README.md):
#   candidates      bench.candidates --gpu: SDPA without cuDNN's kernel, fp32 (TF32), torch.compile, CUDA
#                   graphs, each against the defaults side by side (MiniLM, the default batch), after one
#                   untimed run of the defaults (about 150 s with padding-free batches too; the H100 98 s)
#   candidates-base the same for a bert-base-sized model at an effective batch of 256 (about 150 s; 139 s)
#   profile-minilm  bench.profile_step --gpu: where a default MiniLM step's time goes, fp32 and bf16, after
#                   150 untimed steps: the first steps of each batch shape are slower (38 s with 5; 23 s)
#   profile-base    the same for the bert-base-sized model at an effective batch of 256 (43 s with 5; 37 s)
#   repro           the default `dvc repro` (113 s; 58 s; its log holds the train stage's choices and speed)
#   benchmark       python -m bench.benchmark --gpu --training-only --compile: rows 3-5 and row 7, compile's
#                   cost (all 107 s on the H100, padding-free rows included); a second call, as
#                   `bash scripts/gpu-speed.sh benchmark`, where the first one's deadline cut it
# Logs go to $OUT (the device tool's folder), else a new folder under /tmp (its path printed); the deadline is
# GPU_SPEED_SECONDS (default 570: under the device tool's 600 s per command).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$(mktemp -d /tmp/gpu-speed.XXXXXX)}"  # not in the tree, where git would pick the logs up
mkdir -p "$out"
echo "logs: $out"
deadline=$(( $(date +%s) + ${GPU_SPEED_SECONDS:-570} ))
[ -f .gpu/setup.sh ] && . .gpu/setup.sh >"$out/setup.log" 2>&1
nvidia-smi >>"$out/setup.log" 2>&1  # one file fewer: the device tool brings 8 back

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
    candidates) step candidates 170 python -m bench.candidates --gpu --steps 40 \
                  --only no_cudnn_attention fp32 compile cuda_graphs ;;
    candidates-base) step candidates-base 170 python -m bench.candidates --gpu --steps 40 --model bert-base \
                       --effective-batch-size 256 --only no_cudnn_attention fp32 compile ;;
    profile-minilm) step profile-minilm 70 python -m bench.profile_step --gpu --steps 10 --top 12 ;;
    profile-base) step profile-base 80 python -m bench.profile_step --gpu --model bert-base \
                    --effective-batch-size 256 --steps 10 --top 12 ;;
    repro) step repro 130 dvc repro ;;
    benchmark) step benchmark 280 python -m bench.benchmark --gpu --training-only --compile ;;
    *) echo "unknown step $1 (candidates, candidates-base, profile-minilm, profile-base, repro, benchmark)" >&2
       exit 2 ;;
  esac
}

for name in "${@:-candidates candidates-base profile-minilm profile-base repro benchmark}"; do
  for one in $name; do run_step "$one"; done
done
