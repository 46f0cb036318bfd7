"""One GPU per queued experiment (the README's recipe), on CPU: `dvc queue start -j 1` with
CUDA_VISIBLE_DEVICES=0, then, once DVC reports that worker, `dvc queue start -j 2` with
CUDA_VISIBLE_DEVICES=1. `dvc queue start -j N` spawns each worker 1..N that is not already
running, and a spawned worker inherits the environment of the `dvc queue start` that spawned it, so
worker 2 alone is spawned, seeing GPU 1. The train stage records the CUDA_VISIBLE_DEVICES it saw in
its metrics: each experiment must show a different one, and the two must have run at the same time."""
import json
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from tests.test_experiments import LEARNING_RATES, clone, experiments_by_name, learned, queue_logs, wait_for_queue
from tests.test_pipeline import dvc, init_pipeline_repo, stage_env

GPUS = ("0", "1")  # worker k gets GPUS[k - 1]
WORKER_UP_TIMEOUT = 120  # seconds for a spawned worker to answer DVC (a few seconds here)
QUEUE_TIMEOUT = 600
TRAIN_METRICS = "reports/train/fold-0/metrics.json"
# `dvc queue status` ends with this line, counted from the same celery broadcast (`inspect().active()`)
# with which `dvc queue start` decides which worker numbers already exist
WORKER_STATUS = re.compile(r"Worker status: (\d+) active, (\d+) idle")
STARTED = re.compile(r"Started '(\d+)' new experiments task queue worker")
# Worker k's celery log, where DVC's `_spawn_worker` sends its output (appended, kept after it exits):
# a "... ready." line per celery worker that came up, a "received" and a "succeeded" line per experiment
WORKER_LOG = ".dvc/tmp/exps/celery/dvc-exp-worker-{}.out"
STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/MainProcess\] "
READY = re.compile(STAMP + r"\S+@localhost ready\.", re.MULTILINE)
TASK = re.compile(STAMP + r"Task dvc\.repo\.experiments\.queue\.tasks\.run_exp\[([\w-]+)\] "
                  r"(received|succeeded)", re.MULTILINE)


def start_worker(repo, number, gpu):
    """`dvc queue start -j number` seeing only GPU gpu; return how many workers it says it started.
    Its output goes to a file, not a pipe: the process that spawns a worker (forked by `dvc queue
    start`) keeps its stdout open until the worker exits, so reading a pipe to its end would wait
    for the whole queue."""
    with tempfile.TemporaryFile("w+") as output:
        result = subprocess.run([sys.executable, "-m", "dvc", "queue", "start", "-j", str(number)], cwd=repo,
                                env={**stage_env(), "CUDA_VISIBLE_DEVICES": gpu}, stdout=output,
                                stderr=subprocess.STDOUT, text=True, timeout=120, check=False)
        output.seek(0)
        said = output.read()
    assert result.returncode == 0, f"dvc queue start -j {number} failed ({result.returncode}):\n{said}"
    match = STARTED.search(said)
    assert match, said
    return int(match.group(1))


