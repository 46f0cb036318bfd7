"""evaluate: combine the folds' predictions into scores and a submission.

Reads data/processed/ (the true labels, the test ids, the task shape, the submission's header), data/split/
folds.csv, each fold's predictions/fold-K/oof.csv and the test predictions predictions/test/fold-K.csv;
loads no model, so it takes seconds. Writes reports/evaluate/metrics.json, reports/evaluate/confusion_val.csv
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
value) and the submission's form. probabilities.csv keeps the probabilities, one column per class, for
blending with other models (none for regression).
"""
import json
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.command import run_main
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import PipelineError
from predicting import folds
from predicting.ensemble import combine_out_of_fold, mean_test_probabilities
from reading.csvfiles import read_csv, write_csv
from tasks.shapes import SHAPES, competition_metric, headline, submission_frame, task_params

PROCESSED = Path("data/processed")
REPORTS = Path("reports/evaluate")
SUBMISSION = Path("submission")
# how the log names each score
NAMES = {"accuracy": "accuracy", "f1_macro": "macro-F1", "f1_micro": "micro-F1", "f1_weighted": "weighted F1",
         "log_loss": "log loss", "roc_auc": "ROC AUC", "qwk": "QWK", "rmse": "RMSE", "mae": "MAE",
         "pearson": "Pearson", "spearman": "Spearman"}


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






def unused_folders(k):
    """Fold folders in predictions/ that cv.folds no longer names (left by a run with more folds)."""
    return sorted(p.name for p in folds.PREDICTIONS.glob("fold-*")
                  if not p.name.removeprefix("fold-").isdigit() or int(p.name.removeprefix("fold-")) >= k)


def main():
    task = task_params()
    data = json.loads((PROCESSED / "shape.json").read_text(encoding="utf-8"))
    if data["kind"] != task["kind"]:
        raise PipelineError(f"params.yaml: task.kind is {task['kind']}, but {PROCESSED} holds {data['kind']} data: "
                            "rerun `dvc repro`")
    shape, metric = SHAPES[data["kind"]], competition_metric(task["metric"], data["kind"])
    labels = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))
    columns = shape.outputs(labels)  # of the prediction files
    row_folds = folds.read_folds()
    k = folds.fold_count(row_folds)
    if stale := unused_folders(k):
        print(f"{folds.PREDICTIONS}/: {', '.join(stale)} left by an earlier run with more folds; not used "
              "(delete them to keep the folder tidy)")

    y_train = shape.truth(read_csv(PROCESSED / "train.csv")["label"], labels)
    oof = [folds.read_probabilities(folds.outputs(fold)["predictions"] / "oof.csv", columns) for fold in range(k)]
    rows, oof_outputs = combine_out_of_fold(row_folds, oof)
    y_true = y_train[rows]
    threshold = shape.threshold(y_true, oof_outputs, metric)  # multi-label: chosen on the validation rows
    names = headline(shape.kind, metric)
    if k == 1:
        metrics = {"val": shape.report(y_true, oof_outputs, labels, metric, threshold)}
    else:
        per_fold = [shape.report(y_train[r], p, labels, metric, threshold) for r, p in oof]
        metrics = {"oof": shape.report(y_true, oof_outputs, labels, metric, threshold), "cv": spread(per_fold, names)}
    confusion = shape.confusion(y_true, oof_outputs, labels, threshold)

    submission = probabilities = None
    if (PROCESSED / "test.csv").exists():
        test = read_csv(PROCESSED / "test.csv")
        form = json.loads((PROCESSED / "submission.json").read_text(encoding="utf-8"))
        mean = mean_test_probabilities([folds.read_probabilities(folds.outputs(fold)["test"], columns)
                                        for fold in range(k)], len(test))
        submission = submission_frame(shape, test["id"], mean, labels, form["header"], threshold,
                                      data["label_separator"], form["probabilities"])
        if labels:  # class probabilities; a regression submission holds all there is
            probabilities = pd.concat([test[["id"]], pd.DataFrame(mean, columns=labels)], axis=1)
        if (test["label"] != "").all():  # a labelled test file: score the submission
            metrics["test"] = shape.report(shape.truth(test["label"], labels), mean, labels, metric, threshold)
    printed = shape.evaluated + tuple(n for n in names if n not in shape.evaluated)
    for split, m in metrics.items():
        if split == "cv":
            print("cv: " + ", ".join(f"{NAMES[n]} {m[f'{n}_mean']:.4f} ± {m[f'{n}_std']:.4f}" for n in names
                                     if m[f"{n}_mean"] is not None and m[f"{n}_std"] is not None) + f" over {k} folds")
        else:
            print(f"{split}: {described(m, printed)}" + (f" (threshold {threshold:g})" if threshold is not None else ""))

    with atomic_dir(REPORTS) as tmp:
        write_json(tmp / "metrics.json", metrics)
        write_csv(confusion, tmp / "confusion_val.csv")
    # the folder is written even with no test file, so DVC always finds its declared output
    with atomic_dir(SUBMISSION) as tmp:
        if submission is not None:
            submission.to_csv(tmp / "submission.csv", index=False, float_format=folds.DECIMALS)
            if probabilities is not None:
                probabilities.to_csv(tmp / "probabilities.csv", index=False, float_format=folds.DECIMALS)
    return [REPORTS, SUBMISSION]


if __name__ == "__main__":
    run_main(main)
