"""The loss a run trains with (train.loss), as Trainer's compute_loss_func: one function per loss, named in
LOSSES. To add one, write a function of (logits, targets, weights, gamma) returning a loss per row (per row
and class for multi-label) and add a line to LOSSES; `train.loss: <its name>` then trains with it, students
included.

What a loss function is given, float32 on the training device:
- classification: targets are probabilities, one row per text: a class comes as its one-hot row, a
  student's soft label (pseudo, distill) as the teacher's probabilities;
- multilabel: a 0/1 (or a probability) per class;
- regression: the standardised value, one column.
weights: train.class_weights as a weight per class (classification) or per class's positives (multi-label,
pos_weight), or None; gamma: train.focal_gamma (Lin et al. 2017): each term times (1 - p)^gamma, p the
probability the model gives the right answer, so that easy rows count less; 0: the plain loss.
  balanced class weights are n / (classes x n_c) over the training rows (scikit-learn's
  compute_class_weight("balanced")); balanced pos_weight negatives / positives of each class.

TaskLoss sums the terms over a micro-batch and divides by the terms of the whole accumulated optimizer step
(Trainer's num_items_in_batch counts label elements), so that micro-batches sum as one batch would.
"""
import numpy as np
import torch
import torch.nn.functional as F


def cross_entropy(logits, targets, weights=None, gamma=0.0):
    """-sum_c t_c log p_c per row, times (1 - q)^gamma, q = sum_c t_c p_c the probability given to the
    target, and times the targets' mean class weight sum_c t_c w_c."""
    log_p = F.log_softmax(logits, dim=-1)
    loss = -(targets * log_p).sum(dim=1)
    if gamma:
        loss = loss * (1 - (targets * log_p.exp()).sum(dim=1)).clamp(min=0) ** gamma
    if weights is not None:
        loss = loss * (targets @ weights)
    return loss


def binary_cross_entropy(logits, targets, weights=None, gamma=0.0):
    """Binary cross-entropy of each row and class, its positives counted `weights` times (pos_weight)."""
    loss = F.binary_cross_entropy_with_logits(logits, targets, reduction="none", pos_weight=weights)
    if gamma:
        p = torch.sigmoid(logits)
        loss = loss * (1 - (targets * p + (1 - targets) * (1 - p))) ** gamma
    return loss


def mean_squared_error(logits, targets, weights=None, gamma=0.0):
    """The squared error of each row's value."""
    return (logits.view(-1) - targets.view(-1)) ** 2


# name: (the task kinds it serves, the function)
LOSSES = {
    "cross_entropy": (("classification",), cross_entropy),
    "binary_cross_entropy": (("multilabel",), binary_cross_entropy),
    "mse": (("regression",), mean_squared_error),
}


class TaskLoss:
    """Trainer's compute_loss_func(outputs, labels, num_items_in_batch): LOSSES[name] of the logits against
    the labels (class ids, probabilities, 0/1 per class, or values), over the accumulated step's terms."""

    def __init__(self, name, kind, weights=None, gamma=0.0):
        self.function, self.kind, self.gamma = LOSSES[name][1], kind, gamma
        self.weights = None if weights is None else torch.as_tensor(weights, dtype=torch.float32)

    def __call__(self, outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"].float()
        targets = labels
        if self.kind == "classification" and labels.dim() == 1:  # class ids: their one-hot rows
            targets = F.one_hot(labels.long(), logits.shape[-1])
        weights = None if self.weights is None else self.weights.to(logits.device)
        loss = self.function(logits, targets.float().to(logits.device), weights, self.gamma)
        if num_items_in_batch is None:
            return loss.mean()
        # Trainer counts label elements: a row of probabilities counts each class, its loss one term
        return loss.sum() / (num_items_in_batch * loss.numel() / labels.numel())


def balanced_class_weights(label_ids, classes):
    """n / (classes x count of each class), as sklearn.utils.class_weight.compute_class_weight; a class
    without a training row gets 1 (it cannot be weighted)."""
    counts = np.bincount(np.asarray(label_ids, dtype=int), minlength=classes).astype(float)
    weights = np.ones(classes)
    present = counts > 0
    weights[present] = counts.sum() / (present.sum() * counts[present])
    return weights


def balanced_pos_weights(indicators):
    """negatives / positives of each class (rows x classes 0/1 indicators); 1 for a class never or
    always present."""
    indicators = np.asarray(indicators, dtype=float)
    indicators = indicators[~np.isnan(indicators).any(axis=1)]  # a row without labels says nothing
    positives = indicators.sum(axis=0)
    negatives = len(indicators) - positives
    weights = np.ones(indicators.shape[1])
    usable = (positives > 0) & (negatives > 0)
    weights[usable] = negatives[usable] / positives[usable]
    return weights
