"""The precision a model trains and predicts in, from what the hardware is, never from a timing: the same
params on the same kind of hardware give the same weights.

- A GPU: bf16 autocast where its tensor cores compute bf16 (compute capability 8.0 on: A100, L4, H100,
  RTX 30xx), else fp16 with loss scaling (T4, V100: torch.cuda.is_bf16_supported() is true on a T4 too,
  where bf16 is emulated and slow, so the capability decides).
- A CPU: bf16 autocast where it has bf16 instructions (AMX, or AVX512-BF16) that torch's kernels use,
  else fp32. There the attention runs in fp32 inside bf16: PyTorch's CPU kernel of scaled_dot_product_attention
  trains MiniLM's attention several times slower in bf16 than in fp32 (0.14x-0.62x on every CPU measured),
  while the matrix products gain 1.7x-2x from bf16; a whole default step was 1.37x-1.69x faster so
  (bench/README.md). The fp32 attention is transformers' sdpa function with autocast off around it,
  registered as SDPA_FP32 and switched on while the model trains, evaluates and predicts (in_fp32), so
  that a saved model's config still says "sdpa".
train.mixed_precision: false keeps fp32 everywhere.
"""
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_FP32 = "sdpa_fp32"


def cpu_isa():
    """The best instruction set torch's CPU kernels use here: "AMX" (bf16 tile matrix units, Xeon Sapphire
    Rapids on), "AVX512-BF16" (bf16 dot products: recent AMD EPYC, Cooper Lake), else what
    torch.backends.cpu.get_cpu_capability() says ("AVX512", "AVX2", "DEFAULT", ...). The bf16 units count
    only where torch runs its AVX512 kernels: ATEN_CPU_CAPABILITY=avx2 holds it to AVX2, and bf16 with it."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        if _check("_is_amx_tile_supported"):
            return "AMX"
        if _check("_is_avx512_bf16_supported"):
            return "AVX512-BF16"
    return capability


def _check(name):
    check = getattr(torch.cpu, name, None)
    return bool(check and check())


def gpu_autocast_dtype(capability):
    """bf16 on GPUs of compute capability 8.0 and up, fp16 (with loss scaling) on older ones."""
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def cpu_autocast_dtype(isa):
    """bf16 on a CPU with bf16 instructions (cpu_isa() "AMX" or "AVX512-BF16"), else None: fp32."""
    return torch.bfloat16 if isa in ("AMX", "AVX512-BF16") else None


def autocast_dtype(mixed_precision, device):
    """The autocast dtype for training and prediction on `device` ("cuda" or "cpu"), None for fp32."""
    if not mixed_precision:
        return None
    if device == "cuda":
        return gpu_autocast_dtype(torch.cuda.get_device_capability())
    return cpu_autocast_dtype(cpu_isa())


def describe(mixed_precision, device):
    """The precision in words, for the log: "bfloat16 (a CPU with AMX)"."""
    dtype = autocast_dtype(mixed_precision, device)
    name = str(dtype or torch.float32).removeprefix("torch.")
    if not mixed_precision:
        return f"{name} (train.mixed_precision: false)"
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        why = f"{torch.cuda.get_device_name()}, compute capability {major}.{minor}"
        return f"{name} ({why}" + (", no native bf16: with loss scaling)" if dtype == torch.float16 else ")")
    isa = cpu_isa()
    return f"{name} (a CPU with {isa})" if dtype else f"{name} (a CPU with {isa}: no bf16 instructions)"


def attention_in_fp32(device, dtype, attn_implementation):
    """Whether the attention runs in fp32: on a CPU in bf16 autocast, for a model that uses sdpa."""
    return device == "cpu" and dtype == torch.bfloat16 and attn_implementation == "sdpa"


def fp32_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention computed in fp32, its output in the dtype of the query."""
    mask = attention_mask.float() if attention_mask is not None and attention_mask.is_floating_point() else attention_mask
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(query.dtype), weights


AttentionInterface.register(SDPA_FP32, fp32_sdpa)
AttentionMaskInterface.register(SDPA_FP32, sdpa_mask)  # the same masks as sdpa


@contextmanager
def in_fp32(model, on=True):
    """The model's attention SDPA_FP32 inside the block when `on`, and its own implementation again after
    it, so that a model saved afterwards keeps its own config."""
    own = model.config._attn_implementation
    if on:
        model.set_attn_implementation(SDPA_FP32)
    try:
        yield
    finally:
        if on:
            model.set_attn_implementation(own)
