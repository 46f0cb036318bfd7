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
import torch
import yaml
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
STAGES = {"fetch", "preprocess", "pretrain", "tokenize", "split", "baseline", "train@0", "predict_test", "evaluate"}  # cv.folds [0]: one fold
# Small enough for CI, with margin on any CPU. The tiny BERT is randomly initialised: its token embeddings
# were never trained, so frozen (the default, for pretrained models) they leave it a far harder task, on
# which it ended at chance or stalled on two classes for some seeds and CPUs. Trained, at lr 2e-3, it
# learned the keyword task by epoch 3 of 10 for each of 16 seeds (fp32, bf16, and fp32 limited to AVX2);
# at 5e-3 half of the seeds stall on two classes, and shorter schedules (4-6 epochs) stalled for some.
TINY_PARAMS = dict(preprocess__id_column="id", train__epochs=10, train__batch_size=16, train__effective_batch_size=16,
                   train__lr=2e-3, train__freeze_embeddings=False)
DEFAULT_STEPS = ["unescape_html", "replace_urls", "replace_mentions", "normalize_whitespace"]  # params.yaml's
# This module's pipeline, every setting a test here changes written out: each test starts from these
# (settle), so that a test run alone (-k) checks what it checks in the whole module. fp32 everywhere, so
# that compiled and eager training can be compared closely on any CPU (bf16 where a CPU has it).
PIPELINE_PARAMS = dict(TINY_PARAMS, train__mixed_precision=False,
                       train__dropout=0.0, train__compile=False, tokenize__max_length="auto",
                       split__val_size=0.1, preprocess__steps=DEFAULT_STEPS, tokenize__truncation="head",
                       tokenize__head_tokens=128, tokenize__stride=32, train__evaluations="epoch",
                       train__keep_best=False, task__metric="auto", train__lora_rank=0, train__gradient_checkpointing=False)
PROJECT_FILES = ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore", "predict.py")
# the stages, the shared code they import, and the tools beside them (tests/test_layout.py: LIBRARY)
CODE_FOLDERS = ("stages", "pipeline", "fetching", "reading", "tasks", "training", "predicting", "modeling", "baselines", "tune",
                "students")  # students/: the folder evaluate depends on, kept in git by its README


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


def repro(cwd, with_log=False):
    """Run `dvc repro`; return the set of stages it reproduced, by running them or by restoring their
    outputs from DVC's run cache (settings seen before) (and the log, stdout and stderr)."""
    result = dvc("repro", cwd=cwd)
    ran = set(re.findall(r"Running stage '([^']+)'|Stage '([^']+)' is cached - skipping run", result.stdout))
    ran = {running or cached for running, cached in ran}
    return (ran, result.stdout + result.stderr) if with_log else ran


def settle(repo, with_log=False, **settings):
    """params.yaml as the repo's first commit holds it (init_pipeline_repo's), at PIPELINE_PARAMS changed
    by settings, then `dvc repro`: what a test starts from, whatever ran before it. Every key goes back,
    not only PIPELINE_PARAMS': a setting another module left (test_techniques' train.averaging ema)
    would otherwise train the next module's reference, in whichever order the test processes take the
    modules. Settings trained before come back from DVC's run cache in seconds."""
    first_commit = run(["git", "rev-list", "--max-parents=0", "HEAD"], repo).stdout.split()[0]
    (repo / "params.yaml").write_text(run(["git", "show", f"{first_commit}:params.yaml"], repo).stdout)
    set_params(repo, **{**PIPELINE_PARAMS, **settings})
    return repro(repo, with_log)


def set_params(cwd, **changes):
    """Change params.yaml keys given as section__key=value."""
    path = cwd / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        params[section][key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def project_gitignore():
    """The project's .gitignore without the lines `dvc repro` adds there for the pipeline's top-level
    outputs (/submission): the same whether or not the README's quick start ran in this clone first."""
    outs = [out if isinstance(out, str) else next(iter(out))
            for stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].values() for out in stage.get("outs", [])]
    outputs = {f"/{out}" for out in outs if "/" not in out}
    lines = (REPO / ".gitignore").read_text().splitlines()
    return "".join(f"{line}\n" for line in lines if line.strip() not in outputs)


