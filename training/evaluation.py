"""Each evaluation's scores, and the logits of the latest, which after the last evaluation are the fold's
out-of-fold predictions."""
from tasks.shapes import SHAPES


class ValidationScores:
    """Trainer's compute_metrics, keeping the logits and scores of the latest evaluation: after the last
    one, those are the fold's out-of-fold predictions, with no second pass over the validation rows.
    The task shape computes the scores (scale: a regression target's standardisation)."""

    def __init__(self, shape=SHAPES["classification"], scale=None):
        self.shape, self.scale = shape, scale
        self.logits, self.labels, self.latest = None, None, {}

    def __call__(self, eval_pred):
        self.logits, self.labels = eval_pred
        self.latest = self.shape.evaluation_scores(self.logits, self.labels, self.scale)
        return self.latest


def evaluated_at_end(state):
    """Whether Trainer's last evaluation was of the final model (it evaluates at each epoch's end)."""
    return any("eval_loss" in entry and entry.get("step") == state.global_step for entry in state.log_history)
