"""baseline: the score to beat, TF-IDF word and character n-grams with a linear model, on the same folds
as train@K.

Reads data/processed/{train.csv,test.csv,labels.json,shape.json} and data/split/folds.csv, and its own
section of params.yaml only: a change of train.*, model.* or tokenize.* never reruns it (the tuner's
trials reuse it), one of preprocess.* or the split does. For each fold k, the task shape's linear model
(baselines/tfidf.py: logistic regression, a logistic regression per class for multi-label, ridge for
regression) is fitted on the rows train@k trains on and predicts the rows train@k validates on
(baselines/tfidf.py). Writes predictions/baseline/oof.csv, those out-of-fold outputs of every validated
row, and predictions/baseline/test.csv, the test rows' mean over the folds, in the form of a fold's
prediction files (`row`, then class probabilities or `value`); no test.csv when there is no test file.
evaluate scores them beside the model (`baseline.val.*`, `baseline.oof.*`), the multi-label threshold
chosen on these outputs as on the model's.
"""
import json
import time
from pathlib import Path

import numpy as np

from baselines.tfidf import cross_fit, features, fit_features, vectorizers
from pipeline.command import run_main
from pipeline.outputs import atomic_dir
from pipeline.settings import SEEDS, PipelineError, Range, load_params
from predicting import folds
from reading.csvfiles import read_csv
from tasks.shapes import SHAPES

PROCESSED = Path("data/processed")
OUT = folds.PREDICTIONS / "baseline"
# what each baseline.* key accepts; load_params turns anything else into a one-line error
BASELINE_PARAMS = {"word_ngrams": (int, Range(0, 5)), "char_ngrams": (int, Range(0, 8)),
                   "max_features": (int, Range(1)), "min_df": (int, Range(1)),
                   "regularization": (float, Range(0, low_open=True)), "seed": (int, SEEDS)}


def texts_of(frame):
    """(texts, second texts or None) of a processed frame."""
    return frame["text"].tolist(), (frame["text_pair"].tolist() if "text_pair" in frame else None)


def main():
    params = load_params("baseline", BASELINE_PARAMS)
    if params["char_ngrams"] == 1:
        raise PipelineError("params.yaml: baseline.char_ngrams must be 0 (none) or 2 to 8 (n-grams of 2 to that "
                            "many characters), not 1")
    if not params["word_ngrams"] and not params["char_ngrams"]:
        raise PipelineError("params.yaml: baseline.word_ngrams and baseline.char_ngrams are both 0: the baseline "
                            "needs one kind of n-gram; set either above 0")
    shape = SHAPES[json.loads((PROCESSED / "shape.json").read_text(encoding="utf-8"))["kind"]]
    labels = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))
    columns = shape.outputs(labels)
    row_folds = folds.read_folds()
    train = read_csv(PROCESSED / "train.csv")
    test = read_csv(PROCESSED / "test.csv") if (PROCESSED / "test.csv").exists() else None

    start = time.perf_counter()
    made = vectorizers(params["word_ngrams"], params["char_ngrams"], params["max_features"], params["min_df"])
    try:
        fitted, x = fit_features(made, *texts_of(train))
    except ValueError as e:  # scikit-learn's "empty vocabulary", "max_df ... min_df"
        raise PipelineError(f"{PROCESSED / 'train.csv'}: no n-gram occurs in baseline.min_df "
                            f"({params['min_df']}) train texts or more ({e}): lower baseline.min_df") from None
    x_test = features(fitted, *texts_of(test)) if test is not None else None
    featurized = time.perf_counter() - start
    rows, oof, test_outputs = cross_fit(shape.kind, x, shape.truth(train["label"], labels), row_folds, x_test,
                                        params["regularization"], params["seed"], len(columns))
    print(f"TF-IDF features: {x.shape[1]:,} n-grams of {x.shape[0]:,} train texts in {featurized:.1f} s; "
          f"{shape.baseline} on {folds.fold_count(row_folds)} fold(s) in {time.perf_counter() - start - featurized:.1f} s")

    with atomic_dir(OUT) as tmp:
        folds.write_probabilities(folds.probabilities_frame(rows, oof, columns), tmp / "oof.csv")
        if test_outputs is not None:
            folds.write_probabilities(folds.probabilities_frame(np.arange(len(test)), test_outputs, columns),
                                      tmp / "test.csv")
    return [OUT]


if __name__ == "__main__":
    run_main(main)
