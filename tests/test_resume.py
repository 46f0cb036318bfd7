"""Interrupted training: the real `dvc repro` on the tiny pipeline is stopped (SIGTERM, and
separately SIGKILL) after the train stage saved a checkpoint; the rerun resumes from it and ends
with the weights and curves of a run that was never stopped. Plus the rules for which checkpoint
is resumed (tested on folders) and the sampler that makes a resumed epoch replay its order."""
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.test_pipeline import dvc, init_pipeline_repo, stage_env
from training import checkpoint
from training.trainer import EpochSeededLengthGroupedSampler

# 8 epochs of 9 optimizer steps (270 texts, 16 per micro-batch, 2 accumulated): long enough to
# stop it in the middle, and a checkpoint every 5 steps, so most land inside an epoch.
RESUME_PARAMS = dict(train__epochs=8, train__batch_size=16, train__effective_batch_size=32, machine__checkpoint_steps=5)
STEPS_PER_EPOCH = 9
TOTAL_STEPS = 8 * STEPS_PER_EPOCH
WAIT_S = 120  # for a checkpoint to appear, or for a stopped `dvc repro` to end
CHECKPOINTS = checkpoint.folder(0, "checkpoints")  # one fold (cv.folds [0]): train@0's checkpoints


def tokenized_repo(root, data_dir, model_dir, **params):
    """A committed pipeline repo (tests.test_pipeline.init_pipeline_repo) after `dvc repro
    pretrain tokenize split`: copies of it train with no stage before train left to run."""
    repo = init_pipeline_repo(root, data_dir, model_dir, **params)
    dvc("repro", "pretrain", "tokenize", "split", cwd=repo)
    return repo


def copy_repo(source, dest):
    shutil.copytree(source, dest, symlinks=True)
    return Path(dest)


def shell_less_env():
    """tests.test_pipeline's environment for dvc without SHELL: DVC then runs the stage through
    /bin/sh, which may stay as its parent (dash does), the same on every machine whatever shell
    the test was started from."""
    env = stage_env()
    env.pop("SHELL", None)
    return env


def complete_checkpoint(repo, min_step):
    found = checkpoint.checkpoints(repo / CHECKPOINTS)
    return any(step >= min_step and checkpoint.progress(path) for step, path in found.items())


def runs_train_module(argv):
    """Whether argv is an interpreter running `-m stages.train`, not a shell whose one `-c` string
    holds it: with SHELL unset (as in CI) DVC runs a stage through /bin/sh, and dash stays the
    Python process's parent, so a signal sent to it would leave training running."""
    return any(a == "-m" and b == "stages.train" for a, b in zip(argv, argv[1:]))


def train_process(dvc_process):
    """The `python -m stages.train` process among the descendants of a running `dvc repro`."""
    for child in psutil.Process(dvc_process.pid).children(recursive=True):
        try:
            if runs_train_module(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def interrupt_training(repo, signum, min_step=STEPS_PER_EPOCH + 1, target_of=train_process):
    """Run `dvc repro train`, send signum to the train stage's process (target_of the dvc process)
    once a complete checkpoint of min_step or later exists, and return dvc's output (it must fail:
    the stage did not finish). By default a step of the second epoch: the first epoch's order would
    be replayed right even by a sampler drawing from the global RNG, since a resumed run reaches its
    start with the same RNG state."""
    process = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "train"], cwd=repo, env=shell_less_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not complete_checkpoint(repo, min_step):
            assert process.poll() is None, f"dvc ended before a checkpoint:\n{process.communicate()[0]}"
            assert time.monotonic() < deadline, f"no checkpoint in {repo / CHECKPOINTS} after {WAIT_S}s"
            time.sleep(0.02)
        target = target_of(process)
        assert target is not None, "no process to signal under dvc"
        target.send_signal(signum)
        output, _ = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode != 0, f"the stage finished before it was stopped:\n{output}"
    return output


def weights(repo):
    return load_file(repo / "models/fold-0/model.safetensors")


def curve(repo, name):
    """(step, value) rows of a dvclive curve in reports/train/fold-0 (columns: step, value)."""
    lines = (repo / f"reports/train/fold-0/plots/metrics/{name}.tsv").read_text().splitlines()[1:]
    return [(int(step), float(value)) for step, value in (line.split("\t") for line in lines)]


