"""evaluate: combine the folds' predictions into scores and a submission.

Reads data/processed/ (the true labels, the test ids, the task shape, the submission's header), data/split/
folds.csv, each fold's predictions/fold-K/oof.csv, the test predictions predictions/test/fold-K.csv and the
baseline stage's predictions/baseline/{oof,test}.csv; loads no model, so it takes seconds. Writes reports/evaluate/metrics.json, reports/evaluate/confusion_val.csv
(a DVC confusion-matrix plot) and submission/{submission.csv,probabilities.csv}.

- One fold (cv.folds [0]): `val`, the scores on the holdout rows, and `test` when the test file
  has labels: today's single model.
- K folds: `oof`, the scores of the out-of-fold predictions over every training row (each row
  predicted by the one model that did not train on it); `cv`, each fold's scores with their mean
  and standard deviation; `test`, the scores of the ensemble: the mean of the K models' outputs
  (class probabilities, or values).
The task shape (tasks/shapes.py) says which scores (and task.metric, the competition's, beside them),
how outputs become decisions (the class of highest probability; for multi-label each class whose
probability reaches the threshold that scores best on the validation rows, reported as `threshold`; the
value) and the submission's form.
- `baseline`: the TF-IDF baseline's scores on the same rows (`baseline.val` or `baseline.oof`, and
  `baseline.test`), its multi-label threshold chosen on its own outputs. One line compares the model's and
  the baseline's competition metric; when the model does not beat it, a warning naming the likely causes:
  the tokenizer's fit (tokenize's reports/tokenize/lengths.json), train.epochs, train.lr,
  train.freeze_embeddings (the three train.* keys evaluate reads). probabilities.csv keeps the probabilities, one column per class, for
blending with other models (none for regression).
"""
import json
from pathlib import Path

import numpy as np
import pandas as pd

from baselines.verdict import comparison, likely_causes
from pipeline.command import run_main
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import PipelineError, Range, check_kind, load_params
from predicting import folds
from predicting.ensemble import combine_out_of_fold, mean_test_probabilities
from reading.csvfiles import read_csv, write_csv
from tasks.scores import NAMES
from tasks.shapes import SHAPES, competition_metric, headline, task_params
from tasks.submission import submission_frame

PROCESSED = Path("data/processed")
REPORTS = Path("reports/evaluate")
SUBMISSION = Path("submission")
TOKENS = Path("reports/tokenize/lengths.json")
BASELINE = folds.PREDICTIONS / "baseline"
# the train.* keys the comparison with the baseline names among the likely causes (dvc.yaml declares them)
# what evaluate.submit accepts: the teachers' ensemble, the pseudo students', or a distill student (its name)
EVALUATE_PARAMS = {"submit": (str,)}
TRAIN_KEYS = {"epochs": (float, Range(0, low_open=True)), "lr": (float, "auto", Range(0, 1, low_open=True)),
              "freeze_embeddings": (bool,)}


def spread(per_fold, names=("f1_macro", "accuracy")):
    """Each fold's scores `names`, with their mean and sample standard deviation over folds (None where a
    fold's score is undefined)."""
    summary = {}
    for name in names:
        values = np.array([np.nan if scores[name] is None else scores[name] for scores in per_fold], dtype=float)
        for stat, value in (("mean", values.mean()), ("std", values.std(ddof=1))):
            summary[f"{name}_{stat}"] = round(float(value), 4) if np.isfinite(value) else None
    summary["per_fold"] = {str(k): {name: s[name] for name in sorted(names)} for k, s in enumerate(per_fold)}
    return summary


def described(scores, names):
    """'accuracy 0.8123, macro-F1 0.7801' for the log."""
    return ", ".join(f"{NAMES[name]} {scores[name]:.4f}" if scores[name] is not None else f"{NAMES[name]} undefined"
                     for name in names)


def train_settings():
    """train.epochs, train.lr and train.freeze_embeddings, checked (the train stage checks the rest)."""
    train = load_params("train")
    return {key: check_kind(train.get(key), kinds, f"params.yaml: train.{key}") for key, kinds in TRAIN_KEYS.items()}


def baseline_scores(split, shape, y_true, rows, labels, metric, columns, test_truth=None):
    """The baseline's scores on the model's validated rows (its own multi-label threshold, chosen on its
    outputs by task.metric) and on a labelled test file, from predictions/baseline/."""
    baseline_rows, outputs = folds.read_probabilities(BASELINE / "oof.csv", columns)
    if not np.array_equal(baseline_rows, rows):
        raise PipelineError(f"{BASELINE / 'oof.csv'} holds other rows than the folds of {folds.FOLDS_CSV}: it comes "
                            "from another run; rerun `dvc repro`")
    threshold = shape.threshold(y_true, outputs, metric)
    scores = {split: shape.report(y_true, outputs, labels, metric, threshold)}
    if test_truth is not None:
        _, test = folds.read_probabilities(BASELINE / "test.csv", columns)
        scores["test"] = shape.report(test_truth, test, labels, metric, threshold)
    return scores


