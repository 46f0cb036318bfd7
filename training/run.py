"""One training run with transformers' Trainer: fold K of the train stage, or a student of the pseudo and
distill stages (other rows and targets, the same run). train() is four steps, each a function below:

1. load(): the model with a new head for the task shape (and the low-memory settings), the datasets, the
   batch size that fits, the precision this hardware trains in (modeling/precision.py);
2. make_trainer(): Trainer's arguments, its callbacks (progress, dvclive, checkpoints, keep_best, pruning)
   and the techniques that are on (training/techniques.py); a checkpoint of the same settings is resumed;
3. fit(): the training and the final evaluation; a signal (Ctrl-C, SIGTERM) or pruning ends the process;
4. write_outputs(): the model folder with pipeline.json (how predict_test and python -m predict prepare
   rows for it), the out-of-fold outputs of the validation rows, the metrics.

Students learn soft targets (teacher probabilities, or values): a class is then a vector of probabilities,
which the loss takes as it takes a class's one-hot row (training/losses.py).
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

from modeling.models import load_model, make_collator
from modeling.precision import attention_in_fp32, autocast_dtype, describe, in_fp32
from pipeline.command import seconds_since_start
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import PipelineError
from predicting import folds
from predicting.inference import PIPELINE
from reading import windows
from tasks.shapes import competition_metric
from training import best, checkpoint, lora, lowmemory, pruning, qlora, techniques
from training.arguments import training_arguments
from training.batch_size import out_of_memory_in_training, use_expandable_segments
from training.learning_rate import learning_rate
from training.processes import agreed_batch_size, join_processes
from training.progress import LiveCallback, ProgressLog, open_live
from training.rows import TokenizedDataset, standardised
from training.speed import Throughput, allocator_note, peak_memory, running_allocator, speed_line, tcmalloc_library
from training.trainer import CountingTrainer, EveryShapeAtOnce, FiniteLoss, ValidationScores, check_compiler, evaluated_at_end


@dataclasses.dataclass
class Job:
    """One model to train. name: what the log calls it ("fold 0", "student fold 0"); fold: the fold whose
    rows it validates on (None: no validation); out: where it writes (folds.outputs()'s model, predictions
    and live folders, and its checkpoints); start: what from_pretrained loads; model_name: model.name (the
    checkpoints' fingerprint); data: the training data's TrainingData (training/rows.py); inputs: the files
    whose digest a checkpoint must match; keep_layers: a student made of the start model's first layers."""
    name: str
    fold: int | None
    out: dict
    start: str
    model_name: str
    data: object
    inputs: list
    trust_remote_code: bool = False
    keep_layers: int | None = None
    trial: object = None
    run_inputs: list | None = None  # what pipeline.json's "run" digests (default: inputs): the same in every fold
    after: object = None  # after(folder, tokenizer, model, run): more files for the predictions folder
    settings: dict = dataclasses.field(default_factory=dict)  # more of what a checkpoint must match (pseudo.*)


@dataclasses.dataclass
class Loaded:
    """What load() hands on: the tokenizer and the model; the datasets (the validation rows sorted by length,
    val_texts their texts); a regression target's scale; the batch; the precision."""
    tokenizer: object
    model: object
    train_set: object
    val_set: object
    val_texts: np.ndarray
    scale: tuple | None
    batch_size: int
    accumulation: int
    seq_len: int
    dtype: torch.dtype | None
    fp32_attention: bool
    device: str
    world_size: int


def train(job, rows, params, machine, task_metric):
    """Train job on rows with the train section `params`; write its outputs. Returns the paths written
    (None in the processes that do not write); exits with the signal's or pruning's code when stopped."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    world_size, rank = join_processes(params["num_processes"], device)
    say = print if rank == 0 else (lambda *args, **kwargs: None)  # the first process prints and writes
    use_expandable_segments()
    check_compiler(params["compile"], device)
    loaded = load(job, rows, params, device, world_size, rank == 0, say)
    params = {**params, "lr": learning_rate(params["lr"], loaded.model, params["lora_rank"], say)}
    trainer, watch = make_trainer(job, loaded, rows, params, machine, task_metric, rank == 0, say)
    fit(trainer, watch, job, loaded, rank == 0, say)
    return write_outputs(job, loaded, rows, trainer, watch, say) if rank == 0 else None


def load(job, rows, params, device, world_size, main_process, say):
    """The model and its rows, the batch that fits and the precision, each said in the log."""
    set_seed(params["seed"])  # before the model is built: seeds the new classifier head
    shape, labels = job.data.shape, job.data.labels
    four_bit = qlora.loading(autocast_dtype(params["mixed_precision"], device), device) if params["load_in_4bit"] else None
    tokenizer, model = load_model(job.start, labels, job.trust_remote_code, params["dropout"],
                                  params["freeze_embeddings"], shape, job.keep_layers, four_bit)
    if main_process:  # a checkpoint that cannot be saved must stop the run now, not after an hour
        checkpoint.check_writable(job.out["checkpoints"].parent, checkpoint.checkpoint_bytes(model))
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
        (" and their second texts (pairs)" if job.data.processed["pair_columns"] else "") +
        (f"; windows of {len(set(texts[rows.train])):,} / {len(set(texts[val_rows])):,} texts"
         if len(np.unique(texts)) < len(texts) else ""))
    batch_size, accumulation, seq_len = agreed_batch_size(model, train_set.sequences, params, world_size, device)
    dtype = autocast_dtype(params["mixed_precision"], device)
    fp32_attention = attention_in_fp32(device, dtype, model.config._attn_implementation)
    say(f"batch: {batch_size} per step x {accumulation} accumulated" +
        (f" x {world_size} processes" if world_size > 1 else "") +
        f" = {batch_size * accumulation * world_size} per optimizer step; longest batch {seq_len} tokens; "
        f"{describe(params['mixed_precision'], device)}" + ("; the attention in fp32" if fp32_attention else ""))
    return Loaded(tokenizer, model, train_set, val_set, texts[val_rows], scale, batch_size, accumulation, seq_len,
                  dtype, fp32_attention, device, world_size)


@dataclasses.dataclass
class Watch:
    """What fit() and write_outputs() read back from make_trainer()'s callbacks."""
    fingerprint: dict
    resume: object
    live: object
    throughput: Throughput
    scores: ValidationScores | None
    keep: best.KeepBest | None
    reporter: pruning.EvaluationReporter | None
    stop: checkpoint.StopOnSignal
    speed: dict | None = None  # fit() measures it, every process taking part


def start_or_resume(job, loaded, params, main_process, say):
    """(the settings a checkpoint must match, the checkpoint to resume or None, dvclive's Live or None): a
    checkpoint of the same settings is resumed (training/checkpoint.py), its curves replayed into the Live."""
    fingerprint = {**checkpoint.fingerprint(params, job.model_name, loaded.world_size, loaded.batch_size,
                                            loaded.accumulation, checkpoint.file_digest(job.inputs)),
                   # a checkpoint holds its optimizer's state
                   "optimizer": lowmemory.optimizer(params["fused_adamw"], params["adamw_8bit"], loaded.device)[0],
                   **job.settings}
    resume = checkpoint.prepare(fingerprint, job.out["checkpoints"], main_process=main_process)
    live = open_live(resume, job.out["live"]) if main_process else None
    allocator = running_allocator()
    if live:  # the device this run was given (with a queue worker per GPU (README), which one each took)
        live.summary.update(device=loaded.device, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                            allocator=allocator)
    if note := allocator_note(loaded.device, allocator, tcmalloc_library()):
        say(note)
    if params["compile"]:
        say("train.compile: torch.compile; the first batch is slow while the model is compiled, one graph for "
            "every batch shape")
    return fingerprint, resume, live


def make_trainer(job, loaded, rows, params, machine, task_metric, main_process, say):
    """The Trainer of this run, with its callbacks and techniques, and what write_outputs() reads back."""
    shape, labels, model = job.data.shape, job.data.labels, loaded.model
    fingerprint, resume, live = start_or_resume(job, loaded, params, main_process, say)
    val_set = loaded.val_set
    scores = ValidationScores(shape, loaded.scale, loaded.val_texts) if val_set else None  # windows: each text once
    callbacks = [*([LiveCallback(live=live)] if live else []), FiniteLoss(loaded.dtype, params["lr"])]
    if params["compile"]:
        callbacks.append(EveryShapeAtOnce())
    if params["evaluations"] != "epoch" and val_set:
        callbacks.append(pruning.EvaluateEvenly(params["evaluations"]))
    keep = None  # train.keep_best, train.patience
    if (params["keep_best"] or params["patience"]) and val_set:
        callbacks.append(keep := best.KeepBest(model, scores, competition_metric(task_metric, shape.kind),
                                               shape.outputs(labels), params["keep_best"], params["patience"], resume))
    reporter = None
    if job.trial and job.trial.by == "evaluation":
        n = params["evaluations"] if params["evaluations"] != "epoch" else math.ceil(params["epochs"])
        callbacks.append(reporter := pruning.EvaluationReporter(job.trial, n, main_process))
    args = training_arguments(params, machine, str(job.out["checkpoints"]), loaded.device, loaded.batch_size,
                              loaded.accumulation)
    if not val_set:
        args.eval_strategy = "no"
    learned = [rows.targets[i] for i in rows.train]
    if rows.soft and shape.kind == "classification":  # class weights count each row's likeliest class
        learned = [int(np.argmax(t)) for t in learned]
    # the loss, layer-wise rates, weight averaging, adversarial passes: each on when its setting says
    extra, averaging = techniques.plug_in(params, model, args, shape, shape.outputs(labels), learned, resume, say)
    stop = checkpoint.StopOnSignal(verbose=main_process, save_every=60 * machine["checkpoint_minutes"])
    trainer = CountingTrainer(
        model=model, args=args, train_dataset=loaded.train_set, eval_dataset=val_set,
        data_collator=make_collator(loaded.tokenizer, loaded.device), compute_metrics=scores,
        callbacks=[*callbacks, *averaging, stop, ProgressLog(shown=shape.progress)],
        throughput=(throughput := Throughput()), **extra)
    trainer.remove_callback(PrinterCallback)  # it prints a dict per log; ProgressLog prints for people
    return trainer, Watch(fingerprint, resume, live, throughput, scores, keep, reporter, stop)


def fit(trainer, watch, job, loaded, main_process, say):
    """Train (from the checkpoint to resume, if any) and evaluate the final model on the validation rows.
    A signal saves a checkpoint and exits with the signal's code; a pruned trial exits writing nothing."""
    stop, reporter = watch.stop, watch.reporter
    # the attention in fp32 for the evaluations too, the one after training included, and back for saving
    with stop, in_fp32(loaded.model, loaded.fp32_attention):
        try:
            trainer.train(resume_from_checkpoint=str(watch.resume) if watch.resume else None)
            pruned = reporter is not None and reporter.pruned
            if loaded.val_set and not stop.stopped and not pruned and not evaluated_at_end(trainer.state):
                trainer.evaluate()  # the out-of-fold predictions
        except torch.cuda.OutOfMemoryError:
            raise PipelineError(out_of_memory_in_training(loaded.batch_size, loaded.seq_len)) from None
    state = trainer.state
    if stop.stopped:
        say(f"stopped by {signal.Signals(stop.stopped).name} at step {state.global_step} of {state.max_steps}; "
            f"saved a checkpoint in {job.out['checkpoints']}: rerun to resume from it")
        sys.exit(128 + stop.stopped)  # the shell's convention for "ended by this signal"
    if pruned:  # nothing is written: a half-trained model must not become the cached result of these params
        if main_process:
            checkpoint.remove(job.out["checkpoints"])
        trial = job.trial
        say(f"pruned: trial {trial.number} of study {trial.study!r} stopped at evaluation {reporter.pruned} "
            f"of {reporter.n} (step {state.global_step} of {state.max_steps}), its validation {trial.metric} "
            f"{watch.scores.latest.get(trial.metric, float('nan')):.4f} too low to go on")
        say(f"train@{job.fold}: pruned in {seconds_since_start():.1f} s")
        sys.exit(pruning.PRUNED_EXIT_CODE)
    # every process takes part in the sums and maxima of the speed figures
    watch.speed = {**watch.throughput.summary(), **peak_memory(), "batch_size": loaded.batch_size,
                   "gradient_accumulation_steps": loaded.accumulation, "processes": loaded.world_size}
    if watch.keep:  # train.keep_best: the best evaluation's weights and out-of-fold outputs
        say(watch.keep.finish())


def write_outputs(job, loaded, rows, trainer, watch, say):
    """The model folder (pipeline.json beside it), the out-of-fold outputs and the metrics; the checkpoints
    removed; with a tuning trial by fold, the fold's score reported. Returns the paths written."""
    shape, labels, out, live = job.data.shape, job.data.labels, job.out, watch.live
    print(speed_line(watch.speed))
    if trainer.adversary:
        print(techniques.adversary_line(trainer.adversary, trainer.state.global_step * loaded.accumulation))
    for name, value in watch.speed.items():
        live.log_metric(f"speed/{name}", value, plot=False)
    if watch.keep:
        live.summary["kept_evaluation"] = watch.keep.summary()
    live.make_summary()
    run = {**job.data.processed, "labels": labels, **job.data.tokenized,
           "token_types": rows.token_types is not None, "target_scale": loaded.scale,
           # the test rows are predicted as the validation rows were: batches of this size, in this precision,
           # the attention in fp32 where it trained so
           "predict_batch_size": 2 * loaded.batch_size, "precision": str(loaded.dtype or torch.float32).removeprefix("torch."),
           "fp32_attention": loaded.fp32_attention, "compiled": trainer.args.torch_compile,
           "trust_remote_code": job.trust_remote_code,  # the model's own Python files, saved beside it, load it
           # a distilled student is one model, not a fold; "run": the same in every fold of a run
           "fold": job.fold, "folds": 1 if job.fold is None else job.data.fold_count,
           "run": checkpoint.file_digest(job.run_inputs) if job.run_inputs else watch.fingerprint["data sha256"]}
    written = [out["model"], out["live"]]
    if loaded.val_set or job.after:
        with atomic_dir(out["predictions"]) as tmp:
            if loaded.val_set:
                scores = watch.scores  # one row per text
                oof = windows.mean_by_text(shape.activate(scores.logits, loaded.scale), loaded.val_texts)
                folds.write_probabilities(folds.probabilities_frame(*oof, shape.outputs(labels)), tmp / "oof.csv")
            if job.after:
                job.after(tmp, loaded.tokenizer, loaded.model, run)
        written.insert(1, out["predictions"])
    with atomic_dir(out["model"]) as tmp:
        lora.merged(loaded.model).save_pretrained(tmp)  # LoRA's adapters merged into the weights: a plain model
        loaded.tokenizer.save_pretrained(tmp)
        write_json(tmp / PIPELINE, run)
    checkpoint.remove(out["checkpoints"])
    if job.trial and job.trial.by == "fold":  # written: the fold's score may now count against the trial
        pruning.report_fold(job.trial, job.fold, watch.scores.latest.get(job.trial.metric, float("nan")),
                            trainer.state.global_step)
    return written
