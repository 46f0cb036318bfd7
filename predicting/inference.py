"""Predicting with trained folds, for the predict_test stage and python -m predict: loading a
fold's model with the settings its train stage saved beside it (pipeline.json), and running it over
token ids in length-sorted batches."""
import json
from pathlib import Path

import numpy as np
import torch

from modeling.models import load_trained, load_trained_tokenizer, make_collator
from modeling.precision import cpu_autocast_dtype, cpu_isa, in_fp32
from pipeline.settings import PipelineError
from reading.windows import mean_by_text
from tasks.shapes import SHAPES

PIPELINE = "pipeline.json"  # beside each trained model: how its data was read, cleaned and tokenized


@torch.inference_mode()
def predict_logits(model, collator, sequences, batch_size, device, dtype=None, token_types=None):
    """Logits (n, outputs) in input order, in float32. Batches hold texts of similar length
    (sorted by length), so padding each batch to its own longest text wastes little. token_types:
    the segment ids of text pairs."""
    model.eval()
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    logits = torch.empty(len(sequences), model.config.num_labels)
    for start in range(0, len(order), batch_size):
        batch_index = order[start:start + batch_size]
        examples = [{"input_ids": sequences[i]} if token_types is None else
                    {"input_ids": sequences[i], "token_type_ids": token_types[i]} for i in batch_index]
        batch = collator(examples).to(device)
        with torch.autocast(torch.device(device).type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits[batch_index] = model(**batch).logits.float().cpu()
    return logits


def read_run(folder):
    """pipeline.json of a trained fold: a one-line error for a folder the train stage did not write."""
    path = Path(folder) / PIPELINE
    if not path.is_file():
        what = "does not exist" if not Path(folder).is_dir() else f"holds no {PIPELINE}, so it was not written by this pipeline's train stage"
        raise PipelineError(f"{folder} {what}: train it with `dvc repro` first")
    run = json.loads(path.read_text(encoding="utf-8"))
    if run.get("kind") not in SHAPES:
        raise PipelineError(f"{path}: names no task shape this pipeline knows ({run.get('kind')!r})")
    return run


def fold_folders(models):
    """The fold folders of the trained run in `models` (models/fold-0 ... fold-K-1, K from fold-0's
    pipeline.json, so folders left by an earlier run with more folds are not used) and each fold's
    pipeline.json; every fold must come from one run (the same data, split and settings). What is a
    fold's own (a regression target's scale, from its own training rows) is read from its own."""
    first = read_run(Path(models) / "fold-0")
    folders = [Path(models) / f"fold-{k}" for k in range(first["folds"])]
    runs = [first]
    for folder in folders[1:]:
        runs.append(run := read_run(folder))
        if run["run"] != first["run"] or run["kind"] != first["kind"]:
            raise PipelineError(f"{folder} and {folders[0]} were trained on other data, splits or task shapes "
                                "(their pipeline.json differ): rerun `dvc repro` so that every fold is of one run")
    return folders, runs


def prediction_dtype(run, device):
    """The autocast dtype to predict in: the one the model was trained (and its validation rows
    predicted) in, from pipeline.json, where this device has it; else fp32."""
    trained = getattr(torch, run["precision"])
    if torch.device(device).type == "cuda":  # "cuda", or one GPU of several: "cuda:1"
        supported = trained == torch.float16 or (trained == torch.bfloat16 and torch.cuda.is_bf16_supported())
    else:
        supported = trained == torch.bfloat16 and cpu_autocast_dtype(cpu_isa()) == torch.bfloat16
    return trained if supported else None


def predicted_in_fp32(trained_in_fp32, device, dtype):
    """Whether a run's rows are predicted with the attention in fp32: where the run trained so (its
    pipeline.json's fp32_attention) and they are predicted as it trained, on a CPU in bf16 autocast."""
    return bool(trained_in_fp32) and torch.device(device).type == "cpu" and dtype == torch.bfloat16


def load_tokenizer(folder, run):
    """(tokenizer, config) of a trained fold: what tokenizing for it needs, without its weights."""
    from transformers import AutoConfig

    remote_code = run.get("trust_remote_code", False)
    return load_trained_tokenizer(folder, remote_code), AutoConfig.from_pretrained(folder, trust_remote_code=remote_code)


def load_fold(folder, run, device):
    """(tokenizer, model) of a trained fold, on `device`, checked against its pipeline.json."""
    import transformers

    from pipeline.command import interactive

    if not interactive():  # the bar of weights loaded: one endless line in a log
        transformers.utils.logging.disable_progress_bar()
    tokenizer, model = load_trained(folder, run.get("trust_remote_code", False))
    model.to(device)
    expected = SHAPES[run["kind"]].problem_type
    if model.config.problem_type != expected:
        raise PipelineError(f"{folder}: the model's config.json says {model.config.problem_type}, its {PIPELINE} "
                            f"{run['kind']} ({expected}): the folder mixes two runs; rerun `dvc repro`")
    return tokenizer, model


def fold_outputs(tokenizer, model, run, sequences, token_types, device, batch_size=None, texts=None):
    """The outputs of one trained fold (load_fold's) for token ids: class probabilities, or values in the
    target's units (pipeline.json's target_scale undoes the standardisation the model was trained with).
    texts: the text of each row (tokenize.truncation windows); each text's outputs are then the mean of
    its rows', one row per text in text order."""
    collator = make_collator(tokenizer, device)
    dtype = prediction_dtype(run, device)
    with in_fp32(model, predicted_in_fp32(run.get("fp32_attention"), device, dtype)):
        logits = predict_logits(model, collator, sequences, batch_size or run["predict_batch_size"], device, dtype,
                                token_types)
    outputs = SHAPES[run["kind"]].activate(logits, run["target_scale"])
    if texts is None or len(np.unique(texts)) == len(texts):  # one row per text, in order
        return outputs
    return mean_by_text(outputs, texts)[1]
