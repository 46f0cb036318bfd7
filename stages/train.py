"""train: fine-tune the model on the tokenized train split with transformers' Trainer.

Reads data/tokenized/{train,val}.safetensors and data/processed/labels.json; writes the model
folder models/model (weights as safetensors, tokenizer, label mapping in config.json) and the
training curves in reports/train (dvclive: loss, learning rate, val accuracy/F1, epoch time,
and speed/*: examples and real tokens per second and padding fraction of all processes together,
peak memory of the largest process, batch size per process, number of processes).
Runs on the GPU when there is one (mixed precision, batch size probed to fit), else on the CPU (fp32).

Checkpoints every train.checkpoint_steps steps into checkpoints/train; a rerun with the same
settings resumes from the newest, and Ctrl-C or SIGTERM saves one before stopping (stages/checkpoint.py).
With train.num_processes N > 1 it relaunches itself under torchrun: N processes, one per GPU,
each with its share of every batch (DistributedDataParallel); only the first writes outputs.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from sklearn.metrics import accuracy_score, f1_score
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, TrainingArguments, set_seed)
from transformers.integrations import DVCLiveCallback
from transformers.utils import is_torch_tf32_available

from stages import checkpoint
from stages.common import (PipelineError, atomic_dir, load_params, model_params, resolve_model, run_main,
                           unpack_sequences)
from stages.speed import (CountingTrainer, Throughput, across_processes, autocast_dtype,
                          out_of_memory_in_training, peak_memory, pick_batch_size, use_expandable_segments)

TOKENIZED = Path("data/tokenized")
LABELS = Path("data/processed/labels.json")
OUT = Path("models/model")
LIVE_DIR = Path("reports/train")
# what each train.* key accepts; load_params turns anything else into a one-line error
TRAIN_PARAMS = {"epochs": (int, float), "batch_size": (int, "auto"), "effective_batch_size": (int,),
                "lr": (float,), "weight_decay": (float,), "warmup_ratio": (float,), "max_grad_norm": (float,),
                "seed": (int,), "group_by_length": (bool,), "mixed_precision": (bool,), "tf32": (bool,),
                "fused_adamw": (bool,), "pin_memory": (bool,), "loader_workers": (int,),
                "checkpoint_steps": (int,), "num_processes": (int,)}


class TokenizedDataset(torch.utils.data.Dataset):
    """Unpadded token ids and label ids, as the tokenize stage saved them."""

    def __init__(self, path):
        self.sequences, self.labels = unpack_sequences(load_file(path))

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, i):
        return {"input_ids": self.sequences[i], "labels": self.labels[i]}


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    predictions = np.argmax(logits, axis=-1)
    return {"accuracy": accuracy_score(labels, predictions),
            "f1_macro": f1_score(labels, predictions, average="macro")}


class LiveCallback(DVCLiveCallback):
    """dvclive's Trainer callback, stepping by optimizer step (not by log call) and timing epochs."""

    def on_log(self, args, state, control, **kwargs):
        if self.live is not None:
            self.live.step = state.global_step
        super().on_log(args, state, control, **kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch_start = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.live is not None:
            self.live.log_metric("epoch_time_s", round(time.perf_counter() - self.epoch_start, 1))


def make_collator(tokenizer, device):
    """Pads each batch to its own longest text; on GPU to a multiple of 8, the tensor cores' tile."""
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if device == "cuda" else None)


