"""Long texts end to end (tokenize.truncation), with the real `dvc` CLI and the tiny model: each setting
reruns tokenize onward, not fetch or preprocess; the log names it; windows stay in their text's fold;
every output keeps one row per text (oof.csv, predictions/test, the submission, python -m predict), for
classification and regression. What the files hold is checked against a second path: the fast
tokenizer's own overflowing windows and left truncation, and a plain forward pass over them."""
import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from reading.tokens import unpack_sequences
from tests.shape_data import regression_rows, write_data
from tests.test_pipeline import init_pipeline_repo, repro, set_params, settle, stage_env

CUT = 6  # tokenize.max_length: the tiny texts are 6 to 16 tokens, so most are cut
AFTER_TOKENIZE = {"tokenize", "train@0", "predict_test", "evaluate"}
CHEAP = dict(train__epochs=2)  # shapes and files are checked here, not learning


def processed_texts(repo, split="train"):
    return pd.read_csv(repo / f"data/processed/{split}.csv", keep_default_na=False)["text"].tolist()


def windows_of(repo, texts, stride):
    """The fast tokenizer's own windows of each text (return_overflowing_tokens): (ids, text of each)."""
    tokenizer = AutoTokenizer.from_pretrained(repo / "models/fold-0")
    encoded = tokenizer(texts, truncation=True, max_length=CUT, stride=stride, return_overflowing_tokens=True)
    return encoded["input_ids"], np.asarray(encoded["overflow_to_sample_mapping"])


def validation_counts(log):
    """{fold: (train rows, validation rows)} from the train stages' lines."""
    return {int(k): (int(a.replace(",", "")), int(b.replace(",", "")))
            for k, a, b in re.findall(r"^fold (\d+): training on \w+: ([\d,]+) train / ([\d,]+) validation", log, re.M)}


