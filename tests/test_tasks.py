"""The task shapes' pure functions (tasks/shapes.py, labels.py, scores.py) and what split and tokenize
do with them; the shapes end to end are in test_shapes.py."""
import json

import numpy as np
import pandas as pd
import pytest

from bench.common import tokenize_texts
from pipeline.settings import PipelineError
from reading.cleaning import clean_frame
from reading.tokens import joined
from stages.preprocess import order_by_sample
from stages.split import holdout_folds, kfold_folds
from tasks.labels import multilabel_list, read_multilabels, read_numbers
from tasks.scores import best_threshold, mean_column_auc
from tasks.shapes import SHAPES, competition_metric, headline
from tasks.submission import check_header, submission_frame

CLASSES = ["food", "music", "sports"]


def test_multilabel_labels_read_from_a_joined_column_or_from_0_1_columns():
    raw = pd.DataFrame({"tags": ["music|food", "", " sports | music |", "food||food"],
                        "food": ["1", "0", "0", "1.0"], "music": ["1", "0", "1", "0"], "sports": ["0", "0", "1", " 0"]})
    joined_rows = read_multilabels(raw, ["tags"], "|", "train.csv")
    assert joined_rows.map(json.loads).tolist() == [["music", "food"], [], ["sports", "music"], ["food"]]
    assert multilabel_list(joined_rows, ["tags"], "|", "train.csv") == CLASSES
    columns = read_multilabels(raw, CLASSES, None, "train.csv")
    assert columns.map(json.loads).tolist() == [["food", "music"], [], ["music", "sports"], ["food"]]
    assert multilabel_list(columns, ["sports", "food", "music"], None, "train.csv") == ["sports", "food", "music"]
    with pytest.raises(PipelineError, match=r"train.csv: column 'music' must hold 0 or 1 in every row .*rows 2, 3 hold 'yes', '2'"):
        read_multilabels(raw.assign(music=["yes", "2", "0", "1"]), CLASSES, None, "train.csv")
    # a test file: unlabelled without the column(s), or when the joined column is empty throughout
    assert read_multilabels(raw[["food"]].assign(tags=""), ["tags"], "|", "test.csv", known=CLASSES).eq("").all()
    with pytest.raises(PipelineError, match=r"test.csv: label\(s\) \['jazz'\] never occur in the training data"):
        read_multilabels(pd.DataFrame({"tags": ["jazz|food"]}), ["tags"], "|", "test.csv", known=CLASSES)
    with pytest.raises(PipelineError, match=r"has 'food' but not 'music', 'sports'"):
        read_multilabels(raw[["food"]], CLASSES, None, "test.csv", known=CLASSES)


def test_multilabel_rows_encode_as_0_1_floats_and_unlabelled_as_nan():
    encoded = SHAPES["multilabel"].encode(['["music","food"]', "[]", ""], CLASSES)
    assert encoded[:2].tolist() == [[1, 1, 0], [0, 0, 0]] and np.isnan(encoded[2]).all()
    assert encoded.dtype == np.float32  # transformers' BCE loss takes float labels


def test_regression_targets_must_be_numbers():
    raw = pd.DataFrame({"score": ["1.5", " 2 ", "high", "", "n/a"]})
    with pytest.raises(PipelineError) as raised:
        read_numbers(raw.iloc[[0, 1, 2, 4]], ["score"], None, "train.csv")
    assert str(raised.value) == ("train.csv: 2 row(s) of 'score' are not numbers (rows 4, 6: 'high', 'n/a'); "
                                 "task.kind regression needs a number in every row")
    with pytest.raises(PipelineError, match=r"train.csv: 1 row\(s\) have an empty 'score' \(row 5\)"):
        read_numbers(raw.iloc[[0, 3]], ["score"], None, "train.csv")
    assert read_numbers(raw.iloc[[0, 1, 3]], ["score"], None, "test.csv", known=[]).tolist() == ["1.5", "2", ""]
    # a target must vary: two values are enough (a 0/1 score read as a number), one value, however spelled, not
    label_list = SHAPES["regression"].label_list
    assert label_list(pd.Series(["0", "1", "1.0"]), ["score"], None, "train.csv") == []
    with pytest.raises(PipelineError, match=r"train.csv: 'score' holds a single value \('2'\); regression needs "
                                            r"at least two"):
        label_list(pd.Series(["2", "2.0", "+2"]), ["score"], None, "train.csv")


