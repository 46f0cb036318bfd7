"""train: fine-tune the model on one fold's training rows with transformers' Trainer, then predict.

`python -m stages.train --fold K`; dvc.yaml runs it once per item of cv.folds, as stage train@K.
Reads data/tokenized/{train,test}.safetensors, data/split/folds.csv (fold K validates on the rows
marked K and trains on all the others) and data/processed/labels.json. Writes, for fold K:
- models/fold-K: weights (safetensors), tokenizer, label mapping in config.json;
- predictions/fold-K: oof.csv, the class probabilities of the rows it validated on (its final
  evaluation), and test.csv, those of every test row;
- reports/train/fold-K: the training curves (dvclive: loss, learning rate, validation accuracy/F1,
  epoch time, and speed/*: examples and real tokens per second and padding fraction of all
  processes together, peak memory of the largest process, batch size, number of processes).
Runs on the GPU when there is one (mixed precision, batch size probed to fit), else on the CPU (bf16
where the CPU has bf16 instructions, else fp32); train.mixed_precision: false keeps fp32 on both.
train.compile hands the model to torch.compile (through Trainer's torch_compile settings).

Checkpoints every machine.checkpoint_minutes into <machine.checkpoint_dir>/fold-K; a rerun with the
same settings resumes from the newest, and Ctrl-C or SIGTERM saves one before stopping
(stages/checkpoint.py). The machine section holds what this machine needs and the result does not
depend on: no stage declares it in dvc.yaml, so changing it reruns nothing.
With train.num_processes N > 1 it relaunches itself under torchrun: N processes, one per GPU,
each with its share of every batch (DistributedDataParallel); only the first writes outputs.
"""
import argparse
import json
import math
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
from transformers import (AutoConfig, AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, TrainingArguments, set_seed)
from transformers.integrations import DVCLiveCallback
from transformers.trainer_callback import PrinterCallback
from transformers.utils import is_torch_tf32_available

from stages import checkpoint, folds, pruning, unpadded
from stages.common import (SEEDS, PipelineError, Range, atomic_dir, interactive, load_params, run_main,
                           seconds_since_start, unpack_sequences)
from stages.models import model_params, resolve_model, set_dropout
from stages.progress import ProgressLog
from stages.processes import agreed_batch_size, join_processes, per_process_batch
from stages.speed import (CountingTrainer, Throughput, autocast_dtype, check_batch_size, out_of_memory_in_training,
                          peak_memory, precision_note, use_expandable_segments)

TOKENIZED = Path("data/tokenized")
LABELS = Path("data/processed/labels.json")
# what each train.* key accepts; load_params turns anything else into a one-line error
TRAIN_PARAMS = {"epochs": (float, Range(0, low_open=True)), "batch_size": (int, "auto", Range(1)),
                "effective_batch_size": (int, Range(1)), "lr": (float, Range(0, 1, low_open=True)),
                "weight_decay": (float, Range(0, 1)), "warmup_ratio": (float, Range(0, 1, high_open=True)),
                "max_grad_norm": (float, Range(0)), "seed": (int, SEEDS), "group_by_length": (bool,),
                "mixed_precision": (bool,), "tf32": (bool,), "fused_adamw": (bool,),
                "unpadded": (bool,), "compile": (bool,), "dropout": (float, "model", Range(0, 1, high_open=True)),
                "freeze_embeddings": (bool,), "num_processes": (int, Range(1)), "evaluations": (int, "epoch", Range(1))}
MACHINE_PARAMS = {"checkpoint_dir": (str,), "checkpoint_minutes": (float, Range(0, low_open=True)),
                  "checkpoint_steps": (int, None, Range(1)), "loader_workers": (int, Range(0)), "pin_memory": (bool,)}


class TokenizedDataset(torch.utils.data.Dataset):
    """Unpadded token ids and label ids (lists), e.g. some rows of a split the tokenize stage saved."""

    def __init__(self, sequences, labels):
        self.sequences, self.labels = sequences, labels

    @classmethod
    def rows(cls, sequences, labels, rows):
        return cls([sequences[i] for i in rows], [labels[i] for i in rows])

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, i):
        return {"input_ids": self.sequences[i], "labels": self.labels[i]}


class ValidationScores:
    """Trainer's compute_metrics, keeping the logits and scores of the latest evaluation: after the last
    one, those are the fold's out-of-fold predictions, with no second pass over the validation rows."""

    def __init__(self):
        self.logits, self.latest = None, {}

    def __call__(self, eval_pred):
        self.logits, labels = eval_pred
        predictions = np.argmax(self.logits, axis=-1)
        self.latest = {"accuracy": accuracy_score(labels, predictions),
                       "f1_macro": f1_score(labels, predictions, average="macro")}
        return self.latest


