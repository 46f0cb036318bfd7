"""pseudo: student fold K, trained again on fold K's training rows plus test rows pseudo-labelled by
teacher fold K.

`python -m stages.pseudo --fold K`; dvc.yaml runs it once per item of pseudo.folds, as stage pseudo@K
(none by default: pseudo.folds is []). A family of its own after the teachers (DVC has no cycles).
Reads what train@K reads, plus data/tokenized/test.safetensors and predictions/test/fold-K.csv: teacher
fold K's own test outputs, not the ensemble's (training/pseudo.py says why). pseudo.labels soft: the
outputs (probabilities, or values) are the targets; hard: the likeliest class (multi-label: each class's
0/1) of the test rows the teacher is pseudo.threshold sure of. pseudo.share: the share of test rows drawn.
The student starts from the teachers' start model and trains with the same train.* settings, and is
validated on fold K's rows: its out-of-fold outputs are as honest as the teachers'.
Writes students/pseudo/fold-K/model (a model folder, as models/fold-K), students/pseudo/fold-K/predictions/
{oof.csv, test.csv, pseudo_labels.csv} (its validation and test outputs, and the targets it learned for the test rows,
in the prediction files' form) and reports/pseudo/fold-K (its curves). Checkpoints into
<machine.checkpoint_dir>/pseudo-fold-K, resumed as train's are.
"""
import sys
from pathlib import Path

import transformers
from safetensors.torch import load_file

from modeling.models import model_params, resolve_model
from pipeline.command import interactive, run_main
from pipeline.settings import SEEDS, PipelineError, Range, load_params
from predicting import folds
from predicting.inference import fold_outputs
from reading import windows
from reading.tokens import unpack_flat, unpack_sequences
from tasks.shapes import SHAPES
from training import checkpoint
from training.pretrained import start_model
from training.rows import (TOKENIZED, fold_rows, pseudo_labels, read_train_file, read_training_data, soft_rows,
                           with_test_rows)
from training.run import Job, train
from training.settings import parse_fold, train_settings

STUDENTS = Path("students/pseudo")
# what each pseudo.* key accepts
PSEUDO_PARAMS = {"folds": (list,), "labels": ("soft", "hard"), "threshold": (float, Range(0.5, 1)),
                 "share": (float, Range(0, 1, low_open=True)), "seed": (int, SEEDS)}


def outputs(fold):
    """Where student fold `fold` writes."""
    return {"model": STUDENTS / f"fold-{fold}" / "model", "predictions": STUDENTS / f"fold-{fold}" / "predictions",
            "live": Path(f"reports/pseudo/fold-{fold}")}


def check_settings(pseudo, kind):
    """The combinations load_params cannot see, in one line."""
    if pseudo["labels"] == "hard" and SHAPES[kind].confident is None:
        raise PipelineError(f"params.yaml: pseudo.labels hard needs classes; task.kind {kind} has values: use soft")


def main():
    fold = parse_fold(sys.argv[1:], "python -m stages.pseudo", "train student fold K on teacher K's pseudo-labels")
    pseudo = load_params("pseudo", PSEUDO_PARAMS)
    params, machine, task_metric = train_settings()
    model = model_params()
    data = read_training_data(fold, "pseudo.folds")
    shape, labels = data.shape, data.labels
    check_settings(pseudo, shape.kind)
    if not interactive():
        transformers.utils.logging.disable_progress_bar()
    teacher_file = folds.outputs(fold)["test"]
    if not (TOKENIZED / "test.safetensors").exists():
        raise PipelineError("pseudo.folds: pseudo-labels need test rows, and there is no test file (fetch.test_file)")
    teacher_rows, teacher = folds.read_probabilities(teacher_file, shape.outputs(labels))  # teacher K's, not the mean
    picked, targets = pseudo_labels(teacher, shape, pseudo["labels"], pseudo["threshold"], pseudo["share"], pseudo["seed"])
    if not len(picked):
        raise PipelineError(f"pseudo.threshold {pseudo['threshold']:g}: teacher fold {fold} is that sure of none of "
                            f"its {len(teacher):,} test rows; lower it, or use pseudo.labels soft")
    rows = fold_rows(read_train_file(), data.row_folds, fold)
    rows = soft_rows(rows, shape, labels) if shape.soft else rows
    test_tensors = load_file(TOKENIZED / "test.safetensors")
    rows = with_test_rows(rows, test_tensors, teacher_rows[picked], targets, shape)
    print(f"student fold {fold}: {len(picked):,} of {len(teacher):,} test rows pseudo-labelled by teacher fold {fold} "
          f"({pseudo['labels']} labels" + (f", at least {pseudo['threshold']:g} sure" if pseudo["labels"] == "hard" else "")
          + f", share {pseudo['share']:g})")
    test_sequences, test_types = unpack_sequences(test_tensors)[0], unpack_flat(test_tensors, "token_type_ids")
    test_texts = windows.text_of_row(test_tensors)

    def after(folder, tokenizer, trained, run):  # the student's test outputs, and the targets it learned
        predicted = fold_outputs(tokenizer, trained, run, test_sequences, test_types, trained.device.type, texts=test_texts)
        folds.write_probabilities(folds.probabilities_frame(range(len(predicted)), predicted, shape.outputs(labels)),
                                  folder / "test.csv")
        folds.write_probabilities(folds.probabilities_frame(teacher_rows[picked], targets, shape.outputs(labels)),
                                  folder / "pseudo_labels.csv")

    common = [*data.files, TOKENIZED / "test.safetensors"]
    job = Job(f"student fold {fold}", fold, {**outputs(fold), "checkpoints": checkpoint.folder(f"pseudo-fold-{fold}",
                                                                                             machine["checkpoint_dir"])},
              start=start_model(resolve_model(model["name"])), model_name=model["name"], data=data,
              inputs=[*common, teacher_file], trust_remote_code=model["trust_remote_code"], run_inputs=common,
              after=after, settings={f"pseudo.{k}": v for k, v in pseudo.items() if k != "folds"})
    return train(job, rows, params, machine, task_metric)


if __name__ == "__main__":
    run_main(main)
