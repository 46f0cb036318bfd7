"""python -m predict: label any CSV with the trained fold ensemble, as the pipeline labels its
test file.

    python -m predict new.csv --out predictions.csv
    python -m predict new.csv --out predictions.csv --probabilities probabilities.csv
    python -m predict new.csv --out predictions.csv --student small   # a distilled student alone

A tool beside the stages, not one of them: it writes only --out (and --probabilities), never the
pipeline's outputs or dvc.lock. Everything it applies comes from the trained run, not from params.yaml:
each models/fold-K/pipeline.json (the text columns, the cleaning steps, max_length, the task shape,
the precision), data/processed/submission.json (the submission's columns and the id column, when this
folder holds the run's data) and, for multi-label, the threshold evaluate chose
(reports/evaluate/metrics.json). The rows go through each fold's model in length-sorted batches, in
bf16 where the training used it and this machine has it, the folds shared out over every GPU present; the
folds' outputs are averaged. Before that it says how long the work will take, timed on a sample of the rows.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from modeling.families import takes_segment_ids
from pipeline.command import run_main
from pipeline.settings import PipelineError
from predicting.devices import estimate, predict_on_devices, prediction_devices
from predicting.folds import DECIMALS
from predicting.inference import fold_folders, load_tokenizer, read_run
from reading.cleaning import as_steps, clean_test_frame
from reading.csvfiles import read_csv, require_columns
from reading.tokens import model_inputs, tokenize_rows
from reading.windows import Cutting
from tasks.shapes import SHAPES
from tasks.submission import submission_frame

PROCESSED = Path("data/processed")
METRICS = Path("reports/evaluate/metrics.json")
# what the pipeline writes (dvc.yaml's outputs and the train stage's checkpoints): never an --out
PIPELINE_FOLDERS = ("data", "models", "predictions", "reports", "submission", "checkpoints")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m predict", description="label a CSV with the trained folds")
    parser.add_argument("file", type=Path, help="a CSV with the columns the model was trained on (as test.csv)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the predictions, in the submission's form")
    parser.add_argument("--probabilities", type=Path, help="also write the class probabilities here (not for regression)")
    parser.add_argument("--models", type=Path, default=Path("models"), help="the trained folds (default: models)")
    parser.add_argument("--student", help="a distilled student (a key of distill.students) alone, instead of the folds")
    parser.add_argument("--id-column", help="the file's id column (default: the test file's, preprocess.id_column "
                        "of the run; none: row numbers)")
    parser.add_argument("--threshold", type=float, help="multi-label: the decision threshold (default: the one "
                        f"evaluate chose, in {METRICS})")
    parser.add_argument("--batch-size", type=int, help="rows per batch (default: twice the training batch)")
    return parser.parse_args(argv)


def check_out(path):
    """--out must not be (inside) one of the pipeline's outputs: DVC would find it changed."""
    inside = next((f for f in PIPELINE_FOLDERS if Path(f).resolve() in (path.resolve(), *path.resolve().parents)), None)
    if inside:
        raise PipelineError(f"--out {path} is inside {inside}/, which the pipeline writes; write it elsewhere")


def submission_form(run, shape, models):
    """(header, id column, class columns hold probabilities) of the run's submission: data/processed's
    when it is this run's (same task shape), else the shape's default form."""
    path = PROCESSED / "submission.json"
    separated = run["label_separator"] is not None or shape.kind != "multilabel"
    if path.is_file() and (PROCESSED / "shape.json").is_file():
        workspace = json.loads((PROCESSED / "shape.json").read_text(encoding="utf-8"))
        if workspace["kind"] != run["kind"]:
            raise PipelineError(f"the models in {models} were trained for {run['kind']}, but {PROCESSED} holds "
                                f"{workspace['kind']} data: rerun `dvc repro`, or pass --models of a {workspace['kind']} run")
        form = json.loads(path.read_text(encoding="utf-8"))
        return form["header"], form["id_column"], form["probabilities"]
    return shape.default_header(run["labels"], separated), None, False


def threshold_of(run, option):
    """The multi-label threshold: --threshold, else the one evaluate chose on the run's validation rows."""
    if option is not None or run["kind"] != "multilabel":
        return option
    try:
        metrics = json.loads(METRICS.read_text(encoding="utf-8"))
        return next(m["threshold"] for split, m in metrics.items() if split in ("val", "oof"))
    except (OSError, ValueError, StopIteration, KeyError):
        raise PipelineError(f"multi-label predictions need the decision threshold evaluate chose ({METRICS}, from "
                            "`dvc repro`); or pass --threshold") from None


