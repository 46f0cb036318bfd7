"""Whether the model beats the baseline, in one line for evaluate's log: on the competition metric, on
the same rows; when it does not, a warning naming the likely causes, most specific first: what the
tokenize stage found wrong with the tokenizer's fit to the texts (reading/tokenfit.py), then the
training settings that most often leave a fine-tuned model below a bag of words."""
from reading.tokenfit import fit_problems
from tasks.scores import LOWER_IS_BETTER, NAMES


def beats(metric, model, baseline):
    """Whether the model's score is better than the baseline's (None where either is undefined)."""
    if model is None or baseline is None:
        return None
    return model < baseline if metric in LOWER_IS_BETTER else model > baseline


def likely_causes(tokens, epochs, lr, frozen):
    """Why a model may score below the baseline, most specific first: tokens is tokenize's metrics
    (reports/tokenize/lengths.json's "tokens": fit, train, max_length)."""
    found = fit_problems(tokens.get("fit", {}), tokens.get("train", {}).get("truncated_fraction", 0.0),
                         tokens.get("max_length"))
    causes = [f"{what}: {remedy}" for what, remedy in found.values()]
    causes.append(f"too few epochs (train.epochs {epochs:g})")
    causes.append(f"the learning rate (train.lr {lr if isinstance(lr, str) else format(lr, 'g')})")
    if frozen:
        causes.append("frozen token embeddings (train.freeze_embeddings: false lets them learn words far from the "
                      "model's pretraining)")
    return causes


def comparison(split, metric, model, baseline, linear_model, causes):
    """The line: the model's and the baseline's score on `metric` over `split` (val or oof), a warning
    naming `causes` when the model does not beat the baseline."""
    name = NAMES[metric]
    theirs = f"the TF-IDF + {linear_model} baseline's"
    key = f"(baseline.{split}.{metric})"
    better = beats(metric, model, baseline)
    if better is None:
        shown = lambda v: "undefined" if v is None else f"{v:.4f}"  # noqa: E731
        return f"baseline: {split} {name} of the model {shown(model)}, of {theirs[4:]} {shown(baseline)} {key}: not compared"
    if better:
        return f"baseline: the model's {split} {name} {model:.4f} beats {theirs} {baseline:.4f} {key}"
    if model == baseline == (0.0 if metric in LOWER_IS_BETTER else 1.0):  # both perfect: nothing to beat
        return f"baseline: the model's {split} {name} {model:.4f} is perfect, as is {theirs} {key}"
    return (f"warning: the model's {split} {name} {model:.4f} does not beat {theirs} {baseline:.4f} {key}, "
            f"scored on the same rows; likely causes: {'; '.join(causes)}")
