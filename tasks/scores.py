"""Scores of predictions against the truth, for every task shape: the ones each shape reports, and the
competition metric (task.metric) that the tuner optimizes and multi-label thresholds are chosen by.
Pure functions over arrays; scikit-learn and scipy do the arithmetic.

Arrays: y (n,) class indices, probabilities (n, classes) for classification; y (n, classes) 0/1 and
probabilities (n, classes) for multi-label; y (n,) and values (n,) for regression.
scikit-learn and scipy are imported where they are used: preprocess and fetch read the metric names
here and need neither (each takes seconds to import on a busy 2-core machine).
"""
import math

import numpy as np

# the metrics task.metric may name for each shape (the first is `auto`); each is a key of metrics.json
METRICS = {
    "classification": ("f1_macro", "accuracy", "f1_weighted", "log_loss", "roc_auc", "qwk"),
    "multilabel": ("f1_macro", "f1_micro", "f1_weighted", "accuracy", "roc_auc", "log_loss"),
    "regression": ("rmse", "mae", "pearson", "spearman"),
}
LOWER_IS_BETTER = ("rmse", "mae", "log_loss")
# how the logs name each score
NAMES = {"accuracy": "accuracy", "f1_macro": "macro-F1", "f1_micro": "micro-F1", "f1_weighted": "weighted F1",
         "log_loss": "log loss", "roc_auc": "ROC AUC", "qwk": "QWK", "rmse": "RMSE", "mae": "MAE",
         "pearson": "Pearson", "spearman": "Spearman"}
# scored on probabilities, not on decisions: no threshold to choose, and a submission of class columns
# holds probabilities
ON_PROBABILITIES = ("log_loss", "roc_auc")
# the thresholds tried for multi-label decisions (a row has a class when its probability reaches it)
THRESHOLDS = np.round(np.arange(0.05, 0.951, 0.01), 2)


def rounded(value):
    """A score for metrics.json: 4 decimals; None where it is undefined (a constant prediction has no
    correlation): JSON has no NaN."""
    value = float(value)
    return round(value, 4) if math.isfinite(value) else None


def classification_metrics(y_true, y_pred, labels):
    """accuracy, macro-F1 and per-class precision/recall/F1 (keyed by label name)."""
    from sklearn.metrics import accuracy_score, f1_score, precision_recall_fscore_support

    ids = list(range(len(labels)))
    precision, recall, f1, support = precision_recall_fscore_support(
        y_true, y_pred, labels=ids, zero_division=0)
    return {
        "accuracy": round(float(accuracy_score(y_true, y_pred)), 4),
        "f1_macro": round(float(f1_score(y_true, y_pred, labels=ids, average="macro", zero_division=0)), 4),
        "per_class": {labels[i]: {"precision": round(float(precision[i]), 4), "recall": round(float(recall[i]), 4),
                                  "f1": round(float(f1[i]), 4), "support": int(support[i])} for i in ids},
    }


def mean_column_auc(y, scores):
    """ROC AUC averaged over the columns (classes) whose truth holds both 0 and 1: one-vs-rest for
    classification (for two classes, the usual binary AUC), column-wise for multi-label (Jigsaw's)."""
    from sklearn.metrics import roc_auc_score

    aucs = [roc_auc_score(y[:, c], scores[:, c]) for c in range(y.shape[1]) if 0 < y[:, c].sum() < len(y)]
    return np.mean(aucs) if aucs else float("nan")


def one_hot(y, classes):
    return np.eye(classes, dtype=int)[np.asarray(y, dtype=int)]


def classification_score(metric, y, probabilities):
    """One competition metric of single-label predictions (the class of highest probability)."""
    from sklearn.metrics import accuracy_score, cohen_kappa_score, f1_score, log_loss

    classes = probabilities.shape[1]
    predicted = probabilities.argmax(axis=1)
    if metric == "accuracy":
        return accuracy_score(y, predicted)
    if metric in ("f1_macro", "f1_weighted"):
        return f1_score(y, predicted, labels=range(classes), average=metric[3:], zero_division=0)
    if metric == "log_loss":
        return log_loss(y, np.clip(probabilities, 1e-15, 1), labels=range(classes))
    if metric == "roc_auc":
        return mean_column_auc(one_hot(y, classes), probabilities)
    if metric == "qwk":  # classes in their order (numbers sorted as numbers: preprocess's sort_labels)
        return cohen_kappa_score(y, predicted, labels=range(classes), weights="quadratic")
    raise ValueError(metric)


def multilabel_score(metric, y, probabilities, threshold):
    """One competition metric of multi-label predictions: a row has each class whose probability
    reaches `threshold`."""
    from sklearn.metrics import accuracy_score, f1_score

    predicted = (probabilities >= threshold).astype(int)
    if metric == "accuracy":  # subset accuracy: every class of the row right
        return accuracy_score(y, predicted)
    if metric in ("f1_macro", "f1_micro", "f1_weighted"):
        return f1_score(y, predicted, average=metric[3:], zero_division=0)
    if metric == "roc_auc":
        return mean_column_auc(y, probabilities)
    if metric == "log_loss":
        p = np.clip(probabilities, 1e-15, 1 - 1e-15)
        return float(np.mean(-(y * np.log(p) + (1 - y) * np.log(1 - p))))  # mean of the columns' binary log loss
    raise ValueError(metric)


def regression_score(metric, y, values):
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import mean_absolute_error, root_mean_squared_error

    if metric == "rmse":
        return root_mean_squared_error(y, values)
    if metric == "mae":
        return mean_absolute_error(y, values)
    if len(y) < 2 or np.ptp(values) == 0 or np.ptp(y) == 0:
        return float("nan")  # no correlation is defined
    if metric == "pearson":
        return pearsonr(y, values).statistic
    if metric == "spearman":
        return spearmanr(y, values).statistic
    raise ValueError(metric)


def best_threshold(y, probabilities, metric):
    """The multi-label decision threshold of THRESHOLDS that scores best on these rows by `metric`
    (macro-F1 when the metric scores probabilities, which no threshold changes); ties go to the one
    nearest 0.5."""
    by = "f1_macro" if metric in ON_PROBABILITIES else metric
    scores = np.array([multilabel_score(by, y, probabilities, t) for t in THRESHOLDS])
    best = np.flatnonzero(scores >= scores.max() - 1e-12)
    return float(THRESHOLDS[best[np.argmin(np.abs(THRESHOLDS[best] - 0.5))]])


def multilabel_metrics(y, probabilities, labels, threshold):
    """micro- and macro-F1, subset accuracy, the threshold, per-class precision/recall/F1."""
    from sklearn.metrics import accuracy_score, f1_score, precision_recall_fscore_support

    predicted = (probabilities >= threshold).astype(int)
    precision, recall, f1, support = precision_recall_fscore_support(y, predicted, zero_division=0)
    return {
        "f1_micro": rounded(f1_score(y, predicted, average="micro", zero_division=0)),
        "f1_macro": rounded(f1_score(y, predicted, average="macro", zero_division=0)),
        "accuracy": rounded(accuracy_score(y, predicted)),
        "threshold": threshold,
        "per_class": {labels[i]: {"precision": rounded(precision[i]), "recall": rounded(recall[i]),
                                  "f1": rounded(f1[i]), "support": int(support[i])} for i in range(len(labels))},
    }


def regression_metrics(y, values):
    return {metric: rounded(regression_score(metric, y, values)) for metric in METRICS["regression"]}
