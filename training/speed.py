"""Speed and memory helpers of the train stage: choosing the batch size, probing GPU memory,
and measuring throughput. Kept out of train.py so that file stays a short, linear script."""
import functools
import os
import resource
import time

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler

from stages.common import PipelineError

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


def pick_batch_size(model, sequences, requested, effective_batch_size, mixed_precision, device):
    """(per-device batch, accumulation steps, longest batch length) for train.batch_size.
    On GPU, batches are probed at the longest sequence, padded as the collator pads it."""
    seq_len = max(len(s) for s in sequences)
    if device != "cuda":  # CPU memory is not worth probing: an epoch of a 2-core CPU fits easily
        return (*choose_batch_size(requested, effective_batch_size, lambda b: True, seq_len), seq_len)
    seq_len = -(-seq_len // 8) * 8  # the collator pads to a multiple of 8 on GPU
    model.to(device)
    fits = functools.partial(cuda_fits, model, seq_len=seq_len, dtype=autocast_dtype(mixed_precision, device))
    return (*choose_batch_size(requested, effective_batch_size, fits, seq_len), seq_len)


# bf16 must beat fp32 by this much in cpu_bf16_speedup's test to be used: a clear margin, so that
# the choice does not flip with the machine's load (measured: 0.37x on one CPU, 3.7x on another)
BF16_MIN_SPEEDUP = 1.3


def cpu_has_bf16():
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), as torch's own kernels detect them."""
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup(size=1024, burst_seconds=0.08):
    """How many times faster this CPU multiplies bf16 matrices than fp32 ones, in about half a second:
    the best of three bursts of size x size matmuls each, interleaved so load affects both alike.
    The instructions alone do not make bf16 fast: a virtual Xeon that reports AVX512-BF16 ran bf16
    matmuls at 103 GFLOP/s against 282 in fp32, where an AMD EPYC ran them 3.7x faster than fp32.
    In a multi-process run every process measures and all take the slowest ratio, so that all train in
    one precision (a collective: every process makes its first call at the same point)."""
    rates = {torch.float32: 0.0, torch.bfloat16: 0.0}
    pairs = {dtype: (torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)) for dtype in rates}
    for _ in range(3):
        for dtype, (a, b) in pairs.items():
            a @ b  # the first call may pick and load kernels
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < burst_seconds:
                a @ b
                count += 1
            rates[dtype] = max(rates[dtype], count / (time.perf_counter() - start))
    return across_processes([rates[torch.bfloat16] / rates[torch.float32]], "min")[0]


def gpu_autocast_dtype(capability):
    """bf16 on GPUs whose tensor cores compute it (compute capability 8.0 and up: A100, L4, H100, RTX 30xx
    on); fp16 with loss scaling on older ones (T4, V100: 7.x). torch.cuda.is_bf16_supported() is true on a
    T4 too, where bf16 is emulated and slow, so the capability decides."""
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def autocast_dtype(mixed_precision, device):
    """The autocast dtype for training and prediction, None for fp32: on a GPU bf16 where it is native,
    else fp16 (gpu_autocast_dtype); on a CPU bf16 where it has bf16 instructions and they are faster
    than fp32 here (cpu_bf16_speedup)."""
    if not mixed_precision:
        return None
    if device == "cuda":
        return gpu_autocast_dtype(torch.cuda.get_device_capability())
    return torch.bfloat16 if cpu_has_bf16() and cpu_bf16_speedup() >= BF16_MIN_SPEEDUP else None


def precision_note(mixed_precision, device):
    """Why the precision is not bf16, for the log ("" when nothing to say): a GPU without native bf16,
    or a CPU with bf16 instructions that are not faster than fp32."""
    if mixed_precision and device == "cuda" and autocast_dtype(True, device) == torch.float16:
        major, minor = torch.cuda.get_device_capability()
        return (f" with loss scaling ({torch.cuda.get_device_name()}, compute capability {major}.{minor}, "
                "has no native bf16)")
    if mixed_precision and device == "cpu" and cpu_has_bf16() and autocast_dtype(True, device) is None:
        return (f" (this CPU has bf16 instructions, but multiplies bf16 matrices {cpu_bf16_speedup():.2f}x as fast "
                f"as fp32, below the {BF16_MIN_SPEEDUP}x it takes to use them)")
    return ""


def step_peak_memory(model, batch_size, seq_len, dtype):
    """Peak GPU bytes of one training step (forward, backward, AdamW's state) at batch_size x seq_len."""
    device = next(model.parameters()).device
    model.train()  # dropout's masks take memory too
    torch.cuda.reset_peak_memory_stats(device)
    # AdamW allocates two fp32 buffers per parameter at its first step: hold their room now
    adam_state = [torch.empty_like(p, dtype=torch.float32) for p in model.parameters() for _ in (0, 1)]
    ids = torch.full((batch_size, seq_len), 1000, dtype=torch.long, device=device)  # any real token id
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