def predict_file(repo, csv, *args):
    out = repo.parent / "predicted.csv"
    result = subprocess.run([sys.executable, "-m", "predict", str(csv), "--out", str(out), *args], cwd=repo,
                            env=stage_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return pd.read_csv(out)


def test_windows_train_and_predict_per_text(pipeline, tiny_data_dir):
    repo, _ = pipeline
    settle(repo)  # the module's settings, from DVC's run cache
    set_params(repo, **CHEAP, tokenize__max_length=CUT, tokenize__truncation="windows", tokenize__stride=2)
    ran, log = repro(repo, with_log=True)
    assert ran == AFTER_TOKENIZE
    assert "tokenize.truncation windows (overlapping by 2 tokens, outputs averaged per text)" in log
    texts = processed_texts(repo)
    reference, owner = windows_of(repo, texts, stride=2)
    tokens = json.loads((repo / "reports/tokenize/lengths.json").read_text())["tokens"]["train"]
    per_text = np.bincount(owner, minlength=len(texts))
    assert tokens["cut_texts"] == int((per_text > 1).sum()) > len(texts) / 2
    assert tokens["windows"] == int(per_text[per_text > 1].sum()) and tokens["rows"] == len(reference)
    # the windows of a validation text are all validation rows: a text's windows stay in its fold
    folds = pd.read_csv(repo / "data/split/folds.csv")["fold"].to_numpy()
    assert validation_counts(log)[0] == (int((folds[owner] != 0).sum()), int((folds[owner] == 0).sum()))
    # one oof row per validation text: the mean of its windows' probabilities, here by a plain forward pass
    oof = pd.read_csv(repo / "predictions/fold-0/oof.csv")
    assert oof["row"].tolist() == np.flatnonzero(folds == 0).tolist()
    model = AutoModelForSequenceClassification.from_pretrained(repo / "models/fold-0").eval()
    with torch.inference_mode():
        probabilities = [torch.softmax(model(torch.tensor([ids])).logits[0], -1).numpy() for ids in reference]
    expected = [np.mean([p for p, t in zip(probabilities, owner) if t == row], axis=0) for row in oof["row"]]
    np.testing.assert_allclose(oof.drop(columns="row").to_numpy(), expected, atol=1e-5)
    # test rows: one per text in predictions/test and the submission, and python -m predict agrees
    test = pd.read_csv(tiny_data_dir / "test.csv")
    stage = pd.read_csv(repo / "predictions/test/fold-0.csv")
    assert stage["row"].tolist() == list(range(len(test)))
    submission = pd.read_csv(repo / "submission/submission.csv")
    assert submission["id"].tolist() == test["id"].tolist()
    predicted = predict_file(repo, tiny_data_dir / "test.csv", "--probabilities", str(repo.parent / "p.csv"))
    assert predicted["label"].tolist() == submission["label"].tolist()
    np.testing.assert_allclose(pd.read_csv(repo.parent / "p.csv").drop(columns="id").to_numpy(),
                               stage.drop(columns="row").to_numpy(), atol=1e-5)


def test_tail_and_head_tail_keep_one_row_per_text(pipeline):
    repo, _ = pipeline
    settle(repo)
    tokenizer = AutoTokenizer.from_pretrained(repo / "models/fold-0")
    for settings, name in ((dict(tokenize__truncation="tail"), "tail (the last tokens)"),
                           (dict(tokenize__truncation="head_tail", tokenize__head_tokens=2),
                            "head_tail (the first 2 tokens and the last ones)")):
        set_params(repo, **CHEAP, tokenize__max_length=CUT, **settings)
        ran, log = repro(repo, with_log=True)
        assert ran == AFTER_TOKENIZE and f"tokenize.truncation {name}" in log, name
        texts = processed_texts(repo)
        full = tokenizer(texts)["input_ids"]
        body = [ids[1:-1] for ids in full]  # between [CLS] and [SEP]
        kept = [b[-(CUT - 2):] if settings["tokenize__truncation"] == "tail" else b[:2] + b[-(CUT - 4):] for b in body]
        expected = [ids if len(ids) <= CUT else [ids[0], *k, ids[-1]] for ids, k in zip(full, kept)]
        tensors = load_file(repo / "data/tokenized/train.safetensors")
        assert "text_of_row" not in tensors and unpack_sequences(tensors)[0] == expected, name
        tokens = json.loads((repo / "reports/tokenize/lengths.json").read_text())["tokens"]["train"]
        assert tokens["cut_texts"] == tokens["windows"] == sum(len(ids) > CUT for ids in full) > 0
        folds = pd.read_csv(repo / "data/split/folds.csv")["fold"].to_numpy()
        assert pd.read_csv(repo / "predictions/fold-0/oof.csv")["row"].tolist() == np.flatnonzero(folds == 0).tolist()


@pytest.fixture(scope="module")
def regression_windows(tmp_path_factory, tiny_model_dir):
    """A regression repo with two folds, its texts cut into windows from the first run on."""
    base = tmp_path_factory.mktemp("long_regression")
    source = write_data(base / "source", regression_rows, 120, 30)
    repo = init_pipeline_repo(base / "repo", source, tiny_model_dir, task__kind="regression",
                              preprocess__label_column="score", cv__folds=[0, 1], train__mixed_precision=False,
                              tokenize__max_length=CUT, tokenize__truncation="windows", tokenize__stride=3, **CHEAP)
    ran, log = repro(repo, with_log=True)
    return repo, source, ran, log


def test_regression_windows_stay_in_their_fold_and_average_back(regression_windows):
    repo, source, ran, log = regression_windows
    assert {"train@0", "train@1", "predict_test", "evaluate"} <= ran
    texts = processed_texts(repo)
    _, owner = windows_of(repo, texts, stride=3)
    assert np.bincount(owner).max() > 1  # some texts made several windows
    folds = pd.read_csv(repo / "data/split/folds.csv")["fold"].to_numpy()
    counts = validation_counts(log)
    for k in (0, 1):
        assert counts[k] == (int((folds[owner] != k).sum()), int((folds[owner] == k).sum())), k
        oof = pd.read_csv(repo / f"predictions/fold-{k}/oof.csv")
        assert list(oof.columns) == ["row", "value"] and oof["row"].tolist() == np.flatnonzero(folds == k).tolist()
    n_test = len(pd.read_csv(source / "test.csv"))
    tests = [pd.read_csv(repo / f"predictions/test/fold-{k}.csv") for k in (0, 1)]
    assert all(t["row"].tolist() == list(range(n_test)) for t in tests)
    submission = pd.read_csv(repo / "submission/submission.csv")
    assert len(submission) == n_test
    predicted = predict_file(repo, source / "test.csv")
    assert predicted.columns.tolist() == submission.columns.tolist() and len(predicted) == n_test
    np.testing.assert_allclose(predicted.iloc[:, 1].to_numpy(), np.mean([t["value"] for t in tests], axis=0), atol=1e-4)


def test_a_cut_that_cannot_be_made_stops_tokenize_with_one_line(regression_windows):
    repo, *_ = regression_windows
    before = (repo / "data/tokenized/train.safetensors").read_bytes()
    set_params(repo, tokenize__truncation="head_tail", tokenize__head_tokens=CUT - 2)
    try:
        result = subprocess.run([sys.executable, "-m", "stages.tokenize"], cwd=repo, env=stage_env(),
                                capture_output=True, text=True, timeout=300)
    finally:
        set_params(repo, tokenize__truncation="windows", tokenize__head_tokens=128)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.fullmatch(r"error: data/processed/train\.csv row \d+: tokenize\.head_tokens 4 leaves no tail: a row "
                        r"holds 4 tokens besides the special tokens; set it below 4, or raise tokenize\.max_length "
                        r"\(tokenize\.truncation head_tail, max_length 6\)\n", result.stderr), result.stderr
    assert (repo / "data/tokenized/train.safetensors").read_bytes() == before  # nothing half-written
