"""What a training run learns from and validates on (Rows), read from the tokenize, split and preprocess
stages' outputs (TrainingData): a fold's rows for the train stage, and the students' rows, as pure functions
of the teachers' outputs.

Pseudo-labels (the pseudo stage): student fold K learns fold K's training rows with their labels, plus
test rows labelled by teacher fold K alone, never by the ensemble. Every other teacher trained on fold
K's validation rows: its test predictions carry what it learned from those labels, and a student that
learns them would be scored on rows whose answers it has seen through them (an inflated out-of-fold
score, the leak Feedback Prize 3's write-ups warn of). Teacher K never saw fold K's rows.

Distillation (the distill stage): one smaller student learns every training row's out-of-fold outputs
(each from the teacher that did not train on it), and optionally the test rows' ensemble outputs.
"""
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from pipeline.settings import PipelineError
from predicting import folds
from reading.tokens import unpack_flat, unpack_sequences
from reading.windows import text_of_row
from tasks.shapes import SHAPES

TOKENIZED = Path("data/tokenized")
LABELS = Path("data/processed/labels.json")
SHAPE = Path("data/processed/shape.json")


@dataclasses.dataclass
class TrainingData:
    """What every training stage reads before its rows: data/processed's shape.json (the task shape, how
    the texts were read and cleaned) and labels.json, the tokenize stage's settings.json, and each training
    row's fold (data/split/folds.csv)."""
    processed: dict
    labels: list
    tokenized: dict
    row_folds: np.ndarray

    @property
    def shape(self):
        return SHAPES[self.processed["kind"]]

    @property
    def fold_count(self):
        return folds.fold_count(self.row_folds)

    @property
    def files(self):
        """The files it was read from, whose digest a checkpoint must match."""
        return [TOKENIZED / "train.safetensors", TOKENIZED / "settings.json", LABELS, SHAPE, folds.FOLDS_CSV]


def read_training_data(fold=None, setting="--fold"):
    """The TrainingData; with a fold, first a one-line error when data/split/folds.csv does not have it
    (setting: where the fold came from)."""
    def read(path):
        return json.loads(path.read_text(encoding="utf-8"))

    row_folds = folds.read_folds()
    count = folds.fold_count(row_folds)
    if fold is not None and not 0 <= fold < count:
        raise PipelineError(f"{setting} {fold}: {folds.FOLDS_CSV} has folds 0 to {count - 1} (cv.folds): "
                            "rerun `dvc repro split`, or pick one of those")
    return TrainingData(read(SHAPE), read(LABELS), read(TOKENIZED / "settings.json"), row_folds)


@dataclasses.dataclass
class Rows:
    """Every row the run sees: token ids, segment ids (pairs) or None, the text of each row (windows),
    each row's target in the outputs' units (a class id, or soft: probabilities or a value), the rows it
    trains on and the ones it validates on (class ids there; empty: none). soft: some train rows' targets
    are probability vectors (a classification student)."""
    sequences: list
    token_types: list | None
    texts: np.ndarray
    targets: list
    train: np.ndarray
    val: np.ndarray
    soft: bool = False


class TokenizedDataset(torch.utils.data.Dataset):
    """Unpadded token ids and labels (lists), and segment ids for text pairs, e.g. some rows of a split
    the tokenize stage saved."""

    def __init__(self, sequences, labels, token_types=None):
        self.sequences, self.labels, self.token_types = sequences, labels, token_types

    @classmethod
    def rows(cls, sequences, labels, rows, token_types=None):
        return cls([sequences[i] for i in rows], [labels[i] for i in rows],
                   None if token_types is None else [token_types[i] for i in rows])

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, i):
        example = {"input_ids": self.sequences[i], "labels": self.labels[i]}
        if self.token_types is not None:
            example["token_type_ids"] = self.token_types[i]
        return example


