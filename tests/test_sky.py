"""Rented GPUs (docs/rented-gpus.md): scripts/worker.sh run as two rented machines would run it, each in
a fresh clone at the team's commit, at the same time, against one PostgreSQL study and one DVC remote
folder; then checked from outside the workers: the study in the database, the experiments a third clone
pulls, the folds a third clone combines without training, the logs without the database's password. A
fold trainer killed outright (a preempted spot machine) is started again in a new clone, as SkyPilot
would, and resumes from the checkpoints it left on the "bucket".

No cloud is launched here. SkyPilot's own parser reads scripts/skypilot/*.yaml, from .venv-sky: a
virtualenv that scripts/test.sh makes, apart from .venv, since skypilot's pins would replace click,
httpx and paramiko under dvc."""
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.servers import free_port, postgres_server
from tests.test_experiments import experiments_by_name
from tests.test_pipeline import REPO, commit_all, dvc, run, set_params, stage_env
from tests.test_tune import study_trials, tune_repo

WORKER = "scripts/worker.sh"
TASK_FILES = {"tune": REPO / "scripts/skypilot/tune-worker.yaml", "folds": REPO / "scripts/skypilot/train-folds.yaml"}
SKY_PYTHON = REPO / ".venv-sky/bin/python"
TRIALS = 2  # one for each worker: no more trials than it takes to see the study shared
WORKER_TIMEOUT = 600