def evaluated_at_end(state):
    """Whether Trainer's last evaluation was of the final model (it evaluates at each epoch's end)."""
    return any("eval_loss" in entry and entry.get("step") == state.global_step for entry in state.log_history)


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


def training_arguments(params, machine, output_dir, device, batch_size, accumulation):
    """Trainer's settings from the train and machine sections; output_dir receives the checkpoints."""
    cuda = device == "cuda"
    dtype = autocast_dtype(params["mixed_precision"], device)
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
        dataloader_pin_memory=machine["pin_memory"] and cuda,
        # on the CPU, loader workers would take cores from the model
        dataloader_num_workers=machine["loader_workers"] if cuda else 0,
        dataloader_persistent_workers=cuda and machine["loader_workers"] > 0,
        use_cpu=not cuda,  # also what makes several processes on a CPU talk through gloo
        torch_compile=params["compile"],
        # train.evaluations n: pruning.EvaluateEvenly asks for each of the n evaluations itself
        eval_strategy="epoch" if params["evaluations"] == "epoch" else "no",
        # checkpoints to resume from (the finished model goes to models/fold-K): every checkpoint_steps
        # when set; every checkpoint_minutes in any case (StopOnSignal asks for those)
        save_strategy="steps" if machine["checkpoint_steps"] else "no",
        save_steps=machine["checkpoint_steps"] or 1,
        save_total_limit=1,  # the newest is all a resumed run needs
        logging_strategy="steps",
        logging_steps=0.02,  # a fraction: about 50 points on the loss curve whatever the data size
        # on: every micro-batch Trainer asks the GPU whether the loss is nan, a wait for the host each step;
        # off: a nan loss shows in the curve as nan instead of being averaged away
        logging_nan_inf_filter=False,
        report_to="none",  # dvclive is attached explicitly, to write into reports/train/fold-K
        disable_tqdm=True,  # stages.progress prints instead: a bar on a terminal, lines in a log
    )