def wait_for_workers(repo, count, timeout=WORKER_UP_TIMEOUT):
    """Poll `dvc queue status` until count workers answer (running an experiment or idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        table = dvc("queue", "status", cwd=repo).stdout
        active, idle = map(int, WORKER_STATUS.search(table).groups())
        if active + idle >= count:
            return table
        time.sleep(0.5)  # each `dvc queue status` takes a second or more itself
    raise AssertionError(f"{count} worker(s) not up after {timeout}s:\n{table}\n{worker_logs(repo)}")


def gpus_here():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def worker_logs(repo):
    return "\n".join(f"--- worker {k}:\n{path.read_text(errors='replace')}" for k in range(1, len(GPUS) + 1)
                     if (path := repo / WORKER_LOG.format(k)).exists())


def worker_runs(repo, number):
    """(how many celery workers of this number came up, [(start, end) of each experiment it finished])."""
    text = (repo / WORKER_LOG.format(number)).read_text(errors="replace")
    times = {}
    for stamp, task, event in TASK.findall(text):
        times.setdefault(task, {})[event] = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
    return len(READY.findall(text)), [(t["received"], t["succeeded"]) for t in times.values() if len(t) == 2]


def finished_runs(repo, timeout=30):
    """worker_runs of each worker, once every experiment's "succeeded" line is in the logs: celery
    stores the result (`dvc queue status` says Success) a moment before it logs the line."""
    deadline = time.monotonic() + timeout
    while True:
        runs = {k: worker_runs(repo, k) for k in range(1, len(GPUS) + 1)}
        if sum(len(intervals) for _, intervals in runs.values()) >= len(LEARNING_RATES) \
                or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def queue_one_gpu_each(base, data_dir, model_dir):
    """A clean clone in which the two queued experiments of LEARNING_RATES ran in two workers started
    one after the other, worker k with CUDA_VISIBLE_DEVICES=GPUS[k - 1]. Returns (clone, the `dvc queue
    start` counts, each worker's worker_runs). conftest.py's queued_experiments runs it once a session:
    these experiments are also the ones tests/test_experiments.py compares."""
    origin = init_pipeline_repo(base / "origin", data_dir, model_dir)
    repo = clone(origin, base / "clone")
    for name, lr in LEARNING_RATES.items():  # queued first: a worker that finds the queue empty exits
        dvc("exp", "run", "--queue", "-n", name, "-S", f"train.lr={lr}", cwd=repo)
    started = []
    try:
        for number, gpu in enumerate(GPUS, start=1):
            started.append(start_worker(repo, number, gpu))
            wait_for_workers(repo, number)  # before the next start, or it may spawn this number again
        table = wait_for_queue(repo, list(LEARNING_RATES), timeout=QUEUE_TIMEOUT)
        done = [line for line in table.splitlines() if "Success" in line]
        if not all(any(name in line for line in done) for name in LEARNING_RATES):
            raise AssertionError(f"queued experiments failed:\n{table}\n{queue_logs(repo, LEARNING_RATES)}")
        runs = finished_runs(repo)
    finally:  # never leave a worker running, also after a failure
        dvc("queue", "stop", "--kill", cwd=repo, check=False)
    return Path(repo), started, runs


@pytest.fixture(scope="module")
def one_gpu_each(queued_experiments):
    return queued_experiments


def test_each_start_spawns_one_worker_and_each_worker_runs_one_experiment(one_gpu_each):
    repo, started, runs = one_gpu_each
    # -j 2 with worker 1 running spawns worker 2 only: workers are numbered, not added
    assert started == [1, 1], (started, worker_logs(repo))
    for number, (ups, intervals) in runs.items():
        assert ups == 1, f"worker {number} came up {ups} times\n{worker_logs(repo)}"
        assert len(intervals) == 1, f"worker {number} ran {len(intervals)} experiments\n{worker_logs(repo)}"


def test_the_two_experiments_ran_at_the_same_time(one_gpu_each):
    # from the workers' own logs, not from catching both Running in a poll: when each task started
    # and ended; two intervals overlap when each starts before the other ends
    repo, _, runs = one_gpu_each
    assert all(len(intervals) == 1 for _, intervals in runs.values()), (runs, worker_logs(repo))
    (start_1, end_1), (start_2, end_2) = (intervals[0] for _, intervals in runs.values())
    assert start_1 < end_2 and start_2 < end_1, (runs, worker_logs(repo))


def test_each_experiment_saw_its_workers_gpu(one_gpu_each):
    repo, _, _ = one_gpu_each
    experiments = experiments_by_name(json.loads(dvc("exp", "show", "--json", cwd=repo).stdout))
    assert set(LEARNING_RATES) <= set(experiments), sorted(experiments)
    seen = {}
    for name, lr in LEARNING_RATES.items():
        exp = experiments[name]
        assert exp["error"] is None, (name, exp["error"])
        assert exp["params"]["params.yaml"]["data"]["train"]["lr"] == lr
        train = exp["metrics"][TRAIN_METRICS]["data"]
        learned(name, exp)  # the experiment trained, on whatever device it saw
        seen[name] = train["cuda_visible_devices"]
        # CPU in CI, where what matters is the variable; on a GPU machine, CUDA where that GPU exists
        assert train["device"] == ("cuda" if int(seen[name] or 0) < gpus_here() else "cpu"), (name, train)
    # the worker's environment reached its experiment's stages: one GPU each, both GPUs used
    assert sorted(seen.values()) == sorted(GPUS), seen