def write_atomically(frame, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        frame.to_csv(tmp, index=False, float_format=DECIMALS)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def tokenized(rows, folder, run, file):
    """(token ids, segment ids or None, the text of each row) of the rows, cut as the run's tokenize stage cut
    them (windows: several rows of a text), with the tokenizer every fold saved."""
    tokenizer, config = load_tokenizer(folder, run)
    inputs = model_inputs(rows, tokenizer)
    texts, pairs = inputs if isinstance(inputs, tuple) else (inputs, None)
    types = takes_segment_ids(tokenizer, config, pairs is not None)
    try:
        sequences, token_types, row_texts, _ = tokenize_rows(tokenizer, texts, run["max_length"], pairs, types,
                                                             Cutting.of(run))
    except ValueError as error:  # a row the run's tokenize.truncation cannot cut
        raise PipelineError(f"{file} {error} (the run's tokenize.truncation {run['truncation']})") from None
    return sequences, token_types, np.asarray(row_texts)


def say_estimate(folders, runs, sequences, token_types, devices, batch_size):
    """The time it will take, from the first model on a sample of the rows, said before the work starts."""
    rate, seconds = estimate(folders[0], runs[0], sequences, token_types, devices[0], len(folders), len(devices),
                             batch_size)
    took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"
    print(f"{folders[0].name}: {rate:,.1f} rows/s on {devices[0]} (a sample of the rows); the {len(folders)} model(s) "
          f"take about {took} on {len(devices)} device(s)")


def main():
    args = parse_args(sys.argv[1:])
    check_out(args.out)
    if args.probabilities:
        check_out(args.probabilities)
    if args.student:  # one smaller model, for when prediction time is short (the distill stage)
        folder = Path("students/distill") / args.student / "model"
        folders, runs = [folder], [read_run(folder)]
    else:
        folders, runs = fold_folders(args.models)
    run = runs[0]  # what every fold of a run shares: the data's columns, cleaning, tokenizing, task shape
    shape = SHAPES[run["kind"]]
    header, id_column, probabilities = submission_form(run, shape, args.models)
    id_column = args.id_column or id_column
    threshold = threshold_of(run, args.threshold)
    if args.probabilities and shape.kind == "regression":
        raise PipelineError("--probabilities: a regression model predicts values, not probabilities")
    if not args.file.is_file():
        raise PipelineError(f"{args.file} does not exist")
    start = time.perf_counter()

    raw = read_csv(args.file)
    needed = run["text_columns"] + run["pair_columns"] + ([id_column] if id_column else [])
    require_columns(raw, needed, args.file, f"the model reads {', '.join(needed)}; --id-column names another id column")
    if raw.empty:
        raise PipelineError(f"{args.file}: a header ({', '.join(map(repr, raw.columns))}) but no rows")
    # a run trained before preprocess.steps holds its cleaning switches: as_steps reads those too
    rows = clean_test_frame(raw, run["text_columns"], id_column, as_steps(run["cleaning"]), run["pair_columns"])
    sequences, token_types, row_texts = tokenized(rows, folders[0], run, args.file)
    devices = prediction_devices()
    where = devices[0] if len(devices) == 1 else f"{len(devices)} GPUs"
    print(f"predicting {len(rows):,} rows ({sum(map(len, sequences)):,} tokens) with {len(folders)} model(s) on {where}")
    say_estimate(folders, runs, sequences, token_types, devices, args.batch_size)
    begin = time.perf_counter()
    # each fold's own pipeline.json: a regression target's scale is its own training rows'
    outputs = predict_on_devices(folders, runs, sequences, token_types, row_texts, devices, args.batch_size)
    predicting = time.perf_counter() - begin
    mean = np.mean(outputs, axis=0)
    frame = submission_frame(shape, rows["id"], mean, run["labels"], header, threshold, run["label_separator"],
                             probabilities)
    write_atomically(frame, args.out)
    written = [args.out]
    if args.probabilities:
        write_atomically(pd.concat([rows[["id"]], pd.DataFrame(mean, columns=run["labels"])], axis=1), args.probabilities)
        written.append(args.probabilities)
    print(f"predicted {len(rows):,} rows with " + (f"student {args.student}" if args.student else f"{len(folders)} fold(s)") +
          f" on {where}: {len(rows) / predicting:,.0f} rows/s "
          f"through the models ({predicting:.1f} s); {len(rows) / (time.perf_counter() - start):,.0f} rows/s with "
          "reading, cleaning, tokenizing and loading the models")
    return written


if __name__ == "__main__":
    run_main(main, tool="predict")
