"""evaluate: combine the folds' predictions into scores and a submission.

Reads data/processed/ (the true labels, the test ids), data/split/folds.csv and each fold's
predictions/fold-K/{oof,test}.csv; loads no model, so it takes seconds. Writes
reports/evaluate/metrics.json, reports/evaluate/confusion_val.csv (a DVC confusion-matrix plot)
and submission/{submission.csv,probabilities.csv}.

- One fold (cv.folds [0]): `val`, the scores on the holdout rows, and `test` when the test file
  has labels: today's single model.
- K folds: `oof`, the scores of the out-of-fold predictions over every training row (each row
  predicted by the one model that did not train on it); `cv`, each fold's scores with their mean
  and standard deviation; `test`, the scores of the ensemble: the mean of the K models' class
  probabilities.
The submission takes the class of highest (mean) probability; probabilities.csv keeps them all,
one column per class, for blending with other models.
"""
import json
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.metrics import accuracy_score, f1_score, precision_recall_fscore_support

from stages import folds
from stages.common import PipelineError, atomic_dir, run_main, write_json
from stages.csvfiles import read_csv, write_csv

PROCESSED = Path("data/processed")
REPORTS = Path("reports/evaluate")
SUBMISSION = Path("submission")


def classification_metrics(y_true, y_pred, labels):
    """accuracy, macro-F1 and per-class precision/recall/F1 (keyed by label name)."""
    ids = list(range(len(labels)))
    precision, recall, f1, support = precision_recall_fscore_support(
        y_true, y_pred, labels=ids, zero_division=0)
    return {
        "accuracy": round(float(accuracy_score(y_true, y_pred)), 4),
        "f1_macro": round(float(f1_score(y_true, y_pred, labels=ids, average="macro", zero_division=0)), 4),
        "per_class": {labels[i]: {"precision": round(float(precision[i]), 4), "recall": round(float(recall[i]), 4),
                                  "f1": round(float(f1[i]), 4), "support": int(support[i])} for i in ids},
    }


def spread(per_fold):
    """Each fold's accuracy and macro-F1, with their mean and sample standard deviation over folds."""
    summary = {}
    for name in ("f1_macro", "accuracy"):
        values = np.array([scores[name] for scores in per_fold])
        summary[f"{name}_mean"] = round(float(values.mean()), 4)
        summary[f"{name}_std"] = round(float(values.std(ddof=1)), 4)
    summary["per_fold"] = {str(k): {"accuracy": s["accuracy"], "f1_macro": s["f1_macro"]} for k, s in enumerate(per_fold)}
    return summary


def combine_out_of_fold(row_folds, oof):
    """(rows, probabilities) over every validated row, from [(rows, probabilities) of each fold].
    Each fold must hold exactly the rows the split gave it: anything else means predictions from
    another run."""
    for k, (rows, _) in enumerate(oof):
        expected = np.flatnonzero(row_folds == k)
        if not np.array_equal(np.sort(rows), expected):
            raise PipelineError(f"{folds.PREDICTIONS}/fold-{k}/oof.csv holds other rows than fold {k} of "
                                f"{folds.FOLDS_CSV}: it comes from another run; rerun `dvc repro`")
    rows = np.concatenate([r for r, _ in oof])
    order = np.argsort(rows, kind="stable")
    return rows[order], np.concatenate([p for _, p in oof])[order]


def mean_test_probabilities(tests, n_rows):
    """The ensemble's test probabilities: the mean over folds, every fold covering every test row."""
    for k, (rows, _) in enumerate(tests):
        if not np.array_equal(rows, np.arange(n_rows)):
            raise PipelineError(f"{folds.PREDICTIONS}/fold-{k}/test.csv does not hold the {n_rows} rows of "
                                f"{PROCESSED / 'test.csv'}: it comes from another run; rerun `dvc repro`")
    return np.mean([p for _, p in tests], axis=0)


def unused_folders(k):
    """Fold folders in predictions/ that cv.folds no longer names (left by a run with more folds)."""
    return sorted(p.name for p in folds.PREDICTIONS.glob("fold-*")
                  if not p.name.removeprefix("fold-").isdigit() or int(p.name.removeprefix("fold-")) >= k)


def main():
    labels = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))
    index = {name: i for i, name in enumerate(labels)}
    row_folds = folds.read_folds()
    k = folds.fold_count(row_folds)
    if stale := unused_folders(k):
        print(f"{folds.PREDICTIONS}/: {', '.join(stale)} left by an earlier run with more folds; not used "
              "(delete them to keep the folder tidy)")
    fold_dirs = [folds.outputs(fold)["predictions"] for fold in range(k)]

    y_train = np.array([index[label] for label in read_csv(PROCESSED / "train.csv")["label"]])
    oof = [folds.read_probabilities(d / "oof.csv", labels) for d in fold_dirs]
    rows, oof_probabilities = combine_out_of_fold(row_folds, oof)
    y_true, y_pred = y_train[rows], oof_probabilities.argmax(axis=1)
    if k == 1:
        metrics = {"val": classification_metrics(y_true, y_pred, labels)}
    else:
        per_fold = [classification_metrics(y_train[r], p.argmax(axis=1), labels) for r, p in oof]
        metrics = {"oof": classification_metrics(y_true, y_pred, labels), "cv": spread(per_fold)}
    confusion = pd.DataFrame({"actual": [labels[y] for y in y_true], "predicted": [labels[p] for p in y_pred]})

    submission = probabilities = None
    if (PROCESSED / "test.csv").exists():
        test = read_csv(PROCESSED / "test.csv")
        mean = mean_test_probabilities([folds.read_probabilities(d / "test.csv", labels) for d in fold_dirs],
                                       len(test))
        predicted = mean.argmax(axis=1)
        submission = pd.DataFrame({"id": test["id"], "label": [labels[p] for p in predicted]})
        probabilities = pd.concat([test[["id"]], pd.DataFrame(mean, columns=labels)], axis=1)
        if (test["label"] != "").all():  # a labelled test file: score the submission
            metrics["test"] = classification_metrics([index[label] for label in test["label"]], predicted, labels)
    for split, m in metrics.items():
        if split == "cv":
            print(f"cv: macro-F1 {m['f1_macro_mean']:.4f} ± {m['f1_macro_std']:.4f}, accuracy "
                  f"{m['accuracy_mean']:.4f} ± {m['accuracy_std']:.4f} over {k} folds")
        else:
            print(f"{split}: accuracy {m['accuracy']:.4f}, macro-F1 {m['f1_macro']:.4f}")

    with atomic_dir(REPORTS) as tmp:
        write_json(tmp / "metrics.json", metrics)
        write_csv(confusion, tmp / "confusion_val.csv")
    # the folder is written even with no test file, so DVC always finds its declared output
    with atomic_dir(SUBMISSION) as tmp:
        if submission is not None:
            submission.to_csv(tmp / "submission.csv", index=False)
            probabilities.to_csv(tmp / "probabilities.csv", index=False, float_format=folds.DECIMALS)
    return [REPORTS, SUBMISSION]


if __name__ == "__main__":
    run_main(main)
