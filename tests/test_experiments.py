"""Experiments end to end: two queued `dvc exp run`s with different train.lr, run two at a time
by two queue workers in a fresh `git clone` (no DVC cache, no outputs, nothing untracked), then
compared with `dvc exp show`, `dvc exp diff` and `dvc plots diff`. The runs are those of
tests/test_queue_devices.py (one worker per GPU, started by `dvc queue start -j 1`, then `-j 2`):
conftest.py's queued_experiments runs them once for both modules."""
import csv
import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_pipeline import CODE_FOLDERS, REPO, dvc, run

QUEUE_TIMEOUT = 900  # seconds for both queued runs (each runs all five stages)
# both learn the tiny task with margin (tests.test_pipeline.TINY_PARAMS: by epoch 3 of 10 for 8 seeds each),
# and neither is TINY_PARAMS' 2e-3, so each shows that `-S` reached its run; at 3e-3 one seed stalled
# for 6 epochs, at 5e-3 half of them to the end
LEARNING_RATES = {"lr-small": 1e-3, "lr-large": 1.5e-3}
# what every experiment must reach on the tiny keyword task (chance: about 0.33; measured: 1.0)
FLOOR = 0.8
# the README's `dvc exp show --drop '.*' --keep ...`: the columns worth comparing
SHOW_COLUMNS = r"Experiment|train\.lr|train\.epochs|val\.accuracy|val\.f1_macro|test\.f1_macro"


def clone(source, dest):
    """A fresh `git clone`: what a teammate or a new Colab runtime starts from."""
    run(["git", "clone", "-q", str(source), str(dest)], Path(dest).parent)
    run(["git", "config", "user.name", "pipeline-test"], dest)
    run(["git", "config", "user.email", "pipeline-test@localhost"], dest)
    return Path(dest)


