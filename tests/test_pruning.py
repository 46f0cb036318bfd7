"""The train stage's side of tuning (training/pruning.py) against a real Optuna study in SQLite, and the
tune section's checks (tune/settings.py): evaluations evenly spaced, the default pruner (successive
halving) stopping a trial at an early evaluation but never at the last, the median rule stopping a
trial between folds, a study that cannot be reached not stopping the training, and every bad search
space named in one line."""
import math

import optuna
import pytest
import yaml
from transformers import TrainerControl, TrainerState, TrainingArguments

from pipeline.settings import PipelineError
from tests.test_pipeline import REPO
from training.pruning import EvaluateEvenly, EvaluationReporter, TrialLink, make_pruner, prune_at_fold, report_fold
from tune.settings import load_settings, objective_metric, parse_dimension, parse_enqueued, pruning_plan, storage_url, yaml_value

ARGS = TrainingArguments(output_dir="unused", report_to="none")


def evaluation_steps(n, max_steps):
    """The steps at which EvaluateEvenly asks Trainer for an evaluation."""
    callback, steps = EvaluateEvenly(n), []
    for step in range(1, max_steps + 1):
        control = TrainerControl()
        callback.on_step_end(ARGS, TrainerState(global_step=step, max_steps=max_steps), control)
        if control.should_evaluate:
            steps.append(step)
    return steps


@pytest.mark.parametrize("n, max_steps", [(1, 10), (3, 10), (4, 17), (4, 100), (3, 3)])
def test_evaluations_fall_evenly_and_the_last_at_the_end(n, max_steps):
    assert evaluation_steps(n, max_steps) == [math.ceil(k * max_steps / n) for k in range(1, n + 1)]


def new_study(tmp_path, pruner, name="s", startup=0):
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    study = optuna.create_study(study_name=name, storage=url, pruner=make_pruner(pruner, startup), direction="maximize")
    return study, url


def link_for(trial, url, by, pruner, startup=0):
    return TrialLink(url, "s", trial._trial_id, trial.number, "f1_macro", by, pruner, startup)


def evaluate(reporter, score, step, max_steps):
    """Trainer's evaluation at `step` as the reporter sees it; returns the control it leaves."""
    control = TrainerControl()
    reporter.on_evaluate(ARGS, TrainerState(global_step=step, max_steps=max_steps), control,
                         metrics={"eval_f1_macro": score})
    return control