def init_pipeline_repo(repo, data_dir, model_dir, **params):
    """A git + DVC repo at repo holding this project's pipeline, pointed at the tiny data and
    model, committed and not yet run. Local git identity, so `dvc exp` can commit in CI."""
    repo = Path(repo)
    repo.mkdir(parents=True, exist_ok=True)
    for name in PROJECT_FILES:
        shutil.copy(REPO / name, repo / name)
    (repo / ".gitignore").write_text(project_gitignore())
    for package in CODE_FOLDERS:
        shutil.copytree(REPO / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
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


def test_first_repro_runs_every_stage_and_writes_outputs(pipeline):
    repo, ran = pipeline
    assert ran == STAGES
    for path in ["data/raw/train.csv", "data/raw/test.csv", "data/processed/labels.json",
                 "data/split/folds.csv", "data/tokenized/train.safetensors",
                 "models/fold-0/model.safetensors", "models/fold-0/tokenizer.json",
                 "predictions/fold-0/oof.csv", "predictions/test/fold-0.csv",
                 "reports/tokenize/lengths.json", "reports/train/fold-0/metrics.json",
                 "reports/evaluate/confusion_val.csv", "submission/submission.csv",
                 "submission/probabilities.csv"]:
        assert (repo / path).is_file(), path
    config = json.loads((repo / "models/fold-0/config.json").read_text())
    assert sorted(config["id2label"].values()) == ["negative", "neutral", "positive"]
    assert json.loads((repo / "reports/tokenize/lengths.json").read_text())["tokens"]["train"]["max"] > 5
    assert not list(repo.glob("**/.*.tmp-*")), "a temp folder was left behind"


def test_the_log_reads_top_to_bottom(pipeline):
    # what dvc repro prints in a log file (here a pipe, as in `dvc queue logs` or CI): lines, no redraws
    repo, _ = pipeline
    log = (repo.parent / "first-repro.log").read_text()
    assert "\r" not in log, "a progress bar redrew itself in the log"
    assert "np.float" not in log and "{'loss'" not in log and "Traceback" not in log
    for stage in STAGES:
        assert re.search(rf"^{re.escape(stage)}: wrote \S+ \(.+\) in \d+\.\d s$", log, re.M), stage
    steps = re.findall(r"^step (\d+)/(\d+) \((\d+)%\), loss [\d.]+, \d+:\d\d elapsed, \d+:\d\d left$", log, re.M)
    assert 15 <= len(steps) <= 25 and steps[-1][0] == steps[-1][1], steps  # about one line per 5%
    epochs = PIPELINE_PARAMS["train__epochs"]
    assert re.search(rf"^epoch {epochs}: validation accuracy [\d.]+, macro-F1 [\d.]+, loss [\d.]+$", log, re.M)
    assert "; float32 (train.mixed_precision: false)" in log  # the precision, and why


def test_model_learns_and_metrics_are_reported(pipeline):
    repo, _ = pipeline
    settle(repo)
    shown = json.loads(dvc("metrics", "show", "--json", cwd=repo).stdout)[""]["data"]
    assert shown["reports/train/fold-0/metrics.json"]["data"]["eval"]["f1_macro"] >= 0.8
    assert "p99" in shown["reports/tokenize/lengths.json"]["data"]["tokens"]["train"]
    evaluation = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    # three classes: chance is about 0.33; the keyword data is easy for a model that learns
    assert evaluation["val"]["accuracy"] >= 0.8, evaluation
    assert evaluation["test"]["f1_macro"] >= 0.8, evaluation
    assert "oof" not in evaluation and "cv" not in evaluation  # one fold: a holdout score, as before
    # the holdout score is the one training reported for its last evaluation: the same predictions
    assert evaluation["val"]["f1_macro"] == pytest.approx(
        shown["reports/train/fold-0/metrics.json"]["data"]["eval"]["f1_macro"], abs=1e-4)


def test_the_readmes_first_look_is_a_short_table_of_the_scores(pipeline):
    repo, _ = pipeline
    settle(repo)
    command = re.search(r"^(dvc exp show --drop .*)$", (REPO / "README.md").read_text(), re.M)[1]
    keep = re.search(r"--keep '([^']+)'", command)[1]
    table = dvc("exp", "show", "--csv", "--drop", ".*", "--keep", keep, cwd=repo).stdout
    header = table.splitlines()[0].split(",")
    assert header == ["Experiment", "val.accuracy", "val.f1_macro", "test.accuracy", "test.f1_macro",
                      "baseline.val.f1_macro"], header


def test_submission_has_one_row_per_test_id(pipeline, tiny_data_dir):
    repo, _ = pipeline
    settle(repo)
    submission = pd.read_csv(repo / "submission/submission.csv", dtype=str)
    test = pd.read_csv(tiny_data_dir / "test.csv", dtype=str)
    assert submission.columns.tolist() == ["id", "label"]
    assert submission["id"].tolist() == test["id"].tolist()
    # each row's label is the class the model gave the highest probability to that test row
    probabilities = pd.read_csv(repo / "predictions/test/fold-0.csv")
    assert probabilities.columns.tolist() == ["row", "negative", "neutral", "positive"]
    assert probabilities["row"].tolist() == list(range(len(test)))
    assert submission["label"].tolist() == probabilities.drop(columns="row").idxmax(axis=1).tolist()


def test_plots_render(pipeline):
    repo, _ = pipeline
    settle(repo)
    dvc("plots", "show", "-o", "plots_out", cwd=repo)
    page = (repo / "plots_out/index.html").read_text()
    assert "Confusion matrix (validation rows" in page and "f1_macro" in page and "learning_rate" in page


def test_only_affected_stages_rerun(pipeline):
    repo, _ = pipeline
    settle(repo)
    assert repro(repo) == set()
    set_params(repo, train__lr=3e-3)  # each change: a value PIPELINE_PARAMS does not have
    assert repro(repo) == {"train@0", "predict_test", "evaluate"}
    set_params(repo, tokenize__max_length=8)  # short enough to cut the tiny texts
    assert repro(repo) == {"tokenize", "train@0", "predict_test", "evaluate"}
    set_params(repo, split__val_size=0.2)
    assert repro(repo) == {"split", "baseline", "train@0", "predict_test", "evaluate"}
    set_params(repo, preprocess__steps=[s for s in DEFAULT_STEPS if s != "replace_mentions"])
    assert repro(repo) == STAGES - {"fetch"}


def test_frozen_token_embeddings_stay_as_loaded(pipeline, tiny_model_dir):
    # the pipeline's defaults, frozen token embeddings and no dropout; the tiny BERT's frozen random
    # embeddings make its task harder: 12 epochs (12 seeds tried learned it by epoch 8, most by 4)
    repo, _ = pipeline
    settle(repo, train__freeze_embeddings=True, train__dropout=0.0, train__epochs=12, train__lr=2e-3)
    loaded = load_file(tiny_model_dir / "model.safetensors")
    trained = load_file(repo / "models/fold-0/model.safetensors")
    assert torch.equal(trained["bert.embeddings.word_embeddings.weight"], loaded["embeddings.word_embeddings.weight"])
    # the rest trains, position embeddings included
    assert not torch.equal(trained["bert.embeddings.position_embeddings.weight"],
                           loaded["embeddings.position_embeddings.weight"])
    assert json.loads((repo / "models/fold-0/config.json").read_text())["hidden_dropout_prob"] == 0.0
    evaluation = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    assert evaluation["val"]["accuracy"] >= 0.8, evaluation


def test_a_compiled_model_trains_as_the_eager_one(pipeline, tmp_path, monkeypatch):
    # one short epoch, so that fp32 rounding differences stay small enough to compare (in bf16, which
    # a CPU with AMX picks, compiled and eager weights differed by 0.008 after it)
    repo, _ = pipeline
    settle(repo, train__epochs=1)
    eager = load_file(repo / "models/fold-0/model.safetensors")
    eager_oof = pd.read_csv(repo / "predictions/fold-0/oof.csv")
    compiled_code = tmp_path / "inductor"  # where torch.compile's Inductor writes the kernels it generates
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(compiled_code))
    ran, log = settle(repo, with_log=True, train__epochs=1, train__compile=True)
    assert ran - {"predict_test", "evaluate"} == {"train@0"}
    assert "train.compile: torch.compile; the first batch is slow while the model is compiled" in log
    assert list(compiled_code.rglob("*.py")), "Inductor generated no code: the model was not compiled"
    compiled = load_file(repo / "models/fold-0/model.safetensors")
    assert compiled.keys() == eager.keys()  # saved as the model itself, not as a compiled wrapper
    # the same arithmetic in fused kernels, rounded differently: after 17 steps the same to 4 decimals
    assert max((compiled[k] - eager[k]).abs().max().item() for k in eager) < 1e-4
    oof = pd.read_csv(repo / "predictions/fold-0/oof.csv")
    assert oof["row"].equals(eager_oof["row"])
    assert (oof.drop(columns="row") - eager_oof.drop(columns="row")).abs().max().max() < 1e-4