def test_competition_metrics_belong_to_their_shape():
    assert [competition_metric("auto", kind) for kind in SHAPES] == ["f1_macro", "f1_macro", "rmse"]
    assert competition_metric("qwk", "classification") == "qwk"
    with pytest.raises(PipelineError, match="task.metric pearson does not score task.kind classification; one of: auto"):
        competition_metric("pearson", "classification")


def test_each_shape_reports_its_scores():
    classification = SHAPES["classification"].report(np.array([0, 1, 1]), np.array([[0.9, 0.1], [0.4, 0.6], [0.7, 0.3]]),
                                                      ["a", "b"], "log_loss")
    assert list(classification) == ["accuracy", "f1_macro", "log_loss", "per_class"]
    assert classification["log_loss"] == pytest.approx(-np.mean(np.log([0.9, 0.6, 0.3])), abs=1e-4)
    regression = SHAPES["regression"].report(np.array([1.0, 2.0, 3.0]), np.array([[1.0], [2.5], [2.5]]), [], "rmse")
    assert regression == {"rmse": pytest.approx(np.sqrt(0.5 / 3), abs=1e-4), "mae": pytest.approx(1 / 3, abs=1e-4),
                          "pearson": pytest.approx(0.866, abs=1e-3), "spearman": pytest.approx(0.866, abs=1e-3)}
    constant = SHAPES["regression"].report(np.array([1.0, 2.0]), np.array([[1.5], [1.5]]), [], "rmse")
    assert constant["pearson"] is None  # undefined: null in metrics.json, not NaN
    assert mean_column_auc(np.array([[1, 0], [0, 1], [1, 1]]), np.array([[0.9, 0.2], [0.1, 0.8], [0.8, 0.7]])) == 1.0
    # a class that no row has, or every row: no ROC AUC (scikit-learn raises); the others' mean. The first
    # column's, of one positive row: 2 of its 3 (positive, negative) pairs ranked right
    truth = np.array([[1, 0, 1], [0, 0, 1], [0, 0, 1], [0, 0, 1]])
    assert mean_column_auc(truth, np.array([[0.3, 0.5, 0.5], [0.2, 0.5, 0.5], [0.4, 0.5, 0.5], [0.1, 0.5, 0.5]])) == (
        pytest.approx(2 / 3))
    assert np.isnan(mean_column_auc(truth[:, 1:], np.full((4, 2), 0.5)))
    # a sigmoid in fp32 reaches 0 and 1 exactly: right and sure costs nothing, not NaN
    sure = SHAPES["multilabel"].report(truth, truth.astype(float), ["a", "b", "c"], "log_loss", 0.5)
    assert sure["log_loss"] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("metric", ["accuracy", "f1_macro", "f1_weighted", "log_loss", "roc_auc", "qwk"])
def test_each_classification_metric_is_scikit_learns_on_the_class_of_highest_probability(metric):
    from sklearn.metrics import accuracy_score, cohen_kappa_score, f1_score, log_loss, roc_auc_score

    rng = np.random.default_rng(0)
    truth = np.arange(60) % 4  # every class present, four ordered classes (qwk's case)
    probabilities = rng.dirichlet(np.ones(4), size=60)
    probabilities[np.arange(60), truth] += rng.uniform(0, 0.6, size=60)  # better than chance, far from perfect
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    predicted = probabilities.argmax(axis=1)
    expected = {"accuracy": lambda: accuracy_score(truth, predicted),
                "f1_macro": lambda: f1_score(truth, predicted, average="macro"),
                "f1_weighted": lambda: f1_score(truth, predicted, average="weighted"),
                "log_loss": lambda: log_loss(truth, probabilities),
                "roc_auc": lambda: roc_auc_score(truth, probabilities, multi_class="ovr", average="macro"),
                "qwk": lambda: cohen_kappa_score(truth, predicted, weights="quadratic")}[metric]()
    reported = SHAPES["classification"].report(truth, probabilities, list("abcd"), metric)
    assert 0.05 < accuracy_score(truth, predicted) < 0.95  # a case where the class picked matters
    assert reported[metric] == pytest.approx(expected, abs=1e-4), (metric, reported[metric], expected)


