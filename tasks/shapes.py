"""Task shapes: what differs between single-label classification, multi-label classification and
regression, one small definition per shape, which the stages ask (SHAPES[kind]):
- preprocess: how labels are read (tasks/labels.py) and which classes there are;
- tokenize: the label tensor stored with the token ids;
- split: what folds are stratified by (classes; an indicator matrix, split by iterative stratification;
  quantile bins of the target);
- train: the number of model outputs, transformers' problem_type, the loss (train.loss auto: cross-entropy,
  binary cross-entropy per class, mean squared error) and the scores of each evaluation;
- predict_test, predict: what the model's outputs mean (probabilities: softmax or sigmoid; a value);
- evaluate, predict: the reported scores, the multi-label threshold, the submission's form (from a shape's
  decisions: tasks/submission.py); baseline: its linear model (baselines/tfidf.py builds it), in words;
- pseudo, distill: a student's targets from a teacher's outputs (soft, or hard where it is sure).
Text pairs are not a shape: a second text column (preprocess.text_pair_column) works with every one.
Arrays: `outputs` is (rows, outputs) everywhere: class probabilities, or one column of values.
"""
import json

import numpy as np
import pandas as pd

from pipeline.settings import PipelineError, load_params
from tasks import labels as reading
from tasks import scores

KINDS = ("classification", "multilabel", "regression")
TASK_PARAMS = {"kind": KINDS, "label_separator": (str,), "metric": ("auto", *sorted({m for ms in scores.METRICS.values()
                                                                                       for m in ms}))}
REGRESSION_BINS = 10  # quantile bins of the target that regression folds are stratified by, at most


def task_params(path="params.yaml"):
    """The task section of params.yaml, checked; task.metric resolved (auto: the shape's first metric)."""
    params = load_params("task", TASK_PARAMS, path)
    if params["label_separator"].strip() == "":
        raise PipelineError(f"{path}: task.label_separator must be a character or more that is not a space, "
                            f"not {params['label_separator']!r}")
    params["metric"] = competition_metric(params["metric"], params["kind"], path)
    return params


def competition_metric(metric, kind, path="params.yaml"):
    """task.metric as a key of metrics.json: auto is macro-F1 for classification and multi-label, RMSE for
    regression; a metric of another shape is a one-line error."""
    allowed = scores.METRICS[kind]
    if metric == "auto":
        return allowed[0]
    if metric not in allowed:
        raise PipelineError(f"{path}: task.metric {metric} does not score task.kind {kind}; one of: auto, "
                            f"{', '.join(allowed)}")
    return metric


def headline(kind, metric):
    """The scores evaluate reports for every split and spreads over folds: the shape's own, then the
    competition metric when it is another."""
    own = SHAPES[kind].headline
    return own + ((metric,) if metric not in own else ())


def softmax(logits):
    import torch  # here, not at the top: preprocess and fetch read this module and need no torch

    return torch.softmax(torch.as_tensor(logits, dtype=torch.float32), dim=-1).numpy()


def sigmoid(logits):
    import torch

    return torch.sigmoid(torch.as_tensor(logits, dtype=torch.float32)).numpy()


