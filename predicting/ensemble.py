"""Combining folds: each training row's out-of-fold outputs from the fold that validated on it, and the
test rows' mean over the folds."""
from pathlib import Path

import numpy as np

from pipeline.settings import PipelineError
from predicting import folds

TEST_CSV = Path("data/processed/test.csv")  # the rows every fold's test predictions cover


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
    """The ensemble's test outputs (probabilities, or values): the mean over folds, every fold covering every
    test row."""
    for k, (rows, _) in enumerate(tests):
        if not np.array_equal(rows, np.arange(n_rows)):
            raise PipelineError(f"{folds.outputs(k)['test']} does not hold the {n_rows} rows of "
                                f"{TEST_CSV}: it comes from another run; rerun `dvc repro`")
    return np.mean([p for _, p in tests], axis=0)
