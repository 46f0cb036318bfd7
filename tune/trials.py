"""Running one trial: `dvc exp run --temp -n <study>-<number> -S key=value ...`, a DVC experiment in a
temporary copy of the repository (your workspace is not touched), its output in a log file; then its
score, read back from the experiment."""
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

from pipeline.command import redact
from training.checkpoint import CHECKPOINTS_ENV
from training.pruning import TRIAL_ENV
from tune.settings import TUNING, yaml_value

METRICS = "reports/evaluate/metrics.json"
START_LOCK = TUNING / ".starting.lock"
STARTED_RE = re.compile(r"^(Running stage|Stage '.*' didn't change|Stage '.*' is cached)", re.M)
STAGE_TIME_RE = re.compile(r"^train@\d+: (?:wrote .* in|pruned in) ([\d.]+) s$", re.M)  # a train stage's own time
INTERRUPT_WAIT = 600  # seconds a stopped trial may take to save its checkpoint before it is killed


@dataclass
class Outcome:
    returncode: int
    seconds: float
    train_seconds: float
    error: str  # the last error line of the log, for a failed trial


def dvc_command(name, assignments):
    """The experiment's command line: every searched value as -S key=value."""
    return [sys.executable, "-m", "dvc", "exp", "run", "--temp", "-n", name,
            *[f"-S{key}={yaml_value(value)}" for key, value in assignments.items()]]


@contextmanager
def start_lock():
    """DVC's --temp runs of one clone pass through one stash of pending runs, and two started at the same
    moment can swap their params (README, Multi-GPU). Workers of one clone take this lock until their
    trial's run has left the stash; then the next may start."""
    START_LOCK.parent.mkdir(exist_ok=True)
    with open(START_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def wait_until_started(process, log, timeout=120):
    """Until the log shows DVC reproducing stages (the run left the stash), the run ended, or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if STARTED_RE.search(log.read_text(errors="replace")):
            return
        time.sleep(0.2)


def run(name, assignments, link, log, checkpoints):
    """Run one trial's experiment under tune.guard; its output goes to `log`. Ctrl-C while it runs is
    passed on to it (its train stage saves a checkpoint and stops), then raised here."""
    env = dict(os.environ, **{TRIAL_ENV: link.to_env(), CHECKPOINTS_ENV: str(checkpoints)})
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log, "w") as out, start_lock():
        process = subprocess.Popen([sys.executable, "-m", "tune.guard", *dvc_command(name, assignments)],
                                   stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        wait_until_started(process, log)
    try:
        returncode = process.wait()
    except KeyboardInterrupt:
        interrupt(process)
        raise
    finally:
        process.stdin.close()  # the guard's pipe: closed, it would stop a run still going
    text = log.read_text(errors="replace")
    errors = [line for line in text.splitlines() if line.startswith(("error:", "ERROR:"))]
    return Outcome(returncode, time.monotonic() - start, sum(map(float, STAGE_TIME_RE.findall(text))),
                   errors[0] if errors else f"exited with {returncode}")


def interrupt(process):
    """Ctrl-C reached the tuner: pass it to the trial's session and let the train stage save its checkpoint;
    a second Ctrl-C stops it at once."""
    print("\nstopping the running trial: its train stage saves a checkpoint (Ctrl-C again to kill it)", flush=True)
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(INTERRUPT_WAIT)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def experiment_metrics(name):
    """reports/evaluate/metrics.json of experiment `name`, read from DVC's cache."""
    import dvc.api

    return json.loads(dvc.api.read(METRICS, rev=name))


def lookup(metrics, key):
    """metrics["val"]["f1_macro"] for "val.f1_macro"; None when absent."""
    value = metrics
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def push(remote, name):
    """Share the experiment: its git ref to the git remote, its outputs and run records to the DVC remote.
    A failure is one line and the study goes on (push later with the same command)."""
    command = [sys.executable, "-m", "dvc", "exp", "push", "--run-cache", remote, name]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        last = (result.stderr or result.stdout).strip().splitlines()
        print(f"tune: could not push {name} to {remote} ({redact(last[-1]) if last else result.returncode}); "
              f"push it later: dvc exp push --run-cache {remote} {name}")