@pytest.mark.parametrize("metric", ["f1_macro", "f1_micro", "f1_weighted", "accuracy", "roc_auc", "log_loss"])
def test_each_multilabel_metric_is_scikit_learns_at_the_threshold(metric):
    from sklearn.metrics import accuracy_score, f1_score, log_loss, roc_auc_score

    rng = np.random.default_rng(1)
    truth = (rng.uniform(size=(80, 4)) < [0.2, 0.4, 0.5, 0.7]).astype(int)  # every column holds 0 and 1
    probabilities = np.clip(0.35 * truth + rng.uniform(0, 0.65, size=truth.shape), 0.01, 0.99)
    threshold = 0.6
    predicted = (probabilities >= threshold).astype(int)
    expected = {"f1_macro": lambda: f1_score(truth, predicted, average="macro"),
                "f1_micro": lambda: f1_score(truth, predicted, average="micro"),
                "f1_weighted": lambda: f1_score(truth, predicted, average="weighted"),
                "accuracy": lambda: accuracy_score(truth, predicted),  # subset accuracy: every class of a row
                # Jigsaw's: the mean of the columns' ROC AUC, and of their binary log loss
                "roc_auc": lambda: roc_auc_score(truth, probabilities, average="macro"),
                "log_loss": lambda: np.mean([log_loss(truth[:, c], probabilities[:, c]) for c in range(4)])}[metric]()
    reported = SHAPES["multilabel"].report(truth, probabilities, list("abcd"), metric, threshold)
    assert 0.05 < accuracy_score(truth, predicted) < 0.95 and 0 < predicted.sum() < predicted.size
    assert reported[metric] == pytest.approx(expected, abs=1e-4), (metric, reported[metric], expected)
    assert reported["threshold"] == threshold


def test_the_threshold_is_the_best_on_the_grid_nearest_one_half():
    truth = np.array([[1, 0], [0, 1], [1, 1], [0, 0]])
    probabilities = np.array([[0.3, 0.1], [0.1, 0.35], [0.32, 0.4], [0.2, 0.05]])
    threshold = best_threshold(truth, probabilities, "f1_micro")
    assert 0.2 < threshold <= 0.3 and threshold == pytest.approx(0.3)  # 0.21 to 0.30 score alike: nearest 0.5
    assert best_threshold(truth, probabilities, "roc_auc") == best_threshold(truth, probabilities, "f1_macro")


def test_multilabel_and_regression_score_raw_outputs_during_training_as_scikit_learn_does():
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, mean_absolute_error, root_mean_squared_error

    rng = np.random.default_rng(2)
    logits = rng.normal(size=(40, 4))
    logits[:, 3] = -5  # a class no row has and none is predicted: scored 0, scikit-learn's zero_division=0
    logits[0, 0] = 0.0  # a sigmoid of exactly 0.5: predicted, as at the threshold 0.5
    targets = (rng.uniform(size=(40, 4)) < [0.4, 0.5, 0.3, 0]).astype(float)
    predicted = (1 / (1 + np.exp(-logits)) >= 0.5).astype(int)
    assert predicted[0, 0] == 1 and predicted[:, 3].sum() == targets[:, 3].sum() == 0
    expected = {"accuracy": accuracy_score(targets, predicted),
                "f1_macro": f1_score(targets, predicted, average="macro", zero_division=0),
                "f1_micro": f1_score(targets, predicted, average="micro")}
    assert SHAPES["multilabel"].evaluation_scores(logits, targets) == pytest.approx(expected, abs=1e-9)
    # regression: standardised outputs and targets, scored in the target's units
    outputs, standardised = rng.normal(size=(30, 1)), rng.normal(size=30)
    values, truth = outputs[:, 0] * 4 + 50, standardised * 4 + 50
    expected = {"rmse": root_mean_squared_error(truth, values), "mae": mean_absolute_error(truth, values),
                "pearson": pearsonr(truth, values)[0], "spearman": spearmanr(truth, values)[0]}
    regression = SHAPES["regression"]
    assert regression.evaluation_scores(outputs, standardised, (50.0, 4.0)) == pytest.approx(expected, abs=1e-6)
    assert regression.activate(outputs, None)[:, 0] == pytest.approx(outputs[:, 0])  # no scale: the values
    constant = regression.evaluation_scores(np.zeros((4, 1)), np.array([-1.0, 0.0, 1.0, 2.0]))
    assert constant["pearson"] == constant["spearman"] == 0  # no correlation yet: 0 on the curve, not NaN
    assert regression.target_scale([2.0, 4.0, 9.0]) == pytest.approx((5.0, np.std([2.0, 4.0, 9.0])))
    assert regression.target_scale([3.0, 3.0]) == (3.0, 1.0)  # a constant target: no division by 0