def load_model(model_source, labels, trust_remote_code=False, dropout="model", freeze_embeddings=False):
    """The tokenizer, and the model with a new classifier head for labels (seed first). dropout: a
    probability for every dropout of the model, or "model" for the ones its config has;
    freeze_embeddings: the token-embedding matrix is not trained."""
    tokenizer = AutoTokenizer.from_pretrained(model_source, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(model_source, num_labels=len(labels), trust_remote_code=trust_remote_code,
                                        id2label=dict(enumerate(labels)),
                                        label2id={name: i for i, name in enumerate(labels)})
    if not set_dropout(config, dropout) and dropout != "model":
        print(f"train.dropout {dropout}: the config of {model_source} names no dropout; it keeps its own")
    # transformers prints a table listing the classifier head as MISSING: that is expected for
    # a fresh head, so say it in one line instead
    transformers.logging.set_verbosity_error()
    model = AutoModelForSequenceClassification.from_pretrained(model_source, config=config,
                                                               trust_remote_code=trust_remote_code)
    transformers.logging.set_verbosity_warning()
    if freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return tokenizer, model


def open_live(resume, folder):
    """dvclive's logger for the fold's curves. DVC deletes a stage's metrics and plots before it
    reruns it, so a resumed run rebuilds the curves up to its checkpoint from the checkpoint."""
    from dvclive import Live  # here, not at the top: the benchmark imports this module where dvclive is not

    live = Live(dir=str(folder), dvcyaml=None, save_dvc_exp=False)
    if resume:
        checkpoint.replay_logs(live, json.loads((resume / checkpoint.STATE).read_text())["log_history"])
    return live


@torch.inference_mode()
def predict_logits(model, collator, sequences, batch_size, device, dtype=None):
    """Logits (n, num_labels) in input order, in float32. Batches hold texts of similar length
    (sorted by length), so padding each batch to its own longest text wastes little."""
    model.eval()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    logits = torch.empty(len(sequences), model.config.num_labels)
    for start in range(0, len(order), batch_size):
        batch_index = order[start:start + batch_size]
        batch = collator([{"input_ids": sequences[i]} for i in batch_index]).to(device)
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits[batch_index] = model(**batch).logits.float().cpu()
    return logits


def probabilities(logits):
    return torch.softmax(torch.as_tensor(logits, dtype=torch.float32), dim=-1).numpy()


def speed_line(speed):
    """The speed metrics in words, for the log."""
    memory = (f"peak GPU memory {speed['peak_gpu_gb']:.2f} GB ({speed['peak_gpu_fraction']:.0%})"
              if "peak_gpu_gb" in speed else f"peak memory {speed['peak_rss_gb']:.2f} GB")
    return (f"speed: {speed['tokens_per_s']:,.0f} real tokens/s, {speed['samples_per_s']:,.1f} examples/s, "
            f"padding {speed['padding_fraction']:.1%}, {memory}")


def parse_fold(argv):
    parser = argparse.ArgumentParser(prog="python -m stages.train", description="train one fold")
    parser.add_argument("--fold", type=int, default=0, help="the fold to train (an item of cv.folds); default 0")
    return parser.parse_args(argv).fold


def main():
    fold = parse_fold(sys.argv[1:])
    params = load_params("train", TRAIN_PARAMS)
    machine = load_params("machine", MACHINE_PARAMS)
    check_batch_size(params["batch_size"], per_process_batch(params["effective_batch_size"], params["num_processes"]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world_size, rank = join_processes(params["num_processes"], device)
    main_process = rank == 0  # the only one that prints and writes outputs
    say = print if main_process else (lambda *args, **kwargs: None)
    model = model_params()
    model_name = model["name"]
    if not interactive():  # bars of weights loaded and written, downloads: one endless line in a log
        transformers.utils.logging.disable_progress_bar()
    model_source = resolve_model(model_name)
    labels = json.loads(LABELS.read_text(encoding="utf-8"))
    row_folds = folds.read_folds()
    fold_count = folds.fold_count(row_folds)
    if not 0 <= fold < fold_count:
        raise PipelineError(f"--fold {fold}: {folds.FOLDS_CSV} has folds 0 to {fold_count - 1} "
                            "(cv.folds): rerun `dvc repro split`, or pick one of those")
    out = {**folds.outputs(fold), "checkpoints": checkpoint.folder(fold, machine["checkpoint_dir"])}
    trial = pruning.TrialLink.from_env()  # set by python -m tune: this run is a trial of a study
    if trial and trial.by == "fold" and main_process and pruning.prune_at_fold(trial, fold):
        print(f"pruned: trial {trial.number} of study {trial.study!r} scored too low on the folds before "
              f"fold {fold}, which does not start")
        print(f"train@{fold}: pruned in {seconds_since_start():.1f} s")
        sys.exit(pruning.PRUNED_EXIT_CODE)
    use_expandable_segments()

    set_seed(params["seed"])  # before the model is built: seeds the new classifier head
    tokenizer, model = load_model(model_source, labels, model["trust_remote_code"], params["dropout"],
                                  params["freeze_embeddings"])
    if main_process:  # a checkpoint that cannot be saved must stop the run now, not after an hour
        checkpoint.check_writable(out["checkpoints"].parent, checkpoint.checkpoint_bytes(model))
    say(f"loaded {model_source}; the {len(labels)}-class classifier head is new (randomly initialised); "
        f"dropout {'as the model has it' if params['dropout'] == 'model' else params['dropout']}" +
        (", token embeddings frozen" if params["freeze_embeddings"] else ""))
    sequences, label_ids = unpack_sequences(load_file(TOKENIZED / "train.safetensors"))
    train_set = TokenizedDataset.rows(sequences, label_ids, np.flatnonzero(row_folds != fold))
    # sorted by length: evaluation batches pad little, and its logits come back in this known order
    val_rows = sorted(np.flatnonzero(row_folds == fold), key=lambda i: len(sequences[i]))
    val_set = TokenizedDataset.rows(sequences, label_ids, val_rows)
    say(f"fold {fold}: training on {device}" + (f" in {world_size} processes" if world_size > 1 else "") +
        f": {len(train_set):,} train / {len(val_set):,} validation examples, labels {labels}")
    batch_size, accumulation, seq_len = agreed_batch_size(model, train_set.sequences, params, world_size, device)
    dtype = autocast_dtype(params["mixed_precision"], device)
    say(f"batch: {batch_size} per step x {accumulation} accumulated" +
        (f" x {world_size} processes" if world_size > 1 else "") +
        f" = {batch_size * accumulation * world_size} per optimizer step; longest batch {seq_len} tokens; "
        f"{str(dtype or torch.float32).removeprefix('torch.')}{precision_note(params['mixed_precision'], device)}")

    inputs = sorted(TOKENIZED.glob("*.safetensors")) + [LABELS, folds.FOLDS_CSV]
    trained_with = checkpoint.fingerprint(params, model_name, world_size, batch_size, accumulation,
                                          checkpoint.file_digest(inputs))
    resume = checkpoint.prepare(trained_with, out["checkpoints"], main_process=main_process)
    live = open_live(resume, out["live"]) if main_process else None
    if live:  # the device this run was given: with a queue worker per GPU (README), which one each took
        live.summary.update(device=device, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    throughput, scores, collator = Throughput(), ValidationScores(), make_collator(tokenizer, device)
    packed = params["unpadded"] and unpadded.supports(model)
    if params["unpadded"]:
        say("train.unpadded: padding-free batches" if packed else
            f"train.unpadded: {type(model).__name__} is not a BERT-style classifier; padded batches instead")
    if params["compile"]:
        say("train.compile: torch.compile; the first batches are slow while each new batch shape is compiled")
    callbacks = [LiveCallback(live=live)] if live else []
    if params["evaluations"] != "epoch":
        callbacks.append(pruning.EvaluateEvenly(params["evaluations"]))
    reporter = None
    if trial and trial.by == "evaluation":
        n = params["evaluations"] if params["evaluations"] != "epoch" else math.ceil(params["epochs"])
        callbacks.append(reporter := pruning.EvaluationReporter(trial, n, main_process))
    with checkpoint.StopOnSignal(verbose=main_process, save_every=60 * machine["checkpoint_minutes"]) as stop:
        trainer = CountingTrainer(
            model=unpadded.UnpaddedClassifier(model) if packed else model,  # it trains `model` itself
            args=training_arguments(params, machine, str(out["checkpoints"]), device, batch_size, accumulation),
            train_dataset=train_set,
            eval_dataset=val_set,
            data_collator=unpadded.collate if packed else collator,
            compute_metrics=scores,
            callbacks=[*callbacks, stop, ProgressLog()],
            throughput=throughput,
        )
        trainer.remove_callback(PrinterCallback)  # it prints a dict per log; ProgressLog prints for people
        try:
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
            pruned = reporter is not None and reporter.pruned
            if not stop.stopped and not pruned and not evaluated_at_end(trainer.state):  # the out-of-fold predictions
                trainer.evaluate()
        except torch.cuda.OutOfMemoryError:
            raise PipelineError(out_of_memory_in_training(batch_size, seq_len)) from None
    if stop.stopped:
        say(f"stopped by {signal.Signals(stop.stopped).name} at step {trainer.state.global_step} of "
            f"{trainer.state.max_steps}; saved a checkpoint in {out['checkpoints']}: rerun to resume from it")
        sys.exit(128 + stop.stopped)  # the shell's convention for "ended by this signal"
    if pruned:  # nothing is written: a half-trained model must not become the cached result of these params
        if main_process:
            checkpoint.remove(out["checkpoints"])
        say(f"pruned: trial {trial.number} of study {trial.study!r} stopped at evaluation {reporter.pruned} "
            f"of {reporter.n} (step {trainer.state.global_step} of {trainer.state.max_steps}), its validation "
            f"{trial.metric} {scores.latest.get(trial.metric, float('nan')):.4f} too low to go on")
        say(f"train@{fold}: pruned in {seconds_since_start():.1f} s")
        sys.exit(pruning.PRUNED_EXIT_CODE)

    # summed or maxed over the processes: every process takes part
    speed = {**throughput.summary(), **peak_memory(), "batch_size": batch_size,
             "gradient_accumulation_steps": accumulation, "processes": world_size}
    if not main_process:
        return None
    print(speed_line(speed))
    for name, value in speed.items():
        live.log_metric(f"speed/{name}", value, plot=False)
    live.make_summary()
    test_path = TOKENIZED / "test.safetensors"
    test_sequences = unpack_sequences(load_file(test_path))[0] if test_path.exists() else None
    with atomic_dir(out["predictions"]) as tmp:
        folds.write_probabilities(folds.probabilities_frame(val_rows, probabilities(scores.logits), labels),
                                  tmp / "oof.csv")
        if test_sequences is not None:
            logits = predict_logits(model, collator, test_sequences, 2 * batch_size, device, dtype)
            folds.write_probabilities(folds.probabilities_frame(range(len(test_sequences)), probabilities(logits),
                                                                labels), tmp / "test.csv")
    with atomic_dir(out["model"]) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    checkpoint.remove(out["checkpoints"])
    if trial and trial.by == "fold":  # written: the fold's score may now count against the trial
        pruning.report_fold(trial, fold, scores.latest.get(trial.metric, float("nan")), trainer.state.global_step)
    return [out["model"], out["predictions"], out["live"]]


if __name__ == "__main__":
    run_main(main)
