"""A shared DVC remote saves recomputation, against real servers on 127.0.0.1: a shared folder,
SSH (an asyncssh SFTP server, tests/sftp_server.py, reached by dvc-ssh over TCP) and S3
(SeaweedFS, dvc-s3 with endpointurl).

Clone A runs the pipeline, commits dvc.lock and the metrics, and pushes with `--run-cache`;
it also runs one experiment and pushes it with `dvc exp push --run-cache`. Clone B, a fresh
`git clone`, follows the README: `dvc repro --pull` must restore every stage without running
one (the stages append their name to $PIPELINE_STAGE_LOG when they run), with outputs equal to
A's; a param change in B then reruns only the stages that read it. The experiment is pulled and
applied in B, and its params set by hand in B are restored from the run cache, also without
running anything.

The remote URLs are committed in .dvc/config as a team would; ports, users, key files and keys
go into each clone's .dvc/config.local, never into a commit."""
import hashlib
from pathlib import Path

import pytest
import yaml

from tests.servers import s3_server, ssh_server
from tests.test_experiments import clone, resolved_stages
from tests.test_pipeline import commit_all, dvc, init_pipeline_repo, run, set_params

EXP = "lr-exp"
EXP_LR = 1e-3  # differs from the baseline's train.lr (test_pipeline.TINY_PARAMS)
S3_BUCKET = "dvc-remote"
KINDS = ("folder", "ssh", "s3")


def stage_log(path):
    """Stage names that appended to the PIPELINE_STAGE_LOG file, in order ([] if none ran)."""
    path = Path(path)
    return path.read_text().split() if path.exists() else []


def declared_paths(repo):
    return [path for stage in resolved_stages(repo).values() for path in stage["outs"]]


def fingerprint(repo):
    """{file: md5} of every file under every output dvc.yaml declares (data, model, metrics)."""
    repo = Path(repo)
    files = {}
    for declared in declared_paths(repo):
        root = repo / declared
        for path in sorted([root] if root.is_file() else root.rglob("*")):
            if path.is_file():
                files[str(path.relative_to(repo))] = hashlib.md5(path.read_bytes()).hexdigest()
    return files


def logged(monkeypatch, folder, name):
    """Point PIPELINE_STAGE_LOG at a fresh file; return its path."""
    log = Path(folder) / f"{name}.stages"
    log.unlink(missing_ok=True)
    monkeypatch.setenv("PIPELINE_STAGE_LOG", str(log))
    return log


# ---- servers and their per-clone credentials ---------------------------------------------

@pytest.fixture(scope="module")
def ssh(tmp_path_factory):
    with ssh_server(tmp_path_factory.mktemp("ssh")) as server:
        yield server


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("seaweedfs"), bucket=S3_BUCKET) as server:
        yield server


def add_remotes(repo, storage):
    """The committed part of the remote setup, as the README shows it: name and URL only."""
    dvc("remote", "add", "-d", "folder", str(storage / "folder-remote"), cwd=repo)
    dvc("remote", "add", "ssh", f"ssh://127.0.0.1{storage / 'ssh-remote'}", cwd=repo)
    dvc("remote", "add", "s3", f"s3://{S3_BUCKET}/cache", cwd=repo)


def local_settings(kind, server):
    """Where the server listens and how to log in: what each clone keeps in config.local."""
    if kind == "ssh":
        return {"port": server.port, "user": server.user, "keyfile": server.keyfile}
    if kind == "s3":
        return {"endpointurl": server.endpoint, "access_key_id": server.access_key,
                "secret_access_key": server.secret_key}
    return {}


def configure_clone(repo, kind, server):
    """The uncommitted part of the remote setup, and this remote as the clone's default."""
    for option, value in local_settings(kind, server).items():
        dvc("remote", "modify", "--local", kind, option, str(value), cwd=repo)
    dvc("remote", "default", "--local", kind, cwd=repo)
    committed = (Path(repo) / ".dvc/config").read_text()
    assert "secret" not in committed and "keyfile" not in committed, committed


