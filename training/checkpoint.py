"""Checkpoints of the train stage (and of pretrain, in <folder>/pretrain): where they go, when they are
saved, resuming an interrupted run, and saving one on Ctrl-C or SIGTERM.

Trainer saves a checkpoint (weights, optimizer, scheduler, RNG states, step) every
machine.checkpoint_minutes (and every machine.checkpoint_steps, when set) into
<machine.checkpoint_dir>/fold-<k>/checkpoint-<step>, keeping the newest. The folder may be outside the
clone, on storage that outlives the machine (a mounted Google Drive): it is a setting of the machine,
not of the result, so moving it reruns nothing.
Beside it, fingerprint.json records what the run trains with (train params, model.name, world size,
a digest of the input files): a rerun resumes from a checkpoint only when its fingerprint is the same.
The folder is not a DVC output: a `persist: true` output turns off DVC's run cache for the stage,
which the team workflow relies on to restore train; it is removed after a successful run.
"""
import hashlib
import json
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path

import torch
from transformers import TrainerCallback

from pipeline.outputs import write_json
from pipeline.settings import PipelineError

FINGERPRINT = "fingerprint.json"
STATE = "trainer_state.json"  # Trainer writes it last: a checkpoint without it is incomplete
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# where checkpoints go when set, before machine.checkpoint_dir: for a tool that runs the stage elsewhere
# (python -m tune runs trials in temporary copies of the clone and keeps their checkpoints in it)
CHECKPOINTS_ENV = "PIPELINE_CHECKPOINTS"


def root(checkpoint_dir):
    """Where every stage's checkpoint folder goes: $PIPELINE_CHECKPOINTS or machine.checkpoint_dir."""
    return Path(os.environ.get(CHECKPOINTS_ENV) or checkpoint_dir).expanduser()


def folder(fold, checkpoint_dir):
    """Fold `fold`'s checkpoint folder: root(checkpoint_dir) / fold-<k> (a name instead of a fold number:
    that name, as the students' pseudo-fold-<k> and distill-<name>)."""
    return root(checkpoint_dir) / (fold if isinstance(fold, str) else f"fold-{fold}")


def check_writable(path, needed_bytes):
    """Stop before training, in one line, when checkpoints could not be saved in `path`: a folder that
    cannot be made or written (read-only, not mounted), or without room for one checkpoint."""
    where = f"machine.checkpoint_dir: {path}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{uuid.uuid4().hex}"
        with open(probe, "wb") as f:
            f.write(b"0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
        free = shutil.disk_usage(path).free
    except OSError as e:
        raise PipelineError(f"{where} cannot be written ({e.strerror or type(e).__name__}): checkpoints "
                            "go there; choose a folder you can write, or mount it first") from None
    if free < needed_bytes:
        raise PipelineError(f"{where} has {free / 1e9:.2f} GB free, less than one checkpoint "
                            f"(about {needed_bytes / 1e9:.2f} GB): free some room or choose another folder")


def checkpoint_bytes(model):
    """About what one checkpoint takes: the weights and AdamW's two fp32 moments of the trained ones."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return weights + 2 * 4 * trained


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
    """What a checkpoint must have been trained with to be resumed: a flat {setting: value}.

    A runtime that reconnects on another GPU may probe another batch (train.batch_size auto) and train
    in another precision (bf16 on an A100, fp16 on a T4). Neither is recorded: the weights and AdamW's
    state are fp32 in both precisions, and Trainer skips a resumed epoch's first steps by count, each
    step the same effective batch whatever its split into micro-batches. Except with group_by_length,
    whose length groups are cut by the micro-batch: there the rest of the epoch would be drawn in
    other groups, so the micro-batch is part of the fingerprint."""
    settings = {f"train.{k}": v for k, v in sorted(params.items())}
    recorded = {**settings, "model.name": model_name, "processes": world_size, "data sha256": data_digest,
                "examples per step": batch_size * accumulation * world_size}
    if params.get("group_by_length"):
        recorded["batch per process"] = batch_size
    return recorded


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
    signal after the last step changes nothing: the run finishes and writes its model. Also saves a
    checkpoint when save_every seconds have passed since the last (machine.checkpoint_minutes): the
    same work lost to a crash on any hardware, where a count of steps would be seconds on one GPU
    and an hour on a CPU.

    With several processes, each step they agree (a max over the processes) on whether any of
    them was signalled or is due to save, so all stop or save at the same step and none waits
    forever for the others. They agree over the CPU (gloo), not NCCL: reading an NCCL result would
    make the host wait for the GPU to finish the step before it could queue the next one."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, verbose=True, save_every=None):
        self.verbose = verbose  # only the main process of a multi-process run prints
        self.save_every = save_every  # seconds between checkpoints; None: only on a signal
        self.signum = 0   # the signal received, 0 for none
        self.stopped = 0  # the signal training stopped for, 0 when it ran to the end
        self.previous = {}
        self.group = None  # the processes' CPU group, in a multi-process run
        self.last_save = time.monotonic()

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

    def agreed(self, save_due):
        """(the signal any process received or 0, whether any process is due to save). It never
        overwrites self.signum: a signal caught while this process waits in all_reduce is handled
        only once the call returns, after this process sent 0 for this step, and must count at the
        next one."""
        if self.group is None:
            return self.signum, save_due
        flag = torch.tensor([self.signum, int(save_due)])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flag[0]), bool(flag[1])

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:  # the same step in every process: no need to agree
            control.should_save = False  # the finished model goes to models/fold-K, not a checkpoint
            return
        due = self.save_every is not None and time.monotonic() - self.last_save >= self.save_every
        signum, due = self.agreed(due)
        if signum:
            self.stopped = signum
            control.should_save = control.should_training_stop = True
        elif due:
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        self.last_save = time.monotonic()

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
