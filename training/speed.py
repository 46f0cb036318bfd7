"""Measuring and keeping training fast: Trainer counting real tokens and padding (CountingTrainer,
Throughput), length-grouped batches reshuffled each epoch, and peak memory; values combined across
processes."""
import resource
import time

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler


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
    touching the RNG that dropout draws from. With an adversary (training/adversarial.py), each
    micro-batch of its epochs takes a second, perturbed forward and backward."""

    def __init__(self, *args, throughput, callbacks=(), adversary=None, **kwargs):
        super().__init__(*args, callbacks=[*callbacks, throughput], **kwargs)
        self.throughput = throughput
        self.adversary = adversary
        # transformers 5 sees **kwargs in BertForSequenceClassification.forward, assumes the
        # model normalises its loss by num_items_in_batch and skips dividing by the accumulation
        # steps; the model's loss is a per-batch mean, so losses (and gradients) would be summed
        # over micro-batches. False makes Trainer average them, as accumulation should.
        self.model_accepts_loss_kwargs = False

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.throughput.count(inputs)
        if self.adversary is None or not self.adversary.active(self.state.epoch):
            return super().training_step(model, inputs, num_items_in_batch)
        with self.adversary.watch(model):  # copies: a loss function takes "labels" out of what it is given
            loss = super().training_step(model, dict(inputs), num_items_in_batch)
        with self.adversary.perturbed(model):  # its gradients add to the first pass's
            super().training_step(model, dict(inputs), num_items_in_batch)
        return loss

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
        # a padding-free batch (training.unpadded) has no mask: every token in it is real
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