# ---- clone A -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def origin(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """Clone A after `dvc repro` (results committed and pushed to a bare git repo) and one temp
    experiment. Yields a dict: paths, A's fingerprint, and the experiment's dvc.lock."""
    base = tmp_path_factory.mktemp("remote")
    bare = base / "origin.git"
    run(["git", "init", "-q", "--bare", "-b", "main", str(bare)], base)
    a = init_pipeline_repo(base / "A", tiny_data_dir, tiny_model_dir)
    run(["git", "remote", "add", "origin", str(bare)], a)
    add_remotes(a, base)
    commit_all(a, "shared remotes")
    with pytest.MonkeyPatch.context() as mp:
        log = logged(mp, base, "A")
        dvc("repro", cwd=a)
        assert stage_log(log) == ["fetch", "preprocess", "pretrain", "tokenize", "split", "baseline", "train@0",
                                  "predict_test", "evaluate"]
        # the README's step: dvc.lock, the .gitignore files DVC wrote, and the metrics and
        # plots where dvc.yaml marks them `cache: false` (then git, not DVC, keeps them)
        commit_all(a, "results")
        run(["git", "push", "-q", "origin", "main"], a)
        # --temp: runs in a copy, so A's workspace keeps the committed results
        dvc("exp", "run", "--temp", "-n", EXP, "-S", f"train.lr={EXP_LR}", cwd=a)
        assert stage_log(log)[9:] == ["train@0", "predict_test", "evaluate"]  # the baseline reads no train.*
    yield {"base": base, "bare": bare, "a": a, "fingerprint": fingerprint(a),
           "exp_lock": run(["git", "show", f"{exp_ref(a, EXP)}:dvc.lock"], a).stdout}


def exp_ref(repo, name):
    refs = run(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], repo).stdout.split()
    matches = [ref for ref in refs if ref.rsplit("/", 1)[-1] == name]
    assert len(matches) == 1, (name, refs)
    return matches[0]


@pytest.fixture(scope="module", params=KINDS)
def pushed(request, origin):
    """A pushed its results, its run cache and its experiment to one kind of remote.
    Yields (kind, server); server is None for the folder remote."""
    kind = request.param
    server = None if kind == "folder" else request.getfixturevalue(kind)
    a = origin["a"]
    configure_clone(a, kind, server)
    dvc("push", "--run-cache", cwd=a)
    dvc("exp", "push", "--run-cache", "-r", kind, "origin", EXP, cwd=a)
    yield kind, server


def fresh_clone(origin, kind, server, name):
    b = clone(origin["bare"], origin["base"] / f"{name}-{kind}")
    configure_clone(b, kind, server)
    return b


# ---- the tests ---------------------------------------------------------------------------

def test_fresh_clone_restores_every_stage_without_running_any(pushed, origin, monkeypatch):
    kind, server = pushed
    b = fresh_clone(origin, kind, server, "B")
    log = logged(monkeypatch, origin["base"], f"B-{kind}")
    dvc("repro", "--pull", cwd=b)  # the README's command on a new machine
    assert stage_log(log) == [], "a stage command ran in the fresh clone"
    assert fingerprint(b) == origin["fingerprint"]
    assert "up to date" in dvc("status", cwd=b).stdout

    set_params(b, split__val_size=0.2)  # read by split only
    dvc("repro", cwd=b)
    assert stage_log(log) == ["split", "baseline", "train@0", "predict_test", "evaluate"]


def test_experiment_from_a_is_pulled_and_applied_in_b(pushed, origin, monkeypatch):
    kind, server = pushed
    b = fresh_clone(origin, kind, server, "B-exp")
    dvc("exp", "pull", "--run-cache", "-r", kind, "origin", EXP, cwd=b)
    dvc("exp", "apply", EXP, cwd=b)
    assert yaml.safe_load((b / "params.yaml").read_text())["train"]["lr"] == EXP_LR
    # the lock holds the md5 of every output, metrics included, and status compares the files
    assert (b / "dvc.lock").read_text() == origin["exp_lock"]
    assert "up to date" in dvc("status", cwd=b).stdout
    log = logged(monkeypatch, origin["base"], f"B-exp-{kind}")
    dvc("repro", cwd=b)
    assert stage_log(log) == []


def test_a_param_combination_someone_ran_comes_from_the_run_cache(pushed, origin, monkeypatch):
    # B asks for the experiment's params itself: train and evaluate are restored, not rerun
    kind, server = pushed
    b = fresh_clone(origin, kind, server, "B-runcache")
    log = logged(monkeypatch, origin["base"], f"B-runcache-{kind}")
    result = dvc("exp", "run", "--pull", "-S", f"train.lr={EXP_LR}", cwd=b)
    assert stage_log(log) == [], result.stdout
    assert "is cached - skipping run" in result.stdout + result.stderr
    for stage in ("train@0", "predict_test", "evaluate"):
        assert lock_outs(b / "dvc.lock", stage) == lock_outs(origin["exp_lock"], stage), stage
    assert "up to date" in dvc("status", cwd=b).stdout


def lock_outs(lock, stage):
    """{path: md5} of one stage's outputs in a dvc.lock (a path or the file's text)."""
    text = lock.read_text() if isinstance(lock, Path) else lock
    return {out["path"]: out["md5"] for out in yaml.safe_load(text)["stages"][stage]["outs"]}
