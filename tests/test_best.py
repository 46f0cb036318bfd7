"""train.keep_best and train.patience (training/best.py): the competition metric of an evaluation as
scikit-learn computes it, which evaluation is best for metrics of either direction, the weights and
outputs of the best one restored, early stopping, a checkpoint carrying the best. End to end (a run whose
last evaluation scored worse than an earlier one writes the earlier one's out-of-fold predictions and
weights): tests/test_big_models.py, test_a_lora_run_keeps_its_best_evaluation_and_predicts_with_it."""
import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score, log_loss, mean_squared_error
from transformers import TrainerControl, TrainerState

from tasks.shapes import SHAPES
from training.best import BEST_FILE, KeepBest, competition_score, is_better
from training.trainer import ValidationScores


def test_the_competition_metric_is_the_one_evaluate_computes():
    rng = np.random.default_rng(0)
    logits, y = rng.normal(size=(50, 3)), rng.integers(0, 3, 50)
    shape = SHAPES["classification"]
    assert competition_score(shape, "f1_macro", logits, y, ["a", "b", "c"]) == pytest.approx(
        f1_score(y, logits.argmax(1), average="macro"), abs=1e-4)
    probabilities = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    assert competition_score(shape, "log_loss", logits, y, ["a", "b", "c"]) == pytest.approx(log_loss(y, probabilities), abs=1e-4)
    # regression: in the target's units, from standardised outputs and targets
    z, t = rng.normal(size=(40, 1)), rng.normal(size=40)
    rmse = mean_squared_error(t * 3 + 10, z[:, 0] * 3 + 10) ** 0.5
    assert competition_score(SHAPES["regression"], "rmse", z, t, ["value"], (10.0, 3.0)) == pytest.approx(rmse, abs=1e-4)
    # multi-label: macro-F1 at the threshold that scores best on these rows, as evaluate chooses it
    ml_logits, ml_y = rng.normal(size=(60, 4)), rng.integers(0, 2, (60, 4))
    p = 1 / (1 + np.exp(-ml_logits))
    best = max(f1_score(ml_y, (p >= th).astype(int), average="macro", zero_division=0) for th in np.arange(0.05, 0.951, 0.01))
    assert competition_score(SHAPES["multilabel"], "f1_macro", ml_logits, ml_y.astype(float), list("abcd")) == pytest.approx(best, abs=1e-4)


@pytest.mark.parametrize("metric, score, best, better", [
    ("f1_macro", 0.8, 0.7, True), ("f1_macro", 0.7, 0.8, False), ("f1_macro", 0.8, 0.8, False),  # a tie keeps the earlier
    ("rmse", 1.0, 2.0, True), ("rmse", 2.0, 1.0, False), ("log_loss", 0.3, 0.5, True), ("mae", 0.5, 0.3, False),
    ("pearson", float("nan"), 0.1, False), ("pearson", 0.1, float("nan"), True), ("f1_macro", 0.1, None, True),
])
def test_better_follows_the_metrics_direction(metric, score, best, better):
    assert is_better(score, best, metric) is better


def evaluations(keep, scores, model, logits_and_scores, max_steps=100):
    """Feed KeepBest evaluations at steps 10, 20, ...: before each, the model's weights are set to the step
    number and the scores' logits to the given ones. Returns the control after the last."""
    state, control = TrainerState(max_steps=max_steps), TrainerControl()
    for k, logits in enumerate(logits_and_scores, start=1):
        state.global_step = 10 * k
        with torch.no_grad():
            model.weight.fill_(state.global_step)
        scores((logits, LABELS))
        keep.on_evaluate(None, state, control, metrics={})
        if control.should_training_stop:
            break
    return state, control


LABELS = np.array([0, 1, 2, 0, 1, 2])
RIGHT = np.eye(3)[LABELS] * 5  # every row right: macro-F1 1
WRONG = np.eye(3)[(LABELS + 1) % 3] * 5  # every row wrong: macro-F1 0
HALF = np.concatenate([RIGHT[:3], WRONG[3:]])


def test_the_best_evaluations_weights_and_outputs_are_restored():
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    model.bias.requires_grad_(False)  # frozen: not kept, never changed
    keep = KeepBest(model, scores, "f1_macro", ["a", "b", "c"])
    evaluations(keep, scores, model, [HALF, RIGHT, HALF, WRONG])
    assert keep.best == (20, 1.0) and keep.last == (40, 0.0)
    assert keep.weights.keys() == {"weight"}
    line = keep.finish()
    assert line == ("train.keep_best: kept the weights of the evaluation at step 20, f1_macro 1.0000 "
                    "(the last, at step 40, scored 0.0000)")
    assert torch.all(model.weight == 20)
    assert np.array_equal(scores.logits, RIGHT) and scores.latest["f1_macro"] == 1.0


