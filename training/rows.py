"""Students: what the pseudo and distill stages train on, as pure functions of the teachers' outputs.

Pseudo-labels (the pseudo stage): student fold K learns fold K's training rows with their labels, plus
test rows labelled by teacher fold K alone, never by the ensemble. Every other teacher trained on fold
K's validation rows: its test predictions carry what it learned from those labels, and a student that
learns them would be scored on rows whose answers it has seen through them (an inflated out-of-fold
score, the leak Feedback Prize 3's write-ups warn of). Teacher K never saw fold K's rows.

Distillation (the distill stage): one smaller student learns every training row's out-of-fold outputs
(each from the teacher that did not train on it), and optionally the test rows' ensemble outputs.
"""
import numpy as np

from training.run import Rows
from reading.tokens import unpack_flat, unpack_sequences
from reading.windows import text_of_row


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


def soft_rows(rows, shape, classes):
    """rows with the train rows' labels in soft_targets' form (a class as one-hot probabilities), so that
    labelled and pseudo-labelled rows are learned by one loss; the validation rows keep their labels."""
    targets = list(rows.targets)
    for i in rows.train:
        targets[i] = shape.soft_label(targets[i], classes)
    return Rows(rows.sequences, rows.token_types, rows.texts, targets, rows.train, rows.val, soft=shape.soft)
