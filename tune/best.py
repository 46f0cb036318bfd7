"""python -m tune.best: the study's best trial and its experiment; --apply brings it into the workspace
(`dvc exp apply`: its params, dvc.lock and outputs), pulling it first from --pull's git remote when
another worker ran it."""
import argparse
import subprocess
import sys

from pipeline.command import run_main
from pipeline.settings import PipelineError
from tune.study import add_study_options, open_existing, ranked, study_facts, trial_rows


def dvc(*args):
    result = subprocess.run([sys.executable, "-m", "dvc", *args], capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr or result.stdout).strip().splitlines()
        raise PipelineError(f"dvc {' '.join(args)}: {last[-1] if last else f'exited with {result.returncode}'}")
    return result.stdout


def local_experiments():
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname:lstrip=-1)", "refs/exps"],
                          capture_output=True, text=True).stdout.split()
    return set(refs)


def best_row(study):
    metric, direction, folds = study_facts(study)
    done = [r for r in ranked(trial_rows(study, folds), direction) if r.value is not None]
    if not done:
        raise PipelineError(f"study {study.study_name!r} has no completed trial yet")
    return done[0], metric


def main():
    parser = argparse.ArgumentParser(prog="python -m tune.best", description="the best trial of a study")
    add_study_options(parser)
    parser.add_argument("--apply", action="store_true", help="dvc exp apply it: its params and outputs into the workspace")
    parser.add_argument("--pull", metavar="GIT_REMOTE", help="dvc exp pull it from this git remote first if it is not here")
    args = parser.parse_args(sys.argv[1:])
    best, metric = best_row(open_existing(args))
    print(f"best: trial {best.number}, {metric} {best.value:.4f}, experiment {best.experiment}")
    print("  " + ", ".join(f"{key} {value}" for key, value in best.params.items()))
    if best.experiment not in local_experiments():
        if not args.pull:
            if args.apply:
                raise PipelineError(f"experiment {best.experiment} is not in this clone (another worker ran it): "
                                    "add --pull <git remote>, e.g. --pull origin")
            return
        dvc("exp", "pull", "--run-cache", args.pull, best.experiment)
    if args.apply:
        dvc("exp", "apply", best.experiment)
        print(f"applied {best.experiment}: params.yaml and the outputs are that trial's; commit them to keep them")


if __name__ == "__main__":
    run_main(main, tool="tune.best")
