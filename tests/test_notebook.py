"""notebooks/colab.ipynb run top to bottom, headless (nbclient, a real IPython kernel), as a user runs
it outside Colab: a local folder stands in for Google Drive. The settings cell is given this test's
repository, data and tiny model, as papermill injects parameters. The first runtime is killed in the
middle of its training, kernel and children, as a disconnect kills them, and its folder deleted; the
notebook run again as a new runtime restores the finished stages from "Drive", resumes the fold from
its checkpoint there, and ends with the predictions of a plain `dvc repro` never stopped (the session's
pipeline fixture, at the same settings)."""
import json
import os
import re
import shutil
import signal
import time

import nbformat
import pandas as pd
import pytest
import yaml

from tests.servers import require_module
from tests.test_pipeline import PIPELINE_PARAMS, REPO, init_pipeline_repo, settle, stage_env
from tests.test_reset import newest_step

NOTEBOOK = REPO / "notebooks/colab.ipynb"
CHECKPOINT_STEPS = 20  # of the 170 steps of the tiny run (10 epochs of 17): the kill comes after one
WAIT_S = 600


def prepared(parameters):
    """The notebook with `parameters` appended to its settings cell, as papermill injects them."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    settings = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    settings.source += "\n# injected by tests/test_notebook.py\n" + "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    return notebook


def client_for(notebook, cwd):
    nbclient = require_module("nbclient", "nbclient")
    return nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(cwd)}})


def printed(cells):
    """The text the cells printed or displayed, joined; no cell may have failed."""
    texts = []
    for cell in cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", output
            texts.append(output.get("text", "") + json.dumps(output.get("data", {})))
    return "\n".join(texts)


def cell_of(notebook, heading):
    return next(c for c in notebook.cells if c.cell_type == "code" and c.source.startswith(heading))


def run_until_killed(notebook, cwd, checkpoints):
    """Run the cells up to the pipeline's, start that one, and once the training has saved a checkpoint
    past CHECKPOINT_STEPS kill the kernel's process group (the kernel, dvc, the train stage) with
    SIGKILL: no handler runs, as when Colab's runtime goes. Returns the text the earlier cells printed."""
    import psutil

    client = client_for(notebook, cwd)
    repro = notebook.cells.index(cell_of(notebook, "# Run the pipeline"))
    with client.setup_kernel():
        for index in range(repro):
            client.execute_cell(notebook.cells[index], index)
        client.kc.execute(notebook.cells[repro].source)  # not awaited: it runs while this waits
        kernel = psutil.Process(client.km.provisioner.pid)
        deadline = time.monotonic() + WAIT_S
        while newest_step(checkpoints) < CHECKPOINT_STEPS:
            assert kernel.is_running() and time.monotonic() < deadline, "no checkpoint of fold 0 in time"
            time.sleep(0.05)
        family = [kernel, *kernel.children(recursive=True)]
        assert any("stages.train" in " ".join(p.cmdline()) for p in family[1:]), "the train stage is not running"
        os.killpg(os.getpgid(kernel.pid), signal.SIGKILL)
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert not alive, alive  # every process of the runtime is gone
    return printed(notebook.cells[:repro])


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """(the first runtime's printed text before its kill, the notebook of the second runtime run to its
    end, the text it printed, the root folder). train.epochs comes from the settings cell: 10, the
    pipeline fixture's, written over the origin's 4."""
    root = tmp_path_factory.mktemp("notebook")
    origin = init_pipeline_repo(root / "origin", tiny_data_dir, tiny_model_dir, **{**PIPELINE_PARAMS, "train__epochs": 4})
    drive = root / "drive"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PATH", stage_env()["PATH"])  # the kernel's `python` is this interpreter, as Colab's is its own
        parameters = {"REPO_URL": str(origin), "PROJECT": "p", "FETCH_SOURCE": str(tiny_data_dir),
                      "SETTINGS": {"train.epochs": PIPELINE_PARAMS["train__epochs"],
                                   "machine.checkpoint_steps": CHECKPOINT_STEPS},
                      "DRIVE_FOLDER": str(drive)}
        first = run_until_killed(prepared({**parameters, "WORK_FOLDER": str(root / "runtime-1")}), root,
                                 drive / "checkpoints/fold-0")
        shutil.rmtree(root / "runtime-1")  # the runtime's disk goes with it
        second = prepared({**parameters, "WORK_FOLDER": str(root / "runtime-2")})
        client_for(second, root).execute()
    yield first, second, printed(second.cells), root


