"""Each evaluation's scores, and the logits of the latest, which after the last evaluation are the fold's
out-of-fold predictions."""
import numpy as np

from reading.windows import mean_by_text
from tasks.shapes import SHAPES


class ValidationScores:
    """Trainer's compute_metrics, keeping the logits and scores of the latest evaluation: after the last
    one, those are the fold's out-of-fold predictions, with no second pass over the validation rows.
    The task shape computes the scores (scale: a regression target's standardisation). texts: the text of
    each validation row; where windows made several rows of a text, it is scored once, on the mean of its
    rows' logits (the out-of-fold file averages their probabilities, which may rarely pick another class)."""

    def __init__(self, shape=SHAPES["classification"], scale=None, texts=None):
        self.shape, self.scale, self.texts = shape, scale, texts
        self.logits, self.labels, self.latest = None, None, {}

    def __call__(self, eval_pred):
        self.logits, self.labels = eval_pred
        logits, labels = self.logits, self.labels
        if self.texts is not None and len(np.unique(self.texts)) < len(self.texts):  # windows: score each text once
            first = np.unique(self.texts, return_index=True)[1]  # its rows share its label
            logits, labels = mean_by_text(logits, self.texts)[1], labels[first]
        self.latest = self.shape.evaluation_scores(logits, labels, self.scale)
        return self.latest


def evaluated_at_end(state):
    """Whether Trainer's last evaluation was of the final model (it evaluates at each epoch's end)."""
    return any("eval_loss" in entry and entry.get("step") == state.global_step for entry in state.log_history)
