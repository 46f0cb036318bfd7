"""notebooks/colab.ipynb run top to bottom, headless (nbclient, a real IPython kernel), as a user runs
it outside Colab: a local folder stands in for Google Drive. The settings cell is given this test's
repository, data and tiny model, as papermill injects parameters. A second run in a new working
folder, the same "Drive", is a new runtime after a reset: every stage is restored, none runs."""
import json
import re

import nbformat
import pytest
import yaml

from tests.servers import require_module
from tests.test_pipeline import REPO, init_pipeline_repo, stage_env

NOTEBOOK = REPO / "notebooks/colab.ipynb"


def execute(parameters, cwd):
    """The notebook after running every cell with `parameters` appended to its settings cell; the
    text each cell printed, joined."""
    nbclient = require_module("nbclient", "nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    settings = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    settings.source += "\n# injected by tests/test_notebook.py\n" + "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}}).execute()
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", "") + json.dumps(output.get("data", {})))
            assert output.get("output_type") != "error", output
    return "\n".join(texts)


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    root = tmp_path_factory.mktemp("notebook")
    origin = init_pipeline_repo(root / "origin", tiny_data_dir, tiny_model_dir)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PATH", stage_env()["PATH"])  # the kernel's `python` is this interpreter, as Colab's is its own
        parameters = {"REPO_URL": str(origin), "PROJECT": "p", "FETCH_SOURCE": str(tiny_data_dir),
                      "SETTINGS": {"train.epochs": 4}, "DRIVE_FOLDER": str(root / "drive")}
        first = execute({**parameters, "WORK_FOLDER": str(root / "runtime-1")}, root)
        second = execute({**parameters, "WORK_FOLDER": str(root / "runtime-2")}, root)
    yield first, second, root


def test_the_notebook_runs_the_pipeline_and_shows_the_results(runtimes):
    first, _, root = runtimes
    for stage in ("fetch", "preprocess", "tokenize", "split", "train@0", "evaluate"):
        assert f"Running stage '{stage}'" in first, stage
    assert re.search(r"epoch 4: validation accuracy [\d.]+", first)  # the setting from the settings cell
    assert "f1_macro" in first and "accuracy" in first  # the scores table
    assert "vega" in first and "f1_macro" in first  # the plots, inline
    assert (root / "drive/submission.csv").is_file()  # the submission outlives the runtime
    assert (root / "drive/dvc-cache").is_dir()
    assert yaml.safe_load((root / "runtime-1/origin/params.yaml").read_text())["train"]["epochs"] == 4


def test_a_new_runtime_restores_every_stage_from_drive(runtimes):
    _, second, root = runtimes
    for stage in ("fetch", "preprocess", "tokenize", "split", "train@0", "evaluate"):
        assert f"Stage '{stage}' is cached - skipping run" in second, (stage, second[-3000:])
        assert f"Running stage '{stage}'" not in second, stage
    assert (root / "runtime-2/origin/submission/submission.csv").is_file()