def test_patience_stops_training_after_evaluations_without_a_better_score():
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    keep = KeepBest(model, scores, "log_loss", ["a", "b", "c"], patience=2)  # lower is better
    state, control = evaluations(keep, scores, model, [HALF, RIGHT, HALF, RIGHT, WRONG, HALF])
    assert control.should_training_stop and state.global_step == 40 and keep.stopped_at == 40
    assert "stopped early at step 40: 2 evaluation(s) without a better log_loss (train.patience)" in keep.finish()
    assert torch.all(model.weight == 20)
    # without keep_best, early stopping alone: the last weights stay
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    keep = KeepBest(model, scores, "log_loss", ["a", "b", "c"], keep=False, patience=2)
    evaluations(keep, scores, model, [HALF, RIGHT, HALF, RIGHT])
    assert keep.finish().startswith("train.patience 2: the last weights are kept; stopped early at step 40")
    assert torch.all(model.weight == 40)


def test_a_checkpoint_carries_the_best_to_the_resumed_run(tmp_path):
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    keep = KeepBest(model, scores, "f1_macro", ["a", "b", "c"], patience=3)
    evaluations(keep, scores, model, [HALF, RIGHT, HALF])
    (tmp_path / "checkpoint-30").mkdir()
    keep.output_dir, keep.step = str(tmp_path), 30  # as on_step_end sets them before Trainer saves
    keep.state()
    assert (tmp_path / "checkpoint-30" / BEST_FILE).is_file()
    resumed_model, resumed_scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    resumed = KeepBest(resumed_model, resumed_scores, "f1_macro", ["a", "b", "c"], patience=3,
                       resume=tmp_path / "checkpoint-30")
    assert (resumed.best, resumed.last, resumed.since_best) == ((20, 1.0), (30, 0.5), 1)
    with torch.no_grad():
        resumed_model.weight.fill_(40)  # the resumed run trains on, then scores worse
    resumed_scores((WRONG, LABELS))
    resumed.on_evaluate(None, TrainerState(global_step=40, max_steps=100), TrainerControl())
    resumed.finish()
    assert torch.all(resumed_model.weight == 20) and np.array_equal(resumed_scores.logits, RIGHT)


def test_a_best_last_evaluation_is_not_restored_and_patience_spent_at_the_end_is_no_early_stop(tmp_path):
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    keep = KeepBest(model, scores, "f1_macro", ["a", "b", "c"])
    (tmp_path / "checkpoint-5").mkdir()
    keep.output_dir, keep.step = str(tmp_path), 5
    assert keep.state()["attributes"]["best"] is None  # no evaluation yet: nothing to carry
    assert not (tmp_path / "checkpoint-5" / BEST_FILE).exists()
    evaluations(keep, scores, model, [HALF, RIGHT])
    assert not keep.restore()
    assert keep.finish() == "train.keep_best: the last evaluation (step 20) scored best, f1_macro 1.0000"
    # the second evaluation without a better score comes at the last step: training ends there anyway
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    keep = KeepBest(model, scores, "f1_macro", ["a", "b", "c"], patience=2)
    state, control = evaluations(keep, scores, model, [HALF, RIGHT, HALF, HALF], max_steps=40)
    assert state.global_step == 40 and keep.stopped_at is None and not control.should_training_stop
    assert keep.finish() == ("train.keep_best: kept the weights of the evaluation at step 20, f1_macro 1.0000 "
                             "(the last, at step 40, scored 0.5000)")


def test_the_kept_evaluation_is_summarised_and_a_metric_never_scored_keeps_the_last_weights():
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["classification"])
    keep = KeepBest(model, scores, "f1_macro", ["a", "b", "c"])
    assert keep.summary() == {}
    evaluations(keep, scores, model, [HALF, np.eye(3)[[0, 1, 2, 1, 1, 1]] * 5])  # each class's F1 2/3
    assert keep.summary() == {"step": 20, "f1_macro": 0.6667}  # as metrics.json rounds it
    # constant outputs have no Pearson correlation: no evaluation scores it, and patience runs out at the second
    model, scores = torch.nn.Linear(2, 2), ValidationScores(SHAPES["regression"])
    keep = KeepBest(model, scores, "pearson", ["value"], patience=2)
    stopped = []
    for step in (10, 20):
        scores((np.zeros((4, 1)), np.array([0.0, 1.0, 2.0, 3.0])))
        control = TrainerControl()
        keep.on_evaluate(None, TrainerState(global_step=step, max_steps=100), control)
        stopped.append(control.should_training_stop)
    assert stopped == [False, True] and keep.summary() == {}
    assert keep.finish() == ("train.keep_best: no evaluation scored pearson; the last weights are kept; stopped "
                             "early at step 20: 2 evaluation(s) without a better pearson (train.patience)")
