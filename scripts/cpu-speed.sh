#!/usr/bin/env bash
# The CPU measurements in one run, for a CPU not measured yet, each step under its own timeout, so that
# a hung step leaves the others their time. From the project root, in the project's venv
# (`pip install -r requirements-dev.txt`), on a quiet machine:
#   bash scripts/cpu-speed.sh [STEP ...]      # default: every step, in this order (about 20 minutes
#                                              # on a 2-core Zen 4 EPYC)
# Steps (the most wanted first):
#   machine      the CPU (lscpu), the ISA torch's kernels detect and the precision the stage trains in there
#                (modeling.precision), load average
#   benchmark    python -m bench.benchmark --compile: rows 4 and 5 hold the goals of this ISA, row 7 compile
#   profile      bench.profile_step: where a default step's time goes, fp32, bf16, bf16 with fp32 attention
#   candidates   bench.candidates: each candidate change against the defaults, side by side
#   repro        the default `dvc repro` in a fresh clone of this repository's HEAD, each line timestamped
#                (seconds since the start), so each stage's time and train@0's start-up can be read off
# Logs go to CPU_SPEED_OUT, else a new folder under /tmp (its path printed); steps.log says how each ended.
set -uo pipefail
cd "$(dirname "$0")/.."
script="$(pwd)/scripts/cpu-speed.sh"
step() {  # step NAME SECONDS COMMAND...: COMMAND's output to $out/NAME.log, within SECONDS
  local name=$1 limit=$2
  shift 2
  local start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s (limit $limit s; load average $(cut -d' ' -f1-3 /proc/loadavg))" \
    | tee -a "$out/steps.log"
}

machine() {
  lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | sed 's/^Flags:.*/flags (bf16, AMX): '"$(grep -o 'amx[a-z_0-9]*\|avx512_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"'/'
  python -c 'import torch; from modeling.precision import cpu_isa, describe
trained = describe(True, "cpu")  # the precision the train stage picks here, with train.mixed_precision true
print(f"torch {torch.__version__}, ISA {cpu_isa()}, {torch.get_num_threads()} threads; the stage trains in {trained}")'
  echo "load average: $(cat /proc/loadavg)"
}

repro() {  # the default pipeline as a newcomer runs it, in a clone, so this tree's outputs stay as they are
  local clone
  clone=$(mktemp -d /tmp/cpu-speed-repro.XXXXXX)
  git clone -q . "$clone" && cd "$clone" || return 1
  dvc repro 2>&1 | python -u -c 'import sys, time
start = time.monotonic()
for line in sys.stdin:
    print(f"{time.monotonic() - start:8.1f} {line}", end="")'
  local status=${PIPESTATUS[0]}
  python -c 'import json; m = json.load(open("reports/evaluate/metrics.json"))
pick = lambda scores: {k: scores[k] for k in ("accuracy", "f1_macro", "pearson") if k in scores}
print({**{split: pick(m[split]) for split in ("val", "test") if split in m},
       **{f"baseline {split}": pick(scores) for split, scores in m.get("baseline", {}).items()}})'
  cd - >/dev/null && rm -rf "$clone"
  return "$status"
}

case ${1:-} in  # the steps that are functions of this script, run by `timeout` as commands
  _machine) machine; exit ;;
  _repro) repro; exit ;;
esac

out="${CPU_SPEED_OUT:-$(mktemp -d /tmp/cpu-speed.XXXXXX)}"  # not in the tree, where git would pick the logs up
mkdir -p "$out"
echo "logs: $out"

run_step() {
  case $1 in
    machine) step machine 60 bash "$script" _machine ;;
    benchmark) step benchmark 1200 python -m bench.benchmark --compile ;;
    profile) step profile 600 python -m bench.profile_step --warmup 20 --steps 20 --top 12 ;;
    candidates) step candidates 1800 python -m bench.candidates --steps 24 ;;
    repro) step repro 900 bash "$script" _repro ;;
    *) echo "unknown step $1 (machine, benchmark, profile, candidates, repro)" >&2; exit 2 ;;
  esac
}

for name in "${@:-machine benchmark profile candidates repro}"; do
  for one in $name; do run_step "$one"; done
done
