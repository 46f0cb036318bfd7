"""train.lr: auto: the peak learning rate from the model's size and whether LoRA trains it, as the papers
and the winning write-ups fine-tuned models of that size (docs/big-models.md lists the sources). A number
in train.lr is used as it is.

Fully fine-tuned, the larger the model the lower the rate: MiniLM-sized models learn at 1e-4 (this
pipeline's default run), BERT-base-sized ones at 2e-5 to 5e-5 (BERT), large encoders at 1e-5 or below
(RoBERTa-large, DeBERTa-v3-large), and at 1e-4 a large encoder diverges. LoRA trains a few new weights from
zero and wants about ten times more: 4e-4 to 5e-4 on RoBERTa (LoRA), 2e-4 on 7B-13B decoders and 1e-4 on
larger ones (QLoRA, and the LMSYS and MAP winners' Gemma and Qwen classifiers)."""

AUTO = "auto"
# (models of at most this many parameters, their peak learning rate), smallest first
FULL = ((50e6, 1e-4), (200e6, 3e-5), (1e9, 1e-5), (float("inf"), 5e-6))
LORA = ((1e9, 5e-4), (20e9, 2e-4), (float("inf"), 1e-4))


def auto_lr(parameters, lora):
    """The peak learning rate for a model of `parameters` weights, trained with LoRA or in full."""
    return next(rate for most, rate in (LORA if lora else FULL) if parameters <= most)


def weights(model):
    """The model's own parameters (LoRA's adapters, a few percent, not counted; a 4-bit weight, stored
    two to a byte, counted as the weights it holds)."""
    return sum(p.quant_state.shape.numel() if getattr(p, "quant_state", None) is not None else p.numel()
               for name, p in model.named_parameters() if "lora_" not in name)


def weights_of(model_name, trust_remote_code=False):
    """weights() of model.name with a two-class head, counted from its config on the meta device (no
    weights read): python -m tune's baseline trial runs the rate train.lr auto will pick."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from modeling.models import resolve_model

    config = AutoConfig.from_pretrained(resolve_model(model_name), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return weights(AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code))


def learning_rate(setting, model, lora_rank, say=print):
    """train.lr as a number: the setting, or for auto the rule's rate for this model, said in one line."""
    if setting != AUTO:
        return setting
    parameters = weights(model)
    rate = auto_lr(parameters, lora_rank > 0)
    say(f"train.lr auto: {rate:g} for a model of {parameters / 1e6:,.1f}M parameters "
        f"{'with LoRA' if lora_rank else 'fine-tuned in full'} (a number in train.lr overrides it)")
    return rate