def student_candidates(pseudo_folds, distilled, shape, k, y_true, row_folds, labels, metric, columns, test, teachers,
                       threshold, test_truth):
    """The students' scores ({"pseudo": ..., "distill": {name: ...}}, beside a single teacher fold's on the test
    rows) and {candidate: (test outputs, threshold)} for evaluate.submit. The pseudo students' out-of-fold
    outputs combine as the teachers' do, with their own multi-label threshold; a distill student validated on
    nothing and takes the teachers'. agreement: how often its decisions equal the ensemble's on the test rows
    (regression: the Pearson correlation of its values with the ensemble's)."""
    scores, candidates = {}, {}
    if pseudo_folds:
        if sorted(pseudo_folds) != list(range(k)):
            raise PipelineError(f"params.yaml: pseudo.folds {pseudo_folds}: the students' out-of-fold scores need one "
                                f"student per fold of cv.folds ({list(range(k))})")
        where = [Path(f"students/pseudo/fold-{f}/predictions") for f in range(k)]
        _, outputs = combine_out_of_fold(row_folds, [folds.read_probabilities(w / "oof.csv", columns) for w in where])
        own = shape.threshold(y_true, outputs, metric)
        scores["pseudo"] = {"val" if k == 1 else "oof": shape.report(y_true, outputs, labels, metric, own)}
        if test is not None:
            mean = mean_test_probabilities([folds.read_probabilities(w / "test.csv", columns) for w in where], len(test))
            candidates["students"] = (mean, own)
            if test_truth is not None:
                scores["pseudo"]["test"] = shape.report(test_truth, mean, labels, metric, own)
    for name in distilled:
        where = Path(f"students/distill/{name}/predictions")
        scores.setdefault("distill", {})[name] = found = {"speed": json.loads((where / "speed.json").read_text(encoding="utf-8"))}
        if test is None:
            continue
        _, outputs = folds.read_probabilities(where / "test.csv", columns)
        candidates[name] = (outputs, threshold)
        found["agreement"] = (round(float(np.corrcoef(outputs[:, 0], teachers[:, 0])[0, 1]), 4) if shape.kind == "regression"
                              else round(float((shape.indicators(outputs, threshold) ==
                                                shape.indicators(teachers, threshold)).all(axis=1).mean()), 4))
        if test_truth is not None:
            found["test"] = shape.report(test_truth, outputs, labels, metric, threshold)
    if scores and test_truth is not None and k > 1:  # one teacher alone, for scale
        _, single = folds.read_probabilities(folds.outputs(0)["test"], columns)
        scores["single_fold"] = {"test": shape.report(test_truth, single, labels, metric, threshold)}
    return scores, candidates


def unused_folders(k):
    """Fold folders in predictions/ that cv.folds no longer names (left by a run with more folds)."""
    return sorted(p.name for p in folds.PREDICTIONS.glob("fold-*")
                  if not p.name.removeprefix("fold-").isdigit() or int(p.name.removeprefix("fold-")) >= k)


def out_of_fold_scores(shape, labels, metric, columns, row_folds, names):
    """(metrics: `val` with one fold, else `oof` and `cv`; the rows scored, their truth and outputs; the
    multi-label threshold chosen on them, else None)."""
    k = folds.fold_count(row_folds)
    y_train = shape.truth(read_csv(PROCESSED / "train.csv")["label"], labels)
    oof = [folds.read_probabilities(folds.outputs(fold)["predictions"] / "oof.csv", columns) for fold in range(k)]
    rows, outputs = combine_out_of_fold(row_folds, oof)
    y_true = y_train[rows]
    threshold = shape.threshold(y_true, outputs, metric)  # multi-label: chosen on the validation rows
    if k == 1:
        metrics = {"val": shape.report(y_true, outputs, labels, metric, threshold)}
    else:
        per_fold = [shape.report(y_train[r], p, labels, metric, threshold) for r, p in oof]
        metrics = {"oof": shape.report(y_true, outputs, labels, metric, threshold), "cv": spread(per_fold, names)}
    return metrics, rows, y_true, outputs, threshold


def submission_frames(shape, test, submitted, labels, threshold, separator):
    """(the submission in the form data/processed/submission.json says, the class probabilities or None)."""
    form = json.loads((PROCESSED / "submission.json").read_text(encoding="utf-8"))
    submission = submission_frame(shape, test["id"], submitted, labels, form["header"], threshold, separator,
                                  form["probabilities"])
    # class probabilities; a regression submission holds all there is
    probabilities = pd.concat([test[["id"]], pd.DataFrame(submitted, columns=labels)], axis=1) if labels else None
    return submission, probabilities


