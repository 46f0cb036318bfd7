"""train.load_in_4bit: QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"), the
way the 2024-2025 Kaggle winners trained 7B-14B decoders as classifiers on 16 GB GPUs. The pretrained
weights of every linear layer are stored in 4-bit NormalFloat (bitsandbytes' NF4, with its scales quantized
too) and computed with in the training precision (bf16 where the GPU has it, else fp16 or fp32); LoRA's
adapters and the head train in full precision on top (train.lora_rank, which this needs).

The saved model is plain: each 4-bit weight dequantized and its LoRA update added, the weights training
computed with, never quantized again (PEFT's merge into a 4-bit layer quantizes the sum again, which moved
a trained tiny model's logits by up to 7). predict_test and python -m predict load it as any other fold,
without bitsandbytes. bitsandbytes runs its 4-bit layers on CUDA GPUs, and its recent releases on CPUs too
(the tests train this way on a CPU)."""
import importlib.util

import torch

from pipeline.settings import PipelineError


def check(params):
    """One line for a setting QLoRA cannot run with, before any work."""
    if not params["load_in_4bit"]:
        return
    if not params["lora_rank"]:
        raise PipelineError("params.yaml: train.load_in_4bit needs train.lora_rank above 0 (4-bit weights are "
                            "frozen; LoRA's adapters are what trains): set train.lora_rank: 16")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise PipelineError("params.yaml: train.load_in_4bit needs the bitsandbytes package: pip install "
                            "bitsandbytes (or set train.load_in_4bit false)")


def loading(dtype, device):
    """from_pretrained's arguments for 4-bit weights computed in `dtype` (None: float32): the quantization,
    and the GPU to put them on (Trainer does not move a quantized model)."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=dtype or torch.float32)
    return {"quantization_config": config,
            **({"device_map": {"": torch.cuda.current_device()}} if device == "cuda" else {})}


def prepare(model):
    """PEFT's preparation of a 4-bit model for training: its other weights frozen and in float32. On a CPU
    with AVX512-BF16, bitsandbytes would evaluate in bfloat16 whatever the compute dtype (it repacks the
    weights for a bf16 kernel in eval mode): turned off, so the evaluations compute in the precision the
    settings name, as training does."""
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)  # train.gradient_checkpointing does it


def is_4bit(model):
    return bool(getattr(model, "is_loaded_in_4bit", False)) or getattr(getattr(model, "base_model", None),
                                                                       "is_loaded_in_4bit", False)


def dequantized_merge(model):
    """The plain float32 model a QLoRA model computes: in each adapted layer the 4-bit weight dequantized
    plus LoRA's update, any other 4-bit layer dequantized, the trained head in place."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer
    from peft.utils.integrations import dequantize_module_weight
    from peft.utils.other import ModulesToSaveWrapper

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            weight = dequantize_module_weight(module.get_base_layer()).float()
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter).float()
            module.base_layer = plain_linear(module.get_base_layer(), weight)
        elif isinstance(module, ModulesToSaveWrapper):
            # the head's trained copy in place: PEFT's unload (no merge) gives back the original from 0.22 on
            model.set_submodule(name, module.modules_to_save[module.active_adapters[0]])
    plain = model.unload()  # each LoRA layer replaced by its base layer
    for name, module in list(plain.named_modules()):
        if isinstance(module, bnb.nn.Linear4bit):
            plain.set_submodule(name, plain_linear(module, dequantize_module_weight(module).float()))
    plain.hf_quantizer.remove_quantization_config(plain)
    return plain.float()


def plain_linear(layer, weight):
    """A torch Linear of `weight` and the layer's bias."""
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device=weight.device)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if layer.bias is not None:
        linear.bias = torch.nn.Parameter(layer.bias.detach().float(), requires_grad=False)
    return linear
