"""Folds: which training rows each fold validates on (the split stage's data/split/folds.csv),
where each fold's outputs live, and the prediction files (class probabilities, or values) that a
fold's train stage (validation rows) and the predict_test stage (test rows) write and evaluate combines."""
from pathlib import Path

import numpy as np
import pandas as pd

from pipeline.settings import PipelineError
from reading.csvfiles import read_csv

FOLDS_CSV = Path("data/split/folds.csv")
PREDICTIONS = Path("predictions")  # predictions/fold-<k>/oof.csv, predictions/test/fold-<k>.csv
TEST_PREDICTIONS = PREDICTIONS / "test"
DECIMALS = "%.7g"  # a float32 probability's precision: shorter files, the same argmax


def read_folds(path=FOLDS_CSV):
    """The fold of each training row (-1: validated by no fold), as the split stage wrote it."""
    return read_csv(path)["fold"].astype(int).to_numpy()


def fold_count(folds):
    """K, the number of folds, from the fold of each row."""
    return int(folds.max()) + 1


def outputs(fold):
    """Where fold `fold`'s train stage writes (its model, its validation predictions, its training curves)
    and where predict_test writes its test predictions (its checkpoints: training.checkpoint.folder)."""
    return {"model": Path(f"models/fold-{fold}"), "predictions": PREDICTIONS / f"fold-{fold}",
            "test": TEST_PREDICTIONS / f"fold-{fold}.csv", "live": Path(f"reports/train/fold-{fold}")}


def probabilities_frame(rows, probabilities, labels):
    """A `row` column (positions in train.csv or test.csv) and one column per output (a class's
    probability, or `value`), sorted by row."""
    frame = pd.DataFrame(np.asarray(probabilities, dtype=np.float64), columns=labels)
    frame.insert(0, "row", np.asarray(rows))
    return frame.sort_values("row", kind="stable").reset_index(drop=True)


def write_probabilities(frame, path):
    """probabilities_frame's frame as CSV, probabilities to 7 significant digits."""
    frame.to_csv(path, index=False, encoding="utf-8", float_format=DECIMALS)


def read_probabilities(path, labels):
    """(rows, outputs of shape (rows, outputs)) from a file probabilities_frame wrote; a file with other
    columns than `labels` is an error (it was written for another label set or task shape)."""
    frame = pd.read_csv(path, encoding="utf-8")
    if [str(c) for c in frame.columns[1:]] != list(labels) or frame.columns[0] != "row":
        raise PipelineError(f"{path}: columns {list(frame.columns)} are not row and the classes "
                            f"{labels}; it was written for other data: rerun `dvc repro`")
    return frame["row"].to_numpy(), frame.iloc[:, 1:].to_numpy(dtype=np.float64)