def test_each_shape_decides_and_tabulates_its_outputs_as_worked_by_hand():
    classes = ["a", "b", "c"]
    single = SHAPES["classification"]
    assert single.encode(["b", "", "a"], classes).tolist() == [1, -1, 0]  # unlabelled: -1
    assert single.soft_label(1, classes) == [0.0, 1.0, 0.0]  # a train row's class index, as probabilities
    probabilities = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    assert single.decide(probabilities, classes, None, None) == ["b", "a"]
    assert single.indicators(probabilities, None).tolist() == [[0, 1, 0], [1, 0, 0]]
    assert single.confusion(np.array([1, 2]), probabilities, classes, None).to_dict("list") == {
        "actual": ["b", "c"], "predicted": ["b", "a"]}
    # multi-label: a class at the threshold is predicted; a confusion row per class found, missed or added
    tags = SHAPES["multilabel"]
    outputs = np.array([[0.5, 0.2], [0.7, 0.6], [0.1, 0.49]])
    assert tags.decide(outputs, ["x", "y"], 0.5, "|") == ["x", "x|y", ""]
    truth = np.array([[1, 1], [0, 1], [0, 0]])
    assert tags.confusion(truth, outputs, ["x", "y"], 0.5).values.tolist() == [
        ["x", "x"], ["y", "(none)"], ["(none)", "x"], ["y", "y"]]
    # regression: values in the truth's quantile bins, the outermost taking what lies beyond them
    values = SHAPES["regression"]
    assert values.decide(np.array([[1.5], [-2.0]]), [], None, None).tolist() == [1.5, -2.0]
    truth = np.arange(11.0)  # deciles at 0, 1, ..., 10
    table = values.confusion(truth, np.array([[-5.0], [0.5], [3.5], [9.5], [99.0], *[[5.5]] * 6]), [], None)
    assert table["predicted"].tolist()[:5] == ["0 to 1", "0 to 1", "3 to 4", "9 to 10", "9 to 10"]
    assert table["actual"].iloc[[0, -1]].tolist() == ["0 to 1", "9 to 10"]
    assert set(table["actual"]) <= {f"{v} to {v + 1}" for v in range(10)}
    # k-fold strata: as many bins as hold 2 x k rows each, at most 10
    strata = values.strata([str(v) for v in range(35)], [], 5)
    assert len(set(strata)) == 3 and min(pd.Series(strata).value_counts()) >= 10
    assert set(values.strata([str(v) for v in range(12)], [], 5)) == {"0 to 11"}  # too few rows for 2 bins


def test_the_headline_scores_end_with_the_competition_metric_when_it_is_another():
    assert headline("classification", "f1_macro") == ("f1_macro", "accuracy")
    assert headline("classification", "qwk") == ("f1_macro", "accuracy", "qwk")
    assert headline("regression", "pearson") == ("rmse", "mae", "pearson", "spearman")


def test_submissions_take_the_header_and_form():
    outputs = np.array([[0.7, 0.6, 0.1], [0.1, 0.2, 0.3]])
    shape = SHAPES["multilabel"]
    joined_form = submission_frame(shape, ["a", "b"], outputs, CLASSES, ["id", "label"], 0.5, ";", False)
    assert joined_form.to_dict("list") == {"id": ["a", "b"], "label": ["food;music", ""]}
    columns = submission_frame(shape, ["a", "b"], outputs, CLASSES, ["Id", "sports", "food", "music"], 0.5, None, False)
    assert columns.to_dict("list") == {"Id": ["a", "b"], "sports": [0, 0], "food": [1, 0], "music": [1, 0]}
    probabilities = submission_frame(shape, ["a", "b"], outputs, CLASSES, ["id", *CLASSES], 0.5, None, True)
    assert probabilities["music"].tolist() == [0.6, 0.2]  # ROC AUC or log loss score the probabilities
    single = submission_frame(SHAPES["classification"], [1, 2], outputs, CLASSES, ["id", "target"], None, None, False)
    assert single.to_dict("list") == {"id": [1, 2], "target": ["food", "sports"]}
    assert check_header(["ID", "score"], SHAPES["regression"], [], "sample.csv") == ["ID", "score"]
    # Jigsaw's form: one column per class, in the sample's own order, for either kind with classes
    for kind in ("multilabel", "classification"):
        header = ["Id", "sports", "food", "music"]
        assert check_header(header, SHAPES[kind], CLASSES, "s.csv") == header
    with pytest.raises(PipelineError, match=r"s.csv: columns 'id', 'a', 'b': expected the id column, then one "
                                            r"prediction column$"):  # regression: no class columns to offer
        check_header(["id", "a", "b"], SHAPES["regression"], [], "s.csv")
    with pytest.raises(PipelineError, match=r"sample.csv: columns 'id', 'a', 'b': expected the id column, then one "
                                            r"prediction column, or one column per class \(food, music, sports\)"):
        check_header(["id", "a", "b"], shape, CLASSES, "sample.csv")


