"""Every model family a competitor brings, run as the pipeline runs it: tiny random models of each family with
the kind of tokenizer it ships (tests/families.py), text pairs through tokenize, train, predict_test and
python -m predict, each a fork of this process running the module as `python -m` does (imports paid once);
the decoders (Qwen2, Llama, Gemma 2) also on single texts with LoRA.

The test rows' outputs are checked by another path than the one that wrote them: the trained fold read by
transformers alone, each text tokenized on its own (no padding, so no pad token and no last-token search
over padding), with segment ids only where the model has more than one token type."""
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.families import FAMILIES, build
from tests.shape_data import pair_rows, write_data
from tests.test_params import run_module_in
from tests.test_pipeline import REPO, set_params

PAIRS = dict(preprocess__text_column="premise", preprocess__text_pair_column="hypothesis",
             preprocess__label_column="label", preprocess__id_column="id")
# one short epoch: what is checked is that each family runs and predicts what transformers computes
FAST = dict(train__epochs=1, train__batch_size=8, train__effective_batch_size=8, train__lr=1e-3,
            train__freeze_embeddings=False, train__mixed_precision=False, tokenize__max_length="auto",
            train__evaluations="epoch", cv__folds=[0])
DECODERS = [name for name, family in FAMILIES.items() if family.decoder]


def forked(folder, module, *args):
    """`python -m module *args` in folder, run in a fork of this process: (exit code, stdout, stderr)."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=run_module_in, args=(str(folder), module, args))
    child.start()
    child.join(timeout=300)
    streams = [(folder / f".{name}").read_text() for name in ("stdout", "stderr")]
    for name in ("stdout", "stderr"):
        (folder / f".{name}").unlink()
    return child.exitcode, *streams


def run_ok(folder, module, *args):
    code, out, err = forked(folder, module, *args)
    assert code == 0 and "Traceback" not in err, f"{module} {args}: exit {code}\n{out}\n{err}"
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A project folder with pair data fetched, preprocessed and split (one holdout fold): each case copies it."""
    for module in ("stages.fetch", "stages.preprocess", "stages.split", "stages.tokenize", "stages.train",
                   "stages.predict_test", "predict"):
        __import__(module)  # imported once, here; each run is a fork of this process
    folder = tmp_path_factory.mktemp("families")
    source = write_data(folder / "source", pair_rows, 120, 24)
    project = folder / "project"
    project.mkdir()
    for name in ("params.yaml",):
        shutil.copy(REPO / name, project / name)
    set_params(project, fetch__source=str(source), model__name=str(folder), **PAIRS, **FAST)
    for stage in ("stages.fetch", "stages.preprocess", "stages.split"):
        run_ok(project, stage)
    return project, source


def by_transformers(folder, test, pairs):
    """Class probabilities of the rows of `test` from the trained fold in `folder`, by transformers alone,
    one text at a time, computed in a fork: torch's thread pool started in this process would hang the
    forks that run the next stages."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=probabilities_to, args=(folder, test, pairs))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0, f"transformers could not read {folder}: exit {child.exitcode}"
    return np.load(folder / "by_transformers.npy")


def probabilities_to(folder, test, pairs):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    types = pairs and getattr(model.config, "type_vocab_size", 2) > 1 and "token_type_ids" in tokenizer.model_input_names
    outputs = []
    with torch.inference_mode():
        for _, row in test.iterrows():
            encoded = tokenizer(row["premise"], row["hypothesis"] if pairs else None, return_tensors="pt",
                                return_token_type_ids=types)
            outputs.append(model(**encoded).logits.softmax(-1)[0].numpy())
    np.save(folder / "by_transformers.npy", np.array(outputs))


def run_family(prepared, tmp_path, family, pairs=True, lora_rank=0):
    """tokenize, train@0, predict_test and python -m predict for one family's tiny model: (project folder,
    the test rows, the stage's test outputs, python -m predict's)."""
    project, source = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    model = build(family, tmp_path / family)
    set_params(work, model__name=str(model), train__lora_rank=lora_rank,
               **({} if pairs else {"preprocess__text_pair_column": None}))
    if not pairs:  # single texts: preprocess again without the second column
        run_ok(work, "stages.preprocess")
        run_ok(work, "stages.split")
    for stage, *args in (("stages.tokenize",), ("stages.train", "--fold", "0"), ("stages.predict_test",)):
        run_ok(work, stage, *args)
    test = pd.read_csv(source / "test.csv", dtype=str, keep_default_na=False)
    test.drop(columns="label").to_csv(work / "new.csv", index=False)
    run_ok(work, "predict", "new.csv", "--out", "predicted.csv", "--probabilities", "probabilities.csv",
           "--batch-size", "5")  # other batches than the stage's: a row's output must not depend on its batch
    stage = pd.read_csv(work / "predictions/test/fold-0.csv").drop(columns="row").to_numpy()
    return work, test, stage, pd.read_csv(work / "probabilities.csv")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_on_text_pairs_and_predicts_what_transformers_computes(prepared, tmp_path, family):
    work, test, stage, predicted = run_family(prepared, tmp_path, family)
    expected = by_transformers(work / "models/fold-0", test, pairs=True)
    np.testing.assert_allclose(stage, expected, atol=1e-4)
    labels = sorted(set(test["label"]))
    np.testing.assert_allclose(predicted[labels].to_numpy(), expected, atol=1e-4)


@pytest.mark.parametrize("family", DECODERS)
def test_a_decoder_trains_with_lora_on_single_texts(prepared, tmp_path, family):
    work, test, stage, predicted = run_family(prepared, tmp_path, family, pairs=False, lora_rank=4)
    expected = by_transformers(work / "models/fold-0", test, pairs=False)  # a plain model: the adapters merged
    np.testing.assert_allclose(stage, expected, atol=1e-4)
    np.testing.assert_allclose(predicted[sorted(set(test["label"]))].to_numpy(), expected, atol=1e-4)


def test_a_loss_that_becomes_nan_stops_the_fold_with_one_line_naming_the_setting(prepared, tmp_path):
    """A model whose activations overflow (its embeddings scaled past what float32 squares: the layer norm's
    variance is infinite, as Gemma's activations are in float16): Trainer would train on and the fold submit
    NaNs; the stage stops at the first logged loss that is not finite, names train.lr, and writes no model."""
    from safetensors.torch import load_file, save_file

    project, _ = prepared
    work = tmp_path / "project"
    shutil.copytree(project, work)
    model = build("bert", tmp_path / "bert")
    weights = load_file(model / "model.safetensors")
    name = next(key for key in weights if key.endswith("word_embeddings.weight"))
    weights[name] = weights[name] * 1e25
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    set_params(work, model__name=str(model))
    run_ok(work, "stages.tokenize")
    code, out, err = forked(work, "stages.train", "--fold", "0")
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "training loss became nan by step 1 " in lines[0] and "train.lr" in lines[0], err
    assert not (work / "models/fold-0").exists()