@pytest.fixture(scope="module")
def repos(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """(a tokenized pipeline repo, a copy of it trained without interruption)."""
    root = tmp_path_factory.mktemp("resume")
    base = tokenized_repo(root / "base", tiny_data_dir, tiny_model_dir, **RESUME_PARAMS)
    reference = copy_repo(base, root / "reference")
    dvc("repro", "train", cwd=reference)
    return base, reference


def test_the_train_process_is_told_from_the_shell_that_starts_it():
    assert runs_train_module([sys.executable, "-m", "stages.train"])
    assert not runs_train_module(["/bin/sh", "-c", "python -m stages.train"])
    assert not runs_train_module(["/bin/bash", "--noprofile", "--norc", "-c", "python -m stages.train"])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_stopped_run_resumes_and_ends_as_an_uninterrupted_one(repos, tmp_path, signum):
    base, reference = repos
    repo = copy_repo(base, tmp_path / "repo")
    stopped = interrupt_training(repo, signum)
    assert not (repo / "models/fold-0").exists()
    rerun = dvc("repro", "train", cwd=repo).stdout
    resumed = re.search(r"resuming from checkpoints/fold-0/checkpoint-(\d+): step (\d+) of (\d+)", rerun)
    assert resumed, rerun
    step, total = int(resumed[2]), int(resumed[3])
    assert int(resumed[1]) == step and STEPS_PER_EPOCH < step < total == TOTAL_STEPS
    assert "ignoring" not in rerun
    if signum == signal.SIGTERM:  # caught: a checkpoint of the step it was in, then exit 128 + 15
        assert "SIGTERM: saving a checkpoint after this step" in stopped, stopped
        assert (f"stopped by SIGTERM at step {step} of {total}; saved a checkpoint in checkpoints/fold-0: "
                "rerun to resume from it") in stopped, stopped
        assert "exited with 143" in stopped, stopped

    expected, got = weights(reference), weights(repo)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=0, atol=1e-6), name
    for name in ("loss", "learning_rate", "eval/accuracy"):  # curves rebuilt up to the checkpoint, then continued
        got, expected = curve(repo, name), curve(reference, name)
        assert [s for s, _ in got] == [s for s, _ in expected], name
        if name == "loss":  # the first loss logged after resuming averages only the steps since then
            first_after = next(i for i, (s, _) in enumerate(got) if s > step)
            del got[first_after], expected[first_after]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-5, abs=1e-7), name
    assert not (repo / CHECKPOINTS).exists(), "checkpoints are removed after a successful run"
    assert not list(repo.glob("models/.fold-0.*")), "a temp folder was left behind"


def make_checkpoint(folder, step, total=10, complete=True):
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / checkpoint.STATE).write_text(json.dumps({"global_step": step, "max_steps": total}))
    return path


FINGERPRINT = {"train.lr": 0.01, "train.epochs": 2, "model.name": "minilm", "processes": 1, "data sha256": "ab"}


def test_a_checkpoint_of_other_settings_is_ignored_and_deleted(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    make_checkpoint(folder, 3)
    (folder / checkpoint.FINGERPRINT).write_text(json.dumps(FINGERPRINT))
    current = {**FINGERPRINT, "train.lr": 0.02}
    assert checkpoint.prepare(current, folder) is None
    assert capsys.readouterr().out == (f"ignoring {folder}/checkpoint-3: it was trained with other settings "
                                       "(train.lr 0.01 -> 0.02); starting from step 0\n")
    assert not checkpoint.checkpoints(folder)
    assert json.loads((folder / checkpoint.FINGERPRINT).read_text()) == current


def test_a_checkpoint_without_fingerprint_is_ignored(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    make_checkpoint(folder, 4)
    assert checkpoint.prepare(FINGERPRINT, folder) is None
    assert "there is no fingerprint.json saying what it was trained with" in capsys.readouterr().out
    assert not checkpoint.checkpoints(folder)


def test_the_newest_complete_checkpoint_of_the_same_settings_is_resumed(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    make_checkpoint(folder, 5)
    make_checkpoint(folder, 10)
    make_checkpoint(folder, 15, complete=False)  # a kill while it was being written
    (folder / checkpoint.FINGERPRINT).write_text(json.dumps(FINGERPRINT))
    assert checkpoint.prepare(dict(FINGERPRINT), folder) == folder / "checkpoint-10"
    assert capsys.readouterr().out == f"resuming from {folder}/checkpoint-10: step 10 of 10\n"
    assert sorted(checkpoint.checkpoints(folder)) == [5, 10]  # Trainer's save_total_limit prunes the rest


def test_other_processes_only_read(tmp_path, capsys):
    folder = tmp_path / "checkpoints"
    make_checkpoint(folder, 3)
    (folder / checkpoint.FINGERPRINT).write_text(json.dumps(FINGERPRINT))
    assert checkpoint.prepare({**FINGERPRINT, "processes": 2}, folder, main_process=False) is None
    assert capsys.readouterr().out == ""
    assert (folder / "checkpoint-3").is_dir()
    assert json.loads((folder / checkpoint.FINGERPRINT).read_text()) == FINGERPRINT


def test_a_checkpoint_carries_over_to_another_gpu_with_the_same_effective_batch():
    def fingerprint(batch, accumulation, group_by_length=False, **changes):
        params = {"lr": 0.01, "group_by_length": group_by_length, **changes}
        return checkpoint.fingerprint(params, "m", 1, batch, accumulation, "ab")

    # a runtime that reconnects on another GPU probes another micro-batch: the same 32 examples per step
    assert fingerprint(16, 2) == fingerprint(32, 1) == fingerprint(8, 4)
    assert fingerprint(16, 2) != fingerprint(16, 1)  # another effective batch is another run
    # length groups are cut by the micro-batch: the rest of the epoch would be drawn in other groups
    assert fingerprint(16, 2, group_by_length=True) != fingerprint(32, 1, group_by_length=True)
    assert fingerprint(16, 2) != fingerprint(16, 2, lr=0.02)


def test_length_grouped_order_is_a_function_of_seed_and_epoch():
    lengths = [(i * 7) % 23 + 1 for i in range(200)]

    def order(seed, epoch):
        sampler = EpochSeededLengthGroupedSampler(8, lengths, seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(1, 3) == order(1, 3)  # what a resumed run relies on
    assert order(1, 3) != order(1, 4) and order(1, 3) != order(2, 3)
    assert sorted(order(1, 3)) == list(range(200))
    sampler = EpochSeededLengthGroupedSampler(8, lengths, 1)
    assert list(sampler) == order(1, 0) and list(sampler) == order(1, 1)  # unset, the epoch counts passes
