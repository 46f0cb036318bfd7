#!/usr/bin/env bash
# One rented machine's share of the work, in a clone of the repository at the commit to run: what
# scripts/skypilot/*.yaml run on each machine (docs/rented-gpus.md). Everything comes from the
# environment, so it runs the same on any machine with the requirements installed.
#
#   bash scripts/worker.sh tune    one worker of python -m tune: joins the study, pushes every trial
#   bash scripts/worker.sh folds   trains the folds in $FOLDS, pushing each as it finishes
#
#   CHECKPOINT_DIR  required: this worker's own folder on storage that outlives the machine (a mounted
#                   bucket); the machine that replaces a lost one resumes from the checkpoints there
#   TUNE_STORAGE    tune, required: the study's database, postgresql://user:password@host/db (a secret)
#   FOLDS           folds, required: the folds to train, e.g. "0 2"
#   TRIALS          tune: trials in all, every worker together (default tune.trials)
#   DVC_REMOTE      the DVC remote to pull from and push to (default: the repository's default remote)
#   GIT_REMOTE      tune: the git remote that gets each trial's experiment (default origin)
#   GIT_TOKEN       tune: a token that may push to that remote over https (a secret)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "error: $*" >&2; exit 2; }
require() { [ -n "${!1:-}" ] || fail "$1 is not set: $2 (docs/rented-gpus.md)"; }

mode=${1:-}
[ "$mode" = tune ] || [ "$mode" = folds ] || fail "usage: bash scripts/worker.sh tune|folds"
require CHECKPOINT_DIR "this worker's folder on storage that outlives the machine, e.g. a mounted bucket"
if [ "$mode" = tune ]; then
  require TUNE_STORAGE "the study's database, postgresql://user:password@host/db"
else
  require FOLDS 'the folds to train, e.g. FOLDS="0 2"'
  for fold in $FOLDS; do [[ $fold =~ ^[0-9]+$ ]] || fail "FOLDS: '$fold' is not a fold number"; done
fi

# a new machine has no git identity for the trials' commits (DVC experiments): this one names the machine
git config user.email >/dev/null || git config user.email "worker@$(hostname)"
git config user.name >/dev/null || git config user.name "pipeline worker"
# in .dvc/config.local, so every DVC command here uses it, python -m tune's pushes included
if [ -n "${DVC_REMOTE:-}" ]; then
  dvc remote default --local "$DVC_REMOTE" 2>/dev/null \
    || fail "DVC_REMOTE: no remote named '$DVC_REMOTE' in .dvc/config (dvc remote list)"
fi
remote=$(dvc remote default 2>/dev/null) \
  || fail "no DVC remote to share results through: set DVC_REMOTE or commit one (docs/remotes.md)"
# the stages put their checkpoints here, and python -m tune its trials'
export PIPELINE_CHECKPOINTS=$CHECKPOINT_DIR
echo "worker $mode: checkpoints in $CHECKPOINT_DIR, DVC remote '$remote'"

if [ "$mode" = tune ]; then
  # python -m tune pushes each trial to this git remote; over https, with $GIT_TOKEN in its URL as SkyPilot's
  # own clone of a private repository has it (in this clone's .git/config only; tune masks it in messages)
  git_remote=${GIT_REMOTE:-origin}
  url=$(git remote get-url "$git_remote" 2>/dev/null) || fail "GIT_REMOTE: no git remote named '$git_remote'"
  if [ -n "${GIT_TOKEN:-}" ] && [[ $url =~ ^https://([^/@]*@)?(.+)$ ]]; then
    git remote set-url "$git_remote" "https://x-access-token:$GIT_TOKEN@${BASH_REMATCH[2]}"
  fi
  # the outputs of the team's last committed run: stages a trial does not change are not run again
  [ ! -f dvc.lock ] || dvc pull --allow-missing
  exec python -m tune --push "$git_remote" ${TRIALS:+--trials "$TRIALS"}
fi
for fold in $FOLDS; do
  dvc repro --pull "train@$fold"
  # before the next fold starts: a lost machine costs at most the fold it was training
  dvc push --run-cache
done
