"""Cross-validation end to end with the real `dvc` CLI, tiny data and a tiny model, cv.folds [0, 1, 2]:
one train stage per fold (train@0..2), out-of-fold predictions over every training row, the
ensemble's submission, which stages a change reruns, a kill in the middle of fold 2, and folds
run on three clones that share a DVC remote. Stages append their name to $PIPELINE_STAGE_LOG when
they run, which is how the tests count what really ran."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from safetensors.torch import load_file
from sklearn.metrics import accuracy_score, f1_score

from predicting.inference import fold_outputs, load_fold
from reading.tokens import unpack_flat
from tests.test_experiments import clone
from tests.test_pipeline import dvc, init_pipeline_repo, run, set_params, stage_env
from tests.test_resume import copy_repo

FOLDS = [0, 1, 2]
# a fold trains on 180 texts, 12 steps an epoch: at 6 epochs one seed of 8 stalled on two classes; at 12
# each of 16 seeds learned the task by epoch 4
CV_PARAMS = dict(cv__folds=FOLDS, train__epochs=12, train__effective_batch_size=16)
UPSTREAM = ["fetch", "preprocess", "pretrain", "tokenize", "split"]  # pretrain: off, a marker
FOLD_STAGES = [f"train@{k}" for k in FOLDS]
LABELS = ["negative", "neutral", "positive"]
WAIT_S = 300  # for a fold to start, or a killed `dvc repro` to end


def stage_log(path):
    path = Path(path)
    return path.read_text().split() if path.exists() else []


def logged_repro(repo, *args, log_name="stages.log", env=None):
    """`dvc repro *args` with a fresh stage log (and `env` added to the environment); returns (the stages
    that ran, dvc's output)."""
    log = Path(repo).parent / f"{Path(repo).name}-{log_name}"
    log.unlink(missing_ok=True)
    env = {**stage_env(), **(env or {}), "PIPELINE_STAGE_LOG": str(log)}
    result = subprocess.run([sys.executable, "-m", "dvc", "repro", *args], cwd=repo, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"dvc repro {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return stage_log(log), result.stdout


@pytest.fixture(scope="module")
def cv_repo(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """A committed K=3 pipeline repo before any run, and a copy of it after one `dvc repro`.
    Yields (fresh repo, reproduced repo, stages the first repro ran)."""
    root = tmp_path_factory.mktemp("cv")
    fresh = init_pipeline_repo(root / "fresh", tiny_data_dir, tiny_model_dir, **CV_PARAMS)
    done = copy_repo(fresh, root / "done")
    ran, log = logged_repro(done)
    (root / "done.log").write_text(log)
    yield fresh, done, ran


def probabilities(path):
    frame = pd.read_csv(path)
    return frame.iloc[:, 0].to_numpy(), frame.iloc[:, 1:]


def test_one_stage_per_fold_each_ran_once(cv_repo):
    _, repo, ran = cv_repo
    assert ran[:6] == [*UPSTREAM, "baseline"] and sorted(ran[6:9]) == FOLD_STAGES and ran[9:] == ["predict_test", "evaluate"]
    for k in FOLDS:
        for path in (f"models/fold-{k}/model.safetensors", f"predictions/fold-{k}/oof.csv",
                     f"predictions/test/fold-{k}.csv", f"reports/train/fold-{k}/metrics.json"):
            assert (repo / path).is_file(), path
    assert "Data and pipelines are up to date" in dvc("repro", cwd=repo).stdout


def test_out_of_fold_predictions_cover_every_training_row_once(cv_repo):
    _, repo, _ = cv_repo
    train = pd.read_csv(repo / "data/processed/train.csv", dtype=str, keep_default_na=False)
    folds = pd.read_csv(repo / "data/split/folds.csv")["fold"].to_numpy()
    rows = []
    for k in FOLDS:
        fold_rows, probs = probabilities(repo / f"predictions/fold-{k}/oof.csv")
        assert list(probs.columns) == LABELS
        assert sorted(fold_rows) == list(np.flatnonzero(folds == k)), f"fold {k} predicted rows it trained on"
        assert set(train["label"].to_numpy()[fold_rows]) == set(LABELS), f"fold {k} misses a class"
        rows += list(fold_rows)
    assert sorted(rows) == list(range(len(train)))


def test_metrics_are_out_of_fold_scores_and_their_spread_over_folds(cv_repo):
    _, repo, _ = cv_repo
    metrics = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    assert set(metrics) == {"oof", "cv", "test", "baseline"}  # baseline: the TF-IDF score beside the model's
    train = pd.read_csv(repo / "data/processed/train.csv", dtype=str, keep_default_na=False)
    y_true, y_pred, per_fold = [], [], []
    for k in FOLDS:
        rows, probs = probabilities(repo / f"predictions/fold-{k}/oof.csv")
        truth, guess = train["label"].to_numpy()[rows], np.array(LABELS)[probs.to_numpy().argmax(axis=1)]
        per_fold.append(f1_score(truth, guess, average="macro"))
        y_true += list(truth)
        y_pred += list(guess)
    assert metrics["oof"]["f1_macro"] == pytest.approx(f1_score(y_true, y_pred, average="macro"), abs=1e-4)
    assert metrics["oof"]["accuracy"] == pytest.approx(accuracy_score(y_true, y_pred), abs=1e-4)
    assert metrics["cv"]["f1_macro_mean"] == pytest.approx(np.mean(per_fold), abs=1e-4)
    assert metrics["cv"]["f1_macro_std"] == pytest.approx(np.std(per_fold, ddof=1), abs=1e-4)
    assert {"accuracy_mean", "accuracy_std"} <= set(metrics["cv"])
    assert metrics["oof"]["f1_macro"] >= 0.8, metrics  # it learned; chance is about 0.33
    shown = dvc("exp", "show", "--csv", "--drop", ".*", "--keep", r"oof\.f1_macro|cv\.f1_macro_mean", cwd=repo)
    assert "oof.f1_macro" in shown.stdout and "cv.f1_macro_mean" in shown.stdout


def test_each_fold_predicts_rows_as_it_validated_them(cv_repo):
    # a fold's out-of-fold outputs come from Trainer's evaluation inside the train stage, its test rows' from
    # predicting/inference.py (predict_test, python -m predict): given the fold's validation rows, the second
    # gives the first's outputs, in the precision the fold trained in (bf16 where the CPU has it), its
    # attention in fp32 where the fold's log says it trained so
    _, repo, _ = cv_repo
    log = (repo.parent / "done.log").read_text()
    tensors = load_file(repo / "data/tokenized/train.safetensors")
    sequences, token_types = unpack_flat(tensors, "input_ids"), unpack_flat(tensors, "token_type_ids")
    runs = [json.loads((repo / f"models/fold-{k}/pipeline.json").read_text()) for k in FOLDS]
    assert sum(run["fp32_attention"] for run in runs) == log.count("; the attention in fp32\n")
    for k, run in zip(FOLDS, runs):
        rows, oof = probabilities(repo / f"predictions/fold-{k}/oof.csv")
        order = np.argsort(rows)  # the rows in file order, as a test file's are
        tokenizer, model = load_fold(repo / f"models/fold-{k}", run, "cpu")
        outputs = fold_outputs(tokenizer, model, run, [sequences[i] for i in rows[order]],
                               token_types and [token_types[i] for i in rows[order]], "cpu")
        assert np.abs(outputs - oof.to_numpy()[order]).max() < 1e-6, (k, run["precision"], run["fp32_attention"])


def test_submission_is_the_argmax_of_the_mean_fold_probabilities(cv_repo, tiny_data_dir):
    _, repo, _ = cv_repo
    fold_probs = [probabilities(repo / f"predictions/test/fold-{k}.csv")[1].to_numpy() for k in FOLDS]
    mean = np.mean(fold_probs, axis=0)
    submission = pd.read_csv(repo / "submission/submission.csv", dtype=str)
    test_ids = pd.read_csv(tiny_data_dir / "test.csv", dtype=str)["id"].tolist()
    assert submission["id"].tolist() == test_ids
    assert submission["label"].tolist() == [LABELS[i] for i in mean.argmax(axis=1)]
    blend = pd.read_csv(repo / "submission/probabilities.csv", dtype={"id": str})
    assert blend.columns.tolist() == ["id", *LABELS] and blend["id"].tolist() == test_ids
    assert np.allclose(blend[LABELS].sum(axis=1), 1, atol=1e-5)
    assert np.allclose(blend[LABELS].to_numpy(), mean, atol=1e-6)


def test_a_change_reruns_exactly_what_it_affects(cv_repo, tmp_path):
    fresh, done, _ = cv_repo
    repo = copy_repo(done, tmp_path / "repo")
    assert logged_repro(repo)[0] == []
    with open(repo / "stages/evaluate.py", "a") as f:  # a change that only affects combining
        f.write("\n# combining changed\n")
    assert logged_repro(repo)[0] == ["evaluate"]
    set_params(repo, train__lr=1e-3)  # tests.test_pipeline.TINY_PARAMS has 2e-3
    ran, _ = logged_repro(repo)
    assert sorted(ran[:-2]) == FOLD_STAGES and ran[-2:] == ["predict_test", "evaluate"]
    set_params(repo, cv__folds=[0, 1])
    ran, out = logged_repro(repo)
    assert ran == ["split", "baseline", "train@0", "train@1", "predict_test", "evaluate"]
    assert "fold-2 left by an earlier run with more folds; not used" in out
    assert set(json.loads((repo / "reports/evaluate/metrics.json").read_text())["cv"]["per_fold"]) == {"0", "1"}


def test_a_kill_in_fold_2_loses_only_fold_2(cv_repo, tmp_path):
    fresh, done, _ = cv_repo
    repo = copy_repo(fresh, tmp_path / "repo")
    log = tmp_path / "killed.log"
    env = {**stage_env(), "PIPELINE_STAGE_LOG": str(log)}
    # a session of its own: the kill takes dvc and every stage process with it, as a reset runtime does
    process = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=env, start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while "train@2" not in stage_log(log):
            assert process.poll() is None, f"dvc ended before fold 2 started:\n{process.communicate()[0]}"
            assert time.monotonic() < deadline, f"fold 2 did not start within {WAIT_S}s"
            time.sleep(0.05)
        time.sleep(1.0)  # inside fold 2's process
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert stage_log(log)[-1] == "train@2" and not (repo / "models/fold-2").exists()
    ran, _ = logged_repro(repo)
    assert ran == ["train@2", "predict_test", "evaluate"], "folds 0 and 1 were finished: only fold 2 and the ensemble rerun"
    for name in ("models/fold-2/model.safetensors", "submission/submission.csv"):
        assert (repo / name).is_file(), name
    for name in ("predictions/fold-2/oof.csv", "predictions/test/fold-2.csv"):
        assert (repo / name).read_bytes() == (done / name).read_bytes(), name


def test_folds_run_on_three_clones_that_share_a_remote(cv_repo, tmp_path):
    fresh, done, _ = cv_repo
    bare = tmp_path / "origin.git"
    run(["git", "clone", "-q", "--bare", str(fresh), str(bare)], tmp_path)
    remote = tmp_path / "dvc-remote"
    clones = {}
    for name in ("a", "b", "c"):
        clones[name] = clone(bare, tmp_path / name)
        dvc("remote", "add", "--local", "-d", "shared", str(remote), cwd=clones[name])
    # A trains fold 0, B fold 1, each on its machine, and both share their runs
    ran_a, _ = logged_repro(clones["a"], "train@0")
    assert ran_a == [*UPSTREAM, "train@0"]  # the baseline is not upstream of a fold
    dvc("push", "--run-cache", cwd=clones["a"])
    ran_b, _ = logged_repro(clones["b"], "--pull", "train@1")
    assert ran_b == ["train@1"], "B restores fetch to split from A's runs and trains only fold 1"
    dvc("push", "--run-cache", cwd=clones["b"])
    # C restores both folds and trains only the one nobody ran
    ran_c, _ = logged_repro(clones["c"], "--pull")
    assert sorted(ran_c[:2]) == ["baseline", "train@2"] and ran_c[2:] == ["predict_test", "evaluate"], ran_c  # nobody ran the baseline
    for k in FOLDS:  # the same runs as the one-machine repro, fold by fold
        name = f"predictions/fold-{k}/oof.csv"
        assert (clones["c"] / name).read_bytes() == (done / name).read_bytes(), name
    assert "up to date" in dvc("status", cwd=clones["c"]).stdout


def test_cv_folds_given_as_a_number_stops_dvc_before_any_stage(cv_repo, tmp_path):
    fresh, _, _ = cv_repo
    repo = copy_repo(fresh, tmp_path / "repo")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["cv"]["folds"] = 0
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = dvc("repro", cwd=repo, check=False)
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert errors == ["ERROR: failed to resolve 'stages.train.foreach' in 'dvc.yaml': expected list/dictionary, "
                      "got int"], errors
    assert not (repo / "data").exists()
