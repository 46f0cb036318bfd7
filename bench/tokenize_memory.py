"""Peak memory of the tokenize stage as the data grows: the stage run as a subprocess on the
embedded corpus and on the corpus copied N times (each copy's texts made distinct), its peak
resident set as the kernel accounts it.

The stage is started by a small Python launcher, which reads its child's peak: a process forked
from a big one (this benchmark holds torch and a model) starts with the parent's pages counted in
its own peak, which made a 0.38 GB run read as 0.59 GB."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from reading.csvfiles import write_csv

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
    (folder / "data/processed/shape.json").write_text(json.dumps({"kind": "classification", "pair_columns": []}))
    return folder


# runs argv[1:], then prints the child's exit code and peak resident set in KiB (Linux)
LAUNCHER = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
            "print(code, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def stage_environment(environ):
    """The stage's environment: environ with the repo first on PYTHONPATH, and what PYTHONPATH held
    after it (the GPU machine's packages are installed there: without them the stage cannot load MiniLM)."""
    return dict(environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), environ.get("PYTHONPATH")])))


def stage_peak_rss(folder):
    """(peak resident memory in GB, wall seconds) of `python -m stages.tokenize` run in folder."""
    env = stage_environment(os.environ)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "stages.tokenize"], cwd=folder,
                            env=env, capture_output=True, text=True)
    code, kib = map(int, result.stdout.split()[-2:])
    if code != 0:
        sys.exit(f"the tokenize stage failed in {folder}:\n{result.stderr[-2000:]}")
    return kib / 2**20, time.perf_counter() - start


def tokenize_memory(texts, labels, copies=(1, 10)):
    """{copies: (number of texts, peak GB, seconds)} of the tokenize stage."""
    found = {}
    with tempfile.TemporaryDirectory() as root:
        for n in copies:
            folder = prepared_folder(root, texts, labels, n)
            found[n] = (n * len(texts), *stage_peak_rss(folder))
            shutil.rmtree(folder)
    return found
