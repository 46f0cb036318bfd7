"""Losses for imbalanced classes (train.class_weights, train.focal_gamma), as Trainer's compute_loss_func.

- classification: cross-entropy with a weight per class: `balanced` gives class c the weight
  n / (classes x n_c) over the training rows (scikit-learn's compute_class_weight("balanced")), or
  {class: weight} as written; each row's loss counts its class's weight.
- multilabel: binary cross-entropy per class with pos_weight: the positives of class c count
  pos_weight_c times (`balanced`: negatives / positives of c in the training rows, as in torch's docs).
- focal_gamma > 0 (Lin et al. 2017): each term is multiplied by (1 - p)^gamma, p the probability the
  model gives the right answer (the class, or each class's 0/1), so that easy rows count less.

Without weights or focal the model's own loss is used (transformers' problem_type), as before.
Regression has no classes: both settings are errors there (techniques.py says so in one line).

Normalisation: the sum over the batch's rows (times classes for multilabel) over num_items_in_batch,
the rows of the whole accumulated optimizer step, so that micro-batches and gradient accumulation sum
as one batch would. Balanced weights average 1 over the training rows, so the loss keeps its scale.
"""
import numpy as np
import torch
import torch.nn.functional as F


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


def classification_loss(logits, labels, weight=None, gamma=0.0, reduction_total=None):
    """Weighted, optionally focal, cross-entropy: sum_i w_{y_i} (1 - p_i)^gamma (-log p_i) / total,
    total the number of rows unless given."""
    log_p = F.log_softmax(logits.float(), dim=-1).gather(1, labels.long().view(-1, 1)).squeeze(1)
    loss = -log_p
    if gamma:
        loss = loss * (1 - log_p.exp()).clamp(min=0) ** gamma
    if weight is not None:
        loss = loss * weight.to(loss.device)[labels.long().view(-1)]
    return loss.sum() / (reduction_total if reduction_total is not None else len(loss))


def soft_classification_loss(logits, targets, weight=None, gamma=0.0, reduction_total=None):
    """Cross-entropy against probability targets (a student's soft labels; a one-hot row is a class):
    sum_i w_i (1 - q_i)^gamma (-sum_c t_ic log p_ic) / total, with w_i = sum_c t_ic w_c the targets' mean
    class weight and q_i = sum_c t_ic p_ic the probability the model gives the target. For one-hot targets
    this is classification_loss exactly."""
    log_p = F.log_softmax(logits.float(), dim=-1)
    targets = targets.float().to(log_p.device)
    loss = -(targets * log_p).sum(dim=1)
    if gamma:
        loss = loss * (1 - (targets * log_p.exp()).sum(dim=1)).clamp(min=0) ** gamma
    if weight is not None:
        loss = loss * (targets @ weight.to(loss.device))
    return loss.sum() / (reduction_total if reduction_total is not None else len(loss))


def multilabel_loss(logits, targets, pos_weight=None, gamma=0.0, reduction_total=None):
    """Binary cross-entropy per class with pos_weight, optionally focal: summed over rows and classes,
    over `total` (rows x classes unless given)."""
    logits, targets = logits.float(), targets.float()
    loss = F.binary_cross_entropy_with_logits(logits, targets, reduction="none",
                                              pos_weight=None if pos_weight is None else pos_weight.to(logits.device))
    if gamma:
        p = torch.sigmoid(logits)
        p_right = targets * p + (1 - targets) * (1 - p)
        loss = loss * (1 - p_right) ** gamma
    return loss.sum() / (reduction_total if reduction_total is not None else loss.numel())


class TaskLoss:
    """Trainer's compute_loss_func(outputs, labels, num_items_in_batch) for a shape's kind; a classification
    batch of probability vectors (a student's soft labels) gets cross-entropy against them."""

    def __init__(self, kind, weights=None, gamma=0.0):
        self.kind, self.gamma = kind, gamma
        self.weights = None if weights is None else torch.as_tensor(weights, dtype=torch.float32)

    def __call__(self, outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"]
        total = None if num_items_in_batch is None else num_items_in_batch
        if self.kind == "multilabel":
            return multilabel_loss(logits, labels, self.weights, self.gamma, total)
        if labels.dim() == 2:  # probabilities: a student's soft labels
            return soft_classification_loss(logits, labels, self.weights, self.gamma, total)
        return classification_loss(logits, labels, self.weights, self.gamma, total)