def training_arguments(params, output_dir, device, batch_size, accumulation):
    """Trainer's settings; output_dir receives the checkpoints."""
    cuda = device == "cuda"
    dtype = autocast_dtype(params["mixed_precision"])
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=params["epochs"],
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size * 2,  # no gradients kept: twice the batch fits
        gradient_accumulation_steps=accumulation,
        learning_rate=params["lr"],
        weight_decay=params["weight_decay"],
        warmup_steps=params["warmup_ratio"],  # a float below 1 is a fraction of all steps
        max_grad_norm=params["max_grad_norm"],
        lr_scheduler_type="linear",
        seed=params["seed"],
        train_sampling_strategy="group_by_length" if params["group_by_length"] else "random",
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,  # with a gradient scaler
        tf32=params["tf32"] if cuda and is_torch_tf32_available() else None,  # None: leave torch's setting
        optim="adamw_torch_fused" if params["fused_adamw"] else "adamw_torch",
        dataloader_pin_memory=params["pin_memory"] and cuda,
        # on the CPU, loader workers would take cores from the model
        dataloader_num_workers=params["loader_workers"] if cuda else 0,
        dataloader_persistent_workers=cuda and params["loader_workers"] > 0,
        use_cpu=not cuda,  # also what makes several processes on a CPU talk through gloo
        eval_strategy="epoch",
        save_strategy="steps",  # checkpoints to resume from; the finished model goes to models/model
        save_steps=params["checkpoint_steps"],
        save_total_limit=1,  # the newest is all a resumed run needs
        logging_strategy="steps",
        logging_steps=0.02,  # a fraction: about 50 points on the loss curve whatever the data size
        report_to="none",  # dvclive is attached explicitly, to write into reports/train
    )


def torchrun_command(num_processes):
    """This stage under torchrun on this machine: one process per GPU (or CPU share), rendezvous on
    a free local port (--standalone)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}",
            "-m", "stages.train"]


def relaunch_under_torchrun(num_processes):
    """Replace this process by torchrun running num_processes copies of this stage: its exit code
    becomes the stage's, and signals (Ctrl-C, SIGTERM) reach torchrun, which passes them on."""
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_STAGE_LOG"}  # the stage ran once, not N times
    sys.stdout.flush()
    os.execve(sys.executable, torchrun_command(num_processes), env)


def join_processes(num_processes, device):
    """(number of processes, this one's rank). With num_processes > 1 and no torchrun around yet,
    becomes torchrun (does not return); under torchrun (ours, or one started by hand across
    machines) joins the others."""
    if num_processes < 1:
        raise PipelineError(f"train.num_processes must be 1 or more, not {num_processes}")
    if num_processes > 1 and "LOCAL_RANK" not in os.environ:
        relaunch_under_torchrun(num_processes)
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world_size > 1:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # now, not when Trainer starts: the processes agree on the batch size before that
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo")
    return world_size, rank


def per_process_batch(effective_batch_size, world_size):
    """Examples per optimizer step in each process: the effective batch split evenly."""
    if effective_batch_size % world_size:
        raise PipelineError(f"train.effective_batch_size {effective_batch_size} does not split evenly over "
                            f"{world_size} processes: make it a multiple of {world_size}")
    return effective_batch_size // world_size


def agreed_batch_size(model, sequences, params, world_size, device):
    """(per-process batch, accumulation steps, longest batch) as pick_batch_size finds them, the
    same in every process: a GPU with less free memory sets the batch for all, so that all
    processes take the same number of steps."""
    process_batch = per_process_batch(params["effective_batch_size"], world_size)
    batch_size, accumulation, seq_len = pick_batch_size(
        model, sequences, params["batch_size"], process_batch, params["mixed_precision"], device)
    smallest = int(across_processes([batch_size], "min")[0])
    if smallest != batch_size:
        batch_size, accumulation = smallest, process_batch // smallest
    return batch_size, accumulation, seq_len