def wait_for_queue(repo, names, timeout=QUEUE_TIMEOUT):
    """Poll `dvc queue status` until none of names is queued or running; return the table.
    On timeout, kill the runs and fail with their logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        table = dvc("queue", "status", cwd=repo).stdout
        if not any(word in table for word in ("Queued", "Running")):
            return table
        time.sleep(3)
    logs = queue_logs(repo, names)
    dvc("queue", "kill", *names, cwd=repo, check=False)
    raise AssertionError(f"queued experiments not done after {timeout}s:\n{table}\n{logs}")


def queue_logs(repo, names):
    return "\n".join(dvc("queue", "logs", name, cwd=repo, check=False).stdout for name in names)


def experiments_by_name(shown):
    """{name: {"params": {...}, "metrics": {...}}} of the experiments in `dvc exp show --json`."""
    found = {}
    for baseline in shown:
        for exp in baseline.get("experiments") or []:
            for revision in exp.get("revs") or []:
                data = revision.get("data") or {}
                found[revision.get("name") or data.get("name")] = {
                    "params": data.get("params", {}), "metrics": data.get("metrics", {}),
                    "error": revision.get("error") or data.get("error")}
    return found


@pytest.fixture(scope="module")
def queued(queued_experiments):
    """The clean clone in which the two queued experiments ran (conftest.py)."""
    repo, _, _ = queued_experiments
    return repo


def learned(name, exp):
    """Assert that an experiment of `dvc exp show --json` learned the tiny task, by both of its scores:
    the train stage's last evaluation and the evaluate stage's, recomputed from the predictions."""
    train = exp["metrics"]["reports/train/fold-0/metrics.json"]["data"]
    evaluation = exp["metrics"]["reports/evaluate/metrics.json"]["data"]
    assert train["eval"]["f1_macro"] >= FLOOR, (name, train)
    assert evaluation["val"]["accuracy"] >= FLOOR and evaluation["test"]["f1_macro"] >= FLOOR, (name, evaluation)
    # one set of validation predictions, scored by Trainer and by the evaluate stage
    assert evaluation["val"]["f1_macro"] == pytest.approx(train["eval"]["f1_macro"], abs=1e-4), (name, evaluation)


def test_queued_experiments_are_listed_with_their_params_and_metrics(queued):
    shown = json.loads(dvc("exp", "show", "--json", cwd=queued).stdout)
    experiments = experiments_by_name(shown)
    assert set(LEARNING_RATES) <= set(experiments), sorted(experiments)
    for name, lr in LEARNING_RATES.items():
        exp = experiments[name]
        assert exp["error"] is None, (name, exp["error"])
        assert exp["params"]["params.yaml"]["data"]["train"]["lr"] == lr
        learned(name, exp)


def test_each_experiment_trained_with_its_own_learning_rate(queued):
    # dvclive's curve holds the learning rate the scheduler really used; its peak is train.lr,
    # so this fails if `-S train.lr=...` never reached the training. Read through `dvc plots
    # diff`, which finds the curve in git or in the DVC cache, wherever dvc.yaml keeps it.
    curve = "reports/train/fold-0/plots/metrics/learning_rate.tsv"
    shown = json.loads(dvc("plots", "diff", *LEARNING_RATES, "--json", "--targets", curve, cwd=queued).stdout)
    points = shown["data"][curve][0]["content"]["data"]["values"]
    for name, lr in LEARNING_RATES.items():
        peak = max(float(p["learning_rate"]) for p in points if p["rev"] == name)
        assert peak == pytest.approx(lr, rel=0.2), (name, peak)


def test_exp_show_with_the_readme_columns_lists_both(queued):
    # the README's command for a readable table: the params and metrics worth comparing
    out = dvc("exp", "show", "--csv", "--drop", ".*", "--keep", SHOW_COLUMNS, cwd=queued).stdout
    rows = {row["Experiment"]: row for row in csv.DictReader(io.StringIO(out))}
    assert set(LEARNING_RATES) <= set(rows), out
    experiments = experiments_by_name(json.loads(dvc("exp", "show", "--json", cwd=queued).stdout))
    for name, lr in LEARNING_RATES.items():
        assert float(rows[name]["train.lr"]) == lr, out
        assert set(rows[name]) == {"Experiment", "train.lr", "train.epochs", "val.accuracy", "val.f1_macro",
                                   "test.f1_macro"}, out  # the columns kept, no others
        # the table's figures are the experiment's own (evaluate's metrics.json), as --json has them
        evaluation = experiments[name]["metrics"]["reports/evaluate/metrics.json"]["data"]
        for column in ("val.accuracy", "val.f1_macro", "test.f1_macro"):
            split, metric = column.split(".")
            shown = float(rows[name][column])
            assert shown == pytest.approx(evaluation[split][metric], abs=1e-4) and shown >= FLOOR, (name, column, out)


def test_exp_diff_and_plots_diff_compare_the_two(queued):
    # --all: tiny runs may well score the same, and exp diff hides unchanged metrics
    diff = json.loads(dvc("exp", "diff", "lr-small", "lr-large", "--all", "--json", cwd=queued).stdout)
    small, large = LEARNING_RATES.values()
    assert diff["params"]["params.yaml"]["train.lr"] == pytest.approx({"old": small, "new": large,
                                                                       "diff": large - small})
    assert "val.accuracy" in diff["metrics"]["reports/evaluate/metrics.json"], diff["metrics"]
    dvc("plots", "diff", "lr-small", "lr-large", "-o", "compare", cwd=queued)
    page = (queued / "compare/index.html").read_text()
    for name in LEARNING_RATES:
        assert f'"rev": "{name}"' in page, f"{name}'s points missing from the plots diff page"
    for plot in declared_plots(queued):
        # a declared folder (the train stage's eval curves) is one chart per file, each id starting with its path
        assert f'id = "{re.sub(r"[^A-Za-z0-9_-]", "_", plot)}' in page, f"{plot} missing from the plots diff page"


def test_everything_the_pipeline_reads_is_tracked_by_git():
    """Queued and temp runs see only what git tracks: a dep that no stage writes must be
    committed and not ignored, or `dvc exp run --queue` fails in a clean checkout."""
    stages = resolved_stages(REPO)
    written = {path for stage in stages.values() for path in stage["outs"]}
    needed = {"dvc.yaml", "params.yaml", *(str(p.relative_to(REPO)) for folder in CODE_FOLDERS
                                            for p in (REPO / folder).rglob("*.py"))}
    for stage in stages.values():
        # a dep written by a stage, or a folder of stages' outputs (evaluate's predictions/), comes from dvc
        needed |= {dep for dep in stage["deps"] if not any(under(dep, out) or under(out, dep) for out in written)}
    tracked = set(run(["git", "ls-files", "--", *sorted(needed)], REPO).stdout.split())
    # a folder (evaluate's students/, kept by its README until a student writes there) counts by its files
    untracked = sorted(path for path in needed if path not in tracked and not any(under(t, path) for t in tracked))
    assert not untracked, f"not committed to git, so queued/temp experiments cannot see them: {untracked}"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *sorted(needed)], cwd=REPO,
                             capture_output=True, text=True).stdout.split()
    assert not ignored, f"ignored by .gitignore, so queued/temp experiments cannot see them: {ignored}"


def resolved_stages(repo):
    """{stage name: {"outs": [...], "plots": [...], "deps": [...]}} as DVC reads dvc.yaml in repo,
    foreach expanded (train@0, train@1, ...): outs holds every declared output, metrics and
    plots included."""
    from dvc.repo import Repo

    with Repo(str(repo)) as dvc_repo:
        return {stage.addressing: {"outs": [out.def_path for out in stage.outs],
                                   "plots": [out.def_path for out in stage.outs if out.plot],
                                   "deps": [dep.def_path for dep in stage.deps]}
                for stage in dvc_repo.index.stages}


def declared_plots(repo):
    return [plot for stage in resolved_stages(repo).values() for plot in stage["plots"]]


def under(path, folder):
    return path == folder or path.startswith(folder.rstrip("/") + "/")
