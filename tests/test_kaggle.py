"""A Kaggle code competition, headless: `python -m bundle` makes the bundle of the session's trained run
(its wheels downloaded by pip from a folder standing in for PyPI: wheels made here of the packages
installed here), and notebooks/kaggle.ipynb runs top to bottom (nbclient, a real IPython kernel) in a Python
that holds what Kaggle's image holds and the bundle leaves to it (torch, numpy, pandas, scipy, scikit-learn
and the Jupyter kernel; no transformers), with no network: pip has no index and every proxy is a closed
port. It finds the bundle and the hidden test file under its input folder, installs from the bundle, and
its submission must be what `python -m predict` writes here on the same hidden rows."""
import base64
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.servers import require_module
from tests.test_pipeline import REPO, stage_env

NOTEBOOK = REPO / "notebooks/kaggle.ipynb"
# what a Kaggle image holds that predicting uses, and the kernel that runs the notebook
KAGGLE_IMAGE = ["torch", "numpy", "pandas", "scipy", "scikit-learn", "ipykernel"]
CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens there, so any request fails at once


def closure(names):
    """The installed distributions `names` need, themselves included (requirements that apply here, no extras)."""
    found, todo = {}, list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        try:
            found[name] = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in found[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def wheel_of(dist, folder):
    """A wheel made of an installed distribution's files (its RECORD), tagged as the wheel it came from."""
    tags = [line.split(":", 1)[1].strip().split("-") for line in dist.read_text("WHEEL").splitlines()
            if line.startswith("Tag:")]
    tag = "-".join(".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3))
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"]).lower()
    path = folder / f"{name}-{dist.version}-{tag}.whl"
    base = Path(dist.locate_file(""))
    files = [f for f in dist.files if not str(f).startswith("..") and "__pycache__" not in f.parts
             and f.name not in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")]
    info = next(f.parts[0] for f in dist.files if f.parts[0].endswith(".dist-info"))
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as wheel:
        for file in files:
            data = (base / file).read_bytes()
            wheel.writestr(str(file), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{file},sha256={digest},{len(data)}")
        wheel.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def kaggle_python(folder):
    """A new venv whose Python also sees the image's packages (KAGGLE_IMAGE and what they need) through a .pth
    file: links to this environment's installed files, as an image's site-packages would hold them."""
    subprocess.run([sys.executable, "-m", "venv", str(folder / "venv")], check=True, timeout=300)
    python = folder / "venv/bin/python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    image = folder / "image"
    image.mkdir()
    for dist in closure(KAGGLE_IMAGE).values():
        base = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files if not str(f).startswith("..")}:
            if not (image / top).exists() and (base / top).exists():
                (image / top).symlink_to(base / top)
    (site / "kaggle-image.pth").write_text(f"{image}\n")
    return python, site


def kernel_spec(folder, python):
    """A Jupyter kernel of that Python, found through JUPYTER_PATH."""
    spec = folder / "jupyter/kernels/kaggle"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({"argv": [str(python), "-m", "ipykernel_launcher", "-f",
                                                           "{connection_file}"], "display_name": "kaggle",
                                                  "language": "python"}))
    return folder / "jupyter"


def offline_env(home):
    """No network for pip or the hub: no index, no config (this machine's names local indexes), closed proxies."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    return {**env, "HOME": str(home), "PIP_CONFIG_FILE": os.devnull, "OMP_NUM_THREADS": "1",
            **{name: CLOSED_PORT for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}}


def bundle(repo, out, pypi, *args):
    env = {**offline_env(Path.home()), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(pypi), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "bundle", str(out), *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def competition(pipeline, tmp_path_factory):
    """The bundle of the session's run and a hidden test file, in a Kaggle input folder; the notebook run."""
    nbclient = require_module("nbclient", "nbclient")
    repo = pipeline[0]
    folder = tmp_path_factory.mktemp("kaggle")
    pypi = folder / "pypi"
    pypi.mkdir()
    from predicting.bundling import distributions_of, needed_code

    for dist in closure(distributions_of(needed_code(REPO)[1])).values():
        if canonicalize_name(dist.metadata["Name"]) != "torch":
            wheel_of(dist, pypi)
    made = bundle(repo, folder / "input/my-bundle", pypi)
    assert made.returncode == 0 and "Traceback" not in made.stderr, made.stdout + made.stderr
    hidden = pd.read_csv(repo / "data/raw/test.csv", dtype=str).drop(columns="sentiment").iloc[::-1]
    hidden["id"] = [f"h{i}" for i in range(len(hidden))]  # ids the run never saw
    (folder / "input/competition").mkdir(parents=True)
    hidden.to_csv(folder / "input/competition/test.csv", index=False)

    python, site = kaggle_python(folder)
    before = {p.name for p in site.iterdir()}
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    settings = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    settings.source += (f"\n# injected by tests/test_kaggle.py\nINPUT = {str(folder / 'input')!r}\n"
                        f"SUBMISSION = {str(folder / 'working/submission.csv')!r}")
    (folder / "home").mkdir()
    os.environ["JUPYTER_PATH"] = str(kernel_spec(folder, python))
    try:
        client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="kaggle",
                                         resources={"metadata": {"path": str(folder)}})
        client.execute(env=offline_env(folder / "home"))
    finally:
        del os.environ["JUPYTER_PATH"]
    return {"repo": repo, "folder": folder, "pypi": pypi, "notebook": notebook, "made": made.stdout,
            "installed": {p.name for p in site.iterdir()} - before}


def printed(notebook):
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", output
            texts.append(output.get("text", "") + json.dumps(output.get("data", {})))
    return "\n".join(texts)


def test_the_notebook_submits_what_predict_writes_here_on_the_hidden_rows(competition):
    folder, repo = competition["folder"], competition["repo"]
    expected = folder / "expected.csv"
    result = subprocess.run([sys.executable, "-m", "predict", str(folder / "input/competition/test.csv"), "--out",
                             str(expected)], cwd=repo, env={**stage_env(), "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    submitted = pd.read_csv(folder / "working/submission.csv", dtype=str)
    assert submitted.equals(pd.read_csv(expected, dtype=str))
    assert submitted["id"].tolist() == [f"h{i}" for i in range(60)]


def test_it_installed_transformers_from_the_bundle_and_said_the_time_before_predicting(competition):
    said = printed(competition["notebook"])
    assert any(name.startswith("transformers-") and name.endswith(".dist-info") for name in competition["installed"])
    estimate = re.search(r"fold-0: [\d,.]+ rows/s on cpu \(a sample of the rows\); the 1 model\(s\) take about", said)
    assert estimate and said.index(estimate[0]) < said.index("predicted 60 rows"), said
    assert "working/submission.csv: 60 rows" in said


def test_the_bundle_holds_the_folds_the_code_predict_imports_and_a_wheel_per_package(competition):
    out = competition["folder"] / "input/my-bundle"
    info = json.loads((out / "bundle.json").read_text())
    assert info["models"] == ["models/fold-0"] and info["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert (out / "models/fold-0/pipeline.json").is_file() and (out / "data/processed/submission.json").is_file()
    assert (out / "predict.py").is_file() and not (out / "stages").exists() and not (out / "training").exists()
    wheels = {canonicalize_name(w.name.split("-")[0]) for w in (out / "wheels").glob("*.whl")}
    assert wheels == set(info["packages"]) and "torch" not in wheels and "transformers" in wheels
    pinned = (out / "wheels/requirements.txt").read_text().split()
    assert f"transformers=={importlib.metadata.version('transformers')}" in pinned


def test_a_bundle_into_a_folder_that_holds_files_is_one_line_and_touches_nothing(competition, tmp_path):
    (tmp_path / "mine.txt").write_text("kept")
    result = bundle(competition["repo"], tmp_path, competition["pypi"])
    assert result.returncode == 1 and result.stderr.splitlines() == [
        f"error: {tmp_path} exists and is not an empty folder: name a new one"], result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
