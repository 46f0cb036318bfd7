"""What winning solutions add to fine-tuning, as train.* settings, each off by default and each one small
module plugged into Trainer the way transformers' own features are:
- layer-wise learning rates and a head rate, re-initialised top layers (layerwise.py): an optimizer factory;
- weight averaging, EMA or SWA (averaging.py): a callback;
- adversarial training, FGM or AWP (adversarial.py): a second pass in CountingTrainer.training_step;
- the loss (losses.py), class-weighted or focal: Trainer's compute_loss_func.
plug_in() turns the settings into Trainer's arguments and callbacks, and says in the log which are on.
"""
import math

import numpy as np

from pipeline.settings import PipelineError, Range
from training import adversarial, averaging, layerwise, losses

# the train.* keys of the techniques; training/settings.py adds them to TRAIN_PARAMS
TECHNIQUE_PARAMS = {
    "layer_lr_decay": (float, Range(0, 1, low_open=True)), "head_lr_multiple": (float, Range(0, 1000, low_open=True)),
    "reinit_layers": (int, Range(0)),
    "averaging": averaging.KINDS, "average_decay": (float, Range(0, 1, high_open=True)),
    "average_from": (float, Range(0, 1, high_open=True)),
    "adversarial": adversarial.KINDS, "adversarial_from": (float, Range(0)),
    "fgm_epsilon": (float, Range(0, low_open=True)), "awp_lr": (float, Range(0, low_open=True)),
    "awp_eps": (float, Range(0, low_open=True)),
    "class_weights": ("none", "balanced", dict), "focal_gamma": (float, Range(0, 10)),
}


def class_weights(setting, kind, classes, train_labels):
    """The weight vector of train.class_weights (None for none), checked against the classes."""
    if setting == "none":
        return None
    if setting == "balanced":
        if kind == "multilabel":
            return losses.balanced_pos_weights(train_labels)
        return losses.balanced_class_weights(train_labels, len(classes))
    unknown = sorted(set(map(str, setting)) - set(map(str, classes)))
    missing = [c for c in classes if str(c) not in set(map(str, setting))]
    if unknown or missing:
        raise PipelineError(f"params.yaml: train.class_weights names {'unknown classes ' + ', '.join(unknown) if unknown else ''}"
                            f"{'; ' if unknown and missing else ''}{'no weight for ' + ', '.join(map(str, missing)) if missing else ''}"
                            f": give one weight for each of {', '.join(map(str, classes))}, or balanced, or none")
    by_name = {str(k): v for k, v in setting.items()}
    weights = []
    for c in classes:
        w = by_name[str(c)]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise PipelineError(f"params.yaml: train.class_weights {c}: must be a number above 0, not {w!r}")
        weights.append(float(w))
    return np.array(weights)


def loss_name(params, kind, default):
    """train.loss, auto being the task shape's `default`; a one-line error for a loss, class weights or focal
    loss that the task kind cannot take."""
    name = default if params["loss"] == "auto" else params["loss"]
    kinds = losses.LOSSES[name][0]
    if kind not in kinds:
        raise PipelineError(f"params.yaml: train.loss {name} trains {' and '.join(kinds)}, not task.kind {kind}: "
                            f"use auto ({default})")
    if kind == "regression" and (params["class_weights"] != "none" or params["focal_gamma"]):
        raise PipelineError("params.yaml: train.class_weights and train.focal_gamma weigh classes; "
                            "task.kind regression has none: set them to none and 0")
    return name


def loss_function(params, kind, default, classes, train_labels):
    """Trainer's compute_loss_func for train.loss (auto: the task shape's `default`), train.class_weights and
    train.focal_gamma, and a line for the log naming what is on ("" for the shape's plain loss)."""
    name, setting, gamma = loss_name(params, kind, default), params["class_weights"], params["focal_gamma"]
    weights = class_weights(setting, kind, classes, train_labels)
    described = [f"train.loss {name}"] if name != default else []
    if weights is not None:
        what = "pos_weight" if kind == "multilabel" else "class weights"
        described.append(f"train.class_weights {setting if isinstance(setting, str) else 'as given'}: {what} " +
                         ", ".join(f"{c} {w:.3g}" for c, w in zip(classes, weights)))
    if gamma:
        described.append(f"train.focal_gamma {gamma:g}: focal loss")
    return losses.TaskLoss(name, kind, weights, gamma), "; ".join(described)


def plug_in(params, model, args, shape, classes, train_labels, resume=None, say=print):
    """(keyword arguments for CountingTrainer, callbacks to put after the ones that ask for evaluations)
    for the technique settings in params (the train section), model the model being trained and args
    its TrainingArguments. Re-initialises the top layers of model now, when asked. Prints a line per
    technique that is on."""
    kwargs, callbacks = {}, []
    layers = layerwise.layer_count(model)
    if params["reinit_layers"]:
        if params["reinit_layers"] > layers:
            raise PipelineError(f"params.yaml: train.reinit_layers {params['reinit_layers']}: the model has "
                                f"{layers} encoder layers; at most {layers}")
        names = layerwise.reinitialise_top(model, params["reinit_layers"])
        say(f"train.reinit_layers {params['reinit_layers']}: the top layers re-initialised ({len(names)} tensors)")
    if params["layer_lr_decay"] != 1 or params["head_lr_multiple"] != 1:
        kwargs["optimizer_cls_and_kwargs"] = layerwise.optimizer_factory(
            args, model, params["layer_lr_decay"], params["head_lr_multiple"])
        say(layerwise.describe(model, args.learning_rate, params["layer_lr_decay"], params["head_lr_multiple"]))
    if params["averaging"] != "none":
        callbacks.append(averaging.AveragingCallback(model, params["averaging"], params["average_decay"],
                                                     params["average_from"], resume))
        say(f"train.averaging {params['averaging']}: "
            + (f"an exponential moving average (decay {params['average_decay']:g})" if params["averaging"] == "ema"
               else "the mean") + f" of the weights after each optimizer step from {params['average_from']:.0%} "
            "of training on: evaluations, out-of-fold predictions and the saved model use it")
    adversary = adversarial.make(params["adversarial"], model, params["adversarial_from"], params["fgm_epsilon"],
                                 params["awp_lr"], params["awp_eps"])
    if adversary:
        kwargs["adversary"] = adversary
        size = (f"epsilon {params['fgm_epsilon']:g} on the word embeddings" if adversary.name == "fgm"
                else f"lr {params['awp_lr']:g}, eps {params['awp_eps']:g} on the weights")
        say(f"train.adversarial {adversary.name}: {size}, from epoch {params['adversarial_from']:g}"
            + ("" if params["adversarial_from"] < params["epochs"] else
               f" (never: train.epochs is {params['epochs']:g})"))
    kwargs["compute_loss_func"], described = loss_function(params, shape.kind, shape.loss, classes,
                                                            train_labels)
    if described:
        say(described)
    return kwargs, callbacks


def adversary_line(adversary, micro_batches):
    """After training: how many micro-batches took the adversarial pass."""
    return (f"train.adversarial {adversary.name}: {adversary.attacks} of {micro_batches} micro-batches "
            "trained twice (clean and perturbed)")
