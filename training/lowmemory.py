"""Training a big encoder on a small GPU (Colab's 16 GB T4), each a setting of the train section:
- train.gradient_checkpointing: each encoder layer keeps only its input for the backward pass and runs
  its forward again there (transformers' activation checkpointing, non-reentrant torch.utils.checkpoint):
  activations of one layer at a time instead of all, for a second forward pass of each step;
- train.lora_rank > 0: LoRA adapters (training/lora.py): gradients and AdamW's state for a few
  percent of the weights;
- train.adamw_8bit: AdamW's two moments in 8 bits, blockwise quantized (bitsandbytes, through
  Trainer's optim="adamw_bnb_8bit"): 2 bytes per trained weight instead of 8. CUDA only: elsewhere
  AdamW keeps fp32 moments and the log says so, as train.mixed_precision does where the hardware
  lacks bf16 (the pipeline runs everywhere; a CPU has memory to spare).
prepare() applies them before the batch-size probe (training/batch_size.py), which then measures the
real step: activations recomputed, gradients only where weights train, and adamw_state_bytes of
AdamW's state held in advance.
"""
import importlib.util
import math

import torch

from pipeline.settings import PipelineError
from training import lora, qlora

# bitsandbytes keeps 32-bit moments for a tensor of fewer elements than this (its min_8bit_size), and,
# through Trainer, for embedding matrices; 8-bit moments come with one fp32 scale per block of 256
MIN_8BIT_SIZE, BLOCK = 4096, 256


def optimizer(fused, eight_bit, device):
    """(Trainer's optim name, a line for the log or None) for train.fused_adamw and train.adamw_8bit."""
    if eight_bit and device == "cuda":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise PipelineError("params.yaml: train.adamw_8bit needs the bitsandbytes package on a GPU machine: "
                                "pip install bitsandbytes (or set train.adamw_8bit false)")
        return "adamw_bnb_8bit", "train.adamw_8bit: 8-bit AdamW (bitsandbytes)"
    name = "adamw_torch_fused" if fused else "adamw_torch"
    if eight_bit:
        return name, (f"train.adamw_8bit: bitsandbytes' 8-bit AdamW runs on CUDA GPUs only; on the {device} "
                      "AdamW keeps fp32 moments (which a GPU run would keep in 8 bits)")
    return name, None


def adamw_state_bytes(model, eight_bit=False):
    """Bytes of AdamW's two moments for the trained parameters of model: fp32 each, or with 8-bit AdamW
    one byte each plus a fp32 scale per block, except where bitsandbytes keeps fp32 (small tensors,
    embedding matrices)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        if eight_bit and n >= MIN_8BIT_SIZE and id(p) not in embeddings:
            total += 2 * (n + 4 * math.ceil(n / BLOCK))
        else:
            total += 2 * 4 * n
    return total


def prepare(model, params, device, say=print):
    """The model to train with train.gradient_checkpointing and train.lora_* applied (LoRA wraps it),
    each named in the log; and the line for train.adamw_8bit."""
    if params["load_in_4bit"]:
        model = qlora.prepare(model)
        say(f"train.load_in_4bit: the pretrained linear layers' weights in 4-bit NF4 (bitsandbytes), computed in "
            f"{str(model.config.quantization_config.bnb_4bit_compute_dtype).removeprefix('torch.')}")
    if params["gradient_checkpointing"]:
        kwargs = {"use_reentrant": False}  # works with frozen embeddings, whose output needs no gradient
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        say("train.gradient_checkpointing: each layer's activations are recomputed in the backward pass")
    if params["lora_rank"]:
        model = lora.wrap(model, params["lora_rank"], params["lora_alpha"], params["lora_modules"])
        say(f"train.lora_rank {params['lora_rank']}: LoRA (alpha {params['lora_alpha']:g}) on "
            f"{params['lora_modules'] if params['lora_modules'] == lora.ALL_LINEAR else ', '.join(params['lora_modules'])}"
            f" of the encoder, the head trained fully: {lora.trainable_line(model)}")
    note = optimizer(params["fused_adamw"], params["adamw_8bit"], device)[1]
    if note:
        say(note)
    return model
