"""train: fine-tune the model on one fold's training rows with transformers' Trainer.

`python -m stages.train --fold K`; dvc.yaml runs it once per item of cv.folds, as stage train@K.
Reads data/tokenized/{train.safetensors,settings.json}, data/split/folds.csv (fold K validates on the
rows marked K and trains on all the others) and data/processed/{labels.json,shape.json}: the task shape
(tasks/shapes.py) gives the number of outputs, the loss (transformers' problem_type) and the scores of
each evaluation. Writes, for fold K:
- models/fold-K: weights (safetensors), tokenizer, label mapping in config.json, and pipeline.json:
  how the data was read, cleaned and tokenized, which python -m predict and the predict_test
  stage read (the test rows are predicted there, so a new test file retrains nothing);
- predictions/fold-K: oof.csv, the outputs (class probabilities, or values) of the rows it validated
  on (its final evaluation; with train.keep_best its best by task.metric, whose weights models/fold-K
  then holds: training/best.py);
- reports/train/fold-K: the training curves (dvclive: loss, learning rate, validation accuracy/F1,
  epoch time, and speed/*: examples and real tokens per second and padding fraction of all
  processes together, peak memory of the largest process, batch size, number of processes).
Runs on the GPU when there is one (mixed precision, batch size probed to fit), else on the CPU (bf16
where the CPU has bf16 instructions, else fp32); train.mixed_precision: false keeps fp32 on both.
train.compile hands the model to torch.compile (through Trainer's torch_compile settings).
Gradient checkpointing, LoRA and 8-bit AdamW (training/lowmemory.py) fit a big encoder on a small GPU; the
batch-size probe runs with them applied. A LoRA model is saved merged: a plain model for predicting.

Checkpoints every machine.checkpoint_minutes into <machine.checkpoint_dir>/fold-K; a rerun with the
same settings resumes from the newest, and Ctrl-C or SIGTERM saves one before stopping
(training/checkpoint.py). The machine section holds what this machine needs and the result does not
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
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from transformers import set_seed
from transformers.trainer_callback import PrinterCallback

from pipeline.command import interactive, run_main, seconds_since_start
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import SEEDS, PipelineError, Range, load_params
from predicting import folds
from predicting.inference import PIPELINE, make_collator
from reading import windows
from reading.tokens import unpack_flat, unpack_sequences
from tasks.shapes import SHAPES, TASK_PARAMS, competition_metric
from training import attention, best, checkpoint, compiling, lora, lowmemory, pruning, techniques, unpadded
from training.arguments import training_arguments
from training.batch_size import check_batch_size, out_of_memory_in_training, use_expandable_segments
from training.data import TokenizedDataset, standardised
from training.evaluation import ValidationScores, evaluated_at_end
from training.models import load_model, model_params, resolve_model
from training.precision import autocast_dtype, cpu_isa, precision_note
from training.processes import agreed_batch_size, join_processes, per_process_batch
from training.progress import LiveCallback, ProgressLog, open_live
from training.speed import CountingTrainer, Throughput, peak_memory

TOKENIZED = Path("data/tokenized")
LABELS = Path("data/processed/labels.json")
SHAPE = Path("data/processed/shape.json")
# what each train.* key accepts; load_params turns anything else into a one-line error
TRAIN_PARAMS = {"epochs": (float, Range(0, low_open=True)), "batch_size": (int, "auto", Range(1)),
                "effective_batch_size": (int, Range(1)), "lr": (float, Range(0, 1, low_open=True)),
                "weight_decay": (float, Range(0, 1)), "warmup_ratio": (float, Range(0, 1, high_open=True)),
                "max_grad_norm": (float, Range(0)), "seed": (int, SEEDS), "group_by_length": (bool,),
                "mixed_precision": (bool,), "tf32": (bool,), "fused_adamw": (bool,),
                "unpadded": (bool,), "compile": (bool, "auto"), "dropout": (float, "model", Range(0, 1, high_open=True)),
                "freeze_embeddings": (bool,), "num_processes": (int, Range(1)), "evaluations": (int, "epoch", Range(1)),
                "keep_best": (bool,), "patience": (int, None, Range(1)), "gradient_checkpointing": (bool,),
                "lora_rank": (int, Range(0)), "lora_alpha": (float, Range(0, low_open=True)),
                "lora_modules": (lora.ALL_LINEAR, list), "adamw_8bit": (bool,), **techniques.TECHNIQUE_PARAMS}
MACHINE_PARAMS = {"checkpoint_dir": (str,), "checkpoint_minutes": (float, Range(0, low_open=True)),
                  "checkpoint_steps": (int, None, Range(1)), "loader_workers": (int, Range(0)), "pin_memory": (bool,)}


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
    task_metric = load_params("task", TASK_PARAMS)["metric"]  # train.keep_best and train.patience go by it
    lora.check_modules(params["lora_modules"])
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
    data = json.loads(SHAPE.read_text(encoding="utf-8"))  # the task shape, and how the texts were read
    shape = SHAPES[data["kind"]]
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
                                  params["freeze_embeddings"], shape)
    if main_process:  # a checkpoint that cannot be saved must stop the run now, not after an hour
        checkpoint.check_writable(out["checkpoints"].parent, checkpoint.checkpoint_bytes(model))
    say(f"loaded {model_source}; {shape.head(labels)} is new (randomly initialised); "
        f"dropout {'as the model has it' if params['dropout'] == 'model' else params['dropout']}" +
        (", token embeddings frozen" if params["freeze_embeddings"] else ""))
    model = lowmemory.prepare(model, params, device, say)  # before the batch-size probe, which runs its real step
    tensors = load_file(TOKENIZED / "train.safetensors")
    sequences, label_ids = unpack_sequences(tensors)
    token_types = unpack_flat(tensors, "token_type_ids")  # text pairs: which text each token belongs to
    texts = windows.text_of_row(tensors)  # tokenize.truncation windows: several rows (windows) of a text
    row_folds = row_folds[texts]  # each in its text's fold
    train_rows = np.flatnonzero(row_folds != fold)
    scale = shape.target_scale([label_ids[i] for i in train_rows])  # regression: the target standardised
    if scale:
        label_ids = standardised(label_ids, scale)
    train_set = TokenizedDataset.rows(sequences, label_ids, train_rows, token_types)
    # sorted by length: evaluation batches pad little, and its logits come back in this known order
    val_rows = sorted(np.flatnonzero(row_folds == fold), key=lambda i: len(sequences[i]))
    val_set = TokenizedDataset.rows(sequences, label_ids, val_rows, token_types)
    say(f"fold {fold}: training on {device}" + (f" in {world_size} processes" if world_size > 1 else "") +
        f": {len(train_set):,} train / {len(val_set):,} validation examples, {shape.describe(labels)}" +
        (" and their second texts (pairs)" if data["pair_columns"] else "") +
        (f"; windows of {len(set(texts[train_rows])):,} / {len(set(texts[val_rows])):,} texts"
         if "text_of_row" in tensors else ""))
    batch_size, accumulation, seq_len = agreed_batch_size(model, train_set.sequences, params, world_size, device)
    dtype = autocast_dtype(params["mixed_precision"], device)
    precision = str(dtype or torch.float32).removeprefix("torch.")
    packed = params["unpadded"] and unpadded.supports(model)
    fp32_attention, attention_note = attention.choose(model, device, dtype, packed)
    say(f"batch: {batch_size} per step x {accumulation} accumulated" +
        (f" x {world_size} processes" if world_size > 1 else "") +
        f" = {batch_size * accumulation * world_size} per optimizer step; longest batch {seq_len} tokens; "
        f"{precision}{precision_note(params['mixed_precision'], device)}{attention_note}")
    steps = compiling.run_steps(len(train_set), batch_size * accumulation * world_size, params["epochs"])
    hardware = torch.cuda.get_device_name() if device == "cuda" else cpu_isa()
    compiled, compile_note = compiling.choose(params["compile"], device, hardware, precision, steps)

    inputs = [TOKENIZED / "train.safetensors", TOKENIZED / "settings.json", LABELS, SHAPE, folds.FOLDS_CSV]
    trained_with = {**checkpoint.fingerprint(params, model_name, world_size, batch_size, accumulation,
                                             checkpoint.file_digest(inputs)),  # a checkpoint holds its optimizer's state
                    "optimizer": lowmemory.optimizer(params["fused_adamw"], params["adamw_8bit"], device)[0]}
    resume = checkpoint.prepare(trained_with, out["checkpoints"], main_process=main_process)
    live = open_live(resume, out["live"]) if main_process else None
    if live:  # the device this run was given: with a queue worker per GPU (README), which one each took
        live.summary.update(device=device, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    throughput, collator = Throughput(), make_collator(tokenizer, device)
    scores = ValidationScores(shape, scale, texts[val_rows])  # windows: each text scored once
    if params["unpadded"]:
        say("train.unpadded: padding-free batches" if packed else
            f"train.unpadded: {type(model).__name__} is not a BERT-style single-label classifier; padded batches instead")
    if compile_note:
        say(compile_note)
    callbacks = ([LiveCallback(live=live)] if live else []) + ([attention.Fp32Attention(model)] if fp32_attention else [])
    if params["evaluations"] != "epoch":
        callbacks.append(pruning.EvaluateEvenly(params["evaluations"]))
    keep = None  # train.keep_best, train.patience
    if params["keep_best"] or params["patience"]:
        callbacks.append(keep := best.KeepBest(model, scores, competition_metric(task_metric, shape.kind),
                                               shape.outputs(labels), params["keep_best"], params["patience"], resume))
    reporter = None
    if trial and trial.by == "evaluation":
        n = params["evaluations"] if params["evaluations"] != "epoch" else math.ceil(params["epochs"])
        callbacks.append(reporter := pruning.EvaluationReporter(trial, n, main_process))
    args = training_arguments({**params, "compile": compiled}, machine, str(out["checkpoints"]), device,
                              batch_size, accumulation)
    # layer-wise rates, weight averaging, adversarial passes, class weights: each on when its setting says
    extra, averaging = techniques.plug_in(params, model, args, shape.kind, shape.outputs(labels),
                                          [label_ids[i] for i in train_rows], resume, say)
    with checkpoint.StopOnSignal(verbose=main_process, save_every=60 * machine["checkpoint_minutes"]) as stop:
        trainer = CountingTrainer(
            model=unpadded.UnpaddedClassifier(model) if packed else model,  # it trains `model` itself
            args=args,
            train_dataset=train_set,
            eval_dataset=val_set,
            data_collator=unpadded.collate if packed else collator,
            compute_metrics=scores,
            callbacks=[*callbacks, *averaging, stop, ProgressLog(shown=shape.progress)],
            throughput=throughput,
            **extra,
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
    if keep:  # train.keep_best: the best evaluation's weights and out-of-fold outputs
        say(keep.finish())
    if not main_process:
        return None
    print(speed_line(speed))
    if "adversary" in extra:
        print(techniques.adversary_line(extra["adversary"], trainer.state.global_step * accumulation))
    for name, value in speed.items():
        live.log_metric(f"speed/{name}", value, plot=False)
    if keep:
        live.summary["kept_evaluation"] = keep.summary()
    live.make_summary()
    with atomic_dir(out["predictions"]) as tmp:
        oof = windows.mean_by_text(shape.activate(scores.logits, scale), texts[val_rows])  # one row per text
        folds.write_probabilities(folds.probabilities_frame(*oof, shape.outputs(labels)), tmp / "oof.csv")
    run = {**data, "labels": labels, **json.loads((TOKENIZED / "settings.json").read_text(encoding="utf-8")),
           "token_types": token_types is not None, "target_scale": scale,
           # the test rows are predicted as the validation rows were: batches of this size, in this precision
           "predict_batch_size": 2 * batch_size, "precision": precision, "compiled": compiled,
           "fold": fold, "folds": fold_count, "run": trained_with["data sha256"]}  # the same in every fold of a run
    with atomic_dir(out["model"]) as tmp:
        lora.merged(model).save_pretrained(tmp)  # LoRA's adapters merged into the weights: a plain model
        tokenizer.save_pretrained(tmp)
        write_json(tmp / PIPELINE, run)
    checkpoint.remove(out["checkpoints"])
    if trial and trial.by == "fold":  # written: the fold's score may now count against the trial
        pruning.report_fold(trial, fold, scores.latest.get(trial.metric, float("nan")), trainer.state.global_step)
    return [out["model"], out["predictions"], out["live"]]


if __name__ == "__main__":
    run_main(main)
