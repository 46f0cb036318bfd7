"""Opening a study (Optuna's RDB storage: the SQLite default or PostgreSQL) with one-line errors that
never show a password; creating it with its objective and first trials; and reading its trials back
as plain rows for the table, the report, the best trial and the blend."""
import re
import subprocess
import time
from dataclasses import dataclass

from pipeline.command import redact
from pipeline.settings import PipelineError
from training.pruning import engine_kwargs, make_pruner
from tune.budget import OVER_BUDGET
from tune.settings import current_values


def scrub(text, url):
    """`text` with the storage URL's password removed wherever it appears (a driver's message may
    quote the connection string)."""
    password = re.search(r"://[^/@\s:]*:([^/@\s]+)@", url or "")
    if password:
        text = text.replace(password[1], "***")
    return redact(text)


def first_line(error):
    """An exception's first line, without SQLAlchemy's pointer to its web page."""
    text = str(getattr(error, "orig", None) or error).strip().splitlines()
    return (text[0] if text else type(error).__name__).split(" (Background on this error")[0]


def open_storage(url, heartbeat=None, retries=3):
    """Optuna's RDBStorage at url. heartbeat (seconds): running trials of this process record signs of
    life; one silent for twice that is failed by the next worker to start a trial, and its params are
    tried again (up to twice). A database that cannot be reached or refuses the login is one line."""
    import warnings

    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)  # heartbeats are "experimental"
    extra = {}
    if heartbeat:
        extra = {"heartbeat_interval": heartbeat,
                 "heartbeat_stale_trial_callback": optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=2)}
    for attempt in range(retries):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs(url), **extra)
        except (SQLAlchemyError, ImportError, ValueError, OSError) as e:
            # two workers creating one new database's tables at once: the loser retries
            if attempt + 1 == retries or not re.search(r"already exists|duplicate key|locked", str(e), re.I):
                raise PipelineError(f"tune storage {scrub(url, url)}: {scrub(first_line(e), url)}") from None
            time.sleep(1 + attempt)


def load_study(storage, name, url):
    import optuna

    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        known = [s.study_name for s in optuna.get_all_study_summaries(storage)]
        raise PipelineError(f"tune storage {scrub(url, url)} has no study {name!r}"
                            + (f"; it has {', '.join(known)}" if known else "")) from None


def create_study(storage, settings, metric, pruner, by, fold_count):
    """The study, created with the pruner and objective, or loaded when it exists (then those must be
    what it was created with)."""
    import optuna

    from tune.sampling import SeededPerTrial

    name = settings["study"]
    # each trial's draws seeded by its number: workers sharing the study never draw alike, and a resumed
    # study's suggestions are reproducible too
    sampler = SeededPerTrial(settings["seed"], constant_liar=True,
                             n_startup_trials=min(10, max(2, settings["trials"] // 3)))
    options = dict(study_name=name, storage=storage, sampler=sampler, pruner=make_pruner(pruner, settings["pruner_startup"]))
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


@dataclass
class TrialRow:
    """What a person reads about one trial."""
    number: int
    state: str            # COMPLETE, PRUNED, FAIL, RUNNING, WAITING
    value: float          # the objective (None unless complete)
    params: dict
    experiment: str       # the DVC experiment holding it (None when it did not complete)
    note: str             # where it was pruned, why it failed, that it is the baseline
    seconds: float        # wall time of the trial
    train_seconds: float  # of which its train stages ran
    steps: tuple          # (optimizer steps run, steps of the whole run) over its folds


def trial_steps(trial, fold_count):
    """(steps run, steps a full run takes) over a trial's folds, from what its train stages recorded;
    a fold that never started counts as long as the trial's others."""
    folds = [trial.user_attrs[f"steps fold {k}"] for k in range(fold_count) if f"steps fold {k}" in trial.user_attrs]
    if not folds:
        return (0, 0)
    done, total = sum(d for d, _ in folds), sum(t for _, t in folds)
    return done, total + (fold_count - len(folds)) * total / len(folds)


def trial_rows(study, fold_count):
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    rows = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        if attrs.get(OVER_BUDGET):  # given back before it started (tune/budget.py)
            continue
        note = attrs.get("pruned_at") and f"pruned at {attrs['pruned_at']}" or attrs.get("error") or ""
        if attrs.get("baseline"):
            note = "params.yaml's values" + (f"; {note}" if note else "")
        retry_of = attrs.get("retry_of", RetryHeartbeatStaleTrialCallback.retried_trial_number(t))
        if retry_of is not None:
            note = f"retry of trial {retry_of}" + (f"; {note}" if note else "")
        rows.append(TrialRow(t.number, t.state.name, t.value if t.state.name == "COMPLETE" else None, t.params,
                             attrs.get("experiment") if t.state.name == "COMPLETE" else None, note,
                             attrs.get("seconds"), attrs.get("train_seconds"), trial_steps(t, fold_count)))
    return rows


def ranked(rows, direction):
    """Complete trials best first, then the others by number."""
    done = sorted((r for r in rows if r.value is not None), key=lambda r: r.value, reverse=direction == "maximize")
    return done + [r for r in rows if r.value is None]


def steps_saved(rows):
    """The share of training steps pruning saved: 1 - steps run / steps every trial would have run to
    its end, over the trials that trained (None before any did)."""
    done = sum(r.steps[0] for r in rows)
    total = sum(r.steps[1] for r in rows)
    return 1 - done / total if total else None


def add_study_options(parser):
    parser.add_argument("--study", help="the study's name (default tune.study in params.yaml)")
    parser.add_argument("--storage", help="its Optuna storage URL (default $TUNE_STORAGE, tune.storage, else "
                        "tuning/studies.db)")


def open_existing(args):
    """The study that --study/--storage (or params.yaml's tune section) name, for reading."""
    import optuna

    from pipeline.settings import load_params
    from tune.settings import storage_url

    tune = load_params("tune")
    url = storage_url(args.storage, tune.get("storage"))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return load_study(open_storage(url), args.study or tune.get("study"), url)


def study_facts(study):
    """(metric, direction, folds) the study was created with."""
    return study.user_attrs["metric"], study.direction.name.lower(), study.user_attrs["folds"]
