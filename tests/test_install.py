"""What the README says about installing: requirements.txt gives torch a lower bound only (pip then
picks the build that fits the machine: CUDA on a GPU box), and a torch installed beforehand, such
as PyTorch's CPU-only build on a machine without a GPU, is kept, not replaced by a newer build
from the index. Checked with pip's own resolver (`pip install --dry-run --report`) in a new venv,
offline: its index is a folder of metadata-only wheels."""
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def test_torch_has_a_lower_bound_only():
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    (torch_line,) = [line for line in lines if re.match(r"torch\b", line)]
    assert re.fullmatch(r"torch>=[\d.]+", torch_line), torch_line  # no ==, no upper bound, no +cpu, no index


def metadata_wheel(folder, name, version, metadata):
    """A wheel holding only a distribution's METADATA: all pip's resolver reads in a dry run."""
    dist = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{dist}.dist-info/METADATA", metadata)
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def metadata_text(dist):
    """A distribution's core metadata as METADATA holds it, whatever installed it: a .dist-info's
    METADATA, or an .egg-info's PKG-INFO (what an old pip's `setup.py install` of an sdist leaves,
    e.g. antlr4-python3-runtime 4.9.3, which dvc's hydra needs), whose requirements live apart in
    requires.txt; importlib.metadata reads both."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO")
    if dist.requires and not dist.metadata.get_all("Requires-Dist"):
        headers, blank, body = text.partition("\n\n")
        text = headers.rstrip("\n") + "".join(f"\nRequires-Dist: {r}" for r in dist.requires) + "\n" + blank + body
    return text


def with_version(metadata, version):
    return re.sub(r"(?m)^Version: .*$", f"Version: {version}", metadata, count=1)


def test_installing_the_requirements_keeps_an_installed_torch_older_than_the_index_has(tmp_path):
    """A venv holds this environment's torch (e.g. 2.13.0+cpu from PyTorch's CPU index); the index
    offers every distribution of this environment (what requirements.txt needs, whole) and a newer
    torch, as PyPI has one before PyTorch's CPU index does. After `bash scripts/test.sh` this
    environment already holds what pip chose, so a dry run here could not tell; a new venv can."""
    index = tmp_path / "index"
    index.mkdir()
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) != "pip":
            metadata_wheel(index, dist.metadata["Name"], dist.version, metadata_text(dist))
    torch = importlib.metadata.distribution("torch")
    installed = Version(torch.version)
    newer = f"{installed.major}.{installed.minor + 1}.0"
    metadata_wheel(index, "torch", newer, with_version(metadata_text(torch), newer))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    info = Path(site) / f"torch-{torch.version}.dist-info"  # installed, as pip records it; no code needed
    info.mkdir()
    (info / "METADATA").write_text(metadata_text(torch))
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")

    report = tmp_path / "report.json"
    # the user's pip settings (PIP_FIND_LINKS, an index) would add other candidates: only the folder counts
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--quiet",
                             "--report", str(report), "--no-index", "--find-links", str(index),
                             "-r", str(REPO / "requirements.txt")],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    would_install = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                     for item in json.loads(report.read_text())["install"]}
    assert "transformers" in would_install, would_install  # the venv was empty: it resolved the requirements
    assert "torch" not in would_install, (f"pip would replace the installed torch {torch.version} "
                                          f"with {would_install['torch']}")