def test_a_sample_submission_orders_the_test_rows_and_spells_their_ids():
    test = pd.DataFrame({"id": ["7", "8", "10"], "text": ["x", "y", "z"]})
    ordered = order_by_sample(test, pd.Series(["010", "7", "8"], name="Id"), "id", "sample.csv", "test.csv")
    assert ordered.to_dict("list") == {"id": ["010", "7", "8"], "text": ["z", "x", "y"]}  # one number, one id
    with pytest.raises(PipelineError, match=r"sample.csv: id '9' \(row 4\) is not in test.csv's 'id'"):
        order_by_sample(test, pd.Series(["7", "8", "9"], name="Id"), "id", "sample.csv", "test.csv")


def test_multilabel_folds_are_stratified_iteratively_and_keep_duplicates_together():
    rng = np.random.default_rng(0)
    indicators = (rng.random((300, 4)) < [0.5, 0.2, 0.05, 0.3]).astype(int)
    texts = [f"t{i % 250}" for i in range(300)]  # 50 texts twice
    folds = kfold_folds(texts, indicators, 5, seed=1)
    assert sorted(set(folds)) == [0, 1, 2, 3, 4]
    assert (pd.Series(folds).groupby(pd.Series(texts)).nunique() == 1).all()
    for c in range(4):  # each class spread over the folds in proportion, the rare one too
        per_fold = np.bincount(folds, weights=indicators[:, c], minlength=5)
        assert per_fold.max() - per_fold.min() <= 5 and per_fold.min() >= 1, (c, per_fold)
    holdout = holdout_folds(pd.DataFrame({"text": texts}), 0.2, seed=1, strata=indicators)
    assert set(holdout) == {-1, 0} and abs((holdout == 0).sum() - 60) <= 1


def test_regression_folds_are_stratified_by_quantile_bins():
    shape = SHAPES["regression"]
    values = [str(v) for v in np.linspace(0, 5, 200)]
    strata = shape.strata(values, [], 5)
    assert len(set(strata)) == 10 and strata[0] == "0 to 0.5"  # ten bins of 20 values
    folds = kfold_folds([f"t{i}" for i in range(200)], strata, 5, seed=0)
    means = [np.mean(np.array(values, dtype=float)[folds == k]) for k in range(5)]
    assert max(means) - min(means) < 0.2  # every fold spans the range alike


def test_pairs_and_joined_columns_reach_the_tokenizer_as_such(tokenizer):
    frame = clean_frame(pd.DataFrame({"title": ["Great", "", " "], "body": ["the car", "", "x"], "b": ["a", "b", ""]}),
                        ["title", "body"], None, ["normalize_whitespace"], "b")
    assert frame["text"].tolist() == ["Great\x1fthe car", "", "\x1fx"]  # a row with no text at all is dropped
    assert frame.index.tolist() == [0, 1, 2] and frame["text_pair"].tolist() == ["a", "b", ""]
    assert joined(["Great\x1fthe car"], tokenizer) == ["Great [SEP] the car"]
    ids, types, lengths = tokenize_texts(tokenizer, ["a man plays", "long " * 40], 12, pairs=["a guitar", "short"],
                                         types=True)
    reference = tokenizer(["a man plays", "long " * 40], ["a guitar", "short"], truncation=True, max_length=12)
    assert ids == reference["input_ids"] and types == reference["token_type_ids"]
    assert types[0] == [0, 0, 0, 0, 0, 1, 1, 1] and lengths[1] > 12
