"""Row 6: the wall time of a no-op `dvc repro` over a reproduced pipeline (built here with a tiny model
unless --repo names one)."""
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from transformers import BertConfig, BertModel

from bench.common import GOALS, REPO, verdict


def command(args, cwd, timeout=1800):
    """Run a command with this interpreter's folder first on PATH (dvc.yaml says `python`)."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed in {cwd}:\n"
                 f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return result.stdout


def dvc(*args, cwd):
    return command([sys.executable, "-m", "dvc", *args], cwd)


def build_pipeline_repo(root, tokenizer):
    """This pipeline with its default data and params in a fresh git + DVC repo, reproduced. Two
    changes make the full `dvc repro` take about a minute, and leave the no-op as it is: the model
    is a tiny randomly initialised BERT, and the effective batch is 512 (70 optimizer steps)."""
    model_dir = root / "tiny_model"
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    repo = root / "pipeline"
    repo.mkdir()
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO / name, repo / name)
    for folder in ("stages", "pipeline", "fetching", "reading", "tasks", "training", "predicting", "modeling", "baselines",
                   "students"):  # what dvc.yaml runs, and the students' folder evaluate depends on
        shutil.copytree(REPO / folder, repo / folder, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["model"]["name"] = str(model_dir)
    params["train"]["effective_batch_size"] = 512
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    command(["git", "init", "-q"], repo)
    dvc("init", "-q", cwd=repo)
    dvc("config", "core.analytics", "false", cwd=repo)  # as this repository's .dvc/config has it
    command(["git", "add", "-A"], repo)
    command(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "pipeline"],
            repo)
    start = time.perf_counter()
    dvc("repro", cwd=repo)
    print(f"   (built {repo} with a tiny model: full dvc repro {time.perf_counter() - start:.0f} s)")
    return repo


def require_reproduced(repo):
    if dvc("status", "--json", cwd=repo).strip() not in ("{}", ""):
        sys.exit(f"{repo}: dvc status shows changes; run `dvc repro` there first, then time the no-op")


def noop_repro_seconds(repo, runs=3):
    """Median wall time of `dvc repro` in a repo where nothing changed; exits if a stage runs."""
    require_reproduced(repo)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = dvc("repro", cwd=repo)
        times.append(time.perf_counter() - start)
        if re.search(r"Running stage", out):
            sys.exit(f"{repo}: `dvc repro` ran a stage, so it was not a no-op:\n{out}")
    return statistics.median(times)


def report_dvc(repo_option, tokenizer):
    if importlib.util.find_spec("dvc") is None:
        print("6. no-op dvc repro: skipped, dvc is not installed in this Python")
        return
    with tempfile.TemporaryDirectory() as root:
        repo = repo_option.resolve() if repo_option else build_pipeline_repo(Path(root), tokenizer)
        seconds = noop_repro_seconds(repo)
    where = repo_option or "the default pipeline (tiny model)"
    print(f"6. no-op dvc repro in {where}: {seconds:.2f} s, median of 3 (goal <= {GOALS['dvc_s']:.0f} s: "
          f"{verdict(seconds, GOALS['dvc_s'], at_least=False)})")
