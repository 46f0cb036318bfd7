"""A reset runtime loses nothing: the README's lines put DVC's cache and the train stage's checkpoints
in a folder that outlives the machine (a stand-in for a mounted Google Drive). A 2-fold run there is
killed, process group and all, in fold 1; its clone is deleted; a fresh clone runs the same lines and
`dvc repro`: every finished stage is restored without running, fold 1 resumes from its checkpoint
and ends with the predictions of a run that was never stopped. The machine section of params.yaml
(where checkpoints go, how often, the GPU's loaders) reruns nothing when changed."""
import os
import re
import shutil
import signal
import subprocess
import time

import pandas as pd
import pytest
import yaml
from transformers import TrainerControl, TrainerState, TrainingArguments

from pipeline.settings import PipelineError
from tests.test_experiments import clone
from tests.test_pipeline import REPO, dvc, init_pipeline_repo, repro, set_params, stage_env
from training import checkpoint

# checkpoints by the clock, as users have them, every 0.1 s here (a step or two of the tiny model)
RESET_PARAMS = dict(cv__folds=[0, 1], train__epochs=6, train__effective_batch_size=16, machine__checkpoint_minutes=0.002)
STEPS_PER_EPOCH = 10  # fold 1 trains on 150 of the 300 texts, 16 at a time
WAIT_S = 300
MACHINE_CHANGES = {"checkpoint_dir": "elsewhere/checkpoints", "checkpoint_minutes": 3, "checkpoint_steps": 7,
                   "pin_memory": False, "loader_workers": 0}


def readme_reset_lines(drive):
    """The README's reset-proof lines, verbatim but for where the Drive folder is."""
    block = re.search(r"<!-- reset lines: tests/test_reset.py runs them -->\n```bash\n(.*?)```",
                      (REPO / "README.md").read_text(), re.S)
    assert block, "README.md lost its reset lines"
    lines = block[1].splitlines()
    assert lines[0].startswith("DRIVE=") and lines[-1] == "dvc repro", lines
    return "\n".join([f"DRIVE={drive}", *lines[1:]]) + "\n"


def bash(script, cwd, **popen):
    env = {**stage_env(), "OMP_NUM_THREADS": "1"}  # one thread: resumed and uninterrupted runs compare exactly
    return subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def newest_step(folder):
    done = [step for step, path in checkpoint.checkpoints(folder).items() if checkpoint.progress(path)]
    return max(done, default=0)


@pytest.fixture(scope="module")
def reset(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """(clone B's output after the reset, clone B, an uninterrupted run's clone, the Drive folder)."""
    root = tmp_path_factory.mktemp("reset")
    origin = init_pipeline_repo(root / "origin", tiny_data_dir, tiny_model_dir, **RESET_PARAMS)
    drive = root / "drive"
    lines = readme_reset_lines(drive)
    first = clone(origin, root / "runtime-1")
    run = bash(lines, first, start_new_session=True)
    deadline = time.monotonic() + WAIT_S
    while newest_step(drive / "checkpoints/fold-1") <= STEPS_PER_EPOCH:  # a checkpoint in fold 1's 2nd epoch
        assert run.poll() is None, f"the run ended before fold 1 saved a checkpoint:\n{run.communicate()[0]}"
        assert time.monotonic() < deadline, "no checkpoint of fold 1"
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)  # the runtime is gone: every process, no handler runs
    run.communicate()
    shutil.rmtree(first)  # and its disk
    second = clone(origin, root / "runtime-2")
    resumed = bash(lines, second)
    output = resumed.communicate(timeout=900)[0]
    assert resumed.returncode == 0, output
    reference = clone(origin, root / "uninterrupted")
    done = bash("dvc repro", reference)
    assert done.communicate(timeout=900)[0] and done.returncode == 0
    yield output, second, reference, drive


def test_the_finished_stages_are_restored_without_running(reset):
    output, _, _, _ = reset
    for stage in ("fetch", "preprocess", "pretrain", "tokenize", "split", "train@0"):
        assert f"Stage '{stage}' is cached - skipping run, checking out outputs" in output, (stage, output)
        assert f"Running stage '{stage}'" not in output, stage
    assert "Running stage 'train@1'" in output and "Running stage 'evaluate'" in output


def test_the_interrupted_fold_resumes_and_ends_as_an_uninterrupted_run(reset):
    output, repo, reference, drive = reset
    resumed = re.search(rf"resuming from {re.escape(str(drive))}/checkpoints/fold-1/checkpoint-(\d+): step (\d+) of (\d+)",
                        output)
    assert resumed and int(resumed[2]) > STEPS_PER_EPOCH, output
    for name in ("predictions/fold-1/oof.csv", "predictions/test/fold-1.csv"):
        got, expected = (pd.read_csv(r / name) for r in (repo, reference))
        assert got["row"].equals(expected["row"])
        assert (got.drop(columns="row") - expected.drop(columns="row")).abs().max().max() < 1e-5, name
    assert not (drive / "checkpoints/fold-1").exists(), "a finished fold keeps no checkpoint"


def test_settings_of_the_machine_rerun_nothing(reset):
    _, repo, _, _ = reset
    for key, value in MACHINE_CHANGES.items():
        set_params(repo, **{f"machine__{key}": value})
        assert repro(repo) == set(), key


def test_a_checkpoint_folder_that_cannot_be_written_stops_the_stage_before_training(reset, tmp_path):
    _, repo, _, _ = reset
    # a file, not a folder; and another learning rate than the run's, so that train@0 must run
    lr = yaml.safe_load((repo / "params.yaml").read_text())["train"]["lr"]
    set_params(repo, machine__checkpoint_dir="params.yaml/checkpoints", train__lr=lr * 1.5)
    result = dvc("repro", "train@0", cwd=repo, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and errors == [
        "error: machine.checkpoint_dir: params.yaml/checkpoints cannot be written (Not a directory): checkpoints "
        "go there; choose a folder you can write, or mount it first"], result.stdout + result.stderr
    assert "step 1/" not in result.stdout and "Traceback" not in result.stdout + result.stderr
    with pytest.raises(PipelineError, match=r"has [\d.]+ GB free, less than one checkpoint \(about 1000000000.00 GB\)"):
        checkpoint.check_writable(tmp_path, needed_bytes=10**18)  # a full disk: not even one checkpoint fits


def test_a_checkpoint_is_due_every_checkpoint_minutes_and_never_at_the_end():
    args = TrainingArguments(output_dir="unused", report_to="none")
    stop = checkpoint.StopOnSignal(verbose=False, save_every=0.3)

    def step(n, last=10):
        control = TrainerControl()
        stop.on_step_end(args, TrainerState(global_step=n, max_steps=last), control)
        return control.should_save

    assert not step(1)
    time.sleep(0.35)
    assert step(2)
    stop.on_save(args, TrainerState(), TrainerControl())  # Trainer saved: the clock starts again
    assert not step(3)
    time.sleep(0.35)
    assert not step(10)  # the last step: the finished model is the output, not a checkpoint
