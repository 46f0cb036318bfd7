"""split: put each training row in the validation part of one fold (or of none).

Reads data/processed/{train.csv,labels.json,shape.json}; writes data/split/folds.csv, one row per
training row in the same order: `row` (its position in train.csv) and `fold`, the fold whose model
validates on that row (-1: a row every fold trains on). Fold k trains on every row whose fold is not k.

- cv.folds [0]: one fold, a holdout split: split.val_size of the rows, stratified by label,
  validate; classes with a single example stay in training.
- cv.folds [0, 1, ..., K-1]: stratified K-fold: every row is validated by exactly one fold, every
  fold validates on every class, and rows with the same text (text pair) share a fold (duplicates
  never sit on both sides of a fold, even with preprocess.drop_duplicates off).
What is stratified by comes from the task shape (tasks/shapes.py): the class; for multi-label the
classes of each row, by iterative stratification (the iterative-stratification package: Sechidis et al.
2011's algorithm, which keeps each class's share, and pairs of classes', alike across folds); for
regression quantile bins of the target.
"""
import json
import math

import numpy as np
import pandas as pd
from sklearn.model_selection import StratifiedKFold, train_test_split

from pipeline.command import run_main
from pipeline.outputs import atomic_dir
from pipeline.settings import SEEDS, PipelineError, Range, load_params
from reading.csvfiles import read_csv, write_csv
from tasks.shapes import SHAPES

TRAIN_CSV = "data/processed/train.csv"
LABELS = "data/processed/labels.json"
SHAPE = "data/processed/shape.json"
OUT = "data/split"
# what the keys this stage reads accept; load_params turns anything else into a one-line error
CV_PARAMS = {"folds": (list,)}
SPLIT_PARAMS = {"val_size": (float, Range(0, 1, low_open=True, high_open=True)), "seed": (int, SEEDS)}


def checked_fold_count(folds):
    """K from cv.folds, which must be the list 0, 1, ..., K-1: DVC makes one train stage per item
    (it can expand a list into stages, not a number), and each fold number is a stage's name."""
    if not isinstance(folds, list) or not folds or folds != list(range(len(folds))) or any(isinstance(f, bool) for f in folds):
        raise PipelineError(f"params.yaml: cv.folds must list the folds 0 to K-1: [0] for one model on a "
                            f"holdout split, or e.g. [0, 1, 2, 3, 4] for 5-fold cross-validation; not {folds!r}")
    return len(folds)


def split_train_val(df, val_size, seed):
    """Stratified, seeded holdout split: (train rows, val rows). Classes with a single example stay
    in train. Validation gets at least one row of each other class and train keeps one, even when
    val_size asks for fewer (stratifying needs it, and validation must never be empty)."""
    counts = df["label"].value_counts()
    rare = df["label"].isin(counts[counts < 2].index)
    splittable, classes = df[~rare], int((counts >= 2).sum())
    if classes == 0:
        raise PipelineError(f"{TRAIN_CSV}: no validation split possible: each of the {len(counts)} "
                            "classes has a single example; every class needs two or more")
    n_val = math.ceil(val_size * len(splittable))  # sklearn's rounding of a fractional test_size
    n_taken = min(max(n_val, classes), len(splittable) - classes)
    if n_taken != n_val:
        print(f"split.val_size {val_size} of {len(splittable)} rows gives {n_val} validation "
              f"row(s); taking {n_taken}, so train and validation each hold all {classes} classes")
    train, val = train_test_split(splittable, test_size=n_taken, random_state=seed,
                                  stratify=splittable["label"])
    if rare.any():
        singles = sorted(df.loc[rare, "label"])
        print(f"{len(singles)} row(s) of classes with a single example kept in train only: "
              f"{singles[:10]}{' ...' if len(singles) > 10 else ''}")
    return pd.concat([train, df[rare]]), val


def holdout_folds(df, val_size, seed, strata=None):
    """The fold of each row for one holdout split: 0 for validation rows, -1 for the others. strata: what
    to stratify by, df's labels by default; a 0/1 matrix (multi-label) is split iteratively."""
    folds = np.full(len(df), -1)
    if strata is not None and np.ndim(strata) == 2:
        from iterstrat.ml_stratifiers import MultilabelStratifiedShuffleSplit

        if len(df) < 2:
            raise PipelineError(f"{TRAIN_CSV}: no validation split possible with {len(df)} row(s)")
        n_val = min(max(1, math.ceil(val_size * len(df))), len(df) - 1)
        splitter = MultilabelStratifiedShuffleSplit(n_splits=1, test_size=n_val, random_state=seed)
        folds[next(splitter.split(np.zeros(len(df)), strata))[1]] = 0
        return folds
    _, val = split_train_val(df if strata is None else df.assign(label=strata), val_size, seed)
    folds[df.index.get_indexer(val.index)] = 0
    return folds


