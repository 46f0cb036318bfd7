"""End to end: the real `dvc` CLI runs the real pipeline in a temporary git repo, on a tiny
dataset and a tiny BERT, and we check outputs, metrics and which stages rerun after a change."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
STAGES = {"fetch", "preprocess", "tokenize", "train", "evaluate"}
# Small enough for CI; two epochs, so the curves of an experiment have points (2 evaluations per run).
TINY_PARAMS = dict(preprocess__id_column="id", train__epochs=2, train__batch_size=16,
                   train__lr=3e-3, evaluate__batch_size=32)
PROJECT_FILES = ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore")


def stage_env():
    """The environment for dvc: `python` in dvc.yaml must be this interpreter, so its folder comes first on PATH."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def run(cmd, cwd, check=True):
    result = subprocess.run(cmd, cwd=cwd, env=stage_env(), capture_output=True, text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def dvc(*args, cwd, check=True):
    return run([sys.executable, "-m", "dvc", *args], cwd, check)


def repro(cwd):
    """Run `dvc repro`; return the set of stages it executed."""
    out = dvc("repro", cwd=cwd).stdout
    return set(re.findall(r"Running stage '([^']+)'", out))


def set_params(cwd, **changes):
    """Change params.yaml keys given as section__key=value."""
    path = cwd / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        params[section][key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def init_pipeline_repo(repo, data_dir, model_dir, **params):
    """A git + DVC repo at repo holding this project's pipeline, pointed at the tiny data and
    model, committed and not yet run. Local git identity, so `dvc exp` can commit in CI."""
    repo = Path(repo)
    repo.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        shutil.copy(REPO / name, repo / name)
    shutil.copytree(REPO / "stages", repo / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    set_params(repo, fetch__source=str(data_dir), model__name=str(model_dir), **{**TINY_PARAMS, **params})
    run(["git", "init", "-q", "-b", "main"], repo)
    run(["git", "config", "user.name", "pipeline-test"], repo)
    run(["git", "config", "user.email", "pipeline-test@localhost"], repo)
    dvc("init", "-q", cwd=repo)
    dvc("config", "core.analytics", "false", cwd=repo)
    commit_all(repo, "pipeline")
    return repo


def commit_all(repo, message):
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", message], repo)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """A git + DVC repo holding this project's pipeline, pointed at the tiny data and model,
    after one full `dvc repro`. Yields (path, stages the first repro ran)."""
    repo = init_pipeline_repo(tmp_path_factory.mktemp("pipeline"), tiny_data_dir, tiny_model_dir,
                              train__epochs=10, train__effective_batch_size=16)
    yield repo, repro(repo)


def test_first_repro_runs_every_stage_and_writes_outputs(pipeline):
    repo, ran = pipeline
    assert ran == STAGES
    for path in ["data/raw/train.csv", "data/raw/test.csv", "data/processed/labels.json",
                 "data/processed/val.csv", "data/tokenized/train.safetensors",
                 "models/model/model.safetensors", "models/model/tokenizer.json",
                 "reports/tokenize/lengths.json", "reports/train/metrics.json",
                 "reports/evaluate/confusion_val.csv", "submission/submission.csv"]:
        assert (repo / path).is_file(), path
    config = json.loads((repo / "models/model/config.json").read_text())
    assert sorted(config["id2label"].values()) == ["negative", "neutral", "positive"]
    assert json.loads((repo / "reports/tokenize/lengths.json").read_text())["train"]["max"] > 5
    assert not list(repo.glob("**/.*.tmp-*")), "a temp folder was left behind"


def test_model_learns_and_metrics_are_reported(pipeline):
    repo, _ = pipeline
    shown = json.loads(dvc("metrics", "show", "--json", cwd=repo).stdout)[""]["data"]
    assert shown["reports/train/metrics.json"]["data"]["eval"]["f1_macro"] >= 0.8
    assert "p99" in shown["reports/tokenize/lengths.json"]["data"]["train"]
    evaluation = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    # three classes: chance is about 0.33; the keyword data is easy for a model that learns
    assert evaluation["val"]["accuracy"] >= 0.8, evaluation
    assert evaluation["test"]["f1_macro"] >= 0.8, evaluation


def test_submission_has_one_row_per_test_id(pipeline, tiny_data_dir):
    repo, _ = pipeline
    submission = pd.read_csv(repo / "submission/submission.csv", dtype=str)
    test = pd.read_csv(tiny_data_dir / "test.csv", dtype=str)
    assert submission.columns.tolist() == ["id", "label"]
    assert submission["id"].tolist() == test["id"].tolist()
    assert set(submission["label"]) <= {"negative", "neutral", "positive"}


def test_plots_render(pipeline):
    repo, _ = pipeline
    dvc("plots", "show", "-o", "plots_out", cwd=repo)
    page = (repo / "plots_out/index.html").read_text()
    assert "Confusion matrix (validation)" in page and "f1_macro" in page and "learning_rate" in page


def test_only_affected_stages_rerun(pipeline):
    repo, _ = pipeline
    assert repro(repo) == set()
    set_params(repo, train__lr=2e-3)
    assert repro(repo) == {"train", "evaluate"}
    set_params(repo, tokenize__max_length=8)  # short enough to cut the tiny texts
    assert repro(repo) == {"tokenize", "train", "evaluate"}
    set_params(repo, preprocess__replace_mentions=False)
    assert repro(repo) == STAGES - {"fetch"}
