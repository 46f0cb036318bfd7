"""A score to beat: TF-IDF features of word and character n-grams and a linear model fitted on each
fold's training rows, which predicts the rows that fold validates on (out of fold, as train@K's model
does) and the test rows (the mean over the folds, as evaluate averages the models). The linear model
is the task shape's (LINEAR_MODELS: logistic regression, one-vs-rest logistic regressions, ridge).
Pure functions over lists of texts and arrays; the baseline stage does the reading and writing.

The vocabulary and IDF weights are learned once from every train text, labels unseen, so no fold's
model learns from another fold's labels; the test texts play no part, so a new test file leaves the
out-of-fold scores as they were."""
import warnings

import numpy as np
from scipy import sparse
from sklearn.feature_extraction.text import TfidfVectorizer

from reading.csvfiles import COLUMN_JOIN


def logistic_regression(regularization, seed):
    """SAGA to a tolerance of 1e-3: on the embedded tweets' TF-IDF features (247k) 4x faster than lbfgs to
    1e-4 with the same macro-F1 (0.7575 vs 0.7568); it visits the rows in an order drawn from seed."""
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=regularization, solver="saga", tol=1e-3, max_iter=300, random_state=seed)


def one_vs_rest(regularization, seed):
    """A logistic regression per class, each its own yes/no (a class that every fitted row has, or none
    has, becomes a constant)."""
    from sklearn.multiclass import OneVsRestClassifier

    return OneVsRestClassifier(logistic_regression(regularization, seed))


def ridge(regularization, seed):
    from sklearn.linear_model import Ridge

    return Ridge(alpha=1 / regularization)


# the linear model of each task shape (tasks/shapes.py's kind; its `baseline` names it in the log), from
# the inverse of its penalty's strength and a seed
LINEAR_MODELS = {"classification": logistic_regression, "multilabel": one_vs_rest, "regression": ridge}


def linear_outputs(model, x, n_outputs):
    """A fitted model's outputs on the rows x, (rows, n_outputs): class probabilities (a class that none of
    the rows it was fitted on had gets 0), or one column of values."""
    if not hasattr(model, "predict_proba"):
        return model.predict(x).reshape(-1, 1)
    outputs = np.zeros((x.shape[0], n_outputs))
    outputs[:, model.classes_.astype(int)] = model.predict_proba(x)
    return outputs


def vectorizers(word_ngrams, char_ngrams, max_features, min_df):
    """The TF-IDF vectorizers, unfitted: words of 1 to word_ngrams, characters of 2 to char_ngrams inside
    word boundaries (char_wb: morphemes of languages that glue them to words, as Korean and Turkish do);
    0 leaves a kind out. Sublinear term frequencies: a word said twice is not twice the evidence."""
    made = []
    if word_ngrams:
        made.append(TfidfVectorizer(ngram_range=(1, word_ngrams), min_df=min_df, max_features=max_features,
                                    sublinear_tf=True, dtype=np.float32))
    if char_ngrams:
        made.append(TfidfVectorizer(analyzer="char_wb", ngram_range=(2, char_ngrams), min_df=min_df,
                                    max_features=max_features, sublinear_tf=True, dtype=np.float32))
    return made


def plain(texts):
    """Texts of several columns (preprocess joins them with COLUMN_JOIN) as one text."""
    return [text.replace(COLUMN_JOIN, " ") for text in texts]


def fit_features(made, texts, pairs=None):
    """(the vectorizers fitted on the train texts (and their second texts: one vocabulary for both), the
    train texts' features as `features` makes them), each text's n-grams counted once."""
    corpus = plain(texts) + (plain(pairs) if pairs is not None else [])
    n = len(texts)
    matrices = [vectorizer.fit_transform(corpus) for vectorizer in made]
    parts = [m[:n] for m in matrices] + ([m[n:] for m in matrices] if pairs is not None else [])
    return made, sparse.hstack(parts, format="csr")


def features(fitted, texts, pairs=None):
    """A sparse (rows, features) matrix: each vectorizer's columns, then again for the second texts of
    pairs, so the linear model weighs a word by the text it is in."""
    parts = [v.transform(plain(texts)) for v in fitted]
    if pairs is not None:
        parts += [v.transform(plain(pairs)) for v in fitted]
    return sparse.hstack(parts, format="csr")


def cross_fit(kind, x, y, row_folds, x_test, regularization, seed, n_outputs):
    """(validated rows, their out-of-fold outputs (rows, n_outputs), test outputs (test rows, n_outputs)):
    for each fold k the linear model of the task shape `kind` fitted on the rows whose fold is not k predicts the rows of
    fold k and the test rows; the test outputs are the mean over the folds. x_test may be None."""
    k = int(row_folds.max()) + 1
    rows = np.flatnonzero(row_folds >= 0)
    oof = np.zeros((len(row_folds), n_outputs))
    test = np.zeros((x_test.shape[0], n_outputs)) if x_test is not None else None
    for fold in range(k):
        train, val = np.flatnonzero(row_folds != fold), np.flatnonzero(row_folds == fold)
        with warnings.catch_warnings():  # a class absent from a fold's rows: its model predicts it never
            warnings.simplefilter("ignore")
            model = LINEAR_MODELS[kind](regularization, seed).fit(x[train], y[train])
        oof[val] = linear_outputs(model, x[val], n_outputs)
        if test is not None:
            test += linear_outputs(model, x_test, n_outputs) / k
    return rows, oof[rows], test
