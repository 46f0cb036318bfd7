"""The tune section of params.yaml, checked like every stage's settings: the study, its objective and
pruner, and the search space, each dimension checked against the setting it searches (train.lr's
low of 0 is refused as train.lr itself would be). Pure functions apart from load_settings."""
import importlib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.command import redact
from pipeline.settings import PARAMS_FILE, SEEDS, PipelineError, Range, check_kind, load_params
from tasks.scores import LOWER_IS_BETTER
from tasks.shapes import SHAPES, headline, task_params
from training.learning_rate import AUTO
from training.pruning import PRUNERS

TUNING = Path("tuning")  # the studies' database, trial logs, reports and blends; ignored by git and DVC
DEFAULT_STORAGE = TUNING / "studies.db"
STORAGE_ENV = "TUNE_STORAGE"  # a storage URL with a password belongs here (or in --storage), not in params.yaml
TUNE_PARAMS = {"study": (str,), "trials": (int, Range(1)), "metric": (str,), "direction": ("auto", "maximize", "minimize"),
               "seed": (int, SEEDS), "pruner": ("auto", *PRUNERS),
               "pruner_startup": (int, Range(0, 100)), "evaluations": (int, Range(1)),
               "heartbeat": (int, Range(1, 3600)), "storage": (str, None), "space": (dict,)}
STUDY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # it names experiments: a git ref's rules
# where each params.yaml section's checks live (module:name), imported only for the sections searched
SECTION_SPECS = {"preprocess": "stages.preprocess:PREPROCESS_PARAMS", "model": "modeling.models:MODEL_PARAMS",
                 "tokenize": "stages.tokenize:TOKENIZE_PARAMS", "split": "stages.split:SPLIT_PARAMS",
                 "train": "training.settings:TRAIN_PARAMS"}
# not searchable: what the data is (fetch), what the score means (cv.folds), the study itself
NOT_SEARCHED = {"fetch": "it changes the data", "cv": "it changes what the score means",
                "task": "it changes what the score means", "tune": "it is the study"}


@dataclass(frozen=True)
class Dimension:
    """One searched setting: choices, or a range from low to high (log-scaled, stepped)."""
    key: str
    choices: tuple = ()
    low: float = None
    high: float = None
    log: bool = False
    step: float = None

    @property
    def integer(self):
        return not self.choices and all(isinstance(v, int) for v in (self.low, self.high, self.step or 1))

    def suggest(self, trial):
        if self.choices:
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.key, self.low, self.high, step=self.step or 1, log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def contains(self, value):
        if self.choices:
            return value in self.choices
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high

    def __str__(self):
        if self.choices:
            return f"one of {list(self.choices)}"
        return f"{self.low:g} to {self.high:g}" + (" (log scale)" if self.log else "") + \
            (f" in steps of {self.step:g}" if self.step else "")


def section_spec(section):
    module, name = SECTION_SPECS[section].split(":")
    return getattr(importlib.import_module(module), name)