def cuda_fits(model, batch_size, seq_len, dtype):
    """Whether a training step at batch_size x seq_len tokens fits in this process's share of GPU
    memory (memory_budget) with MEMORY_HEADROOM to spare. Leaves the model's weights unchanged."""
    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = memory_budget(free, total, torch.cuda.memory_reserved(device))
    try:
        peak = step_peak_memory(model, batch_size, seq_len, dtype)
    except torch.cuda.OutOfMemoryError:
        peak = None  # leaving the except clause frees the failed step's tensors
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # training's peak memory is reported, not the probe's
    return peak is not None and peak <= budget


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' length-grouped order, drawn from a generator seeded with (seed, epoch) alone,
    as accelerate's SeedableRandomSampler does for plain shuffling. transformers' own sampler draws
    from the global RNG when an epoch starts, a state a run resumed mid-epoch cannot rebuild: it
    would see other batches than the run it continues. Seeded this way, a resumed epoch replays the
    same order, and every process of a multi-process run draws the same one."""

    def __init__(self, batch_size, lengths, seed):
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch):  # Trainer and accelerate call it before each epoch
        self.epoch = epoch

    def __iter__(self):
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from super().__iter__()
        self.epoch += 1  # when nobody calls set_epoch, the next pass is still a new order


class CountingTrainer(Trainer):
    """Trainer that hands every training micro-batch to a Throughput callback to be counted,
    shuffles length groups reproducibly (EpochSeededLengthGroupedSampler), and evaluates without
    touching the RNG that dropout draws from."""

    def __init__(self, *args, throughput, callbacks=(), **kwargs):
        super().__init__(*args, callbacks=[*callbacks, throughput], **kwargs)
        self.throughput = throughput
        # transformers 5 sees **kwargs in BertForSequenceClassification.forward, assumes the
        # model normalises its loss by num_items_in_batch and skips dividing by the accumulation
        # steps; the model's loss is a per-batch mean, so losses (and gradients) would be summed
        # over micro-batches. False makes Trainer average them, as accumulation should.
        self.model_accepts_loss_kwargs = False

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.throughput.count(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_eval_sampler(self, eval_dataset):
        # the train stage hands over its validation rows sorted by length: kept in that order, batches
        # pad little, and the logits come back in an order the stage knows (its out-of-fold predictions)
        return torch.utils.data.SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None

    def _get_train_sampler(self, train_dataset=None):
        if self.args.train_sampling_strategy != "group_by_length":
            return super()._get_train_sampler(train_dataset)
        dataset = self.train_dataset if train_dataset is None else train_dataset
        # The seed comes from the global RNG right after Trainer seeded it (train.seed): the same
        # in a resumed run and in every process, and new for each dataloader built after that.
        seed = int(torch.randint(2**31, ()))
        # grouped by the micro-batch, not the effective batch: transformers sorts "megabatches" of
        # min(n / (4 x batch), 50) batches, and with a big effective batch that is one effective batch,
        # whose first micro-batch then holds its longest texts (measured on the embedded tweets, 1024 x 4
        # accumulated, max_length 512: 54% of tokens padding, 44% when grouped by the micro-batch)
        return EpochSeededLengthGroupedSampler(self.args.train_batch_size,
                                               [len(example["input_ids"]) for example in dataset], seed)

    def evaluate(self, *args, **kwargs):
        """Evaluation at an epoch's end draws from the global RNG (the dataloader's base seed).
        Putting the RNG back makes it neutral, so a run resumed from a checkpoint saved just before
        an evaluation draws the same dropout masks as the run that went on."""
        cpu = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            torch.random.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)


class Throughput(TrainerCallback):
    """Examples, real (non-pad) and padded tokens of the training micro-batches, and the time
    spent in training epochs (evaluation excluded)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.samples = self.padded_tokens = 0
        self.real_tokens = 0  # becomes a tensor on the training device: summing there needs no sync
        self.seconds = 0.0
        self.start = None

    def count(self, inputs):
        self.samples += len(inputs["labels"])
        self.padded_tokens += inputs["input_ids"].numel()
        # a padding-free batch (stages.unpadded) has no mask: every token in it is real
        mask = inputs.get("attention_mask")
        self.real_tokens = self.real_tokens + (mask.sum() if mask is not None else inputs["input_ids"].numel())

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # queued GPU work belongs to this epoch's time
        self.seconds += time.perf_counter() - self.start

    def summary(self):
        """Rates over all processes of a multi-process run: their examples and tokens summed, over
        the time of the slowest (the processes wait for each other at every optimizer step)."""
        samples, padded, real = across_processes([self.samples, self.padded_tokens, int(self.real_tokens)], "sum")
        (seconds,) = across_processes([max(self.seconds, 1e-9)], "max")
        return {"samples_per_s": round(samples / seconds, 1), "tokens_per_s": round(real / seconds, 1),
                "padding_fraction": round(1 - real / max(padded, 1), 4)}


def across_processes(values, op):
    """values reduced over the processes of a multi-process run ("sum", "max" or "min"); as they are in a
    single process. Every process must call it, as with any collective operation."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    device = "cuda" if torch.distributed.get_backend() == "nccl" else "cpu"  # nccl reduces GPU tensors only
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    ops = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX,
           "min": torch.distributed.ReduceOp.MIN}
    torch.distributed.all_reduce(tensor, op=ops[op])
    return [v.item() for v in tensor]


def peak_memory():
    """Peak memory of this process: CPU resident set, and GPU memory allocated when there is a GPU.
    In a multi-process run, the largest over the processes."""
    # ru_maxrss is in KiB on Linux
    peak = {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    if torch.cuda.is_available():
        allocated = torch.cuda.max_memory_allocated()
        peak["peak_gpu_gb"] = round(allocated / 2**30, 3)
        peak["peak_gpu_fraction"] = round(allocated / torch.cuda.get_device_properties(
            torch.cuda.current_device()).total_memory, 4)
    return dict(zip(peak, across_processes(list(peak.values()), "max")))