@pytest.fixture(scope="module")
def pg():
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="module")
def team(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """The team's repository: the tiny pipeline, a study of TRIALS trials that are never pruned (each one
    completes, so the count is known), this project's worker script, a DVC remote folder, and the data
    stages run once and pushed, dvc.lock committed. Yields (its path, the remote's path)."""
    base = tmp_path_factory.mktemp("team")
    origin = tune_repo(base / "origin", tiny_data_dir, tiny_model_dir, study="sky", trials=TRIALS,
                       tune__pruner="none", train__epochs=2)  # 2 epochs: a score, in a few seconds
    (origin / "scripts").mkdir()
    shutil.copy(REPO / WORKER, origin / WORKER)
    dvc("remote", "add", "-d", "shared", str(base / "dvc-remote"), cwd=origin)
    dvc("repro", "pretrain", "tokenize", "split", cwd=origin)  # the data stages, run once before renting machines
    dvc("push", cwd=origin)
    commit_all(origin, "the worker script, a shared DVC remote, the data stages' outputs")
    yield origin, base / "dvc-remote"


def machine(origin, path):
    """A rented machine's clone, as SkyPilot's workdir makes it: the repository at one commit (detached),
    in a home with no git identity of its own. Returns (clone, its HOME)."""
    commit = run(["git", "rev-parse", "HEAD"], origin).stdout.strip()
    run(["git", "clone", "-q", str(origin), str(path)], path.parent)
    run(["git", "checkout", "-q", commit], path)
    home = path.with_name(f"{path.name}-home")
    home.mkdir()
    return path, home


def start_worker(clone, home, mode, log, **env):
    """bash scripts/worker.sh <mode> in the background, in its own session (a machine's processes), its
    output to log. The environment is what the task file gives it; HOME, a new machine's."""
    environ = dict(stage_env(), HOME=str(home), GIT_CONFIG_NOSYSTEM="1", **env)
    with open(log, "w") as out:
        return subprocess.Popen(["bash", WORKER, mode], cwd=clone, env=environ, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def finish(workers, logs):
    """Wait for the workers; fail with the logs of any that did not end well."""
    for worker, log in zip(workers, logs):
        try:
            worker.wait(WORKER_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
    failed = [f"{log}:\n{Path(log).read_text()[-4000:]}" for worker, log in zip(workers, logs) if worker.returncode]
    assert not failed, "\n\n".join(failed)


def test_two_tune_workers_share_the_study_and_push_every_trial(tmp_path, team, pg):
    origin, remote = team
    clones = [machine(origin, tmp_path / f"machine{k}") for k in (1, 2)]
    buckets = [tmp_path / "bucket" / f"worker{k}" for k in (1, 2)]
    logs = [tmp_path / f"worker{k}.log" for k in (1, 2)]
    workers = [start_worker(clone, home, "tune", log, TUNE_STORAGE=pg.url(), CHECKPOINT_DIR=str(bucket),
                            TRIALS=str(TRIALS))
               for (clone, home), bucket, log in zip(clones, buckets, logs)]
    finish(workers, logs)
    outputs = [log.read_text() for log in logs]

    # the database: every trial complete, none twice, and each worker ran some of them
    trials = study_trials(origin, name="sky", url=pg.url())
    started = [t for t in trials if not t.user_attrs.get("over_budget")]  # given back unstarted (tune/budget.py)
    complete = {t.number: t for t in started if t.state.name == "COMPLETE"}
    assert len(complete) == len(started) == TRIALS, [(t.number, t.state.name) for t in trials]
    ran = [{int(n) for n in re.findall(r"^trial (\d+) \(", out, re.M)} for out in outputs]
    assert all(ran) and not ran[0] & ran[1] and ran[0] | ran[1] == set(complete), (ran, outputs)

    # the remotes: a third clone pulls every trial's experiment, with the score the study holds, and the
    # DVC remote's folder holds each trial's model
    third = tmp_path / "third"
    run(["git", "clone", "-q", str(origin), str(third)], tmp_path)
    dvc("exp", "pull", "origin", *[f"sky-{n}" for n in complete], cwd=third)
    pulled = experiments_by_name(json.loads(dvc("exp", "show", "--json", cwd=third).stdout))
    refs = {ref.rsplit("/", 1)[1]: ref for ref in run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"],
                                                      third).stdout.split()}
    for number, trial in complete.items():
        metrics = pulled[f"sky-{number}"]["metrics"]["reports/evaluate/metrics.json"]["data"]
        assert metrics["val"]["f1_macro"] == trial.value
        lock = yaml.safe_load(run(["git", "show", f"{refs[f'sky-{number}']}:dvc.lock"], third).stdout)
        model = next(out["md5"] for out in lock["stages"]["train@0"]["outs"] if out["path"] == "models/fold-0")
        assert (remote / "files/md5" / model[:2] / model[2:]).is_file(), f"sky-{number}'s model is not on the remote"

    # each worker pulled the team's data stages: its trials ran none of them
    trial_logs = {p: p.read_text(errors="replace") for clone, _ in clones for p in (clone / "tuning").rglob("*.log")}
    data_stages = re.compile(r"Running stage '(fetch|preprocess|pretrain|tokenize|split)'")
    assert len(trial_logs) == TRIALS and not [p for p, text in trial_logs.items() if data_stages.search(text)]
    # checkpoints went to each worker's bucket folder (emptied as its trials ended), not into the clones
    assert all(bucket.is_dir() for bucket in buckets)
    assert not any((clone / "checkpoints").exists() for clone, _ in clones)
    # no password in what the workers printed nor in their trials' logs
    assert not [text for text in [*outputs, *trial_logs.values()] if pg.password in text]


def test_fold_trainers_resume_after_a_preemption_and_a_third_clone_retrains_nothing(tmp_path, team):
    origin, _ = team
    # two folds, a checkpoint every 5 steps: the first trainer is killed soon after its first
    set_params(origin, cv__folds=[0, 1], train__epochs=10, machine__checkpoint_steps=5)
    commit_all(origin, "two folds")
    bucket = tmp_path / "bucket"
    (first, first_home), (second, second_home) = (machine(origin, tmp_path / name) for name in ("machine1", "machine2"))
    logs = [tmp_path / "fold0.log", tmp_path / "fold1.log"]
    preempted = start_worker(first, first_home, "folds", tmp_path / "fold0-preempted.log", FOLDS="0",
                             CHECKPOINT_DIR=str(bucket / "trainer1"))
    other = start_worker(second, second_home, "folds", logs[1], FOLDS="1", CHECKPOINT_DIR=str(bucket / "trainer2"))
    deadline = time.monotonic() + WORKER_TIMEOUT
    while not list((bucket / "trainer1/fold-0").glob("checkpoint-*/trainer_state.json")):
        assert preempted.poll() is None and time.monotonic() < deadline, (tmp_path / "fold0-preempted.log").read_text()
        time.sleep(0.05)
    os.killpg(preempted.pid, signal.SIGKILL)  # the machine is gone: nothing runs after this, not even a handler
    preempted.wait()

    # SkyPilot's relaunch: a new machine, a new clone, the same job and so the same bucket folder
    relaunched = machine(origin, tmp_path / "machine3")
    worker = start_worker(*relaunched, "folds", logs[0], FOLDS="0", CHECKPOINT_DIR=str(bucket / "trainer1"))
    finish([worker, other], logs)
    assert f"resuming from {bucket / 'trainer1/fold-0/checkpoint-'}" in logs[0].read_text()
    assert not (bucket / "trainer1/fold-0").exists()  # removed once the fold was trained

    third = tmp_path / "third"
    run(["git", "clone", "-q", str(origin), str(third)], tmp_path)
    out = dvc("repro", "--pull", cwd=third).stdout
    assert not re.findall(r"Running stage 'train@", out), out
    assert {"train@0", "train@1"} <= set(re.findall(r"Stage '([^']+)' is cached", out)), out
    assert "Running stage 'evaluate'" in out
    scores = json.loads((third / "reports/evaluate/metrics.json").read_text())
    assert "f1_macro" in scores["oof"], scores


SETTINGS = ("CHECKPOINT_DIR", "TUNE_STORAGE", "FOLDS", "TRIALS", "DVC_REMOTE", "GIT_REMOTE")


@pytest.mark.parametrize("mode, env, message", [
    ("tune", {}, "CHECKPOINT_DIR is not set"),
    ("tune", {"CHECKPOINT_DIR": "/ckpt"}, "TUNE_STORAGE is not set"),
    ("folds", {"CHECKPOINT_DIR": "/ckpt"}, "FOLDS is not set"),
    ("folds", {"CHECKPOINT_DIR": "/ckpt", "FOLDS": "0 two"}, "FOLDS: 'two' is not a fold number"),
    ("tune", {"CHECKPOINT_DIR": "/ckpt", "TUNE_STORAGE": "postgresql://u:hunter2@h/db", "DVC_REMOTE": "nosuch"},
     "DVC_REMOTE: no remote named 'nosuch'"),
    ("tune", {"CHECKPOINT_DIR": "/ckpt", "TUNE_STORAGE": "postgresql://u:hunter2@h/db", "GIT_REMOTE": "nosuch"},
     "GIT_REMOTE: no git remote named 'nosuch'"),
    ("train", {}, "usage: bash scripts/worker.sh tune|folds"),
])
def test_a_missing_or_wrong_setting_is_one_line(tmp_path, team, mode, env, message):
    clone, home = machine(team[0], tmp_path / "machine")
    environ = {key: value for key, value in stage_env().items() if key not in SETTINGS}
    result = subprocess.run(["bash", WORKER, mode], cwd=clone, env={**environ, "HOME": str(home), **env},
                            capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), result
    assert "hunter2" not in result.stdout + result.stderr


def test_a_tune_worker_puts_the_token_in_an_https_remote_and_prints_no_secret(tmp_path, team):
    clone, home = machine(team[0], tmp_path / "machine")
    run(["git", "remote", "set-url", "origin", "https://github.com/team/repo.git"], clone)
    token, password = "ghp_" + os.urandom(8).hex(), os.urandom(8).hex()
    storage = f"postgresql://tuner:{password}@127.0.0.1:{free_port()}/studies"  # nothing listens: tune stops
    result = subprocess.run(["bash", WORKER, "tune"], cwd=clone, capture_output=True, text=True, timeout=300,
                            env=dict(stage_env(), HOME=str(home), CHECKPOINT_DIR=str(tmp_path / "bucket"),
                                     TUNE_STORAGE=storage, GIT_TOKEN=token))
    assert result.returncode == 1 and result.stderr.strip().splitlines()[-1].startswith("error: tune storage"), result
    url = run(["git", "remote", "get-url", "origin"], clone).stdout.strip()
    assert url == f"https://x-access-token:{token}@github.com/team/repo.git"
    assert token not in result.stdout + result.stderr and password not in result.stdout + result.stderr


# What SkyPilot's parser made of a task file, as JSON: launched as `sky jobs launch ... --env NAME=value` would
# be (the required envs given), and as the bare file (it must refuse, naming a required env)
PARSE = """
import json, sys, yaml
import sky
path, envs = sys.argv[1], json.loads(sys.argv[2])
try:
    sky.Task.from_yaml(path)
    refused = None
except ValueError as error:
    refused = str(error)
task = sky.Task.from_yaml_config(yaml.safe_load(open(path)), env_overrides=list(envs.items()))
print(json.dumps({
    "refused": refused,
    "secrets": sorted(ref.name for ref in task.managed_secret_refs),
    "inline_secrets": sorted(task.secrets),
    "mounts": {at: {"name": s.name, "mode": s.mode.value, "source": s.source} for at, s in task.storage_mounts.items()},
    "use_spot": sorted({r.use_spot for r in task.resources}),
    "workdir": task.workdir,
    "envs": task.envs,
    "setup": task.setup,
    "run": task.run,
}))
"""


@pytest.mark.parametrize("mode", sorted(TASK_FILES))
def test_skypilot_reads_the_task_files(mode):
    if not SKY_PYTHON.exists():
        pytest.fail(f"{SKY_PYTHON.parent.parent.name} is missing: bash scripts/test.sh makes it "
                    "(a virtualenv with skypilot, apart from .venv)", pytrace=False)
    path = TASK_FILES[mode]
    raw = yaml.safe_load(path.read_text())
    required = sorted(name for name, value in raw["envs"].items() if value is None)
    given = {"REPO_URL": "https://github.com/team/repo.git", "COMMIT": "0123456789abcdef0123456789abcdef01234567",
             "CHECKPOINT_BUCKET": "team-checkpoints", "FOLDS": "0 2"}
    assert set(required) <= set(given), required
    result = subprocess.run([str(SKY_PYTHON), "-c", PARSE, str(path), json.dumps({k: given[k] for k in required})],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    task = json.loads(result.stdout.strip().splitlines()[-1])

    assert task["refused"] and re.search(r"Environment variable '(\w+)' is None", task["refused"])[1] in required
    assert task["workdir"] == {"url": given["REPO_URL"], "ref": given["COMMIT"]}  # the repository at one commit
    assert task["use_spot"] == [True]
    assert task["mounts"] == {"/checkpoints": {"name": "team-checkpoints", "mode": "MOUNT", "source": None}}
    # the database's URL and the token that pushes trials: given at launch (--secret NAME), never in the file
    assert task["secrets"] == (["GIT_TOKEN", "TUNE_STORAGE"] if mode == "tune" else []) and not task["inline_secrets"]
    assert not re.search(r"://[^/\s]*:[^/\s]*@", json.dumps(raw))  # nor a URL with a password, outside comments
    # a folder of the bucket per job, the same for the job's every relaunch
    assert f"CHECKPOINT_DIR=/checkpoints/$SKYPILOT_TASK_ID bash {WORKER} {mode}\n" in task["run"], task["run"]
    assert "requirements.txt" in task["setup"]
    # each setting the file gives the worker is one the worker reads
    script = (REPO / WORKER).read_text()
    for name in set(raw["envs"]) - {"REPO_URL", "COMMIT", "CHECKPOINT_BUCKET", "DVC_PLUGIN"}:
        assert re.search(rf"\${{?{name}\b", script), name
