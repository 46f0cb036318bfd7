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
With the pretrain stage on (pretrain.epochs > 0), every fold starts from its model (models/pretrained)
instead of model.name's. The training itself is training/fold.py's, which the students of the pseudo and
distill stages share.
Runs on the GPU when there is one (mixed precision, batch size probed to fit), else on the CPU (bf16
where the CPU has bf16 instructions, else fp32); train.mixed_precision: false keeps fp32 on both.
train.compile hands the model to torch.compile (through Trainer's torch_compile settings).
Gradient checkpointing, LoRA and 8-bit AdamW (training/lowmemory.py) fit a big encoder on a small GPU; the
batch-size probe runs with them applied. A LoRA model is saved merged: a plain model for predicting.

On a CPU where tcmalloc was measured faster (machine.allocator auto), a run long enough to repay it starts
itself again under tcmalloc, where installed, before it loads the model: the same results, sooner
(training/allocator.py).
Checkpoints every machine.checkpoint_minutes into <machine.checkpoint_dir>/fold-K; a rerun with the
same settings resumes from the newest, and Ctrl-C or SIGTERM saves one before stopping
(training/checkpoint.py). The machine section holds what this machine needs and the result does not
depend on: no stage declares it in dvc.yaml, so changing it reruns nothing.
With train.num_processes N > 1 it relaunches itself under torchrun: N processes, one per GPU,
each with its share of every batch (DistributedDataParallel); only the first writes outputs.
"""
import json
import os
import sys
from pathlib import Path

import transformers
from safetensors.torch import load_file

from training.run import Job, fold_rows, start_again_where_it_pays, train
from training.settings import MACHINE_PARAMS, TRAIN_PARAMS, parse_fold, train_settings  # noqa: F401 (tune reads TRAIN_PARAMS here)
from pipeline.command import interactive, run_main, seconds_since_start
from pipeline.settings import PipelineError
from predicting import folds
from tasks.shapes import SHAPES
from training import checkpoint, pruning
from modeling.models import model_params, resolve_model
from training.pretrained import start_model

TOKENIZED = Path("data/tokenized")
LABELS = Path("data/processed/labels.json")
SHAPE = Path("data/processed/shape.json")
def main():
    fold = parse_fold(sys.argv[1:])
    params, machine, task_metric = train_settings()
    model = model_params()
    if not interactive():  # bars of weights loaded and written, downloads: one endless line in a log
        transformers.utils.logging.disable_progress_bar()
    labels = json.loads(LABELS.read_text(encoding="utf-8"))
    row_folds = folds.read_folds()
    fold_count = folds.fold_count(row_folds)
    if not 0 <= fold < fold_count:
        raise PipelineError(f"--fold {fold}: {folds.FOLDS_CSV} has folds 0 to {fold_count - 1} "
                            "(cv.folds): rerun `dvc repro split`, or pick one of those")
    data = json.loads(SHAPE.read_text(encoding="utf-8"))  # the task shape, and how the texts were read
    trial = pruning.TrialLink.from_env()  # set by python -m tune: this run is a trial of a study
    if trial and trial.by == "fold" and os.environ.get("RANK", "0") == "0" and pruning.prune_at_fold(trial, fold):
        print(f"pruned: trial {trial.number} of study {trial.study!r} scored too low on the folds before "
              f"fold {fold}, which does not start")
        print(f"train@{fold}: pruned in {seconds_since_start():.1f} s")
        sys.exit(pruning.PRUNED_EXIT_CODE)

    rows = fold_rows(load_file(TOKENIZED / "train.safetensors"), row_folds, fold)
    # a long enough run on a CPU measured faster under tcmalloc starts again under it, before any model is loaded
    start_again_where_it_pays(rows, params, machine)
    job = Job(f"fold {fold}", fold, {**folds.outputs(fold), "checkpoints": checkpoint.folder(fold, machine["checkpoint_dir"])},
              start=start_model(resolve_model(model["name"])), model_name=model["name"], data=data, labels=labels,
              inputs=[TOKENIZED / "train.safetensors", TOKENIZED / "settings.json", LABELS, SHAPE, folds.FOLDS_CSV],
              shape=SHAPES[data["kind"]], trust_remote_code=model["trust_remote_code"], trial=trial, fold_count=fold_count)
    settings_json = json.loads((TOKENIZED / "settings.json").read_text(encoding="utf-8"))
    return train(job, rows, params, machine, task_metric, settings_json)


if __name__ == "__main__":
    run_main(main)
