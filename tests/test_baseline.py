"""The baseline: TF-IDF n-grams and a linear model on train@K's folds (baselines/tfidf.py), the line
comparing it with the model (baselines/verdict.py), and, end to end with the real `dvc` CLI, a dataset
the tiny model cannot learn and a bag of words can: evaluate warns, once, and the run succeeds. The
baseline of every task shape, K=1 and K=3, is checked in tests/test_shapes.py on the shape repos there."""
import re

import numpy as np
import pandas as pd
import pytest
from sklearn.linear_model import LogisticRegression

from baselines.tfidf import LINEAR_MODELS, cross_fit, features, fit_features, linear_outputs, vectorizers
from baselines.verdict import comparison
from tests.test_cv import logged_repro
from tests.test_pipeline import init_pipeline_repo

WORDS = {0: ["apple", "pear", "plum"], 1: ["train", "bus", "tram"], 2: ["red", "blue", "green"]}


def texts_and_labels(n=90, seed=0):
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 3
    texts = [f"the {rng.choice(WORDS[y])} and {rng.choice(WORDS[y])} of today" for y in labels]
    return texts, labels


@pytest.mark.parametrize("kind", ["classification", "multilabel", "regression"])
def test_a_rows_out_of_fold_output_never_saw_its_own_label(kind):
    texts, labels = texts_and_labels()
    y = {"classification": labels, "multilabel": np.eye(3, dtype=int)[labels],
         "regression": labels.astype(float)}[kind]
    outputs = 1 if kind == "regression" else 3
    _, x = fit_features(vectorizers(2, 4, 1000, 1), texts)
    row_folds = np.arange(len(texts)) // 3 % 3  # every fold holds every class
    rows, oof, _ = cross_fit(kind, x, y, row_folds, None, 1.0, 0, outputs)
    assert rows.tolist() == list(range(len(texts))) and oof.shape == (len(texts), outputs)
    flipped = y.copy()
    fold0 = row_folds == 0
    flipped[fold0] = y[fold0][::-1]  # fold 0's labels shuffled: only the other folds' models see them
    _, again, _ = cross_fit(kind, x, flipped, row_folds, None, 1.0, 0, outputs)
    assert np.array_equal(again[fold0], oof[fold0])
    assert not np.allclose(again[~fold0], oof[~fold0])


def test_the_rows_of_no_fold_only_train_and_the_test_rows_are_the_mean_of_the_folds():
    texts, labels = texts_and_labels()
    fitted, x = fit_features(vectorizers(1, 0, 1000, 1), texts)
    x_test = features(fitted, ["an apple", "a blue bus"])
    row_folds = np.array([-1] * 30 + [0] * 30 + [1] * 30)
    rows, oof, test = cross_fit("classification", x, labels, row_folds, x_test, 1.0, 0, 3)
    assert rows.tolist() == list(range(30, 90))
    by_fold = [LINEAR_MODELS["classification"](1.0, 0).fit(x[row_folds != k], labels[row_folds != k]) for k in (0, 1)]
    assert np.allclose(test, np.mean([m.predict_proba(x_test) for m in by_fold], axis=0))


def test_a_class_no_fitted_row_has_gets_probability_zero():
    x = np.array([[0.0, 1.0], [1.0, 0.0], [0.9, 0.1]])
    model = LogisticRegression().fit(x, [0, 2, 2])  # class 1 is missing
    outputs = linear_outputs(model, x, 3)
    assert outputs.shape == (3, 3) and (outputs[:, 1] == 0).all() and np.allclose(outputs.sum(axis=1), 1)


def test_pairs_get_the_columns_of_each_text():
    fitted, x = fit_features(vectorizers(1, 0, 1000, 1), ["good day", "bad day"], ["bad day", "good day"])
    assert x.shape == (2, 6) and (x[0, :3] != x[0, 3:]).nnz  # good/bad in the first text, then in the second
    assert features(fitted, ["good day"], ["bad day"]).toarray().tolist() == x[:1].toarray().tolist()


