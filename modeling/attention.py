"""Attention in fp32 inside bf16 autocast, on a CPU whose bf16 attention kernel is slower than its fp32 one.

PyTorch's CPU flash-attention kernel (scaled_dot_product_attention) trained MiniLM's attention 4-5x
slower in bf16 than in fp32 on an AMD EPYC with AVX512-BF16 and no AMX (fwd + bwd, batch 32 x 12
heads x 40 tokens x 32: 237-322 ms vs 50-59 ms; `python -m bench.profile_step`: 42% of a bf16 step),
while bf16 matmuls there run 3.7x fp32; on a Xeon with AMX as well (measured 0.14x fp32; 94 of a 176 ms
bf16 step, while its bf16 matmuls run 4.9x fp32). So on such a CPU the matrix products stay in bf16 and the
attention runs in fp32: registered with transformers' AttentionInterface as "sdpa_fp32" (the sdpa
function and its masks, autocast off around it, q, k, v cast up and the output cast back), and
switched on while the model trains, evaluates and predicts (in_fp32), so that the saved model's config
still says "sdpa". Which precision is faster is measured on the machine (bf16_attention_speedup), as for
the matmuls, at the run's own shapes: the model's heads and head size, and the length at which the run's
texts spend most of their attention work (attention_length). It depends on them: on a Xeon with AMX bf16
attention was 0.14x fp32 for MiniLM's 12 heads of 32 at 48 tokens, but 1.30x for bert-base's 12 heads of 64
at 512 tokens, where a whole bert-base training step was 1.11x faster with it (docs/speed.md).
A run that trained so says it in pipeline.json (fp32_attention), and its test rows are predicted so
(predicting/inference.py), as its validation rows were: the same outputs (not for speed: predicting
runs the forward pass only, where bf16 attention is not the slow part).
"""
import functools
import time
from contextlib import contextmanager

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

from training.speed import across_processes

NAME = "sdpa_fp32"
# bf16 attention must be this much slower than fp32 for fp32 to be used: a clear margin, so that the
# choice does not flip with the load (measured: 0.19x-0.21x on the EPYC above)
SLOWER_THAN = 0.8


def fp32_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention computed in fp32, its output in the dtype of the query."""
    mask = attention_mask.float() if attention_mask is not None and attention_mask.is_floating_point() else attention_mask
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), mask, **kwargs)
    return out.to(query.dtype), weights


AttentionInterface.register(NAME, fp32_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the same masks as sdpa
assert NAME in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def attention_in_fp32(device, autocast_dtype, attn_implementation, bf16_speedup):
    """Whether training should run the attention in fp32: on a CPU, in bf16 autocast, for a model that
    uses sdpa, where bf16 attention was measured slower than fp32 (bf16_speedup: bf16 / fp32 speed;
    None: not measured)."""
    return (device == "cpu" and autocast_dtype == torch.bfloat16 and attn_implementation == "sdpa"
            and bf16_speedup is not None and bf16_speedup < SLOWER_THAN)


PROBE_TOKENS = 384  # tokens in the probe's batch (8 texts of 48 at MiniLM's length), at least 2 texts


def attention_length(lengths):
    """The text length at which a run spends the middle of its attention work: the median of the texts'
    lengths with each text weighted by its length squared (attention's work grows with the square of a
    text's length), so that a tail of long texts counts as much as it costs."""
    ordered = np.sort(np.asarray(lengths, dtype=np.int64))
    work = np.cumsum(ordered.astype(np.float64) ** 2)
    return int(ordered[np.searchsorted(work, work[-1] / 2)])


def probe_shape(config, lengths):
    """(heads, head size, length) for bf16_attention_speedup: the model's (its config's head_dim, else
    hidden_size / heads) and attention_length(lengths)."""
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (getattr(config, "hidden_size", 0) // heads if heads else None)
    if not heads or not head_dim:  # a config that names neither: MiniLM's, what the probe measured before
        heads, head_dim = 12, 32
    return heads, head_dim, attention_length(lengths)


@functools.lru_cache(maxsize=None)
def bf16_attention_speedup(heads=12, head_dim=32, length=48, burst_seconds=0.05):
    """How many times faster this CPU trains through scaled_dot_product_attention (forward and backward,
    with a padding mask) in bf16 than in fp32, at these shapes (a batch of PROBE_TOKENS tokens), in a
    fraction of a second: the best of three interleaved bursts each. In a multi-process run all take the
    slowest ratio (a collective, like cpu_bf16_speedup)."""
    batch = max(2, PROBE_TOKENS // length)
    rates = {torch.float32: 0.0, torch.bfloat16: 0.0}
    mask = torch.ones(batch, 1, length, length, dtype=torch.bool)
    mask[: batch // 2, :, :, length // 2:] = False  # half the texts padded to twice their length
    inputs = {dtype: [torch.randn(batch, heads, length, head_dim, dtype=dtype, requires_grad=True) for _ in range(3)]
              for dtype in rates}

    def step(dtype):
        torch.nn.functional.scaled_dot_product_attention(*inputs[dtype], attn_mask=mask).sum().backward()

    for _ in range(3):
        for dtype in rates:
            step(dtype)  # the first call may pick kernels
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < burst_seconds:
                step(dtype)
                count += 1
            rates[dtype] = max(rates[dtype], count / (time.perf_counter() - start))
    return across_processes([rates[torch.bfloat16] / rates[torch.float32]], "min")[0]


def could_matter(device, dtype, packed):
    """Whether the attention's precision is a choice to measure: a CPU training in bf16, padded batches."""
    return device == "cpu" and dtype == torch.bfloat16 and not packed


@contextmanager
def in_fp32(model, on=True):
    """The model's attention NAME inside the block when `on`, and its own implementation again after it,
    so that a model saved afterwards keeps its own config."""
    own = model.config._attn_implementation
    if on:
        model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        if on:
            model.set_attn_implementation(own)


def predicted_in_fp32(trained_in_fp32, device, dtype):
    """Whether a run's rows are predicted with the attention in fp32: where the run trained so (its
    pipeline.json's fp32_attention) and they are predicted as it trained, on a CPU in bf16 autocast."""
    return bool(trained_in_fp32) and device == "cpu" and dtype == torch.bfloat16


def choose(model, device, dtype, packed, sequences):
    """(whether this run trains its attention in fp32, a note for the log): attention_in_fp32 with the
    speedup measured here at the run's shapes (the model's heads, the lengths of its token `sequences`) when
    it could matter (a CPU in bf16); never for padding-free batches (training.unpadded has its own attention
    path)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or not could_matter(device, dtype, packed):
        return False, ""
    shape = probe_shape(model.config, [len(tokens) for tokens in sequences])
    measured = bf16_attention_speedup(*shape)
    where = f"as fast as fp32 here, {shape[0]} heads of {shape[1]} at {shape[2]} tokens"
    if not attention_in_fp32(device, dtype, "sdpa", measured):
        return False, f"; attention in bf16 (measured {measured:.2f}x {where})"
    return True, f"; attention in fp32 (bf16 attention measured {measured:.2f}x {where})"