def print_scores(metrics, shape, names, threshold, k):
    """A line per split and per student, the baseline's and the folds' spread."""
    printed = shape.evaluated + tuple(n for n in names if n not in shape.evaluated)
    for part, m in metrics.items():
        if part in ("pseudo", "single_fold"):
            for split_name, scores in m.items():
                print(f"{'pseudo students' if part == 'pseudo' else 'fold 0 alone'} {split_name}: {described(scores, printed)}")
        elif part == "distill":
            for name, found in m.items():
                print(f"distilled {name}: " + (f"test {described(found['test'], printed)}; " if "test" in found else "") +
                      (f"agreement with the ensemble {found['agreement']:.4f}; " if "agreement" in found else "") +
                      f"{found['speed']['speedup']:.2f}x the ensemble's rows/s")
        elif part == "baseline":
            for part, scores in m.items():
                print(f"baseline {part}: {described(scores, printed)}" +
                      (f" (threshold {scores['threshold']:g})" if scores.get("threshold") is not None else ""))
        elif part == "cv":
            print("cv: " + ", ".join(f"{NAMES[n]} {m[f'{n}_mean']:.4f} ± {m[f'{n}_std']:.4f}" for n in names
                                     if m[f"{n}_mean"] is not None and m[f"{n}_std"] is not None) + f" over {k} folds")
        else:
            print(f"{part}: {described(m, printed)}" + (f" (threshold {threshold:g})" if threshold is not None else ""))


def main():
    task, train = task_params(), train_settings()
    submit = load_params("evaluate", EVALUATE_PARAMS)["submit"]
    # the students (the pseudo and distill stages check these keys; evaluate only needs which ran)
    pseudo_folds, distilled = load_params("pseudo").get("folds") or [], list(load_params("distill").get("students") or {})
    data = json.loads((PROCESSED / "shape.json").read_text(encoding="utf-8"))
    if data["kind"] != task["kind"]:
        raise PipelineError(f"params.yaml: task.kind is {task['kind']}, but {PROCESSED} holds {data['kind']} data: "
                            "rerun `dvc repro`")
    shape, metric = SHAPES[data["kind"]], competition_metric(task["metric"], data["kind"])
    labels = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))
    columns, names = shape.outputs(labels), headline(shape.kind, metric)  # the prediction files' columns
    row_folds = folds.read_folds()
    k = folds.fold_count(row_folds)
    if stale := unused_folders(k):
        print(f"{folds.PREDICTIONS}/: {', '.join(stale)} left by an earlier run with more folds; not used "
              "(delete them to keep the folder tidy)")
    metrics, rows, y_true, oof_outputs, threshold = out_of_fold_scores(shape, labels, metric, columns, row_folds, names)

    submission = probabilities = test_truth = test = mean = None
    if (PROCESSED / "test.csv").exists():
        test = read_csv(PROCESSED / "test.csv")
        mean = mean_test_probabilities([folds.read_probabilities(folds.outputs(fold)["test"], columns)
                                        for fold in range(k)], len(test))
        if (test["label"] != "").all():  # a labelled test file: score the submission
            test_truth = shape.truth(test["label"], labels)
            metrics["test"] = shape.report(test_truth, mean, labels, metric, threshold)
    students, candidates = student_candidates(pseudo_folds, distilled, shape, k, y_true, row_folds, labels, metric,
                                              columns, test, mean, threshold, test_truth)
    metrics.update(students)
    if test is not None:
        if submit != "teachers" and submit not in candidates:
            raise PipelineError(f"params.yaml: evaluate.submit {submit!r}: the run has teachers" +
                                "".join(f", {c}" for c in candidates) + " (students: pseudo.folds; a name: distill.students)")
        submitted, submitted_threshold = (mean, threshold) if submit == "teachers" else candidates[submit]
        submission, probabilities = submission_frames(shape, test, submitted, labels, submitted_threshold,
                                                      data["label_separator"])
        if submit != "teachers":
            whose = "the pseudo students' ensemble" if submit == "students" else f"distilled student {submit}"
            print(f"evaluate.submit {submit}: the submission is {whose}'s")
    split = "val" if k == 1 else "oof"
    metrics["baseline"] = baseline_scores(split, shape, y_true, rows, labels, metric, columns, test_truth)
    print_scores(metrics, shape, names, threshold, k)
    tokens = json.loads(TOKENS.read_text(encoding="utf-8"))["tokens"]
    print(comparison(split, metric, metrics[split][metric], metrics["baseline"][split][metric], shape.baseline,
                     likely_causes(tokens, train["epochs"], train["lr"], train["freeze_embeddings"])))

    with atomic_dir(REPORTS) as tmp:
        write_json(tmp / "metrics.json", metrics)
        write_csv(shape.confusion(y_true, oof_outputs, labels, threshold), tmp / "confusion_val.csv")
    # the folder is written even with no test file, so DVC always finds its declared output
    with atomic_dir(SUBMISSION) as tmp:
        if submission is not None:
            submission.to_csv(tmp / "submission.csv", index=False, float_format=folds.DECIMALS)
            if probabilities is not None:
                probabilities.to_csv(tmp / "probabilities.csv", index=False, float_format=folds.DECIMALS)
    return [REPORTS, SUBMISSION]


if __name__ == "__main__":
    run_main(main)