class Classification:
    """One class per row, from one column (text pairs too: NLI, paraphrase)."""
    kind = "classification"
    problem_type = "single_label_classification"
    loss = "cross_entropy"  # train.loss auto: a name in training/losses.py
    evaluated = ("accuracy", "f1_macro")  # the train stage's scores at each evaluation
    progress = ("accuracy", "f1_macro")  # those of them its line in the log shows
    headline = ("f1_macro", "accuracy")
    baseline = "logistic regression"  # the linear model of the baseline stage, in words
    read_labels = staticmethod(reading.read_class_labels)
    label_list = staticmethod(reading.class_list)

    def outputs(self, classes):
        """The names of the model's outputs: the columns of the prediction files."""
        return list(classes)

    def head(self, classes):
        return f"the {len(classes)}-class classifier head"

    def describe(self, classes):
        return f"labels {classes}"

    def encode(self, processed, classes):
        """Class indices; -1 for an unlabelled row."""
        index = {name: i for i, name in enumerate(classes)}
        return np.array([index[name] if name != "" else -1 for name in processed], dtype=np.int64)

    def activate(self, logits, scale=None):
        return softmax(logits)

    def target_scale(self, targets):
        """None: class labels are not scaled (regression's are)."""
        return None

    def evaluation_scores(self, logits, targets, scale=None):
        """The scores of one evaluation during training, from the model's raw outputs."""
        from sklearn.metrics import accuracy_score, f1_score

        predictions = np.argmax(logits, axis=-1)
        return {"accuracy": accuracy_score(targets, predictions), "f1_macro": f1_score(targets, predictions, average="macro")}

    def strata(self, processed, classes, k):
        return np.asarray(processed)

    # students (pseudo, distill) learn teacher outputs (soft_targets), a labelled row as soft_label
    soft = True  # a target is a row of probabilities, which the loss takes as it takes a one-hot class

    def soft_targets(self, outputs):
        return [list(map(float, row)) for row in np.asarray(outputs, dtype=np.float64)]

    def soft_label(self, label, classes):
        return scores.one_hot([label], len(classes))[0].astype(float).tolist()

    def confident(self, outputs, threshold):
        """(rows a teacher is `threshold` sure of, their likeliest class as one-hot probabilities)."""
        outputs = np.asarray(outputs, dtype=np.float64)
        rows = np.flatnonzero(outputs.max(axis=1) >= threshold)
        return rows, scores.one_hot(outputs[rows].argmax(axis=1), outputs.shape[1]).astype(float)

    def truth(self, processed, classes):
        return self.encode(processed, classes)

    def threshold(self, truth, outputs, metric):
        return None

    def report(self, truth, outputs, classes, metric, threshold=None):
        reported = scores.classification_metrics(truth, outputs.argmax(axis=1), classes)
        if metric not in reported:
            reported = {**{k: v for k, v in reported.items() if k != "per_class"},
                        metric: scores.rounded(scores.classification_score(metric, truth, outputs)),
                        "per_class": reported["per_class"]}
        return reported

    def decide(self, outputs, classes, threshold, separator):
        return [classes[i] for i in outputs.argmax(axis=1)]

    def indicators(self, outputs, threshold):
        return scores.one_hot(outputs.argmax(axis=1), outputs.shape[1])

    def confusion(self, truth, outputs, classes, threshold):
        return pd.DataFrame({"actual": [classes[y] for y in truth],
                             "predicted": [classes[p] for p in outputs.argmax(axis=1)]})

    def default_header(self, classes, separated):
        return ["id", "label"]


class MultiLabel(Classification):
    """Any number of classes per row, none included: a sigmoid per class, binary cross-entropy, and a row
    has each class whose probability reaches a threshold chosen on the validation (out-of-fold) rows."""
    kind = "multilabel"
    problem_type = "multi_label_classification"
    loss = "binary_cross_entropy"
    evaluated = ("accuracy", "f1_macro", "f1_micro")  # at a threshold of 0.5 while training
    progress = ("f1_micro", "f1_macro")
    headline = ("f1_micro", "f1_macro", "accuracy")
    baseline = "one-vs-rest logistic regressions"
    read_labels = staticmethod(reading.read_multilabels)
    label_list = staticmethod(reading.multilabel_list)

    def head(self, classes):
        return f"the {len(classes)}-class multi-label head (a sigmoid per class)"

    def encode(self, processed, classes):
        """A 0/1 float row per example (transformers' BCE loss takes floats); NaN for an unlabelled row."""
        index = {name: i for i, name in enumerate(classes)}
        encoded = np.zeros((len(processed), len(classes)), dtype=np.float32)
        for row, cell in enumerate(processed):
            if cell == "":
                encoded[row] = np.nan
            else:
                encoded[row, [index[name] for name in json.loads(cell)]] = 1
        return encoded

    def activate(self, logits, scale=None):
        return sigmoid(logits)

    def evaluation_scores(self, logits, targets, scale=None):
        from sklearn.metrics import accuracy_score, f1_score

        predicted, truth = (np.asarray(logits) >= 0).astype(int), np.asarray(targets).astype(int)
        return {"accuracy": accuracy_score(truth, predicted),
                "f1_macro": f1_score(truth, predicted, average="macro", zero_division=0),
                "f1_micro": f1_score(truth, predicted, average="micro", zero_division=0)}

    soft = False  # 0/1 targets and probabilities alike: binary cross-entropy takes both
    soft_label = staticmethod(lambda label, classes: list(map(float, label)))

    def confident(self, outputs, threshold):
        """(rows whose every class is `threshold` sure either way, p or 1 - p; their 0/1 targets)."""
        outputs = np.asarray(outputs, dtype=np.float64)
        rows = np.flatnonzero(np.maximum(outputs, 1 - outputs).min(axis=1) >= threshold)
        return rows, (outputs[rows] >= 0.5).astype(float)

    def strata(self, processed, classes, k):
        return self.encode(processed, classes).astype(int)  # a matrix: split stratifies iteratively

    def truth(self, processed, classes):
        return self.encode(processed, classes).astype(int)

    def threshold(self, truth, outputs, metric):
        return scores.best_threshold(truth, outputs, metric)

    def report(self, truth, outputs, classes, metric, threshold=None):
        reported = scores.multilabel_metrics(truth, outputs, classes, threshold)
        if metric not in reported:
            reported = {**{k: v for k, v in reported.items() if k != "per_class"},
                        metric: scores.rounded(scores.multilabel_score(metric, truth, outputs, threshold)),
                        "per_class": reported["per_class"]}
        return reported

    def decide(self, outputs, classes, threshold, separator):
        return [separator.join(classes[c] for c in np.flatnonzero(row)) for row in self.indicators(outputs, threshold)]

    def indicators(self, outputs, threshold):
        return (outputs >= threshold).astype(int)

    def confusion(self, truth, outputs, classes, threshold):
        """A confusion matrix per class: a class found on the diagonal, a missed one against "(none)" in
        the predicted column, an added one against "(none)" in the actual column."""
        predicted = self.indicators(outputs, threshold)
        rows = [(classes[c] if t else "(none)", classes[c] if p else "(none)")
                for truth_row, predicted_row in zip(truth, predicted)
                for c, (t, p) in enumerate(zip(truth_row, predicted_row)) if t or p]
        return pd.DataFrame(rows, columns=["actual", "predicted"])

    def default_header(self, classes, separated):
        return ["id", "label"] if separated else ["id", *classes]


