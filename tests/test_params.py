"""Every key of params.yaml, given a value it does not allow, stops the stage that reads it before
that stage reads any data: exit code 1, one `error:` line naming the key, no traceback, nothing
written. Each case runs the stage's module as `python -m stages.<stage>` runs it (as __main__) in an
empty folder holding only the repository's params.yaml with that one value changed, in a process
forked from this one once it has imported the stages: importing torch and transformers, about 2 s a
process, was nearly all of a case's time (110 s for the table)."""
import importlib
import multiprocessing
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
NOT_A_BOOL = "maybe"
BOOLEANS = ["preprocess.lowercase", "preprocess.unescape_html", "preprocess.replace_urls",
            "preprocess.replace_mentions", "preprocess.normalize_whitespace", "preprocess.drop_duplicates",
            "model.trust_remote_code", "train.group_by_length", "train.mixed_precision", "train.tf32",
            "train.fused_adamw", "machine.pin_memory", "train.unpadded", "train.freeze_embeddings"]
# key: the values outside what it allows (zero, negative, too large, a wrong word or kind, as applies)
BAD_VALUES = {
    "fetch.source": [5], "fetch.train_file": [5], "fetch.test_file": [5], "fetch.sample_submission_file": [5],
    "fetch.sha256": [5],
    "fetch.timeout": [0, -1], "fetch.retries": [-1, 101, 1.5],
    "task.kind": ["regresion", 5], "task.label_separator": ["", " ", 5],
    "task.metric": ["f2", 5, "rmse"],  # rmse scores regression, not the default classification
    "preprocess.text_column": [5, [], ["a", "a"]], "preprocess.text_pair_column": [5, [], [1]],
    "preprocess.label_column": [["a"], 5],  # a list of 0/1 columns is multi-label, not classification
    "preprocess.id_column": [5],
    "model.name": [5],
    "tokenize.max_length": [1, 0, "longest"], "tokenize.length_percentile": [0, 101],
    "cv.folds": [0, 3, [], [1, 2]],
    "split.val_size": [0, 1, -0.1], "split.seed": [-1, 2**32],
    "train.epochs": [0, -1], "train.batch_size": [0, "max", 7], "train.effective_batch_size": [0],
    "train.lr": [0, 2, "fast"], "train.weight_decay": [-0.1, 1.5], "train.warmup_ratio": [1, -0.1],
    "train.max_grad_norm": [-1], "train.seed": [-1, 2**32], "machine.loader_workers": [-1],
    "machine.checkpoint_steps": [0, 2.5], "machine.checkpoint_minutes": [0, -1], "machine.checkpoint_dir": [5, None],
    "train.num_processes": [0], "train.dropout": [1, -0.1, "none"],
    "train.evaluations": [0, "epochs"], "train.compile": [NOT_A_BOOL, 1],
    "tune.study": ["a/b", 5], "tune.trials": [0], "tune.metric": ["val.f2", 5], "tune.direction": ["up"],
    "tune.seed": [-1], "tune.pruner": ["always"], "tune.evaluations": [0], "tune.heartbeat": [0, 3601],
    "tune.storage": [5, "postgresql://tuner:hunter2@db/studies"],
    "tune.space": [{}, {"train.nope": {"low": 1, "high": 2}}, {"train.lr": {"low": 0.1, "high": 0.01}}],
    **{key: [NOT_A_BOOL] for key in BOOLEANS},
}
# the module that checks each section first (dvc.yaml lists every stage that reads it; python -m tune
# reads the tune section, which no stage does)
MODULE_OF = {"fetch": "stages.fetch", "task": "stages.preprocess", "preprocess": "stages.preprocess", "model": "stages.tokenize",
             "tokenize": "stages.tokenize", "cv": "stages.split", "split": "stages.split", "train": "stages.train",
             "machine": "stages.train", "tune": "tune"}


def params_keys():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    return {f"{section}.{key}" for section, values in params.items() for key in values}


def test_every_key_has_bad_values():
    assert set(BAD_VALUES) == params_keys()


def run_stage_with(tmp_path, key, value):
    section, name = key.split(".")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params[section][name] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", MODULE_OF[section]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def run_module_in(folder, module):
    """The child: `python -m module` in folder, its output to files there (read, then removed, by the parent)."""
    os.chdir(folder)
    for fd, name in ((1, ".stdout"), (2, ".stderr")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # not pytest's capture
    sys.argv = [module]
    for name in (module, f"{module}.__main__"):  # imported by the parent: run afresh, as python -m does
        sys.modules.pop(name, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # a SystemExit's code is the exit code


def run_stage_forked(tmp_path, key, value):
    """run_stage_with's CompletedProcess, from a fork of this process."""
    section, name = key.split(".")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params[section][name] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    child = multiprocessing.get_context("fork").Process(target=run_module_in, args=(str(tmp_path), MODULE_OF[section]))
    child.start()
    child.join(timeout=120)
    output = {}
    for stream in ("stdout", "stderr"):
        path = tmp_path / f".{stream}"
        output[stream] = path.read_text()
        path.unlink()
    return subprocess.CompletedProcess([MODULE_OF[section]], child.exitcode, output["stdout"], output["stderr"])


CASES = [(key, value) for key, values in BAD_VALUES.items() for value in values]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(key, repr(value)): (its folder, the finished stage)} for every case."""
    for module in set(MODULE_OF.values()):  # imported once, here; each case's process is a fork of this one
        importlib.import_module(f"{module}.__main__" if module == "tune" else module)
    runs = {}
    for key, value in CASES:  # one at a time
        folder = tmp_path_factory.mktemp("params")
        runs[key, repr(value)] = folder, run_stage_forked(folder, key, value)
    return runs


@pytest.mark.parametrize("key, value", CASES)
def test_a_value_out_of_range_stops_the_stage_with_one_line(runs, key, value):
    tmp_path, result = runs[key, repr(value)]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: params.yaml: ") and key in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"], "the stage wrote something"


def test_the_error_says_what_is_allowed(tmp_path):
    assert run_stage_with(tmp_path, "train.lr", 0).stderr == (
        "error: params.yaml: train.lr must be a number above 0 and at most 1, not 0\n")
    assert run_stage_with(tmp_path, "tokenize.max_length", "longest").stderr == (
        "error: params.yaml: tokenize.max_length must be a whole number at least 2 or 'auto', not 'longest'\n")
    assert run_stage_with(tmp_path, "train.batch_size", 7).stderr == (
        "error: params.yaml: train.batch_size 7 does not divide the 32 examples each process takes per "
        "optimizer step (train.effective_batch_size / train.num_processes): use auto or one of 1, 2, 4, 8, 16, 32\n")
