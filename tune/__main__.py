"""python -m tune: a hyperparameter search in which every trial is a DVC experiment.

Reads the tune section of params.yaml (the study, the objective, the pruner, the search space); each
trial is `dvc exp run --temp -n <study>-<number> -S key=value ...`, so stages a trial does not change
are restored from DVC's cache, and `dvc exp show` lists every completed trial with its params and
metrics. Optuna's TPE suggests the values; a pruner stops hopeless trials early (training/pruning.py).
The study lives in an Optuna storage: tuning/studies.db by default, or a PostgreSQL database shared by
workers on several machines. Running the command again resumes the study.

    python -m tune                      # tune.trials trials in all, tune.study's name
    python -m tune --trials 30 --storage postgresql://tuner@db-host/studies --push origin
    python -m tune --enqueue 'train.lr=2e-5 train.epochs=3'   # a trial with these values first

Then: python -m tune.show (the table), python -m tune.report (HTML), python -m tune.best --apply,
python -m tune.blend --top 3.
"""
import argparse
import signal
import sys
import time

from pipeline.command import run_main
from pipeline.settings import PipelineError, load_params
from training import checkpoint
from training.progress import duration
from training.pruning import TrialLink
from tune import budget
from tune import trials as trial_runs
from tune.settings import (
    TUNING,
    evaluated_metric,
    finite,
    load_settings,
    objective_direction,
    objective_metric,
    parse_enqueued,
    pruning_plan,
    storage_url,
)
from tune.study import check_experiment_names, create_study, enqueue_first, open_storage, scrub

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


def recorded(study, trial):
    """The trial's user attributes as the storage holds them now (the train stage sets some)."""
    return next(t.user_attrs for t in study.get_trials(deepcopy=False) if t.number == trial.number)


def opening_line(name, url, done, trials, direction, metric, pruner, by):
    """The tuner's first line: the study, how far it is, what it optimizes and how it prunes."""
    pruning = f"pruner {pruner} (by {by})" if pruner != "none" else "no pruning"
    verb = "maximizing" if direction == "maximize" else "minimizing"
    return f"study {name!r} in {scrub(url, url)}: {done} of {trials} trials done; {verb} {metric}; {pruning}"


def describe(params):
    return ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}" for key, value in params.items())


def main():
    import optuna

    # Ctrl-C stops the study cleanly (its trial saves a checkpoint) even when the tuner was started by a
    # parent that ignores SIGINT (a script's background job, a test runner): Python keeps an inherited
    # SIG_IGN instead of raising KeyboardInterrupt, and the trial would run on
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
    print(opening_line(name, url, done, settings["trials"], settings["direction"], metric, pruner, by))
    fixed = {"train.evaluations": settings["evaluations"]} if by == "evaluation" and pruner != "none" else {}
    failures, current = [], {}
    # trials run in temporary copies: their checkpoints go to this clone's folder, where a rerun finds them
    # ($PIPELINE_CHECKPOINTS first, as for the stages: a rented machine's bucket, scripts/worker.sh)
    checkpoints = checkpoint.root(load_params("machine").get("checkpoint_dir", "checkpoints")).resolve()

    def objective(trial):
        current["trial"] = trial.number
        params = {key: dimension.suggest(trial) for key, dimension in space.items()}
        experiment = f"{name}-{trial.number}"
        trial.set_user_attr("experiment", experiment)
        link = TrialLink(url, name, trial._trial_id, trial.number,
                         evaluated_metric(metric, settings["kind"]) or "f1_macro", by, pruner,
                         settings["pruner_startup"])
        log = logs / f"trial-{trial.number}.log"
        print(f"trial {trial.number} ({experiment}): {describe(params)}; log {log}", flush=True)
        outcome = trial_runs.run(experiment, {**params, **fixed}, link, log, checkpoints)
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

    start = time.monotonic()
    try:
        budget.optimize(study, objective, settings["trials"], catch=(TrialFailed,))
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
