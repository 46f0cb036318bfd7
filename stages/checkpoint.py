"""Checkpoints of the train stage: resuming an interrupted run, and saving one on Ctrl-C or SIGTERM.

Trainer saves a checkpoint (weights, optimizer, scheduler, RNG states, step) every
train.checkpoint_steps optimizer steps into checkpoints/fold-<k>/checkpoint-<step>, keeping the newest.
Beside it, fingerprint.json records what the run trains with (train params, model.name, world size,
a digest of the input files): a rerun resumes from a checkpoint only when its fingerprint is the same.
The folder is not a DVC output: a `persist: true` output turns off DVC's run cache for the stage,
which the team workflow relies on to restore train; it is removed after a successful run.
"""
import hashlib
import json
import re
import shutil
import signal
from pathlib import Path

import torch
from transformers import TrainerCallback

from stages.common import write_json

FINGERPRINT = "fingerprint.json"
STATE = "trainer_state.json"  # Trainer writes it last: a checkpoint without it is incomplete
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# train params that change how often checkpoints are written but not what is trained
NOT_FINGERPRINTED = ("checkpoint_steps",)


def file_digest(paths):
    """sha256 over the names and bytes of files, in the order given."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{Path(path).name}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def fingerprint(params, model_name, world_size, batch_size, accumulation, data_digest):
    """What a checkpoint must have been trained with to be resumed: a flat {setting: value}. The
    batch is the one used, not train.batch_size: auto may find another size on a busier GPU, and
    Trainer skips a resumed epoch's first batches by count."""
    settings = {f"train.{k}": v for k, v in sorted(params.items()) if k not in NOT_FINGERPRINTED}
    return {**settings, "model.name": model_name, "processes": world_size, "batch per process": batch_size,
            "accumulation": accumulation, "data sha256": data_digest}


def differences(old, new):
    """The settings that differ between two fingerprints, as 'key old -> new' strings."""
    return [f"{key} {old.get(key)!r} -> {new.get(key)!r}" for key in sorted({*old, *new})
            if old.get(key) != new.get(key)]


def checkpoints(folder):
    """{step: path} of the checkpoint folders in folder, complete or not."""
    found = {}
    if folder.is_dir():
        for path in folder.iterdir():
            match = CHECKPOINT_RE.match(path.name)
            if match and path.is_dir():
                found[int(match[1])] = path
    return found


def progress(checkpoint):
    """(optimizer steps done, steps of the whole run) recorded in a checkpoint; None when the
    checkpoint is incomplete (Trainer writes trainer_state.json last)."""
    try:
        state = json.loads((checkpoint / STATE).read_text(encoding="utf-8"))
        return state["global_step"], state["max_steps"]
    except (OSError, ValueError, KeyError):
        return None


def choose_resume(saved, current, complete):
    """(checkpoint to resume or None, why another one is ignored or None). Pure: saved is the
    fingerprint found beside the checkpoints (None when missing), complete the newest checkpoint
    holding trainer_state.json (None when there is none)."""
    if complete is None:
        return None, None
    if saved is None:
        return None, f"ignoring {complete}: there is no {FINGERPRINT} saying what it was trained with"
    changed = differences(saved, current)
    if changed:
        return None, f"ignoring {complete}: it was trained with other settings ({'; '.join(changed)})"
    return complete, None


def prepare(current, folder, main_process=True):
    """Decide whether this run resumes, and make the fold's checkpoint folder ready: returns the checkpoint
    to resume from, or None. Prints one line for a checkpoint resumed or ignored.

    Every process of a multi-process run calls it and reaches the same answer; only the main one
    deletes and writes. It deletes a stale folder before it writes the new fingerprint, so
    another process never sees the new fingerprint beside an old checkpoint."""
    found = checkpoints(folder)
    complete = {step: done for step, path in found.items() if (done := progress(path))}
    newest = found[max(complete)] if complete else None
    try:
        saved = json.loads((folder / FINGERPRINT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = None
    resume, ignored = choose_resume(saved, current, newest)
    if main_process:
        if ignored:
            print(f"{ignored}; starting from step 0")
        if resume is None:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            for step, path in found.items():  # a checkpoint a kill cut short while it was written
                if path != resume and step not in complete:
                    shutil.rmtree(path, ignore_errors=True)
            done, total = complete[max(complete)]
            print(f"resuming from {resume}: step {done} of {total}")
        write_json(folder / FINGERPRINT, current)
    return resume


def remove(folder):
    """After a successful run: the checkpoints are of no further use."""
    shutil.rmtree(folder, ignore_errors=True)


class StopOnSignal(TrainerCallback):
    """On SIGINT (Ctrl-C) or SIGTERM, finish the current optimizer step, save a checkpoint and
    stop training; `stopped` then names the signal. A second signal acts at once, as usual. A
    signal after the last step changes nothing: the run finishes and writes its model.

    With several processes, each step they agree (a max over the processes) on whether any of
    them was signalled, so all stop at the same step and none waits forever for the others. They
    agree over the CPU (gloo), not NCCL: reading an NCCL result would make the host wait for the
    GPU to finish the step before it could queue the next one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, verbose=True):
        self.verbose = verbose  # only the main process of a multi-process run prints
        self.signum = 0   # the signal received, 0 for none
        self.stopped = 0  # the signal training stopped for, 0 when it ran to the end
        self.previous = {}
        self.group = None  # the processes' CPU group, in a multi-process run

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self.previous[signum])  # the next one is not caught
        if self.verbose:
            print(f"\n{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping "
                  "(send it again to stop at once, without one)", flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        if args.world_size > 1:  # every process calls this, as new_group requires
            self.group = torch.distributed.new_group(backend="gloo")

    def agreed_signal(self):
        """The signal any process received (0 for none). It never overwrites self.signum: a signal
        caught while this process waits in all_reduce is handled only once the call returns, after
        this process sent 0 for this step, and must count at the next one."""
        if self.group is None:
            return self.signum
        flag = torch.tensor([self.signum])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:  # the same step in every process: no need to agree
            control.should_save = False  # the finished model goes to models/fold-K, not a checkpoint
        elif signum := self.agreed_signal():
            self.stopped = signum
            control.should_save = control.should_training_stop = True

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopped:  # the checkpoint is saved already; evaluating a part-epoch model is no use
            control.should_evaluate = control.should_save = False


def replay_logs(live, history):
    """Log a checkpoint's log history (Trainer's state.log_history) into a dvclive Live, step by
    step as the callback logged it the first time. DVC deletes a stage's metrics and plots before
    it reruns the stage, so a resumed run rebuilds its curves from the checkpoint instead."""
    from dvclive.plots import Metric
    from dvclive.utils import standardize_metric_name

    for entry in history:
        live.step = entry["step"]
        for key, value in entry.items():
            if key != "step" and Metric.could_log(value):
                live.log_metric(standardize_metric_name(key, "dvclive.huggingface"), value)
        live.next_step()