class Regression(Classification):
    """A number per row: one output, mean squared error; trained on the target standardised by the
    training rows' mean and standard deviation (any scale then trains alike), predicted in its units."""
    kind = "regression"
    problem_type = "regression"
    loss = "mse"
    evaluated = ("rmse", "mae", "pearson", "spearman")
    progress = ("rmse", "pearson")
    headline = evaluated
    baseline = "ridge regression"
    read_labels = staticmethod(reading.read_numbers)
    label_list = staticmethod(reading.no_classes)

    def outputs(self, classes):
        return ["value"]

    def head(self, classes):
        return "the regression head (one output)"

    def describe(self, classes):
        return "a number per row"

    def encode(self, processed, classes):
        return np.array([float(v) if v != "" else np.nan for v in processed], dtype=np.float32)

    def activate(self, logits, scale=None):
        mean, std = scale or (0.0, 1.0)
        return np.asarray(logits, dtype=np.float64).reshape(-1, 1) * std + mean

    def target_scale(self, targets):
        """(mean, standard deviation) of the training rows' targets: the model learns the target
        standardised, so a target in thousands trains as one around 1 does."""
        targets = np.asarray(targets, dtype=np.float64)
        return float(targets.mean()), float(targets.std()) or 1.0

    def evaluation_scores(self, logits, targets, scale=None):
        """Scores in the target's units: the model's outputs and the targets it trained on are standardised."""
        values, targets = self.activate(logits, scale)[:, 0], self.activate(targets, scale)[:, 0]
        # a constant prediction (early in training) has no correlation: 0 on the curve
        return {m: float(np.nan_to_num(scores.regression_score(m, targets, values))) for m in self.evaluated}

    soft = False  # values, as the labels are
    def soft_targets(self, outputs):  # values in the target's units: the student standardises them
        return [float(v) for v in np.asarray(outputs, dtype=np.float64).reshape(-1)]

    soft_label = staticmethod(lambda label, classes: float(label))
    confident = None  # a value has no confidence: pseudo.labels hard needs classes

    def strata(self, processed, classes, k):
        """Quantile bins of the target, named by their range, few enough that each holds 2 x k rows."""
        values = self.encode(processed, classes)
        bins = int(np.clip(len(values) // (2 * k), 1, REGRESSION_BINS))
        codes, edges = pd.qcut(values, bins, labels=False, retbins=True, duplicates="drop")
        names = [f"{a:g} to {b:g}" for a, b in zip(edges[:-1], edges[1:])]
        return np.array([names[c] for c in codes], dtype=object)

    def truth(self, processed, classes):
        return self.encode(processed, classes).astype(np.float64)

    def report(self, truth, outputs, classes, metric, threshold=None):
        return scores.regression_metrics(truth, outputs[:, 0])

    def decide(self, outputs, classes, threshold, separator):
        return outputs[:, 0]

    def confusion(self, truth, outputs, classes, threshold):
        """Predicted against true values in the same quantile bins of the truth: a scatter plot's density,
        right answers on the diagonal."""
        edges = np.unique(np.quantile(truth, np.linspace(0, 1, REGRESSION_BINS + 1)))
        names = [f"{a:.3g} to {b:.3g}" for a, b in zip(edges[:-1], edges[1:])]
        def binned(values):
            return [names[i] for i in np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(names) - 1)]
        return pd.DataFrame({"actual": binned(truth), "predicted": binned(outputs[:, 0])})

    def default_header(self, classes, separated):
        return ["id", "value"]


SHAPES = {shape.kind: shape for shape in (Classification(), MultiLabel(), Regression())}
