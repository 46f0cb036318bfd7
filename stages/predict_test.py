"""predict_test: every trained fold's outputs for the test rows.

Reads data/tokenized/test.safetensors (tokenized as the train rows were, with the same max_length),
data/split/folds.csv (how many folds) and models/fold-K with its pipeline.json; writes
predictions/test/fold-K.csv for each fold: `row` and the fold's outputs (class probabilities, or a
value), in the form of predictions/fold-K/oof.csv. A stage of its own after training, so that a new
or corrected test file reruns this and evaluate and retrains nothing. Without a test file the folder is
written empty (DVC needs its declared output).
"""
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from pipeline.command import run_main
from pipeline.outputs import atomic_dir
from pipeline.settings import PipelineError
from predicting import folds
from predicting.inference import fold_folders, fold_outputs, load_fold
from reading.tokens import unpack_flat, unpack_sequences
from reading.windows import text_of_row
from tasks.shapes import SHAPES

TEST = Path("data/tokenized/test.safetensors")
MODELS = Path("models")


def main():
    k = folds.fold_count(folds.read_folds())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with atomic_dir(folds.TEST_PREDICTIONS) as tmp:
        if not TEST.exists():
            print("no test file (fetch.test_file): nothing to predict")
            return [folds.TEST_PREDICTIONS]
        tensors = load_file(TEST)
        sequences, token_types = unpack_sequences(tensors)[0], unpack_flat(tensors, "token_type_ids")
        texts = text_of_row(tensors)  # tokenize.truncation windows: several rows of a text, averaged back to it
        folders, runs = fold_folders(MODELS)
        if len(folders) != k:
            raise PipelineError(f"{MODELS}/fold-0 was trained in a run of {len(folders)} fold(s), and {folds.FOLDS_CSV} "
                                f"has {k}: rerun `dvc repro`")
        for fold, (folder, run) in enumerate(zip(folders, runs)):  # each fold with its own pipeline.json
            tokenizer, model = load_fold(folder, run, device)
            start = time.perf_counter()
            outputs = fold_outputs(tokenizer, model, run, sequences, token_types, device, texts=texts)
            seconds = time.perf_counter() - start
            print(f"fold {fold}: {len(outputs):,} test rows in {seconds:.1f} s ({len(outputs) / seconds:,.0f} rows/s) "
                  f"on {device}")
            frame = folds.probabilities_frame(range(len(outputs)), outputs, SHAPES[run["kind"]].outputs(run["labels"]))
            folds.write_probabilities(frame, tmp / folds.outputs(fold)["test"].name)
    return [folds.TEST_PREDICTIONS]


if __name__ == "__main__":
    run_main(main)