def kfold_folds(texts, labels, k, seed):
    """The fold (0..k-1) of each row for stratified k-fold, rows with the same text together. labels:
    what to stratify by, one per row, or a 0/1 matrix (multi-label: split iteratively).

    The folds are drawn over distinct texts (each with the label of its first row), so that
    sklearn's fast StratifiedKFold can be used: StratifiedGroupKFold took 17 s for 35k rows."""
    groups, _ = pd.factorize(pd.Series(texts))  # one group id per distinct text
    first_rows = pd.Series(range(len(groups))).groupby(groups).first().to_numpy()
    group_labels = np.asarray(labels)[first_rows]
    if group_labels.ndim == 2:
        return multilabel_kfold(group_labels, k, seed)[groups]
    counts = pd.Series(group_labels).value_counts()
    too_small = counts[counts < k]
    if len(too_small):
        listed = ", ".join(f"{label!r} has {n}" for label, n in too_small.sort_values().items())
        raise PipelineError(f"{TRAIN_CSV}: too few distinct texts for {k} folds ({listed}); every class "
                            f"needs at least one per fold: use at most {counts.min()} folds in cv.folds, "
                            "or more examples of those classes")
    group_folds = np.empty(len(first_rows), dtype=int)
    splitter = StratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    for fold, (_, val_groups) in enumerate(splitter.split(np.zeros(len(first_rows)), group_labels)):
        group_folds[val_groups] = fold
    return group_folds[groups]


def multilabel_kfold(indicators, k, seed):
    """The fold of each row of a 0/1 matrix (rows x classes) by iterative stratification."""
    from iterstrat.ml_stratifiers import MultilabelStratifiedKFold

    if len(indicators) < k:
        raise PipelineError(f"{TRAIN_CSV}: {len(indicators)} distinct texts cannot fill {k} folds; use at most "
                            f"{len(indicators)} folds in cv.folds")
    folds = np.empty(len(indicators), dtype=int)
    splitter = MultilabelStratifiedKFold(n_splits=k, shuffle=True, random_state=seed)
    for fold, (_, val_rows) in enumerate(splitter.split(np.zeros(len(indicators)), indicators)):
        folds[val_rows] = fold
    return folds


def describe_folds(folds, labels, classes=()):
    """One line per fold: how many rows it validates on, per class (for a 0/1 matrix, the rows holding
    each class: a row of several classes counts for each)."""
    folds = pd.Series(folds, name="fold")
    if np.ndim(labels) == 2:
        table = pd.DataFrame(np.asarray(labels), columns=list(classes)).groupby(folds).sum()
    else:
        table = pd.crosstab(folds, pd.Series(np.asarray(labels), name="label"))
    sizes = folds.value_counts()
    for fold, row in table.iterrows():
        counts = ", ".join(f"{label} {n:,}" for label, n in row.items())
        print(f"{sizes[fold]:,} rows train every fold ({counts})" if fold < 0 else
              f"fold {fold} validates on {sizes[fold]:,} rows ({counts})")


def main():
    k = checked_fold_count(load_params("cv", CV_PARAMS)["folds"])
    params = load_params("split", SPLIT_PARAMS)

    train = read_csv(TRAIN_CSV)
    with open(SHAPE, encoding="utf-8") as f:
        shape = SHAPES[json.load(f)["kind"]]
    with open(LABELS, encoding="utf-8") as f:
        classes = json.load(f)
    strata = shape.strata(train["label"], classes, k)
    if k == 1:
        folds = holdout_folds(train, params["val_size"], params["seed"], strata)
    else:
        texts = train["text"] + ("\0" + train["text_pair"] if "text_pair" in train else "")  # a pair is one text here
        folds = kfold_folds(texts, strata, k, params["seed"])
    describe_folds(folds, strata, classes)

    with atomic_dir(OUT) as tmp:
        write_csv(pd.DataFrame({"row": range(len(folds)), "fold": folds}), tmp / "folds.csv")
    return [OUT]


if __name__ == "__main__":
    run_main(main)
