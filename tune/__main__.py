"""python -m tune: a hyperparameter search in which every trial is a DVC experiment.

Reads the tune section of params.yaml (the study, the objective, the pruner, the search space); each
trial is `dvc exp run --temp -n <study>-<number> -S key=value ...`, so stages a trial does not change
are restored from DVC's cache, and `dvc exp show` lists every completed trial with its params and
metrics. Optuna's TPE suggests the values; a pruner stops hopeless trials early (stages/pruning.py).
The study lives in an Optuna storage: tuning/studies.db by default, or a PostgreSQL database shared by
workers on several machines. Running the command again resumes the study.

    python -m tune                      # tune.trials trials in all, tune.study's name
    python -m tune --trials 30 --storage postgresql://tuner@db-host/studies --push origin
    python -m tune --enqueue 'train.lr=2e-5 train.epochs=3'   # a trial with these values first

Then: python -m tune.show (the table), python -m tune.report (HTML), python -m tune.best --apply,
python -m tune.blend --top 3.
"""
import argparse
import sys
import time
from pathlib import Path

from stages.common import PipelineError, run_main
from stages.progress import duration
from stages.pruning import TrialLink, make_pruner
from tune import trials as trial_runs
from tune.settings import (TUNING, current_values, evaluated_metric, finite, load_settings, objective_direction,
                           objective_metric, parse_enqueued, pruning_plan, storage_url)
from tune.study import open_storage, scrub

CHECKPOINTS = Path("checkpoints")  # a trial's train stage checkpoints here, in this clone, so a rerun resumes
MAX_FAILURES_IN_A_ROW = 3


class TrialFailed(Exception):
    """A trial whose experiment failed (not pruned): recorded as FAIL, the study goes on."""


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m tune", description="run (or resume) a hyperparameter study")
    parser.add_argument("--trials", type=int, help="trials in all, every worker together (default tune.trials)")
    parser.add_argument("--study", help="the study's name (default tune.study)")
    parser.add_argument("--storage", help="an Optuna storage URL, e.g. postgresql://user@host/db "
                        "(default $TUNE_STORAGE, tune.storage, else tuning/studies.db)")
    parser.add_argument("--push", metavar="GIT_REMOTE", help="after each trial, dvc exp push --run-cache to this "
                        "git remote (and the default DVC remote)")
    parser.add_argument("--enqueue", action="append", default=[], metavar="'KEY=VALUE ...'",
                        help="run a trial with these values first (the other keys are suggested); repeat for more trials")
    args = parser.parse_args(argv)
    if args.trials is not None and args.trials < 1:
        parser.error("--trials must be 1 or more")
    return args


def create_study(storage, settings, metric, pruner, by, fold_count):
    """The study, created with the pruner and objective, or loaded when it exists (then those must be
    what it was created with)."""
    import optuna

    name = settings["study"]
    existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    trials_so_far = existing[name].n_trials if name in existing else 0
    # reseeded by the number of trials so far, so that a resumed study's suggestions are reproducible too
    sampler = optuna.samplers.TPESampler(seed=settings["seed"] + trials_so_far, constant_liar=True,
                                         n_startup_trials=min(10, max(2, settings["trials"] // 3)))
    options = dict(study_name=name, storage=storage, sampler=sampler, pruner=make_pruner(pruner))
    try:  # only one of several workers starting a new study at once creates it (the database decides)
        study = optuna.create_study(**options, direction=settings["direction"])
        study.set_user_attr("metric", metric)
        study.set_user_attr("folds", fold_count)
        study.set_user_attr("pruning", [pruner, by])
        return study, True
    except optuna.exceptions.DuplicatedStudyError:
        study = optuna.load_study(**options)
    recorded = wait_for_attributes(study)
    if recorded["metric"] != metric or study.direction.name.lower() != settings["direction"] \
            or recorded["folds"] != fold_count:
        raise PipelineError(f"study {name!r} optimizes {recorded['metric']} ({study.direction.name.lower()}) "
                            f"over {recorded['folds']} fold(s); params.yaml now means {metric} "
                            f"({settings['direction']}) over {fold_count}: name a new tune.study for a new objective")
    if recorded["pruning"] != [pruner, by]:
        print(f"study {name!r} was pruned by {recorded['pruning'][0]}; from now on {pruner}")
        study.set_user_attr("pruning", [pruner, by])
    return study, False


def wait_for_attributes(study, timeout=30):
    """The objective a study was created with, which its creator records a moment after creating it."""
    deadline = time.monotonic() + timeout
    while not {"metric", "folds", "pruning"} <= study.user_attrs.keys() and time.monotonic() < deadline:
        time.sleep(0.5)
    if not {"metric", "folds", "pruning"} <= study.user_attrs.keys():
        raise PipelineError(f"study {study.study_name!r} was not made by python -m tune (it records no metric): "
                            "name another tune.study")
    return study.user_attrs


def check_experiment_names(name, is_new):
    """A new study must not reuse the experiment names of an earlier one of the same name."""
    import subprocess

    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname:lstrip=-1)", "refs/exps"],
                          capture_output=True, text=True).stdout.split()
    taken = sorted(r for r in refs if r.rsplit("-", 1)[0] == name and r.rsplit("-", 1)[-1].isdigit())
    if is_new and taken:
        raise PipelineError(f"experiments {', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''} come from an "
                            f"earlier study named {name!r}, not in this storage: choose another tune.study, or "
                            f"remove them (dvc exp remove {' '.join(taken[:3])} ...)")


def enqueue_first(study, space, enqueued, is_new):
    """Trials to run before any suggestion: for a new study params.yaml's own values (the settings you
    have now, the baseline every trial is compared with), then --enqueue's. A trial already in the study
    with those values is not added again (two workers starting a new study at once)."""
    if is_new:
        values = current_values(space)
        outside = [f"{key} {value!r} is not {space[key]}" for key, value in values.items() if not space[key].contains(value)]
        if outside:
            print(f"params.yaml's values are outside tune.space ({'; '.join(outside)}): no baseline trial")
        else:
            study.enqueue_trial(values, user_attrs={"baseline": True}, skip_if_exists=True)
    for values in enqueued:
        study.enqueue_trial(values, user_attrs={"enqueued": True}, skip_if_exists=True)


def recorded(study, trial):
    """The trial's user attributes as the storage holds them now (the train stage sets some)."""
    return next(t.user_attrs for t in study.get_trials(deepcopy=False) if t.number == trial.number)


def describe(params):
    return ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}" for key, value in params.items())


