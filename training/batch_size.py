"""The batch size: the micro-batch that fits the GPU (probed with the longest texts), the gradient
accumulation that keeps the effective batch, and one-line errors when memory runs out."""
import functools
import os

import torch

from modeling.precision import autocast_dtype
from pipeline.settings import PipelineError
from training.lowmemory import adamw_state_bytes

# Probing leaves this share of GPU memory unused: real training also holds the allocator's
# fragmentation across changing sequence lengths, dataloader buffers and evaluation.
MEMORY_HEADROOM = 0.85


def divisors(n):
    return [b for b in range(1, n + 1) if n % b == 0]


def find_batch_size(fits, effective_batch_size):
    """Largest per-device batch b dividing effective_batch_size with fits(b) true, and the
    gradient accumulation steps effective_batch_size // b; None when not even 1 fits.
    Binary search: fits must be monotone (a batch smaller than one that fits also fits)."""
    sizes = divisors(effective_batch_size)  # divisors keep the effective batch exact
    if fits(sizes[-1]):
        return sizes[-1], 1
    fit, no_fit = -1, len(sizes) - 1  # indices into sizes; -1: no fitting size known yet
    while no_fit - fit > 1:
        mid = (fit + no_fit) // 2
        if fits(sizes[mid]):
            fit = mid
        else:
            no_fit = mid
    return None if fit < 0 else (sizes[fit], effective_batch_size // sizes[fit])


def use_expandable_segments():
    """Let PyTorch's GPU allocator grow segments in place: with a different sequence length in
    every batch, fixed-size blocks fragment and can run out of memory where the probe fit.
    Must run before the first GPU allocation; a setting the user made wins."""
    if not {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} & set(os.environ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def out_of_memory(batch_size, seq_len, largest):
    """The one-line message for a batch that does not fit (largest: what fits, or None)."""
    fix = (f"the largest batch that fits is {largest}: set train.batch_size to auto or at most {largest}"
           if largest else "not even 1 text fits: lower tokenize.max_length or pick a smaller model")
    return (f"out of GPU memory at train.batch_size {batch_size} with texts of {seq_len} tokens (the longest "
            f"after tokenize.max_length); {fix}")


def out_of_memory_in_training(batch_size, seq_len):
    """The one-line message for an out-of-memory error after the probe said the batch fits."""
    return (f"out of GPU memory during training at train.batch_size {batch_size} with texts of up to "
            f"{seq_len} tokens (the longest after tokenize.max_length), though that fit when probed before "
            f"training (is another process using the GPU?); set train.batch_size to {max(1, batch_size // 2)} "
            f"or lower tokenize.max_length")


def check_batch_size(requested, effective_batch_size):
    """A number for train.batch_size must divide the examples a process takes per optimizer step:
    otherwise gradient accumulation could not make up the effective batch, which would silently
    become another one."""
    if requested != "auto" and effective_batch_size % requested:
        raise PipelineError(f"params.yaml: train.batch_size {requested} does not divide the {effective_batch_size} "
                            f"examples each process takes per optimizer step (train.effective_batch_size / "
                            f"train.num_processes): use auto or one of {', '.join(map(str, divisors(effective_batch_size)))}")


def choose_batch_size(requested, effective_batch_size, fits, seq_len):
    """(per-device batch, gradient accumulation steps) for train.batch_size (a number or auto).
    auto: the largest fitting divisor of the effective batch; a number must fit as it is."""
    if requested == "auto":
        found = find_batch_size(fits, effective_batch_size)
        if found is None:
            raise PipelineError(out_of_memory(1, seq_len, None))
        return found
    check_batch_size(requested, effective_batch_size)
    if not fits(requested):
        found = find_batch_size(fits, effective_batch_size)
        raise PipelineError(out_of_memory(requested, seq_len, found and found[0]))
    return requested, effective_batch_size // requested


def pick_batch_size(model, sequences, requested, effective_batch_size, mixed_precision, device, adamw_8bit=False):
    """(per-device batch, accumulation steps, longest batch length) for train.batch_size.
    On GPU, batches are probed at the longest sequence, padded as the collator pads it, with the model
    as it trains (gradient checkpointing, LoRA: training.lowmemory.prepare) and AdamW's state held."""
    seq_len = max(len(s) for s in sequences)
    if device != "cuda":  # CPU memory is not worth probing: an epoch of a 2-core CPU fits easily
        return (*choose_batch_size(requested, effective_batch_size, lambda b: True, seq_len), seq_len)
    seq_len = -(-seq_len // 8) * 8  # the collator pads to a multiple of 8 on GPU
    longest = max(sequences, key=len)
    tokens = (list(longest) * (-(-seq_len // len(longest))))[:seq_len]  # real token ids of this model's vocabulary
    model.to(device)
    fits = functools.partial(cuda_fits, model, tokens=tokens, dtype=autocast_dtype(mixed_precision, device),
                             adamw_8bit=adamw_8bit)
    return (*choose_batch_size(requested, effective_batch_size, fits, seq_len), seq_len)


def step_peak_memory(model, batch_size, tokens, dtype, adamw_8bit=False):
    """Peak GPU bytes of one training step (forward, backward, AdamW's state) on batch_size copies of `tokens`."""
    device = next(model.parameters()).device
    model.train()  # dropout's masks take memory too
    torch.cuda.reset_peak_memory_stats(device)
    # AdamW allocates its two moments for each trained parameter at its first step: hold their room now
    adam_state = torch.empty(adamw_state_bytes(model, adamw_8bit), dtype=torch.uint8, device=device)
    ids = torch.tensor([tokens] * batch_size, dtype=torch.long, device=device)
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
        # the sum of the outputs stands for any task shape's loss: the head's few outputs take no memory,
        # and the backward pass through the model is the same
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().sum()
    loss.backward()
    del adam_state
    return torch.cuda.max_memory_allocated(device)


def memory_budget(free, total, reserved_here, headroom=MEMORY_HEADROOM):
    """The bytes a training step of this process may peak at: MEMORY_HEADROOM of the GPU's memory less
    what other processes hold there (another tuning worker or queued experiment on the same GPU, a
    notebook): those hold what is neither free nor reserved by this process."""
    held_by_others = max(0, total - free - reserved_here)
    return headroom * (total - held_by_others)


def cuda_fits(model, batch_size, tokens, dtype, adamw_8bit=False):
    """Whether a training step on batch_size copies of `tokens` fits in this process's share of GPU
    memory (memory_budget) with MEMORY_HEADROOM to spare. Leaves the model's weights unchanged."""
    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = memory_budget(free, total, torch.cuda.memory_reserved(device))
    try:
        peak = step_peak_memory(model, batch_size, tokens, dtype, adamw_8bit)
    except torch.cuda.OutOfMemoryError:
        peak = None  # leaving the except clause frees the failed step's tensors
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # training's peak memory is reported, not the probe's
    return peak is not None and peak <= budget
