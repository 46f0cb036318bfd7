"""What the README says about installing: requirements.txt gives torch a lower bound only (pip then
picks the build that fits the machine: CUDA on a GPU box), and a torch installed beforehand, such
as PyTorch's CPU-only build on a machine without a GPU, is kept, not replaced by pip's default
build. Checked with pip's own resolver (`pip install --dry-run --report`) in this environment."""
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_torch_has_a_lower_bound_only():
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    (torch_line,) = [line for line in lines if re.match(r"torch\b", line)]
    assert re.fullmatch(r"torch>=[\d.]+", torch_line), torch_line  # no ==, no upper bound, no +cpu, no index


def test_installing_the_requirements_keeps_the_installed_torch(tmp_path):
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                             "-r", str(REPO / "requirements.txt")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    would_install = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                     for item in json.loads(report.read_text())["install"]}
    assert "torch" not in would_install, (f"pip would replace the installed torch {torch.__version__} "
                                          f"with {would_install['torch']}")