def main():
    import optuna

    args = parse_args(sys.argv[1:])
    settings, space, fold_count = load_settings()
    if args.study:
        settings["study"] = args.study
    if args.trials:
        settings["trials"] = args.trials
    enqueued = [parse_enqueued(text, space) for text in args.enqueue]
    metric = objective_metric(settings["metric"], fold_count, settings["kind"], settings["competition"])
    settings["direction"] = objective_direction(settings["direction"], metric)
    pruner, by = pruning_plan(settings["pruner"], fold_count, metric, settings["kind"])
    url = storage_url(args.storage, settings["storage"])
    storage = open_storage(url, heartbeat=settings["heartbeat"])
    # the tuner prints a line per trial itself; Optuna would add a traceback for each failed one
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study, is_new = create_study(storage, settings, metric, pruner, by, fold_count)
    check_experiment_names(settings["study"], is_new)
    enqueue_first(study, space, enqueued, is_new)

    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = len(study.get_trials(deepcopy=False, states=finished))
    name, logs = settings["study"], TUNING / settings["study"]
    print(f"study {name!r} in {scrub(url, url)}: {done} of {settings['trials']} trials done; "
          f"maximizing {metric}" if settings["direction"] == "maximize" else f"minimizing {metric}", end="")
    print(f"; pruner {pruner} (by {by})" if pruner != "none" else "; no pruning")
    fixed = {"train.evaluations": settings["evaluations"]} if by == "evaluation" and pruner != "none" else {}
    failures, current = [], {}

    def objective(trial):
        current["trial"] = trial.number
        params = {key: dimension.suggest(trial) for key, dimension in space.items()}
        experiment = f"{name}-{trial.number}"
        trial.set_user_attr("experiment", experiment)
        link = TrialLink(url, name, trial._trial_id, trial.number,
                         evaluated_metric(metric, settings["kind"]) or "f1_macro", by, pruner)
        log = logs / f"trial-{trial.number}.log"
        print(f"trial {trial.number} ({experiment}): {describe(params)}; log {log}", flush=True)
        outcome = trial_runs.run(experiment, {**params, **fixed}, link, log, CHECKPOINTS.resolve())
        trial.set_user_attr("seconds", round(outcome.seconds, 1))
        trial.set_user_attr("train_seconds", round(outcome.train_seconds, 1))
        took = f"in {duration(outcome.seconds)} (training {duration(outcome.train_seconds)})"
        if outcome.returncode == 0:
            failures.clear()
            value = trial_runs.lookup(trial_runs.experiment_metrics(experiment), metric)
            if not finite(value):
                raise TrialFailed(f"{trial_runs.METRICS} of {experiment} has no number at {metric} ({value!r})")
            print(f"trial {trial.number}: {metric} {value:.4f} {took}", flush=True)
            if args.push:
                trial_runs.push(args.push, experiment)
            return value
        if pruned_at := recorded(study, trial).get("pruned_at"):  # by the train stage, in the storage
            failures.clear()
            print(f"trial {trial.number}: pruned at {pruned_at} {took}", flush=True)
            raise optuna.TrialPruned()
        trial.set_user_attr("error", outcome.error[:300])
        print(f"trial {trial.number}: failed {took}: {outcome.error} (log {log})", flush=True)
        failures.append(trial.number)
        if len(failures) >= MAX_FAILURES_IN_A_ROW:
            raise PipelineError(f"trials {', '.join(map(str, failures))} failed in a row; the last: {outcome.error} "
                                f"(log {log})")
        raise TrialFailed(outcome.error)

    stop_at = optuna.study.MaxTrialsCallback(settings["trials"], states=finished)
    start = time.monotonic()
    try:
        if done < settings["trials"]:
            study.optimize(objective, callbacks=[stop_at], catch=(TrialFailed,))
    except KeyboardInterrupt:
        interrupted = [t for t in study.get_trials(deepcopy=False)
                       if t.number == current.get("trial") and t.state.name == "FAIL"]
        for t in interrupted:  # its params first when the study resumes: its train stage resumes its checkpoint
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        print(f"interrupted after {duration(time.monotonic() - start)}; the study is saved: run the same "
              "command to resume it" + (f" (trial {interrupted[0].number}'s params first, from its checkpoint)"
                                        if interrupted else ""))
        sys.exit(130)
    from tune import report, show

    show.print_table(study)
    path = report.write(study)
    print(f"report: {path}; best trial into the workspace: python -m tune.best --apply")
    return None


if __name__ == "__main__":
    run_main(main, tool="tune")
