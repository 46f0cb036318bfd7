"""Weight averaging (train.averaging): an exponential moving average of the trained weights (ema), or
their plain mean over the last part of training (swa, Izmailov et al. 2018, at the schedule's own
rates). Averaging starts once train.average_from of the optimizer steps are done; from then on,
every evaluation scores the averaged weights, and at the end of training they replace the model's,
so that the out-of-fold predictions and the saved model are the averaged ones.

The average of each trained weight is kept in fp32 beside the model (one more copy of the trained
weights). A checkpoint keeps it in averaged.safetensors inside the checkpoint's folder, so a resumed
run goes on with the same average.
"""
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import TrainerCallback

FILE = "averaged.safetensors"
KINDS = ("none", "ema", "swa")


class WeightAverage:
    """The running average of some named tensors. update() after each optimizer step: ema moves the
    average a share 1 - decay towards the weights, swa to the mean of every update so far."""

    def __init__(self, kind, decay=0.99):
        if kind not in ("ema", "swa"):
            raise ValueError(f"averaging is ema or swa, not {kind!r}")
        self.kind, self.decay = kind, decay
        self.average, self.count = {}, 0

    def update(self, named):
        """Fold the current weights {name: tensor} into the average (the first update copies them)."""
        self.count += 1
        share = 1.0 / self.count if self.kind == "swa" or self.count == 1 else 1.0 - self.decay
        with torch.no_grad():
            for name, weight in named.items():
                if name not in self.average:
                    self.average[name] = weight.detach().float().clone()
                else:
                    self.average[name].lerp_(weight.detach().float(), share)

    def swap(self, named):
        """Exchange the weights and the average in place: the model then holds the average, and a second
        swap puts its own weights back, bit for bit (the average is fp32, as the trained weights are)."""
        with torch.no_grad():
            for name, weight in named.items():
                kept = weight.detach().clone()
                weight.copy_(self.average[name])
                self.average[name].copy_(kept)

    def state(self):
        return {name: t.contiguous() for name, t in self.average.items()}, {"count": str(self.count)}

    def load(self, tensors, metadata):
        self.average = {name: t.float() for name, t in tensors.items()}
        self.count = int(metadata["count"])


def trained_weights(model):
    """{name: parameter} of the weights training changes."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


class AveragingCallback(TrainerCallback):
    """Keeps a WeightAverage of `model`'s trained weights from step ceil(start x max_steps) on, and puts
    it in the model for each evaluation (then back) and at the end of training (for good). Placed after
    the callbacks that ask for evaluations, so that it sees their request in the same event."""

    def __init__(self, model, kind, decay, start, resume=None):
        self.weights = trained_weights(model)
        self.average = WeightAverage(kind, decay)
        self.start, self.resume = start, resume
        self.swapped = False

    def on_train_begin(self, args, state, control, **kwargs):
        saved = Path(self.resume) / FILE if self.resume else None
        if saved and saved.is_file():
            from safetensors import safe_open

            with safe_open(saved, "pt") as f:
                metadata = f.metadata()
            self.average.load(load_file(saved), metadata)
        elif self.resume and state.global_step > self.start * state.max_steps and args.process_index == 0:
            # a run killed between Trainer's files and this one's: said, not silently a shorter average
            print(f"train.averaging: {Path(self.resume).name} has no {FILE}; the average starts again "
                  f"at step {state.global_step + 1}")

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.start * state.max_steps:
            self.average.update(self.weights)
        self.swap_in_for(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self.swap_in_for(control)

    def swap_in_for(self, control):
        if control.should_evaluate and self.average.count and not self.swapped:
            self.average.swap(self.weights)
            self.swapped = True

    def on_evaluate(self, args, state, control, **kwargs):
        if self.swapped and state.global_step < state.max_steps:  # the last one is kept for good
            self.average.swap(self.weights)
            self.swapped = False

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir() and self.average.count and args.process_index == 0:
            tensors, metadata = self.average.state()
            save_file(tensors, folder / FILE, metadata=metadata)

    def on_train_end(self, args, state, control, **kwargs):
        if state.global_step < state.max_steps or not self.average.count:  # stopped early, or nothing averaged
            return
        if not self.swapped:
            self.average.swap(self.weights)
            self.swapped = True
        if args.process_index == 0:  # the average now holds the last step's weights
            apart = max((w.detach().float() - self.average.average[n]).abs().max().item()
                        for n, w in self.weights.items())
            print(f"train.averaging: the model keeps the {self.average.kind} of the weights of "
                  f"{self.average.count} optimizer steps (at most {apart:.3g} from the last step's)")