def run_trial(study, url, scores, max_steps=30, pruner="halving", startup=0):
    """A trial of 3 evaluations reporting `scores` in turn through EvaluationReporter, as the train stage
    would; told complete unless it was pruned. Returns (reporter, trial)."""
    trial = study.ask()
    reporter = EvaluationReporter(link_for(trial, url, "evaluation", pruner, startup), 3)
    for k, score in enumerate(scores, start=1):
        control = evaluate(reporter, score, k * max_steps // 3, max_steps)
        if control.should_training_stop:
            break
    reporter.on_train_end(ARGS, TrainerState(global_step=k * max_steps // 3, max_steps=max_steps), TrainerControl())
    study.tell(trial, scores[-1] if not reporter.pruned else None,
               state=optuna.trial.TrialState.PRUNED if reporter.pruned else optuna.trial.TrialState.COMPLETE)
    return reporter, study.trials[trial.number]


def test_halving_stops_a_trial_worse_at_the_first_evaluation(tmp_path):
    study, url = new_study(tmp_path, "halving")
    first, _ = run_trial(study, url, [0.6, 0.8, 0.9])
    assert not first.pruned  # nothing to compare with yet
    worse, trial = run_trial(study, url, [0.3, 0.9, 0.95])
    assert worse.pruned == 1 and trial.user_attrs["pruned_at"] == "evaluation 1 of 3"
    assert trial.user_attrs["steps fold 0"] == [10, 30]  # ran 10 of its 30 steps
    assert list(trial.intermediate_values) == [1]
    better, trial = run_trial(study, url, [0.7, 0.85, 0.92])
    assert not better.pruned and trial.state.name == "COMPLETE" and trial.user_attrs["steps fold 0"] == [30, 30]


@pytest.mark.parametrize("pruner", ["halving", "median"])
def test_no_trial_is_pruned_until_the_start_up_trials_have_reported_there(tmp_path, pruner):
    study, url = new_study(tmp_path, pruner, startup=2)
    first, _ = run_trial(study, url, [0.6, 0.8, 0.9], pruner=pruner, startup=2)
    second, trial = run_trial(study, url, [0.3, 0.5, 0.7], pruner=pruner, startup=2)
    # judged against the first trial alone it would stop (as with a start-up of 0, test above): not yet
    assert not first.pruned and not second.pruned and trial.state.name == "COMPLETE"
    assert list(trial.intermediate_values) == [1, 2, 3]
    third, trial = run_trial(study, url, [0.2, 0.9, 0.95], pruner=pruner, startup=2)
    assert third.pruned == 1 and trial.user_attrs["pruned_at"] == "evaluation 1 of 3"  # two trials scored there


def test_the_start_up_counts_pruned_trials_that_reported_at_that_fold(tmp_path):
    study, url = new_study(tmp_path, "median", startup=2)
    for scores in ([0.9, 0.88, 0.91], [0.85]):  # the second trial was pruned after its fold 0
        trial = study.ask()
        link = link_for(trial, url, "fold", "median", startup=2)
        for fold, score in enumerate(scores):
            report_fold(link, fold, score, steps=40)
        study.tell(trial, scores[-1] if len(scores) == 3 else None,
                   state=optuna.trial.TrialState.COMPLETE if len(scores) == 3 else optuna.trial.TrialState.PRUNED)
    trial = study.ask()
    link = link_for(trial, url, "fold", "median", startup=2)
    report_fold(link, 0, 0.2, steps=40)
    assert prune_at_fold(link, 1)  # two trials reported a fold 0 before it, one of them pruned


def test_no_trial_is_pruned_at_its_last_evaluation(tmp_path):
    study, url = new_study(tmp_path, "halving")
    run_trial(study, url, [0.9, 0.9, 0.9])
    trial = study.ask()
    reporter = EvaluationReporter(link_for(trial, url, "evaluation", "halving"), 1)  # its one evaluation is the end
    control = evaluate(reporter, 0.1, 30, 30)
    assert not control.should_training_stop and not reporter.pruned
    assert study.trials[trial.number].intermediate_values == {1: 0.1}


def test_the_median_rule_stops_a_trial_between_folds(tmp_path):
    study, url = new_study(tmp_path, "median", startup=2)
    for fold_scores in ([0.9, 0.88, 0.91], [0.85, 0.86, 0.84]):
        trial = study.ask()
        link = link_for(trial, url, "fold", "median", startup=2)
        for fold, score in enumerate(fold_scores):
            assert not prune_at_fold(link, fold)
            report_fold(link, fold, score, steps=40)
        study.tell(trial, sum(fold_scores) / 3)
    trial = study.ask()
    link = link_for(trial, url, "fold", "median", startup=2)
    assert not prune_at_fold(link, 0)  # nothing reported yet: fold 0 always starts
    report_fold(link, 0, 0.2, steps=40)
    assert prune_at_fold(link, 1)
    frozen = study.trials[trial.number]
    assert frozen.user_attrs["pruned_at"] == "fold 1" and frozen.user_attrs["steps fold 0"] == [40, 40]
    # each fold's score at its own step: the median compares fold k with the other trials' fold k
    assert study.trials[0].intermediate_values == {0: 0.9, 1: 0.88, 2: 0.91}


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_wilcoxon_stops_a_trial_once_its_folds_are_worse_with_p_below_one_tenth(tmp_path):
    study, url = new_study(tmp_path, "wilcoxon")
    trial = study.ask()
    link = link_for(trial, url, "fold", "wilcoxon")
    for fold in range(10):
        report_fold(link, fold, 0.9 - 0.01 * (fold % 3), steps=40)
    study.tell(trial, 0.89)
    trial = study.ask()
    link = link_for(trial, url, "fold", "wilcoxon")
    stopped = []
    for fold in range(10):
        stopped.append(prune_at_fold(link, fold))
        if stopped[-1]:
            break
        report_fold(link, fold, 0.3 + 0.01 * (fold % 2), steps=40)
    # n folds all worse than the best trial's: a one-sided signed-rank p of 1 / 2^n, first below 0.1 at n = 4
    assert stopped == [False] * 4 + [True] and study.trials[1].user_attrs["pruned_at"] == "fold 4"


def test_a_study_out_of_reach_lets_the_training_run_to_its_end(tmp_path, capsys):
    link = TrialLink(f"sqlite:///{tmp_path / 'no-such-dir/studies.db'}", "s", 1, 0, "f1_macro", "fold", "median")
    assert link.open() is None
    assert "runs to its end, unpruned" in capsys.readouterr().out
    report_fold(link, 0, 0.5, steps=10)  # no error: the fold's outputs are already written
    assert not prune_at_fold(link, 1)


def test_the_trial_link_travels_through_the_environment():
    link = TrialLink("postgresql+psycopg://u@h/db", "s", 7, 3, "accuracy", "evaluation", "median")
    assert TrialLink.from_env({"PIPELINE_TRIAL": link.to_env()}) == link
    assert TrialLink.from_env({}) is None


PARAMS = yaml.safe_load((REPO / "params.yaml").read_text())


@pytest.mark.parametrize("key, spec, expected", [
    ("train.lr", {"low": 1e-5, "high": 3e-4, "log": True}, "1e-05 to 0.0003 (log scale)"),
    ("train.epochs", {"low": 1, "high": 3}, "1 to 3"),
    ("train.effective_batch_size", {"choices": [16, 32]}, "one of [16, 32]"),
    ("model.name", {"choices": ["minilm", "bert-base-uncased"]}, "one of ['minilm', 'bert-base-uncased']"),
    ("tokenize.max_length", {"choices": [64, "auto"]}, "one of [64, 'auto']"),
    ("train.warmup_ratio", {"low": 0.0, "high": 0.2, "step": 0.05}, "0 to 0.2 in steps of 0.05"),
])
def test_a_search_space_takes_ranges_and_choices_of_any_stage_setting(key, spec, expected):
    dimension = parse_dimension(key, spec, PARAMS)
    assert str(dimension) == expected
    assert dimension.integer == (key == "train.epochs")  # a range written in whole numbers is searched in them


@pytest.mark.parametrize("key, spec, message", [
    ("train.lr", {"low": 3e-4, "high": 1e-5}, "tune.space train.lr: low 0.0003 must be below high 1e-05"),
    ("train.weight_decay", {"low": 0, "high": 0.1, "log": True}, "a log scale needs low above 0, not 0"),
    ("train.lr", {"low": 0, "high": 1e-3}, "tune.space train.lr: low must be a number above 0 and at most 1, not 0"),
    ("train.lrate", {"low": 1e-5, "high": 1e-3}, "tune.space train.lrate: not a setting of params.yaml"),
    ("lr", {"low": 1e-5, "high": 1e-3}, "tune.space lr: not a setting of params.yaml"),
    ("train.lr", {"low": 1e-5, "high": 1e-3, "lg": True}, "unknown field 'lg'"),
    ("train.lr", {"min": 1e-5}, "expected {choices: [...]} or {low: ..., high: ...}"),
    ("train.epochs", {"choices": []}, "choices must be a non-empty list"),
    ("train.epochs", {"choices": [1, 1]}, "repeat a value"),
    ("train.dropout", {"choices": [0, 1.5]}, "tune.space train.dropout: choice must be"),
    ("fetch.source", {"choices": ["tweets", "x"]}, "fetch.* cannot be searched (it changes the data)"),
    ("cv.folds", {"choices": [[0], [0, 1]]}, "cv.* cannot be searched"),
    ("model.name", {"low": 1, "high": 2}, "tune.space model.name: low must be a string"),
])
def test_a_bad_search_space_is_one_line_naming_the_key(key, spec, message):
    with pytest.raises(PipelineError, match=None) as raised:
        parse_dimension(key, spec, PARAMS)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_the_objective_follows_the_folds_and_must_be_a_score_evaluate_writes():
    assert objective_metric("auto", 1) == "val.f1_macro" and objective_metric("auto", 5) == "oof.f1_macro"
    assert objective_metric("cv.accuracy_mean", 3) == "cv.accuracy_mean"
    with pytest.raises(PipelineError, match="tune.metric 'oof.f1_macro' is not a score"):
        objective_metric("oof.f1_macro", 1)
    assert pruning_plan("auto", 1, "val.f1_macro") == ("halving", "evaluation")
    assert pruning_plan("auto", 3, "cv.f1_macro_mean") == ("median", "fold")
    assert pruning_plan("median", 3, "cv.f1_macro_std") == ("none", "fold")  # nothing stands for a spread
    with pytest.raises(PipelineError, match="wilcoxon cannot stop a trial of 3 fold"):
        pruning_plan("wilcoxon", 3, "oof.f1_macro")
    assert pruning_plan("wilcoxon", 10, "oof.f1_macro") == ("wilcoxon", "fold")


def test_storage_urls_keep_passwords_out_of_params_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TUNE_STORAGE", raising=False)
    assert storage_url(None, None) == f"sqlite:///{tmp_path / 'tuning/studies.db'}"
    assert storage_url(None, "sqlite:///studies/x.db") == f"sqlite:///{tmp_path / 'studies/x.db'}"
    assert storage_url("postgresql://u@h/db", None) == "postgresql+psycopg://u@h/db"
    monkeypatch.setenv("TUNE_STORAGE", "postgresql://u:pw@h/db")
    assert storage_url(None, "postgresql://u@h/other") == "postgresql+psycopg://u:pw@h/db"
    with pytest.raises(PipelineError) as raised:
        storage_url(None, "postgresql://u:hunter2@h/db")
    assert "hunter2" not in str(raised.value) and "tune.storage holds a password" in str(raised.value)


def test_values_go_to_dvc_as_yaml_reads_them_back():
    for value in (1e-05, 3e-4, 2, 0.1, "minilm", True, "auto"):
        assert yaml.safe_load(yaml_value(value)) == value
    space = {"train.lr": parse_dimension("train.lr", {"low": 1e-5, "high": 1e-3}, PARAMS)}
    assert parse_enqueued("train.lr=1e-9", space) == {"train.lr": 1e-9}  # outside the range is allowed
    with pytest.raises(PipelineError, match="--enqueue train.lr must be a number above 0"):
        parse_enqueued("train.lr=0", space)
    with pytest.raises(PipelineError, match="KEY one of tune.space's keys"):
        parse_enqueued("train.epochs=2", space)


def test_the_default_space_is_valid():
    settings, space, folds = load_settings(REPO / "params.yaml")
    assert set(space) == {"train.lr", "train.epochs", "train.warmup_ratio", "train.weight_decay",
                          "train.effective_batch_size", "train.dropout"}
    assert folds == 1 and settings["pruner"] == "auto"


@pytest.mark.parametrize("metric, kind, lowest_wins", [("val.rmse", "regression", True), ("oof.mae", "regression", True),
                                                      ("cv.log_loss_mean", "classification", True),
                                                      ("val.f1_macro", "classification", False)])
def test_a_study_of_an_error_minimizes_it_and_its_best_trial_has_the_lowest(tmp_path, metric, kind, lowest_wins):
    from tune.best import best_row
    from tune.settings import objective_direction
    from tune.study import create_study, open_storage

    direction = objective_direction("auto", metric)
    settings = {"study": "s", "seed": 0, "trials": 3, "direction": direction, "pruner_startup": 2}
    folds = 1 if metric.startswith("val") else 3
    study, _ = create_study(open_storage(f"sqlite:///{tmp_path / 'studies.db'}"), settings, metric, "none",
                            "evaluation", folds)
    values = [0.7, 0.4, 0.9]
    for value in values:
        trial = study.ask()
        study.tell(trial, value)
    expected = min(values) if lowest_wins else max(values)
    assert study.best_trial.value == expected
    assert best_row(study)[0].value == expected  # python -m tune.best, and the tables, rank it first too


@pytest.mark.parametrize("direction", ["maximize", "minimize"])
def test_the_tuners_first_line_says_how_far_the_study_is_either_way(direction):
    from tune.__main__ import opening_line

    line = opening_line("s", "sqlite:////x/studies.db", 2, 5, direction, "val.rmse", "halving", "evaluation")
    verb = "maximizing" if direction == "maximize" else "minimizing"
    assert line == f"study 's' in sqlite:////x/studies.db: 2 of 5 trials done; {verb} val.rmse; pruner halving (by evaluation)"
    assert opening_line("s", "u", 0, 1, direction, "m", "none", "fold").endswith(f"{verb} m; no pruning")
