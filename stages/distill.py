"""distill: one smaller student that learns what the fold ensemble outputs, for when prediction time is short.

`python -m stages.distill --student NAME`; dvc.yaml runs it once per key of distill.students, as stage
distill@NAME (none by default: distill.students is {}). Each student is {model: a model name or folder
(null: the teachers' start model), layers: keep its first N encoder layers (null: all)}; it must be
smaller than the teachers; a student whose tokenizer has another vocabulary than theirs (a small encoder
learning from an LLM's folds) reads the processed texts tokenized by its own, cut as the teachers' were.
It trains with the train.* settings but distill.epochs and distill.lr.
Its targets are every training row's out-of-fold outputs (class probabilities, or values), each made by
the one teacher that did not train on that row; with distill.test_rows also the test rows' ensemble
outputs. It validates on nothing: evaluate scores it on a labelled test file beside the ensemble and a
single fold, and always reports how often it agrees with the ensemble.
Writes students/distill/NAME/model (a model folder: `python -m predict FILE --out OUT --student NAME` uses
it alone), students/distill/NAME/predictions/{test.csv, speed.json} (its test outputs; its rows/s against the ensemble's
on the same rows, measured here one after the other; with distill.test_rows also test_targets.csv, what it learned
of the test rows) and reports/distill/NAME (its curves). Checkpoints
into <machine.checkpoint_dir>/distill-NAME.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from modeling.families import takes_segment_ids
from modeling.models import model_params, resolve_model, weight_count
from pipeline.command import interactive, run_main
from pipeline.outputs import write_json
from pipeline.settings import PipelineError, Range, check_kind, load_params
from predicting import folds
from predicting.ensemble import combine_out_of_fold, mean_test_probabilities
from predicting.inference import fold_folders, fold_outputs, load_fold
from reading import windows
from reading.splits import cut_split, encode_csv, texts_at
from reading.tokens import model_limit, unpack_flat, unpack_sequences
from reading.windows import Cutting
from training import checkpoint
from training.pretrained import start_model
from training.rows import TOKENIZED, distillation_rows, read_train_file, read_training_data, with_test_rows
from training.run import Job, train
from training.settings import train_settings

STUDENTS = Path("students/distill")
PROCESSED = Path("data/processed")
# what each distill.* key accepts, and each student's
DISTILL_PARAMS = {"students": (dict,), "epochs": (float, Range(0, low_open=True)),
                  "lr": (float, Range(0, 1, low_open=True)), "test_rows": (bool,), "speed_rows": (int, Range(1))}
STUDENT_PARAMS = {"model": (str, None), "layers": (int, None, Range(1))}


def outputs(name):
    """Where student `name` writes."""
    return {"model": STUDENTS / name / "model", "predictions": STUDENTS / name / "predictions",
            "live": Path("reports/distill") / name}


def student_settings(students, name):
    """distill.students.NAME, checked: {model, layers}."""
    if name not in students:
        raise PipelineError(f"params.yaml: distill.students has no student {name!r} (it has {', '.join(students) or 'none'})")
    spec = students[name] if isinstance(students[name], dict) else None
    if spec is None or set(spec) - set(STUDENT_PARAMS):
        raise PipelineError(f"params.yaml: distill.students.{name} must be a mapping of model and layers, "
                            f"not {students[name]!r}")
    return {key: check_kind(spec.get(key), kinds, f"params.yaml: distill.students.{name}.{key}")
            for key, kinds in STUDENT_PARAMS.items()}


def check_student(name, teacher, student, layers, trust_remote_code=False):
    """One line describing the student, or a PipelineError when it is not smaller than the teacher (both
    model sources; layers: the student keeps its first `layers`) or reads other token ids."""
    where = f"params.yaml: distill.students.{name}"
    teacher_weights, teacher_layers = weight_count(teacher, None, trust_remote_code)
    all_layers = weight_count(student, None, trust_remote_code)[1]
    if layers and layers > all_layers:
        raise PipelineError(f"{where}.layers {layers}: {student} has {all_layers} encoder layers; at most {all_layers}")
    student_weights, student_layers = weight_count(student, layers, trust_remote_code)
    if student_weights >= teacher_weights:
        raise PipelineError(f"{where}: the student ({student_weights / 1e6:.1f}M weights, {student_layers} layers) is "
                            f"not smaller than its teacher ({teacher_weights / 1e6:.1f}M, {teacher_layers} layers): "
                            "drop layers or name a smaller model")
    return (f"distill@{name}: a student of {student_weights / 1e6:.1f}M weights ({student_layers} layers) learns "
            f"from teachers of {teacher_weights / 1e6:.1f}M ({teacher_layers} layers)")


def same_vocabulary(teacher, student, trust_remote_code=False):
    """Whether the student reads the teachers' token ids (data/tokenized as it is)."""
    if student == teacher:
        return True
    vocab = AutoTokenizer.from_pretrained(student, trust_remote_code=trust_remote_code).get_vocab()
    return vocab == AutoTokenizer.from_pretrained(teacher, trust_remote_code=trust_remote_code).get_vocab()


