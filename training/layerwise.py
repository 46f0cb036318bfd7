"""Layer-wise learning rates (train.layer_lr_decay, train.head_lr_multiple) and re-initialising the top
encoder layers (train.reinit_layers).

Sun et al. 2019 ("How to Fine-Tune BERT for Text Classification?") train encoder layer k of L at
lr x decay^(L-1-k): the top layer at lr, each layer below at `decay` times the one above (0.95 at lr 2e-5
was their best), the embeddings lowest, at lr x decay^L. The new classifier head, which starts from
random weights, gets its own rate: lr x head_lr_multiple. Zhang et al. 2021 ("Revisiting Few-sample
BERT Fine-tuning") re-initialise the top layers (and the pooler), whose pretraining-specific weights
fine-tune worse than fresh ones on small data.

The groups go to Trainer through its own hook, optimizer_cls_and_kwargs: the optimizer class and
arguments Trainer would pick (train.fused_adamw), with "params" replacing its two groups.
"""
import re

# the index of an encoder layer in a parameter's name: BERT/RoBERTa/DeBERTa/ELECTRA "encoder.layer.3.",
# DistilBERT "transformer.layer.3.", ModernBERT "layers.3."
LAYER_RE = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def layer_count(model):
    """The encoder's number of layers, from its config (num_hidden_layers, or DistilBERT's n_layers)."""
    config = model.config
    return getattr(config, "num_hidden_layers", None) or getattr(config, "n_layers")


def depth(name, base_prefix, layers):
    """Where a parameter sits, counted from the bottom: 0 the embeddings, k + 1 encoder layer k, layers + 1
    the head (anything outside the base model). Other base-model weights (BERT's pooler, a final norm)
    go with the top layer, whose output they read."""
    if not name.startswith(f"{base_prefix}."):
        return layers + 1
    match = LAYER_RE.search(name)
    if match:
        return int(match[1]) + 1
    return 0 if "embeddings" in name else layers


def no_decay_names(model):
    """The parameters weight decay skips, by Trainer's own rule (biases, LayerNorm and other norms);
    Trainer.get_decay_parameter_names uses nothing of the Trainer it is a method of."""
    from transformers import Trainer

    decayed = set(Trainer.get_decay_parameter_names(None, model))
    return {name for name, _ in model.named_parameters() if name not in decayed}


def parameter_groups(model, lr, decay, head_lr_multiple, weight_decay):
    """AdamW's parameter groups: one per (depth, decayed or not), each with its "lr" and "weight_decay".
    Frozen parameters (requires_grad False) are left out, as Trainer leaves them out."""
    layers = layer_count(model)
    skip = no_decay_names(model)
    groups = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        d = depth(name, model.base_model_prefix, layers)
        rate = lr * head_lr_multiple if d == layers + 1 else lr * decay ** (layers - d)
        key = (d, name in skip)
        group = groups.setdefault(key, {"params": [], "names": [], "lr": rate,
                                        "weight_decay": 0.0 if name in skip else weight_decay})
        group["params"].append(param)
        group["names"].append(name)
    return [groups[key] for key in sorted(groups)]


def optimizer_factory(args, model, decay, head_lr_multiple):
    """Trainer's optimizer_cls_and_kwargs: the optimizer Trainer picks for args, with layer-wise groups."""
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    groups = parameter_groups(model, args.learning_rate, decay, head_lr_multiple, args.weight_decay)
    for group in groups:
        del group["names"]  # torch keeps extra keys in its state dict; names are for tests and the log
    return cls, {**kwargs, "params": groups}


def describe(model, lr, decay, head_lr_multiple):
    """The rates in words, for the log."""
    layers = layer_count(model)
    return (f"train.layer_lr_decay {decay:g}: encoder layers {lr * decay ** (layers - 1):.3g} (bottom) to {lr:.3g} "
            f"(top), embeddings {lr * decay ** layers:.3g}; train.head_lr_multiple {head_lr_multiple:g}: head "
            f"{lr * head_lr_multiple:.3g}")


def reinitialise_top(model, n):
    """Re-initialise the top n encoder layers and the pooler, if any, with the model's own init
    (its _init_weights, as for a new head). Returns the names of the parameters re-initialised."""
    layers = layer_count(model)
    if not 0 <= n <= layers:
        raise ValueError(f"the model has {layers} layers; cannot re-initialise {n}")
    base = model.base_model_prefix
    chosen = []
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        full = [f"{name}.{p}" for p, _ in own]
        d = depth(full[0], base, layers)
        pooler = ".pooler." in f".{name}." and full[0].startswith(f"{base}.")
        if (layers - n < d <= layers and LAYER_RE.search(full[0])) or (n and pooler):
            for _, param in own:
                param._is_hf_initialized = False  # transformers' init skips weights loaded from a checkpoint
            model._init_weights(module)
            chosen += full
    return chosen
