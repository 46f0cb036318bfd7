"""The split stage's pure functions: the holdout split of one fold, and stratified K-fold with
duplicate texts kept together. The stage end to end is in test_cv.py and test_bad_input.py."""
import numpy as np
import pandas as pd
import pytest

from pipeline.settings import PipelineError
from stages.split import checked_fold_count, holdout_folds, kfold_folds, split_train_val


def test_split_is_stratified_seeded_and_keeps_singletons_in_train():
    df = pd.DataFrame({"text": [f"t{i}" for i in range(101)], "label": ["a"] * 60 + ["b"] * 40 + ["c"]})
    train, val = split_train_val(df, 0.2, seed=3)
    again_train, _ = split_train_val(df, 0.2, seed=3)
    assert train["text"].tolist() == again_train["text"].tolist()
    assert set(train["text"]).isdisjoint(val["text"]) and len(train) + len(val) == 101
    assert val["label"].value_counts().to_dict() == {"a": 12, "b": 8}
    assert "c" in set(train["label"])


def test_split_gives_every_class_a_validation_row_when_val_size_is_too_small():
    # sklearn alone raises here: "The test_size = 1 should be greater or equal to the number of classes = 3"
    df = pd.DataFrame({"text": [f"t{i}" for i in range(9)], "label": ["a", "b", "c"] * 3})
    train, val = split_train_val(df, 0.1, seed=0)
    assert sorted(val["label"]) == ["a", "b", "c"] and sorted(set(train["label"])) == ["a", "b", "c"]


def test_split_leaves_train_every_class_when_val_size_is_too_large():
    df = pd.DataFrame({"text": [f"t{i}" for i in range(6)], "label": ["a", "b", "c"] * 2})
    train, val = split_train_val(df, 0.9, seed=0)
    assert sorted(train["label"]) == sorted(val["label"]) == ["a", "b", "c"]


def test_holdout_marks_validation_rows_0_and_the_rest_minus_1():
    df = pd.DataFrame({"text": [f"t{i}" for i in range(101)], "label": ["a"] * 60 + ["b"] * 40 + ["c"]})
    folds = holdout_folds(df, 0.2, seed=3)
    _, val = split_train_val(df, 0.2, seed=3)
    assert sorted(np.flatnonzero(folds == 0)) == sorted(val.index)
    assert set(folds) == {-1, 0} and folds[100] == -1  # the single "c" trains only


def test_kfold_validates_every_row_once_with_every_class_in_every_fold():
    rng = np.random.default_rng(0)
    labels = rng.choice(["neg", "neu", "pos"], size=500, p=[0.2, 0.5, 0.3])
    texts = [f"text {i}" for i in range(500)]
    folds = kfold_folds(texts, labels, 5, seed=1)
    assert sorted(set(folds)) == [0, 1, 2, 3, 4]  # no -1: every row is some fold's validation row
    for k in range(5):
        assert set(labels[folds == k]) == {"neg", "neu", "pos"}
        assert abs((folds == k).sum() - 100) <= 3  # folds of nearly equal size
    assert (kfold_folds(texts, labels, 5, seed=1) == folds).all()  # seeded
    assert (kfold_folds(texts, labels, 5, seed=2) != folds).any()


def test_kfold_keeps_duplicate_texts_in_one_fold():
    texts = [f"t{i % 40}" for i in range(120)]  # every text three times
    labels = np.array(["a" if i % 40 < 20 else "b" for i in range(120)])
    folds = kfold_folds(texts, labels, 4, seed=0)
    by_text = pd.Series(folds).groupby(pd.Series(texts)).nunique()
    assert (by_text == 1).all(), "a duplicated text sits in two folds"


def test_kfold_names_the_class_too_small_for_k():
    labels = np.array(["a"] * 10 + ["b"] * 10 + ["rare"] * 3)
    texts = [f"t{i}" for i in range(len(labels))]
    with pytest.raises(PipelineError) as e:
        kfold_folds(texts, labels, 5, seed=0)
    assert str(e.value) == ("data/processed/train.csv: too few distinct texts for 5 folds ('rare' has 3); every "
                            "class needs at least one per fold: use at most 3 folds in cv.folds, or more "
                            "examples of those classes")
    # the most folds the message offers work: one of the rarest class's texts in each
    folds = kfold_folds(texts, labels, 3, seed=0)
    assert sorted(folds[labels == "rare"]) == [0, 1, 2]


@pytest.mark.parametrize("folds", [[], [1], [0, 2], [1, 0], 5, [True], ["0"]])
def test_cv_folds_must_list_0_to_k_minus_1(folds):
    with pytest.raises(PipelineError, match=r"cv.folds must list the folds 0 to K-1"):
        checked_fold_count(folds)
    assert checked_fold_count([0, 1, 2]) == 3 and checked_fold_count([0]) == 1