def student_tokens(name, student, data, trust_remote_code=False):
    """{split: its tensors} of the processed train and test texts for a student whose tokenizer has
    another vocabulary than the teachers' (an LLM's folds distilled into a small encoder): tokenized by its
    own tokenizer and cut as the tokenize stage cut the teachers' (data/tokenized/settings.json), so each
    text's rows line up with the teachers' outputs by text."""
    tokenizer = AutoTokenizer.from_pretrained(student, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(student, trust_remote_code=trust_remote_code)
    settings, shape = data.tokenized, data.shape
    limit = model_limit(tokenizer, config)
    if settings["max_length"] > limit:
        raise PipelineError(f"params.yaml: distill.students.{name}.model {student} takes at most {limit} tokens, "
                            f"the teachers were tokenized at {settings['max_length']}: set tokenize.max_length to "
                            f"at most {limit}, or pick a student that takes {settings['max_length']}")
    cutting = Cutting(settings["truncation"], settings["head_tokens"], settings["stride"])
    types = takes_segment_ids(tokenizer, config, bool(data.processed["pair_columns"]))
    tensors = {}
    for split in ("train", "test"):
        path = PROCESSED / f"{split}.csv"
        if path.exists():
            flat, lengths, labels = encode_csv(tokenizer, path, data.labels, shape, types)
            tensors[split] = cut_split(tokenizer, flat, lengths, labels, settings["max_length"], cutting,
                                       lambda rows, path=path: texts_at(path, rows, tokenizer), path)[0]
    return tensors


def rows_per_second(run_model, sequences):
    start = time.perf_counter()
    run_model(sequences)
    return len(sequences) / (time.perf_counter() - start)


def rows_of(tensors, sample):
    """(token ids, segment ids or None) of some rows of a tokenized split."""
    token_types = unpack_flat(tensors, "token_type_ids")
    return unpack_sequences(tensors)[0][sample], None if token_types is None else token_types[sample]


def speed_against_ensemble(tokenizer, student, run, sequences, token_types, teacher_sequences, teacher_types, device):
    """speed.json: the student's rows/s and the fold ensemble's (every teacher in models/, one after the
    other) on the same rows, each model reading them as its own tokenizer made them, on `device`."""
    student_speed = rows_per_second(lambda s: fold_outputs(tokenizer, student, run, s, token_types, device), sequences)
    seconds = 0.0
    for teacher_folder, teacher_run in zip(*fold_folders("models")):
        teacher_tokenizer, teacher_model = load_fold(teacher_folder, teacher_run, device)
        seconds += len(teacher_sequences) / rows_per_second(
            lambda s: fold_outputs(teacher_tokenizer, teacher_model, teacher_run, s, teacher_types, device),
            teacher_sequences)
    ensemble_speed = len(teacher_sequences) / seconds
    return {"rows": len(sequences), "student_rows_per_s": round(student_speed, 1),
            "ensemble_rows_per_s": round(ensemble_speed, 1), "speedup": round(student_speed / ensemble_speed, 2),
            "student_weights": sum(p.numel() for p in student.parameters()), "device": device}


def main():
    distill = load_params("distill", DISTILL_PARAMS)
    parser = argparse.ArgumentParser(prog="python -m stages.distill", description="distill the fold ensemble into one student")
    parser.add_argument("--student", required=True, help="a key of distill.students")
    name = parser.parse_args(sys.argv[1:]).student
    spec = student_settings(distill["students"], name)
    params, machine, task_metric = train_settings()
    params = {**params, "epochs": distill["epochs"], "lr": distill["lr"], "keep_best": False, "patience": None}
    model = model_params()
    teacher = start_model(resolve_model(model["name"]))
    student = resolve_model(spec["model"]) if spec["model"] else teacher
    student_line = check_student(name, teacher, student, spec["layers"], model["trust_remote_code"])  # before any work
    if not interactive():
        transformers.utils.logging.disable_progress_bar()
    data = read_training_data()
    shape, k, columns = data.shape, data.fold_count, data.shape.outputs(data.labels)
    texts_out, oof = combine_out_of_fold(data.row_folds, [
        folds.read_probabilities(folds.outputs(f)["predictions"] / "oof.csv", columns) for f in range(k)])
    has_test = (TOKENIZED / "test.safetensors").exists()
    teacher_tests = load_file(TOKENIZED / "test.safetensors") if has_test else read_train_file()
    if same_vocabulary(teacher, student, model["trust_remote_code"]):
        tensors, test_tensors = read_train_file(), teacher_tests
    else:
        print(f"distill@{name}: the student's tokenizer has another vocabulary than the teachers': the texts "
              "tokenized again by its own")
        own = student_tokens(name, student, data, model["trust_remote_code"])
        tensors, test_tensors = own["train"], own.get("test", own["train"])
    rows = distillation_rows(tensors, texts_out, oof, shape)
    test_sequences, test_types = unpack_sequences(test_tensors)[0], unpack_flat(test_tensors, "token_type_ids")
    test_texts = windows.text_of_row(test_tensors)
    teacher_files = [folds.outputs(f)["test"] for f in range(k)] if has_test else []
    print(student_line)
    print(f"distill@{name}: learning the out-of-fold outputs of {len(texts_out):,} training texts"
          + ("" if k > 1 else " (one fold: only its validation rows have out-of-fold outputs)"))
    learned_test = None  # the test texts' targets (distill.test_rows): the mean of every fold's test outputs
    if distill["test_rows"] and has_test:
        n = len(np.unique(test_texts))
        learned_test = mean_test_probabilities([folds.read_probabilities(f, columns) for f in teacher_files], n)
        rows = with_test_rows(rows, test_tensors, np.arange(n), learned_test, shape)
        print(f"distill.test_rows: also the ensemble's outputs of the {n:,} test texts")

    def after(folder, tokenizer, trained, run):  # its test outputs, and its speed against the ensemble's
        device = trained.device.type
        if has_test:
            predicted = fold_outputs(tokenizer, trained, run, test_sequences, test_types, device, texts=test_texts)
            folds.write_probabilities(folds.probabilities_frame(range(len(predicted)), predicted, columns),
                                      folder / "test.csv")
        if learned_test is not None:  # what it learned of them, as pseudo's pseudo_labels.csv
            folds.write_probabilities(folds.probabilities_frame(range(len(learned_test)), learned_test, columns),
                                      folder / "test_targets.csv")
        sample = slice(0, distill["speed_rows"])  # the same rows through the student, then every teacher
        speed = speed_against_ensemble(tokenizer, trained, run, *rows_of(test_tensors, sample),
                                       *rows_of(teacher_tests, sample), device)
        print(f"distill@{name}: {speed['student_rows_per_s']:,.0f} rows/s against the {k}-fold ensemble's "
              f"{speed['ensemble_rows_per_s']:,.0f} on the same {speed['rows']:,} rows ({speed['speedup']:.2f}x)")
        write_json(folder / "speed.json", speed)

    inputs = [*data.files, *[folds.outputs(f)["predictions"] / "oof.csv" for f in range(k)], *teacher_files]
    job = Job(f"distill@{name}", None, {**outputs(name), "checkpoints": checkpoint.folder(f"distill-{name}",
                                                                                         machine["checkpoint_dir"])},
              start=student, model_name=spec["model"] or model["name"], data=data, inputs=inputs,
              trust_remote_code=model["trust_remote_code"], keep_layers=spec["layers"], after=after,
              settings={"distill.layers": spec["layers"], "distill.test_rows": distill["test_rows"]})
    torch.manual_seed(params["seed"])
    return train(job, rows, params, machine, task_metric)


if __name__ == "__main__":
    run_main(main)
