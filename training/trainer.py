"""transformers' Trainer as the pipeline trains with it: every micro-batch counted (training/speed.py's
Throughput), length groups shuffled reproducibly, evaluations that leave the random state as it was and keep
their scores and logits (ValidationScores, Trainer's compute_metrics), an adversarial second pass
(training/adversarial.py), and with train.compile one compiled graph for every batch shape."""
import math
import os
import shutil

import numpy as np
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler

from pipeline.settings import PipelineError
from reading.windows import mean_by_text
from tasks.shapes import SHAPES


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


class FiniteLoss(TrainerCallback):
    """Stops the run at the first logged training loss that is NaN or infinite, with one line saying why and
    what to change: a model that overflows float16 (Gemma in fp16 on a T4, which has no bf16), or updates
    that diverged. Trainer would train on, and the fold would submit the outputs of a broken model. Read at
    each log (about 50 a run), so it costs no synchronisation per step."""

    def __init__(self, dtype, lr):
        self.dtype, self.lr = dtype, lr

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is None or math.isfinite(loss):
            return
        where = f"the training loss became {loss} by step {state.global_step} of {state.max_steps}"
        if self.dtype == torch.float16:
            raise PipelineError(f"{where} in float16: the model overflows float16 (Gemma does); set "
                                "train.mixed_precision: false (float32), or train on a GPU with bfloat16 "
                                "(compute capability 8.0 or more: A100, L4, H100)")
        if state.global_step <= state.logging_steps:  # before the updates could diverge
            raise PipelineError(f"{where}: the model's outputs overflow from its first steps; check the weights "
                                f"of model.name, or lower train.lr (now {self.lr:g})")
        raise PipelineError(f"{where}: training diverged; lower train.lr (now {self.lr:g}), or keep "
                            "train.max_grad_norm at 1.0")


class ValidationScores:
    """Trainer's compute_metrics, keeping the logits and scores of the latest evaluation: after the last
    one, those are the fold's out-of-fold predictions, with no second pass over the validation rows.
    The task shape computes the scores (scale: a regression target's standardisation). texts: the text of
    each validation row; where windows made several rows of a text, it is scored once, on the mean of its
    rows' logits (the out-of-fold file averages their probabilities, which may rarely pick another class)."""

    def __init__(self, shape=SHAPES["classification"], scale=None, texts=None):
        self.shape, self.scale, self.texts = shape, scale, texts
        self.logits, self.labels, self.latest = None, None, {}

    def __call__(self, eval_pred):
        self.logits, self.labels = eval_pred
        logits, labels = self.logits, self.labels
        if self.texts is not None and len(np.unique(self.texts)) < len(self.texts):  # windows: score each text once
            first = np.unique(self.texts, return_index=True)[1]  # its rows share its label
            logits, labels = mean_by_text(logits, self.texts)[1], labels[first]
        self.latest = self.shape.evaluation_scores(logits, labels, self.scale)
        return self.latest


def evaluated_at_end(state):
    """Whether Trainer's last evaluation was of the final model (it evaluates at each epoch's end)."""
    return any("eval_loss" in entry and entry.get("step") == state.global_step for entry in state.log_history)


class EveryShapeAtOnce(TrainerCallback):
    """train.compile: torch.compile traces a batch's size and length as variables from the first batch on
    (torch.compile(dynamic=True), which Trainer does not pass), so that one graph serves every batch. By
    default it would compile the first batch's exact shape, then again for the second length (each
    length-grouped batch has its own) and for the epoch's last, short batch: three compilings of the whole
    model, 25-35 s each on a CPU for the tests' tiny model, 13-45 s on a GPU for MiniLM."""

    def on_train_begin(self, args, state, control, **kwargs):
        self.patch = torch._dynamo.config.patch(assume_static_by_default=False)
        self.patch.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self.patch.__exit__(None, None, None)


def check_compiler(compile, device):
    """train.compile on a CPU: torch.compile builds its kernels with a C++ compiler (Inductor's
    cpp.cxx: $CXX, else g++); a one-line error before any work where there is none."""
    if compile and device == "cpu" and not shutil.which(os.environ.get("CXX") or "g++"):
        raise PipelineError("params.yaml: train.compile true: on a CPU torch.compile builds its kernels with a "
                            "C++ compiler, and none is installed here (apt-get install g++, or set CXX); or set it "
                            "to false")
