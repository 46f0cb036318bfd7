"""train.keep_best: the fold keeps the weights of its best evaluation by the competition metric
(task.metric), not those of its last; train.patience stops training after that many evaluations
without a better score (early stopping).

Trainer's own load_best_model_at_end / EarlyStoppingCallback need a checkpoint saved at every
evaluation (save_strategy equal to eval_strategy), and a metric among the evaluation's scores. This
pipeline saves checkpoints by the clock (training/checkpoint.py), evaluates n times evenly through
pruning.EvaluateEvenly (eval_strategy "no"), and the competition metric (qwk, log loss, a multi-label
F1 at its best threshold) is not one of the scores of each evaluation. So KeepBest keeps the best
evaluation in memory instead: a copy of the trained parameters (the frozen ones do not change: with
LoRA that is the adapters and the head only) and the logits it scored, which become the fold's
out-of-fold predictions. A checkpoint carries it (best.safetensors beside Trainer's files), so a
resumed run keeps the best of the evaluations before its checkpoint.

The fold's out-of-fold score is then the best of several looks at its validation rows: slightly
optimistic, as any choice made on the rows that are scored (README).
"""
import json
import math
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from tasks.scores import LOWER_IS_BETTER

BEST_FILE = "best.safetensors"  # in each checkpoint folder, beside Trainer's files


def competition_score(shape, metric, logits, labels, classes, scale=None):
    """task.metric of one evaluation's logits as evaluate computes it on a fold (multi-label at the
    threshold that scores best on these rows); nan where it is undefined (a constant regression)."""
    outputs = shape.activate(logits, scale)
    labels = np.asarray(labels)
    truth = labels * scale[1] + scale[0] if scale else labels.astype(int)  # regression: in the target's units
    value = shape.report(truth, outputs, classes, metric, shape.threshold(truth, outputs, metric))[metric]
    return float("nan") if value is None else float(value)


def is_better(score, best, metric):
    """Whether score beats best (None: nothing scored yet) by metric; a nan score never does, and a
    tie keeps the earlier evaluation."""
    if math.isnan(score):
        return False
    if best is None or math.isnan(best):
        return True
    return score < best if metric in LOWER_IS_BETTER else score > best


class KeepBest(TrainerCallback, ExportableState):
    """Keeps the parameters of `model` and the logits (from `scores`, training.trainer.ValidationScores)
    of the evaluation that scores best by `metric`; restore() puts them back after training. patience n:
    training stops after n evaluations in a row without a better score (keep false: early stopping
    alone, the last weights kept). resume: the checkpoint a run resumes from, whose best.safetensors
    it reads."""

    def __init__(self, model, scores, metric, classes, keep=True, patience=None, resume=None):
        self.model, self.scores, self.metric, self.classes = model, scores, metric, classes
        self.keep, self.patience = keep, patience
        self.best = None  # (step, score) of the best evaluation so far
        self.weights, self.logits, self.latest = {}, None, {}
        self.evaluations = self.since_best = 0
        self.last = None  # (step, score) of the latest evaluation
        self.stopped_at = None  # the step early stopping ended training at
        self.output_dir = self.step = None
        if resume is not None and (resume / BEST_FILE).is_file():
            self.load(resume / BEST_FILE)

    def trained(self):
        return {name: p for name, p in self.model.named_parameters() if p.requires_grad}

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        score = competition_score(self.scores.shape, self.metric, self.scores.logits, self.scores.labels,
                                  self.classes, self.scores.scale)
        self.evaluations += 1
        self.last = (state.global_step, score)
        if is_better(score, self.best and self.best[1], self.metric):
            self.best, self.since_best = (state.global_step, score), 0
            self.weights = {name: p.detach().to("cpu", copy=True) for name, p in self.trained().items()}
            self.logits, self.latest = np.array(self.scores.logits, copy=True), dict(self.scores.latest)
        else:
            self.since_best += 1
        if self.patience and self.since_best >= self.patience and state.global_step < state.max_steps:
            self.stopped_at = state.global_step
            control.should_training_stop = True

    def restore(self):
        """Put the best evaluation's parameters back into the model and its logits and scores into
        `scores` (what the fold writes); False when the last evaluation was the best (nothing to do)."""
        if self.best is None or self.best == self.last:
            return False
        with torch.no_grad():
            for name, p in self.trained().items():
                p.copy_(self.weights[name])
        self.scores.logits, self.scores.latest = self.logits, self.latest
        return True

    def finish(self):
        """After training: restore() when keeping the best; the line that says what the fold kept."""
        stopped = (f"; stopped early at step {self.stopped_at}: {self.patience} evaluation(s) without a better "
                   f"{self.metric} (train.patience)" if self.stopped_at else "")
        if not self.keep:
            return f"train.patience {self.patience}: the last weights are kept" + stopped
        if self.best is None:
            return f"train.keep_best: no evaluation scored {self.metric}; the last weights are kept" + stopped
        (step, score), restored = self.best, self.restore()
        if not restored:
            return f"train.keep_best: the last evaluation (step {step}) scored best, {self.metric} {score:.4f}{stopped}"
        return (f"train.keep_best: kept the weights of the evaluation at step {step}, {self.metric} {score:.4f} "
                f"(the last, at step {self.last[0]}, scored {self.last[1]:.4f}){stopped}")

    def summary(self):
        """For reports/train/fold-K/metrics.json: the evaluation kept."""
        return {} if self.best is None else {"step": self.best[0], self.metric: round(self.best[1], 6)}

    # checkpoints: Trainer calls state() while it saves one, after the weights and before trainer_state.json,
    # which marks a checkpoint complete (training/checkpoint.py): a complete checkpoint holds its best
    def on_step_end(self, args, state, control, **kwargs):
        self.output_dir, self.step = args.output_dir, state.global_step

    def state(self):
        record = {"best": self.best, "last": self.last, "evaluations": self.evaluations, "since_best": self.since_best}
        if self.best is not None and self.output_dir is not None:
            folder = os.path.join(self.output_dir, f"checkpoint-{self.step}")
            tmp = os.path.join(folder, f".{BEST_FILE}.tmp")
            save_file({**{f"weights.{k}": v for k, v in self.weights.items()},
                       "logits": torch.from_numpy(np.ascontiguousarray(self.logits))},
                      tmp, metadata={"record": json.dumps(record), "latest": json.dumps(self.latest)})
            os.replace(tmp, os.path.join(folder, BEST_FILE))
        return {"args": {}, "attributes": record}

    def load(self, path):
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(path))
        record = json.loads(metadata["record"])
        self.best, self.last = tuple(record["best"]), record["last"] and tuple(record["last"])
        self.evaluations, self.since_best = record["evaluations"], record["since_best"]
        self.latest = json.loads(metadata["latest"])
        self.logits = tensors.pop("logits").numpy()
        self.weights = {k.removeprefix("weights."): v for k, v in tensors.items()}
