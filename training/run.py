"""Training one model with transformers' Trainer: what the train stage does for fold K, and what the
pseudo and distill stages do for their students, on other rows and targets.

A Job says which model starts (model.name, the pretrain stage's, or a smaller student) and where the
outputs go; Rows say what it learns from and validates on. train() then runs what train@K has always
run: the batch-size probe, precision, checkpoints and resume, the techniques, keep_best, pruning,
and writes the model folder (with pipeline.json, which predict_test and python -m predict read) and the
out-of-fold outputs of the validation rows. Students learn soft targets (teacher probabilities, or
values): a class is then a vector of probabilities, learned with cross-entropy on probability targets
(losses.TaskLoss), which for a one-hot vector is the usual loss.
"""
import dataclasses
import math
import os
import signal
import sys

import numpy as np
import torch
from transformers import set_seed
from transformers.trainer_callback import PrinterCallback

from pipeline.command import seconds_since_start
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import PipelineError
from predicting import folds
from predicting.inference import PIPELINE, make_collator
from reading import windows
from reading.tokens import unpack_flat, unpack_sequences
from tasks.shapes import competition_metric
from training import (
    allocator,
    attention,
    best,
    checkpoint,
    compiling,
    first_token,
    lora,
    losses,
    lowmemory,
    pruning,
    techniques,
    unpadded,
)
from training.arguments import training_arguments
from training.batch_size import out_of_memory_in_training, use_expandable_segments
from training.data import TokenizedDataset, standardised
from training.evaluation import ValidationScores, evaluated_at_end
from modeling.models import load_model
from modeling.precision import autocast_dtype, cpu_isa, precision_note
from training.processes import agreed_batch_size, join_processes
from training.progress import LiveCallback, ProgressLog, open_live
from training.speed import CountingTrainer, Throughput, peak_memory


@dataclasses.dataclass
class Job:
    """One model to train. name: what the log calls it ("fold 0", "student fold 0"); fold: the fold whose
    rows it validates on (None: no validation); out: folds.outputs()'s folders (model, predictions, live)
    and checkpoints; start: what from_pretrained loads; model_name: model.name (the checkpoints'
    fingerprint); data: shape.json; labels: the classes; inputs: the files whose digest a checkpoint must
    match; shape: the task shape; keep_layers: a student made of the start model's first layers."""
    name: str
    fold: int | None
    out: dict
    start: str
    model_name: str
    data: dict
    labels: list
    inputs: list
    shape: object
    trust_remote_code: bool = False
    keep_layers: int | None = None
    trial: object = None
    fold_count: int = 1
    run_inputs: list | None = None  # what pipeline.json's "run" digests (default: inputs): the same in every fold
    after: object = None  # after(folder, tokenizer, model, run): more files for the predictions folder
    settings: dict = dataclasses.field(default_factory=dict)  # more of what a checkpoint must match (pseudo.*)


@dataclasses.dataclass
class Rows:
    """Every row the job sees: token ids, segment ids (pairs) or None, the text of each row (windows),
    each row's target in the outputs' units (a class id, or soft: probabilities or a value), the rows it
    trains on and the ones it validates on (class ids there; empty: none). soft: some train rows' targets
    are probability vectors (a classification student)."""
    sequences: list
    token_types: list | None
    texts: np.ndarray
    targets: list
    train: np.ndarray
    val: np.ndarray
    soft: bool = False


def fold_rows(tensors, row_folds, fold):
    """The train file's Rows (tensors: data/tokenized/train.safetensors) for fold `fold`: it trains on the
    other folds' rows and validates on its own; windows (tokenize.truncation) go with their text's fold."""
    sequences, label_ids = unpack_sequences(tensors)
    texts = windows.text_of_row(tensors)  # several rows (windows) of a text
    row_folds = row_folds[texts]
    return Rows(sequences, unpack_flat(tensors, "token_type_ids"), texts, list(label_ids),
                train=np.flatnonzero(row_folds != fold), val=np.flatnonzero(row_folds == fold))


def start_again_where_it_pays(rows, params, machine):
    """A training stage, once its rows are read and before it loads a model: on a CPU measured faster under
    tcmalloc, a run of these rows long enough to repay it starts again under tcmalloc (machine.allocator;
    training/allocator.py). What the stage did before runs again there: reading, not printing."""
    allocator.restart_where_it_pays(machine["allocator"], compiling.run_steps(
        len(rows.train), params["effective_batch_size"], params["epochs"]))