def load_model(model_source, labels, trust_remote_code=False):
    """The tokenizer, and the model with a new classifier head for labels (seed first)."""
    tokenizer = AutoTokenizer.from_pretrained(model_source, trust_remote_code=trust_remote_code)
    # transformers prints a table listing the classifier head as MISSING: that is expected for
    # a fresh head, so say it in one line instead
    transformers.logging.set_verbosity_error()
    model = AutoModelForSequenceClassification.from_pretrained(
        model_source, num_labels=len(labels), trust_remote_code=trust_remote_code,
        id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    transformers.logging.set_verbosity_warning()
    return tokenizer, model


def open_live(resume):
    """dvclive's logger for reports/train. DVC deletes a stage's metrics and plots before it
    reruns it, so a resumed run rebuilds the curves up to its checkpoint from the checkpoint."""
    from dvclive import Live  # here, not at the top: the benchmark imports this module where dvclive is not

    live = Live(dir=str(LIVE_DIR), dvcyaml=None, save_dvc_exp=False)
    if resume:
        checkpoint.replay_logs(live, json.loads((resume / checkpoint.STATE).read_text())["log_history"])
    return live


def main():
    params = load_params("train", TRAIN_PARAMS)
    if params["checkpoint_steps"] < 1:
        raise PipelineError(f"train.checkpoint_steps must be 1 or more, not {params['checkpoint_steps']}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world_size, rank = join_processes(params["num_processes"], device)
    main_process = rank == 0  # the only one that prints and writes outputs
    say = print if main_process else (lambda *args, **kwargs: None)
    model = model_params()
    model_name = model["name"]
    model_source = resolve_model(model_name)
    labels = json.loads(LABELS.read_text(encoding="utf-8"))
    use_expandable_segments()

    set_seed(params["seed"])  # before the model is built: seeds the new classifier head
    tokenizer, model = load_model(model_source, labels, model["trust_remote_code"])
    say(f"loaded {model_source}; the {len(labels)}-class classifier head is new (randomly initialised)")
    train_set = TokenizedDataset(TOKENIZED / "train.safetensors")
    val_set = TokenizedDataset(TOKENIZED / "val.safetensors")
    say(f"training on {device}" + (f" in {world_size} processes" if world_size > 1 else "") +
        f": {len(train_set)} train / {len(val_set)} val examples, labels {labels}")
    batch_size, accumulation, seq_len = agreed_batch_size(model, train_set.sequences, params, world_size, device)
    say(f"batch: {batch_size} per step x {accumulation} accumulated" +
        (f" x {world_size} processes" if world_size > 1 else "") +
        f" = {batch_size * accumulation * world_size} per optimizer step; longest batch {seq_len} tokens; "
        f"{autocast_dtype(params['mixed_precision']) or torch.float32}")

    inputs = sorted(TOKENIZED.glob("*.safetensors")) + [LABELS]
    resume = checkpoint.prepare(checkpoint.fingerprint(params, model_name, world_size, batch_size, accumulation,
                                                       checkpoint.file_digest(inputs)), main_process=main_process)
    live = open_live(resume) if main_process else None
    throughput = Throughput()
    with checkpoint.StopOnSignal(verbose=main_process) as stop:
        trainer = CountingTrainer(
            model=model,
            args=training_arguments(params, str(checkpoint.FOLDER), device, batch_size, accumulation),
            train_dataset=train_set,
            eval_dataset=val_set,
            data_collator=make_collator(tokenizer, device),
            compute_metrics=compute_metrics,
            callbacks=[LiveCallback(live=live), stop] if live else [stop],
            throughput=throughput,
        )
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        except torch.cuda.OutOfMemoryError:
            raise PipelineError(out_of_memory_in_training(batch_size, seq_len)) from None
    if stop.stopped:
        say(f"stopped by {signal.Signals(stop.stopped).name} at step {trainer.state.global_step} of "
            f"{trainer.state.max_steps}; saved a checkpoint in {checkpoint.FOLDER}: rerun to resume from it")
        sys.exit(128 + stop.stopped)  # the shell's convention for "ended by this signal"

    # summed or maxed over the processes: every process takes part
    speed = {**throughput.summary(), **peak_memory(), "batch_size": batch_size,
             "gradient_accumulation_steps": accumulation, "processes": world_size}
    if main_process:
        print(f"speed: {speed}")
        for name, value in speed.items():
            live.log_metric(f"speed/{name}", value, plot=False)
        live.make_summary()
        with atomic_dir(OUT) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        checkpoint.remove()


if __name__ == "__main__":
    run_main(main)
