"""Adversarial training (train.adversarial), from epoch train.adversarial_from on: after each training
micro-batch's forward and backward, a second forward and backward of the same batch under a small
perturbation in the direction that raises the loss, its gradients added to the first's; then the
perturbation is undone, before the optimizer steps. About twice the compute per step.

- fgm (Miyato et al. 2017, the fast gradient method on the word embeddings): the embedded tokens of each
  text move by fgm_epsilon x g / ||g||, g the loss's gradient with respect to them (the norm over the text).
  It acts on the embedding layer's output, not on its weight matrix as some Kaggle versions do, so it
  works with train.freeze_embeddings and costs no dense gradient of the vocabulary.
- awp (Wu et al. 2020, adversarial weight perturbation, as in the Kaggle Feedback Prize and NBME
  solutions): every trained weight matrix w moves by awp_lr x ||w|| x g / ||g|| (g its gradient), each
  element kept within awp_eps x |w| of where it was.

Trainer runs the two passes through CountingTrainer.training_step (training/speed.py), which calls
watch() around the first and perturbed() around the second.
"""
from contextlib import contextmanager

import torch

KINDS = ("none", "fgm", "awp")
TINY = 1e-6  # keeps a zero gradient's direction defined


class Adversary:
    """Shared by both kinds: which epochs it acts in, and how many micro-batches it attacked."""
    name = ""

    def __init__(self, start_epoch):
        self.start_epoch = start_epoch
        self.attacks = 0

    def active(self, epoch):
        return (epoch or 0) >= self.start_epoch

    @contextmanager
    def watch(self, model):
        yield

    @contextmanager
    def perturbed(self, model):
        self.attacks += 1
        yield


class FGM(Adversary):
    """Perturbs the output of the model's input-embedding layer."""
    name = "fgm"

    def __init__(self, model, epsilon=1.0, start_epoch=0):
        super().__init__(start_epoch)
        self.embeddings = model.get_input_embeddings()
        self.epsilon = epsilon
        self.seen = None  # the embedded batch of the watched pass, its gradient filled by backward

    @contextmanager
    def watch(self, model):
        def keep(module, args, output):
            if not output.requires_grad:  # frozen embeddings: a leaf of its own, so that it gets a gradient
                output = output.detach().requires_grad_(True)
            output.retain_grad()
            self.seen = output
            return output

        handle = self.embeddings.register_forward_hook(keep)
        try:
            yield
        finally:
            handle.remove()

    def perturbation(self):
        """epsilon x g / ||g|| per text (row), from the watched pass's gradient g."""
        grad = self.seen.grad
        if grad is None:
            return None
        norms = grad.float().flatten(1).norm(dim=1).view(-1, *[1] * (grad.dim() - 1))
        return (self.epsilon * grad.float() / norms.clamp_min(1e-12)).to(grad.dtype)

    @contextmanager
    def perturbed(self, model):
        delta = self.perturbation()
        self.seen = None
        handle = self.embeddings.register_forward_hook(
            lambda module, args, output: output if delta is None else output + delta)
        self.attacks += 1
        try:
            yield
        finally:
            handle.remove()


class AWP(Adversary):
    """Perturbs the trained weight matrices (names with "weight"), restoring them exactly afterwards."""
    name = "awp"

    def __init__(self, model, lr=1.0, eps=0.01, start_epoch=0):
        super().__init__(start_epoch)
        self.weights = {n: p for n, p in model.named_parameters() if p.requires_grad and "weight" in n}
        self.lr, self.eps = lr, eps

    def attack(self):
        """Moves each weight up its gradient, clamped; returns their originals to restore."""
        backup = {}
        with torch.no_grad():
            for name, w in self.weights.items():
                if w.grad is None:
                    continue
                grad_norm = w.grad.norm()
                if grad_norm == 0 or not torch.isfinite(grad_norm):
                    continue
                backup[name] = original = w.detach().clone()
                w.add_(self.lr * w.grad / (grad_norm + TINY) * (original.norm() + TINY))
                bound = self.eps * original.abs()
                w.copy_(torch.minimum(torch.maximum(w, original - bound), original + bound))
        return backup

    def restore(self, backup):
        with torch.no_grad():
            for name, original in backup.items():
                self.weights[name].copy_(original)

    @contextmanager
    def perturbed(self, model):
        backup = self.attack()
        self.attacks += 1
        try:
            yield
        finally:
            self.restore(backup)


def make(kind, model, start_epoch, fgm_epsilon, awp_lr, awp_eps):
    """The Adversary for train.adversarial; None for none."""
    if kind == "fgm":
        return FGM(model, fgm_epsilon, start_epoch)
    if kind == "awp":
        return AWP(model, awp_lr, awp_eps, start_epoch)
    return None