def standardised(labels, scale):
    """Targets as the model learns them: (y - mean) / std, scale from the task shape's target_scale."""
    mean, std = scale
    # None: a row outside the job's training and validation rows (a distilled student's row that no
    # teacher validated on) has no target, and is never read
    return [None if y is None else (y - mean) / std for y in labels]


def fold_rows(tensors, row_folds, fold):
    """The train file's Rows (tensors: data/tokenized/train.safetensors) for fold `fold`: it trains on the
    other folds' rows and validates on its own; windows (tokenize.truncation) go with their text's fold."""
    sequences, label_ids = unpack_sequences(tensors)
    texts = text_of_row(tensors)  # several rows (windows) of a text
    row_folds = row_folds[texts]
    return Rows(sequences, unpack_flat(tensors, "token_type_ids"), texts, list(label_ids),
                train=np.flatnonzero(row_folds != fold), val=np.flatnonzero(row_folds == fold))


def read_train_file():
    """data/tokenized/train.safetensors."""
    return load_file(TOKENIZED / "train.safetensors")


def pseudo_labels(outputs, shape, labels, threshold, share, seed):
    """(test texts picked, their targets in the outputs' units) from one teacher's test outputs (texts,
    outputs): a random `share` of the texts (seeded), then for labels "hard" only those the teacher is
    `threshold` sure of, as hard targets (shape.confident); "soft": the outputs themselves."""
    outputs = np.asarray(outputs, dtype=np.float64)
    n = len(outputs)
    picked = np.sort(np.random.default_rng(seed).permutation(n)[:max(1, round(share * n))])
    if labels == "soft":
        return picked, outputs[picked]
    sure, targets = shape.confident(outputs[picked], threshold)
    return picked[sure], targets


def with_test_rows(rows, test_tensors, picked, targets, shape):
    """rows (the train file's, a Rows) plus the test rows of the texts `picked` (every window of each),
    each learned as its text's target (targets: one per picked text, in the outputs' units)."""
    test_texts = text_of_row(test_tensors)
    target_of = dict(zip(picked.tolist(), shape.soft_targets(targets)))
    test_rows = np.flatnonzero(np.isin(test_texts, picked))
    sequences = unpack_sequences(test_tensors)[0]
    token_types = unpack_flat(test_tensors, "token_type_ids")
    first = len(rows.sequences)
    new_texts = rows.texts.max() + 1 + test_texts[test_rows]  # test texts numbered after the train file's
    return Rows(rows.sequences + [sequences[i] for i in test_rows],
                None if rows.token_types is None else rows.token_types + [token_types[i] for i in test_rows],
                np.concatenate([rows.texts, new_texts]),
                rows.targets + [target_of[t] for t in test_texts[test_rows].tolist()],
                np.concatenate([rows.train, first + np.arange(len(test_rows))]), rows.val, rows.soft)


def distillation_rows(tensors, texts_out, outputs, shape):
    """The train file's Rows (tensors: data/tokenized/train.safetensors) for a distilled student: each row of a
    text some teacher validated on (texts_out) learns that teacher's outputs, in soft_targets' form; it
    validates on none."""
    sequences = unpack_sequences(tensors)[0]
    texts = text_of_row(tensors)
    target_of = dict(zip(texts_out.tolist(), shape.soft_targets(outputs)))
    return Rows(sequences, unpack_flat(tensors, "token_type_ids"), texts, [target_of.get(t) for t in texts.tolist()],
                train=np.flatnonzero(np.isin(texts, texts_out)), val=np.array([], dtype=int), soft=shape.soft)


def soft_rows(rows, shape, classes):
    """rows with the train rows' labels in soft_targets' form (a class as one-hot probabilities), so that
    labelled and pseudo-labelled rows are learned by one loss; the validation rows keep their labels."""
    targets = list(rows.targets)
    for i in rows.train:
        targets[i] = shape.soft_label(targets[i], classes)
    return Rows(rows.sequences, rows.token_types, rows.texts, targets, rows.train, rows.val, soft=shape.soft)