def parse_dimension(key, spec, params):
    """A Dimension from tune.space's entry `key: spec`, each value checked as params.yaml's `key` is."""
    where = f"{PARAMS_FILE}: tune.space {key}"
    section, _, name = key.partition(".")
    if section in NOT_SEARCHED:
        raise PipelineError(f"{where}: {section}.* cannot be searched ({NOT_SEARCHED[section]})")
    if section not in SECTION_SPECS or not name or name not in section_spec(section):
        known = ", ".join(f"{s}.*" for s in SECTION_SPECS)
        raise PipelineError(f"{where}: not a setting of params.yaml; tune.space takes keys of {known} "
                            "(e.g. train.lr)")
    if name not in params.get(section, {}):
        raise PipelineError(f"{where}: params.yaml has no {key} to search")
    kinds = section_spec(section)[name]
    if not isinstance(spec, dict) or not ({"choices"} <= spec.keys() or {"low", "high"} <= spec.keys()):
        raise PipelineError(f"{where}: expected {{choices: [...]}} or {{low: ..., high: ...}} "
                            f"(optionally log: true, step: ...), not {spec!r}")
    unknown = sorted(set(spec) - ({"choices"} if "choices" in spec else {"low", "high", "log", "step"}))
    if unknown:
        raise PipelineError(f"{where}: unknown field {unknown[0]!r}; a range takes low, high, log and step, "
                            "choices stands alone")
    if "choices" in spec:
        choices = spec["choices"]
        if not isinstance(choices, list) or not choices:
            raise PipelineError(f"{where}: choices must be a non-empty list, not {choices!r}")
        if len(set(map(repr, choices))) < len(choices):
            raise PipelineError(f"{where}: choices {choices!r} repeat a value")
        return Dimension(key, choices=tuple(check_kind(c, kinds, f"{where}: choice") for c in choices))
    numeric = tuple(kind for kind in kinds if not isinstance(kind, str))  # a range's bounds are numbers, never auto
    low, high = (as_written(spec[b], check_kind(spec[b], numeric, f"{where}: {b}")) for b in ("low", "high"))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        raise PipelineError(f"{where}: low and high must be numbers; for other values use choices")
    if not low < high:
        raise PipelineError(f"{where}: low {low!r} must be below high {high!r}")
    log = check_kind(spec.get("log", False), (bool,), f"{where}: log")
    if log and low <= 0:
        raise PipelineError(f"{where}: a log scale needs low above 0, not {low!r}")
    step = spec.get("step")
    if step is not None:
        step = as_written(step, check_kind(step, (float,), f"{where}: step"))
        if step <= 0 or log:
            raise PipelineError(f"{where}: step must be above 0 and cannot go with log, not {spec['step']!r}")
    return Dimension(key, low=low, high=high, log=log, step=step)


def as_written(raw, checked):
    """A bound as check_kind returns it, but whole numbers written as such stay whole: a range of
    them is searched in whole numbers (train.epochs from 1 to 3: 1, 2 or 3)."""
    return int(checked) if isinstance(raw, int) and not isinstance(raw, bool) else checked


def objective_metric(metric, fold_count, kind="classification", competition="f1_macro"):
    """The metrics key the study optimizes: tune.metric, or for auto the competition's metric (task.metric)
    on the holdout rows with one fold (val.f1_macro by default) and out of fold with several
    (oof.f1_macro). A key evaluate never writes for this task shape is a one-line error."""
    if metric == "auto":
        return f"{'val' if fold_count == 1 else 'oof'}.{competition}"
    splits = ("val", "test") if fold_count == 1 else ("oof", "test")
    scores = headline(kind, competition)
    known = [f"{s}.{m}" for s in splits for m in scores]
    if fold_count > 1:
        known += [f"cv.{m}_{stat}" for m in scores for stat in ("mean", "std")]
    if metric not in known:
        raise PipelineError(f"{PARAMS_FILE}: tune.metric {metric!r} is not a score of "
                            f"reports/evaluate/metrics.json with {fold_count} fold(s); one of: auto, {', '.join(known)}")
    return metric


def evaluated_metric(metric, kind="classification"):
    """The train stage's per-evaluation score that stands for `metric` while a trial runs (f1_macro for
    val.f1_macro, oof.f1_macro or cv.f1_macro_mean); None when none does (a spread, say)."""
    name = metric.split(".", 1)[1].removesuffix("_mean")
    return name if name in SHAPES[kind].evaluated else None


def objective_direction(direction, metric):
    """tune.direction, or for auto: minimize an error or loss (RMSE, MAE, log loss and their means and
    spreads), maximize the others (a spread too, as ever: say minimize to prefer steady folds)."""
    if direction != "auto":
        return direction
    name = metric.split(".", 1)[1].removesuffix("_mean").removesuffix("_std")
    return "minimize" if name in LOWER_IS_BETTER else "maximize"


def pruning_plan(pruner, fold_count, metric, kind="classification"):
    """(pruner, "evaluation" or "fold"): what prunes a trial and at which points. auto: successive
    halving over the evaluations with one fold, the median rule over the folds with several."""
    by = "evaluation" if fold_count == 1 else "fold"
    if pruner == "auto":
        pruner = "halving" if by == "evaluation" else "median"
    if pruner == "wilcoxon" and fold_count < 5:
        # its smallest one-sided p-value after n paired folds is 1/2^n: below 0.1 only from 4 folds on
        raise PipelineError(f"{PARAMS_FILE}: tune.pruner wilcoxon cannot stop a trial of {fold_count} "
                            "fold(s) (its test needs 4 finished folds to reach p < 0.1): use median, or more folds")
    if evaluated_metric(metric, kind) is None and pruner != "none":
        print(f"tune.metric {metric}: no score of a running trial stands for it, so trials are not pruned")
        pruner = "none"
    return pruner, by