def test_the_killed_runtime_had_trained_past_a_checkpoint_on_drive(runtimes):
    first, _, _, root = runtimes
    assert f"kept on Drive: {root / 'drive'}" in first
    assert not (root / "runtime-1").exists()


def test_a_new_runtime_restores_the_finished_stages_and_resumes_the_fold(runtimes):
    _, _, second, root = runtimes
    for stage in ("fetch", "preprocess", "pretrain", "tokenize", "split"):
        assert f"Stage '{stage}' is cached - skipping run" in second, (stage, second[-3000:])
        assert f"Running stage '{stage}'" not in second, stage
    assert "Running stage 'train@0'" in second and "Running stage 'evaluate'" in second
    resumed = re.search(rf"resuming from {re.escape(str(root / 'drive/checkpoints/fold-0'))}/checkpoint-(\d+): "
                        r"step (\d+) of (\d+)", second)
    assert resumed and int(resumed[2]) >= CHECKPOINT_STEPS and int(resumed[2]) < int(resumed[3]), second[-3000:]
    assert re.search(r"epoch 10: validation accuracy [\d.]+", second)  # the setting from the settings cell
    assert yaml.safe_load((root / "runtime-2/origin/params.yaml").read_text())["train"]["epochs"] == 10


def test_the_resumed_run_predicts_as_a_run_never_stopped(runtimes, pipeline):
    _, _, _, root = runtimes
    reference = pipeline[0]
    settle(reference)  # the pipeline fixture's repo at PIPELINE_PARAMS, whatever tests ran on it before
    resumed = root / "runtime-2/origin"
    for name in ("predictions/fold-0/oof.csv", "predictions/test/fold-0.csv", "submission/probabilities.csv"):
        got, expected = (pd.read_csv(r / name) for r in (resumed, reference))
        assert list(got.columns) == list(expected.columns) and got.iloc[:, 0].equals(expected.iloc[:, 0]), name
        # fp32 on one thread (PIPELINE_PARAMS, tests/conftest.py): a resumed run sums as the other did
        assert (got.iloc[:, 1:] - expected.iloc[:, 1:]).abs().max().max() < 1e-5, name
    assert pd.read_csv(root / "drive/submission.csv").equals(pd.read_csv(reference / "submission/submission.csv"))


def test_the_scores_cell_shows_the_evaluated_scores(runtimes):
    _, notebook, _, root = runtimes
    metrics = json.loads((root / "runtime-2/origin/reports/evaluate/metrics.json").read_text())
    shown = [o["data"]["text/plain"] for o in cell_of(notebook, "# The scores that matter").outputs
             if "text/plain" in o.get("data", {})]
    assert len(shown) == 1, shown
    header, *rows = shown[0].splitlines()
    names = header.split()
    # a row: its name ("val", "baseline test", ...), then one number per column
    table = {" ".join(row.split()[:-len(names)]): dict(zip(names, map(float, row.split()[-len(names):]))) for row in rows}
    assert set(table) == {"val", "test", "baseline val", "baseline test"}, shown[0]
    for split in ("val", "test"):
        for name in ("accuracy", "f1_macro"):
            assert table[split][name] == pytest.approx(metrics[split][name], abs=1e-6), (split, name)
            assert table[f"baseline {split}"][name] == pytest.approx(metrics["baseline"][split][name], abs=1e-6)


def test_the_notebook_shows_the_plots_and_keeps_the_submission_on_drive(runtimes):
    _, notebook, _, root = runtimes
    plots = printed([cell_of(notebook, "# Training curves")])
    assert "vega" in plots and "f1_macro" in plots  # the plots, inline
    assert (root / "drive/submission.csv").is_file()  # the submission outlives the runtime
    assert (root / "drive/dvc-cache").is_dir()
