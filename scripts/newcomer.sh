#!/usr/bin/env bash
# The README's two commands as a new user runs them, in the README's order, in one fresh clone: the
# quick-start line (the CPU-only one on a machine without an NVIDIA driver, as the README says), then
# the test command. The clone is of this repository's committed HEAD (uncommitted changes are not in
# it). Arguments go to pytest, as with scripts/test.sh:
#   bash scripts/newcomer.sh                      # everything (the quick start's dvc repro: ~6 min on 2 cores)
#   bash scripts/newcomer.sh -k test_install -x   # the whole quick start, then only these tests
# NEWCOMER_DIR names the clone's folder (default: a new one under /tmp); it must not exist yet. The clone
# stays (several GB: the last line says how much); delete it once its logs are read.
# NEWCOMER_QUICKSTART replaces the README's line (only for a machine that cannot reach what it names,
# e.g. download.pytorch.org: the same line with a local torch wheel); it must still make .venv.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
clone="${NEWCOMER_DIR:-$(mktemp -d /tmp/newcomer.XXXXXX)/repo}"
if [ -e "$clone" ]; then
  echo "error: $clone exists; the newcomer's clone must be fresh (set NEWCOMER_DIR to a new folder)" >&2
  exit 1
fi
git clone -q "$repo" "$clone"
git -C "$clone" checkout -q --detach "$(git -C "$repo" rev-parse HEAD)"
cd "$clone"

# the quick-start lines are the first two ```bash blocks after "## Quick start": generic, then CPU-only
lines=$(awk '/^## Quick start/ {on=1} on && /^```bash/ {block=1; next} block && /^```/ {block=0; n++; if (n == 2) exit}
             block {print}' README.md)
if [ -e /proc/driver/nvidia/version ]; then line=$(sed -n 1p <<<"$lines"); else line=$(sed -n 2p <<<"$lines"); fi
case "$line" in
  "python3 -m venv .venv && "*"dvc repro") ;;
  *) echo "error: README.md's quick start is not the line this script expects: ${line:-nothing found}" >&2; exit 1 ;;
esac
line="${NEWCOMER_QUICKSTART:-$line}"
echo "newcomer: in $clone"
echo "newcomer: the quick start: $line"
# a new shell, as a user's: no virtualenv of this session active
user_path=$(sed "s|${VIRTUAL_ENV:-/nonexistent}/bin:||g" <<<"$PATH")
env -u VIRTUAL_ENV -u PYTHONPATH PATH="$user_path" bash -euo pipefail -c "$line"
echo "newcomer: the test command: bash scripts/test.sh $*"
status=0
env -u VIRTUAL_ENV -u PYTHONPATH PATH="$user_path" bash scripts/test.sh "$@" || status=$?
# the clone's .venv holds the quick start's torch, where pip picked a CUDA build several GB with its
# libraries: a few clones left behind once filled the disk
echo "newcomer: the tests exited $status; the clone stays for reading, $(du -sh "$clone" | cut -f1): rm -rf $clone"
exit "$status"
