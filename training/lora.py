"""train.lora_rank: LoRA through PEFT (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models"). The pretrained encoder is frozen; each targeted linear layer W gets a trained low-rank update
(alpha / rank) * B A, with A (rank x in) and B (out x rank), B starting at zero so that training starts
from the pretrained model. The task head (every module outside the pretrained encoder: the new
classifier, DeBERTa's pooler, DistilBERT's pre_classifier) is trained fully. Gradients and AdamW's
state then exist for a few percent of the weights (docs/big-models.md).

The finished model is merged (W + (alpha / rank) B A, PEFT's merge_and_unload) and saved as a plain
model: predict_test and python -m predict load it as any other fold. A checkpoint holds the adapters
and the head only (PEFT's save_pretrained), which Trainer loads back into the wrapped model on resume.
"""
from pipeline.settings import PipelineError
from training import qlora

ALL_LINEAR = "all-linear"


def check_modules(modules):
    """train.lora_modules: all-linear or a list of layer names (checked against the model in target_modules)."""
    if modules != ALL_LINEAR and not (isinstance(modules, list) and modules and all(isinstance(m, str) and m for m in modules)):
        raise PipelineError(f"params.yaml: train.lora_modules must be {ALL_LINEAR} or a list of the encoder's linear "
                            f"layer names (BERT: [query, key, value, dense]), not {modules!r}")


def encoder_prefix(model):
    """The name of the pretrained encoder inside a task model (bert, roberta, deberta, ...)."""
    return model.base_model_prefix


def head_modules(model):
    """The top-level modules outside the pretrained encoder that hold weights: the task head, new at
    load time, which LoRA trains fully."""
    prefix = encoder_prefix(model)
    return [name for name, child in model.named_children()
            if name != prefix and any(True for _ in child.parameters())]


def target_modules(model, modules):
    """The full names of the encoder's linear layers that get adapters: every one for all-linear, else
    those whose own name (the last part: query, value, dense, ...) is in `modules`. A one-line error
    naming the layers there are when a name matches none."""
    import torch

    prefix = encoder_prefix(model)
    linear = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and name.startswith(f"{prefix}.")]
    if modules == ALL_LINEAR:
        return linear
    names = sorted({name.rsplit(".", 1)[-1] for name in linear})
    unknown = [m for m in modules if m not in names]
    if unknown:
        raise PipelineError(f"params.yaml: train.lora_modules names {', '.join(map(repr, unknown))}, which "
                            f"{type(model).__name__} has no linear layer called; its layers are called "
                            f"{', '.join(names)} (or use {ALL_LINEAR})")
    return [name for name in linear if name.rsplit(".", 1)[-1] in modules]


def wrap(model, rank, alpha, modules):
    """The model with LoRA adapters of `rank` (scaled by alpha / rank) on target_modules(model, modules)
    and its head trained fully; everything else frozen."""
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=rank, lora_alpha=alpha, lora_dropout=0.0,
                        target_modules=target_modules(model, modules), modules_to_save=head_modules(model))
    return get_peft_model(model, config)


def is_wrapped(model):
    return type(model).__module__.startswith("peft.")


def trainable_line(model):
    """'LoRA: 0.59M of 22.9M parameters trained (2.6%)' for the log."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return f"{trained / 1e6:.2f}M of {total / 1e6:.1f}M parameters trained ({trained / total:.1%})"


def merged(model):
    """The plain model to save: LoRA's updates added into the weights it adapts, the trained head in
    place (PEFT's merge_and_unload); a model without adapters as it is."""
    if is_wrapped(model) and qlora.is_4bit(model):
        return qlora.dequantized_merge(model)  # not quantized again after the merge
    return model.merge_and_unload() if is_wrapped(model) else model