def speed_line(speed):
    """The speed metrics in words, for the log."""
    memory = (f"peak GPU memory {speed['peak_gpu_gb']:.2f} GB ({speed['peak_gpu_fraction']:.0%})"
              if "peak_gpu_gb" in speed else f"peak memory {speed['peak_rss_gb']:.2f} GB")
    return (f"speed: {speed['tokens_per_s']:,.0f} real tokens/s, {speed['samples_per_s']:,.1f} examples/s, "
            f"padding {speed['padding_fraction']:.1%}, {memory}")


def train(job, rows, params, machine, task_metric, tokenized_settings):
    """Train job on rows with the train section `params`; write its outputs. Returns the paths written
    (None in the processes that do not write); exits with the signal's or pruning's code when stopped."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world_size, rank = join_processes(params["num_processes"], device)
    main_process = rank == 0  # the only one that prints and writes outputs
    say = print if main_process else (lambda *args, **kwargs: None)
    shape, labels, out, trial = job.shape, job.labels, job.out, job.trial
    use_expandable_segments()

    set_seed(params["seed"])  # before the model is built: seeds the new classifier head
    tokenizer, model = load_model(job.start, labels, job.trust_remote_code, params["dropout"],
                                  params["freeze_embeddings"], shape, job.keep_layers)
    if main_process:  # a checkpoint that cannot be saved must stop the run now, not after an hour
        checkpoint.check_writable(out["checkpoints"].parent, checkpoint.checkpoint_bytes(model))
    say(f"loaded {job.start}" + (f" (its first {job.keep_layers} layers)" if job.keep_layers else "") +
        f"; {shape.head(labels)} is new (randomly initialised); "
        f"dropout {'as the model has it' if params['dropout'] == 'model' else params['dropout']}" +
        (", token embeddings frozen" if params["freeze_embeddings"] else ""))
    model = lowmemory.prepare(model, params, device, say)  # before the batch-size probe, which runs its real step
    targets, texts = rows.targets, rows.texts
    scale = shape.target_scale([targets[i] for i in rows.train])  # regression: the target standardised
    if scale:
        targets = standardised(targets, scale)
    train_set = TokenizedDataset.rows(rows.sequences, targets, rows.train, rows.token_types)
    # sorted by length: evaluation batches pad little, and its logits come back in this known order
    val_rows = sorted(rows.val, key=lambda i: len(rows.sequences[i]))
    val_set = TokenizedDataset.rows(rows.sequences, targets, val_rows, rows.token_types) if val_rows else None
    say(f"{job.name}: training on {device}" + (f" in {world_size} processes" if world_size > 1 else "") +
        f": {len(train_set):,} train / {len(val_rows):,} validation examples, {shape.describe(labels)}" +
        (" and their second texts (pairs)" if job.data["pair_columns"] else "") +
        (f"; windows of {len(set(texts[rows.train])):,} / {len(set(texts[val_rows])):,} texts"
         if len(np.unique(texts)) < len(texts) else ""))
    packed = params["unpadded"] and unpadded.supports(model) and not rows.soft  # packed rows take class ids
    collator = make_collator(tokenizer, device)
    # before the batch-size probe, which then measures the step as it trains
    say(first_token.choose(model, first_token.check_batch(collator, train_set.sequences, train_set.token_types), packed))
    batch_size, accumulation, seq_len = agreed_batch_size(model, train_set.sequences, params, world_size, device)
    dtype = autocast_dtype(params["mixed_precision"], device)
    precision = str(dtype or torch.float32).removeprefix("torch.")
    fp32_attention, attention_note = attention.choose(model, device, dtype, packed, train_set.sequences)
    say(f"batch: {batch_size} per step x {accumulation} accumulated" +
        (f" x {world_size} processes" if world_size > 1 else "") +
        f" = {batch_size * accumulation * world_size} per optimizer step; longest batch {seq_len} tokens; "
        f"{precision}{precision_note(params['mixed_precision'], device)}{attention_note}")
    steps = compiling.run_steps(len(train_set), batch_size * accumulation * world_size, params["epochs"])
    hardware = torch.cuda.get_device_name() if device == "cuda" else cpu_isa()
    compiled, compile_note = compiling.choose(params["compile"], device, hardware, precision, steps,
                                              compiler=device != "cpu" or compiling.cpp_compiler() is not None)

    trained_with = {**checkpoint.fingerprint(params, job.model_name, world_size, batch_size, accumulation,
                                             checkpoint.file_digest(job.inputs)),  # a checkpoint holds its optimizer's state
                    "optimizer": lowmemory.optimizer(params["fused_adamw"], params["adamw_8bit"], device)[0], **job.settings}
    resume = checkpoint.prepare(trained_with, out["checkpoints"], main_process=main_process)
    live = open_live(resume, out["live"]) if main_process else None
    memory_allocator = allocator.running()
    if live:  # the device this run was given (with a queue worker per GPU (README), which one each took), its allocator
        live.summary.update(device=device, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                            allocator=memory_allocator)
    throughput = Throughput()
    scores = ValidationScores(shape, scale, texts[val_rows]) if val_set else None  # windows: each text scored once
    if params["unpadded"]:
        say("train.unpadded: padding-free batches" if packed else
            f"train.unpadded: {type(model).__name__} is not a BERT-style single-label classifier learning class "
            "ids; padded batches instead")
    if compile_note:
        say(compile_note)
    if allocator_note := allocator.note(device, memory_allocator, allocator.tcmalloc_library()):
        say(allocator_note)
    callbacks = [LiveCallback(live=live)] if live else []
    if compiled:
        callbacks.append(compiling.EveryShapeAtOnce())
    if params["evaluations"] != "epoch" and val_set:
        callbacks.append(pruning.EvaluateEvenly(params["evaluations"]))
    keep = None  # train.keep_best, train.patience
    if (params["keep_best"] or params["patience"]) and val_set:
        callbacks.append(keep := best.KeepBest(model, scores, competition_metric(task_metric, shape.kind),
                                               shape.outputs(labels), params["keep_best"], params["patience"], resume))
    reporter = None
    if trial and trial.by == "evaluation":
        n = params["evaluations"] if params["evaluations"] != "epoch" else math.ceil(params["epochs"])
        callbacks.append(reporter := pruning.EvaluationReporter(trial, n, main_process))
    args = training_arguments({**params, "compile": compiled}, machine, str(out["checkpoints"]), device,
                              batch_size, accumulation)
    if not val_set:
        args.eval_strategy = "no"
    # layer-wise rates, weight averaging, adversarial passes, class weights: each on when its setting says
    learned = [targets[i] for i in rows.train]
    if rows.soft and shape.kind == "classification":  # class weights count each row's likeliest class
        learned = [int(np.argmax(t)) for t in learned]
    extra, averaging = techniques.plug_in(params, model, args, shape.kind, shape.outputs(labels), learned, resume, say)
    if rows.soft and "compute_loss_func" not in extra:  # probability targets: the model's own loss takes class ids
        extra["compute_loss_func"] = losses.TaskLoss(shape.kind)
    # the attention in fp32 for the evaluations too, the one after training included, and back for saving
    with checkpoint.StopOnSignal(verbose=main_process, save_every=60 * machine["checkpoint_minutes"]) as stop, \
            attention.in_fp32(model, fp32_attention):
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
            if val_set and not stop.stopped and not pruned and not evaluated_at_end(trainer.state):
                trainer.evaluate()  # the out-of-fold predictions
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
        say(f"train@{job.fold}: pruned in {seconds_since_start():.1f} s")
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
    run = {**job.data, "labels": labels, **tokenized_settings,
           "token_types": rows.token_types is not None, "target_scale": scale,
           # the test rows are predicted as the validation rows were: batches of this size, in this precision,
           # the attention in fp32 where it trained so
           "predict_batch_size": 2 * batch_size, "precision": precision, "fp32_attention": fp32_attention,
           "compiled": compiled,
           "fold": job.fold, "folds": job.fold_count,  # "run": the same in every fold of a run
           "run": checkpoint.file_digest(job.run_inputs) if job.run_inputs else trained_with["data sha256"]}
    written = [out["model"], out["live"]]
    if val_set or job.after:
        with atomic_dir(out["predictions"]) as tmp:
            if val_set:
                oof = windows.mean_by_text(shape.activate(scores.logits, scale), texts[val_rows])  # one row per text
                folds.write_probabilities(folds.probabilities_frame(*oof, shape.outputs(labels)), tmp / "oof.csv")
            if job.after:
                job.after(tmp, tokenizer, model, run)
        written.insert(1, out["predictions"])
    with atomic_dir(out["model"]) as tmp:
        lora.merged(model).save_pretrained(tmp)  # LoRA's adapters merged into the weights: a plain model
        tokenizer.save_pretrained(tmp)
        write_json(tmp / PIPELINE, run)
    checkpoint.remove(out["checkpoints"])
    if trial and trial.by == "fold":  # written: the fold's score may now count against the trial
        pruning.report_fold(trial, job.fold, scores.latest.get(trial.metric, float("nan")), trainer.state.global_step)
    return written