def test_the_comparison_line():
    assert comparison("val", "f1_macro", 0.81, 0.75, "logistic regression", ["x"]) == (
        "baseline: the model's val macro-F1 0.8100 beats the TF-IDF + logistic regression baseline's 0.7500 "
        "(baseline.val.f1_macro)")
    assert comparison("oof", "rmse", 0.5, 0.4, "ridge regression", ["too few epochs (train.epochs 1)", "b"]) == (
        "warning: the model's oof RMSE 0.5000 does not beat the TF-IDF + ridge regression baseline's 0.4000 "
        "(baseline.oof.rmse), scored on the same rows; likely causes: too few epochs (train.epochs 1); b")
    assert comparison("val", "rmse", 0.3, 0.4, "ridge regression", []).startswith("baseline: the model's val RMSE 0.3000 beats")
    assert comparison("val", "f1_macro", 1.0, 1.0, "x", []).startswith("baseline: the model's val macro-F1 1.0000 is perfect")
    # a tie beats nothing, whichever way the metric goes; both perfect says so, an RMSE of 0 as an F1 of 1
    for metric, score in (("rmse", 0.4), ("log_loss", 0.3), ("f1_macro", 0.8)):
        assert comparison("val", metric, score, score, "x", []).startswith("warning: the model's val"), metric
    assert comparison("val", "rmse", 0.0, 0.0, "x", []).startswith("baseline: the model's val RMSE 0.0000 is perfect")
    assert "not compared" in comparison("val", "pearson", None, 0.4, "ridge regression", [])


# Classes told apart by Chinese words whose every character the embedded MiniLM's vocabulary lacks: the
# tiny model reads them all as its unknown token and cannot tell the classes apart; a bag of words can
UNKNOWN_WORDS = {"animals": ["猫狗", "鱼鸟", "牛羊"], "weather": ["雨雪", "风云", "草树"], "colours": ["红黄", "蓝绿", "黑叶"]}
FILLER = ["the", "car", "phone", "flight", "today", "my", "new", "really", "this", "is", "was"]


def unlearnable_rows(n, seed):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = sorted(UNKNOWN_WORDS)[i % 3]
        words = list(rng.choice(FILLER, 4, replace=False)) + list(rng.choice(UNKNOWN_WORDS[label], 2))
        rng.shuffle(words)
        rows.append({"text": " ".join(words), "sentiment": label})
    return pd.DataFrame(rows)


def test_a_model_below_the_baseline_gets_one_warning_naming_the_causes_and_the_run_succeeds(tmp_path, tiny_model_dir,
                                                                                          tokenizer):
    assert tokenizer.tokenize("猫狗 鱼鸟") == ["[UNK]"] * 4
    data = tmp_path / "data"
    data.mkdir()
    unlearnable_rows(150, 1).to_csv(data / "train.csv", index=False)
    unlearnable_rows(30, 2).assign(id=lambda f: [f"t{i}" for i in range(len(f))]).to_csv(data / "test.csv", index=False)
    repo = init_pipeline_repo(tmp_path / "repo", data, tiny_model_dir, train__epochs=2, split__val_size=0.2)
    ran, log = logged_repro(repo)  # asserts that it succeeds
    assert "evaluate" in ran and (repo / "submission/submission.csv").is_file()
    metrics = pd.read_json(repo / "reports/evaluate/metrics.json", typ="series")
    assert metrics["baseline"]["val"]["f1_macro"] == 1.0, metrics["baseline"]
    warnings = [line for line in log.splitlines() if line.startswith("warning: the model's")]
    assert len(warnings) == 1, warnings
    assert re.match(r"warning: the model's val macro-F1 0\.\d{4} does not beat the TF-IDF \+ logistic regression "
                    r"baseline's 1\.0000 \(baseline\.val\.f1_macro\), scored on the same rows; likely causes: \d+% of "
                    r"the train texts' tokens are unknown to the tokenizer \(the model sees nothing of them\): a model whose vocabulary "
                    r"covers the texts' characters \(model\.name\); too few epochs \(train\.epochs 2\); "
                    r"the learning rate \(train\.lr 0\.002\)$", warnings[0]), warnings[0]
    # the tokenize stage said it before training
    said = [line for line in log.splitlines() if "tokens are unknown to" in line and line.startswith("warning: ")
            and not line.startswith("warning: the model's")]
    assert len(said) == 1 and log.index(said[0]) < log.index("Running stage 'train@0'"), said