def storage_url(option, setting):
    """The study's storage: --storage, else $TUNE_STORAGE, else tune.storage, else tuning/studies.db
    (SQLite, made on first use). A password in params.yaml (a committed file) is refused."""
    if setting and re.search(r"://[^/@\s]*:[^/@\s]*@", setting):
        raise PipelineError(f"{PARAMS_FILE}: tune.storage holds a password ({redact(setting)}); params.yaml is "
                            f"committed: pass the URL with --storage or ${STORAGE_ENV}, or keep the password in "
                            "~/.pgpass or $PGPASSWORD")
    url = option or os.environ.get(STORAGE_ENV) or setting
    if not url:
        TUNING.mkdir(exist_ok=True)
        return f"sqlite:///{DEFAULT_STORAGE.resolve()}"
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):  # relative: from this folder,
        url = f"sqlite:///{Path(url.removeprefix('sqlite:///')).resolve()}"  # also for trials run elsewhere
    if url.startswith(("postgresql://", "postgres://")):  # psycopg 3 (requirements.txt), whatever
        url = "postgresql+psycopg://" + url.split("://", 1)[1]  # SQLAlchemy's default driver is
    return url


def yaml_value(value):
    """A value as `dvc exp run -S key=value` reads it back (YAML): 1e-05 as 1.0e-05, a float, not a string."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n").removesuffix("\n...")


def parse_enqueued(text, space):
    """{key: value} of one trial to run first, from --enqueue 'KEY=VALUE KEY=VALUE': searched keys, and
    values their settings accept (outside the searched range is allowed: that is what it is for)."""
    values = {}
    for assignment in text.split():
        key, sep, raw = assignment.partition("=")
        if not sep or key not in space:
            raise PipelineError(f"--enqueue {assignment!r}: expected KEY=VALUE with KEY one of tune.space's keys "
                                f"({', '.join(space)})")
        section, _, name = key.partition(".")
        values[key] = check_kind(yaml.safe_load(raw), section_spec(section)[name], f"--enqueue {key}")
    return values


def load_settings(path=PARAMS_FILE):
    """(tune settings, search space {key: Dimension}, the number of folds): everything checked before a
    trial runs, each problem one line naming the key. The settings gain the task shape (`kind`) and the
    competition's metric (`competition`, task.metric resolved)."""
    settings = load_params("tune", TUNE_PARAMS, path)
    task = task_params(path)
    settings.update(kind=task["kind"], competition=task["metric"])
    if not STUDY_NAME_RE.match(settings["study"]):
        raise PipelineError(f"{path}: tune.study {settings['study']!r} names experiments: letters, digits, "
                            "'.', '_' and '-', starting with a letter or digit")
    with open(path, encoding="utf-8") as f:
        params = yaml.safe_load(f)
    if not settings["space"]:
        raise PipelineError(f"{path}: tune.space is empty: name at least one setting to search")
    space = {key: parse_dimension(key, spec, params) for key, spec in settings["space"].items()}
    folds = params.get("cv", {}).get("folds")
    fold_count = len(folds) if isinstance(folds, list) and folds else 1
    return settings, space, fold_count


def current_values(space, path=PARAMS_FILE):
    """The values params.yaml holds now for each searched key."""
    with open(path, encoding="utf-8") as f:
        params = yaml.safe_load(f)
    values = {key: params[key.split(".")[0]][key.split(".", 1)[1]] for key in space}
    if values.get("train.lr") == AUTO:  # the number auto picks for this model, as the train stage will
        from training.learning_rate import auto_lr, weights_of

        model = params["model"]
        values["train.lr"] = auto_lr(weights_of(model["name"], model.get("trust_remote_code", False)),
                                     params["train"].get("lora_rank", 0) > 0)
    return values


def finite(value):
    return isinstance(value, (int, float)) and math.isfinite(value)
