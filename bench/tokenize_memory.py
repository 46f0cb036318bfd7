"""Peak memory of the tokenize stage as the data grows: the stage run as a subprocess on the
embedded corpus and on the corpus copied N times (each copy's texts made distinct), its peak
resident set read from the kernel's accounting of that one child (os.wait4)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from stages.csvfiles import write_csv

REPO = Path(__file__).resolve().parents[1]


def prepared_folder(root, texts, labels, copies):
    """A folder with params.yaml and data/processed/ holding `copies` copies of the texts as train.csv."""
    folder = Path(root) / f"x{copies}"
    (folder / "data/processed").mkdir(parents=True)
    shutil.copy(REPO / "params.yaml", folder / "params.yaml")
    # " (copy k)" keeps every text distinct, as a real corpus of that size would be
    frame = pd.DataFrame({"text": [text if k == 0 else f"{text} (copy {k})" for k in range(copies) for text in texts],
                          "label": [label for _ in range(copies) for label in labels]})
    write_csv(frame, folder / "data/processed/train.csv")
    (folder / "data/processed/labels.json").write_text(json.dumps(sorted(set(labels))))
    return folder


def stage_peak_rss(folder):
    """(peak resident memory in GB, wall seconds) of `python -m stages.tokenize` run in folder."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "stages.tokenize"], cwd=folder, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        sys.exit(f"the tokenize stage failed in {folder}:\n{process.stderr.read().decode()[-2000:]}")
    return usage.ru_maxrss / 2**20, time.perf_counter() - start  # ru_maxrss is in KiB on Linux


def tokenize_memory(texts, labels, copies=(1, 10)):
    """{copies: (number of texts, peak GB, seconds)} of the tokenize stage."""
    found = {}
    with tempfile.TemporaryDirectory() as root:
        for n in copies:
            folder = prepared_folder(root, texts, labels, n)
            found[n] = (n * len(texts), *stage_peak_rss(folder))
            shutil.rmtree(folder)
    return found
