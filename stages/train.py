"""train: fine-tune the model on one fold's training rows with transformers' Trainer.

`python -m stages.train --fold K`; dvc.yaml runs it once per item of cv.folds, as stage train@K.
Reads data/tokenized/{train.safetensors,settings.json}, data/split/folds.csv (fold K validates on the
rows marked K and trains on all the others) and data/processed/{labels.json,shape.json}: the task shape
(tasks/shapes.py) gives the number of outputs, the loss and the scores of each evaluation. Writes, for fold K:
- models/fold-K: weights (safetensors), tokenizer, label mapping in config.json, and pipeline.json:
  how the data was read, cleaned and tokenized, which python -m predict and the predict_test
  stage read (the test rows are predicted there, so a new test file retrains nothing);
- predictions/fold-K: oof.csv, the outputs (class probabilities, or values) of the rows it validated
  on (its final evaluation; with train.keep_best its best by task.metric, whose weights models/fold-K
  then holds: training/best.py);
- reports/train/fold-K: the training curves (dvclive: loss, learning rate, validation scores, epoch time,
  and speed/*: examples and real tokens per second, padding, peak memory, batch size, processes).
With the pretrain stage on (pretrain.epochs > 0), every fold starts from its model (models/pretrained)
instead of model.name's. The training itself is training/run.py's, which the pseudo and distill stages'
students share: the precision from the hardware, the batch size probed to fit a GPU, checkpoints every
machine.checkpoint_minutes into <machine.checkpoint_dir>/fold-K (a rerun with the same settings resumes;
Ctrl-C or SIGTERM saves one before stopping), train.num_processes processes under torchrun.
The machine section holds what this machine needs and the result does not depend on: no stage declares it
in dvc.yaml, so changing it reruns nothing.
"""
import os
import sys

import transformers

from modeling.models import model_params, resolve_model
from pipeline.command import interactive, run_main, seconds_since_start
from predicting import folds
from training import checkpoint, pruning
from training.pretrained import start_model
from training.rows import fold_rows, read_train_file, read_training_data
from training.run import Job, train
from training.settings import parse_fold, train_settings


def main():
    fold = parse_fold(sys.argv[1:])
    params, machine, task_metric = train_settings()
    model = model_params()
    if not interactive():  # bars of weights loaded and written, downloads: one endless line in a log
        transformers.utils.logging.disable_progress_bar()
    data = read_training_data(fold, "--fold")
    trial = pruning.TrialLink.from_env()  # set by python -m tune: this run is a trial of a study
    if trial and trial.by == "fold" and os.environ.get("RANK", "0") == "0" and pruning.prune_at_fold(trial, fold):
        print(f"pruned: trial {trial.number} of study {trial.study!r} scored too low on the folds before "
              f"fold {fold}, which does not start")
        print(f"train@{fold}: pruned in {seconds_since_start():.1f} s")
        sys.exit(pruning.PRUNED_EXIT_CODE)
    rows = fold_rows(read_train_file(), data.row_folds, fold)
    job = Job(f"fold {fold}", fold, {**folds.outputs(fold), "checkpoints": checkpoint.folder(fold, machine["checkpoint_dir"])},
              start=start_model(resolve_model(model["name"])), model_name=model["name"], data=data,
              inputs=data.files, trust_remote_code=model["trust_remote_code"], trial=trial)
    return train(job, rows, params, machine, task_metric)


if __name__ == "__main__":
    run_main(main)
