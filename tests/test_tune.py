"""python -m tune end to end: real Optuna, the real `dvc` CLI, a real PostgreSQL server, tiny studies
on the tiny data and model. Each completed trial must be a DVC experiment with its params and
metrics; upstream stages run once; hopeless trials are pruned (by evaluation with one fold, by fold
with three); two workers in two clones share one study; a stopped or killed worker's trial is
retried and resumes from its checkpoint; bad settings fail in one line; the report draws in Chromium."""
import io
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import f1_score

from tests.servers import free_port, postgres_server, require_module
from tests.test_experiments import clone, experiments_by_name
from tests.test_pipeline import REPO, commit_all, dvc, init_pipeline_repo, repro, run, stage_env
from tests.test_plots import CHROMIUM_FLAGS, RENDER_TIMEOUT_MS, chromium_path
from tune.settings import yaml_value

# a tiny task the tiny model learns in a few seconds, and a space around it where it learns with margin:
# at 6 epochs, lr 1e-3, 2e-3 and 3e-3 each reached val macro-F1 1.0 for all 6 seeds tried; at 4 epochs
# (lr 2e-3, 5e-3 and 7e-3) 3 of 18 runs stalled, at 0.18 to 0.56, which another CPU could hit at the test's seed
TUNE_TRAIN = dict(train__epochs=6, train__lr=2e-3, train__effective_batch_size=16, train__batch_size="auto")
SPACE = {"train.lr": {"low": 1e-3, "high": 3e-3, "log": True}, "train.warmup_ratio": {"low": 0.0, "high": 0.2}}
GOOD = "train.lr=3e-3"
HOPELESS = "train.lr=1e-9"  # a model that does not move stays at chance: the pruner must stop it


def tune_repo(path, data, model, study="s", trials=5, **params):
    return init_pipeline_repo(path, data, model, **{**TUNE_TRAIN, "tune__study": study, "tune__trials": trials,
                                                    "tune__evaluations": 3, "tune__space": SPACE, **params})


def tune(repo, *args, module="tune", env=None, check=True, stage_log=None):
    environ = dict(stage_env(), **(env or {}))
    if stage_log:
        environ["PIPELINE_STAGE_LOG"] = str(stage_log)
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=repo, env=environ, capture_output=True,
                            text=True, timeout=1200)
    if check and result.returncode:
        raise AssertionError(f"python -m {module} {args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def study_trials(repo, name="s", url=None):
    import optuna

    storage = url or f"sqlite:///{repo / 'tuning/studies.db'}"
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def stage_runs(log):
    return Counter(Path(log).read_text().split())


def finished(trials):
    return [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]


@pytest.fixture(scope="module")
def one_fold(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """A 5-trial study with one fold, pruned by the median rule: params.yaml's values first, another good
    learning rate, a hopeless one, then two suggested. Yields (repo, the tuner's output, the stages that
    ran, params.yaml before). (Successive halving, the default, is tested in tests/test_pruning.py.)"""
    base = tmp_path_factory.mktemp("tune")
    repo = tune_repo(base / "repo", tiny_data_dir, tiny_model_dir, tune__pruner="median")
    before = (repo / "params.yaml").read_text()
    result = tune(repo, "--enqueue", GOOD, "--enqueue", HOPELESS, stage_log=base / "stages.log")
    yield repo, result.stdout, stage_runs(base / "stages.log"), before


def test_each_completed_trial_is_an_experiment_with_its_params_and_score(one_fold):
    repo, out, _, _ = one_fold
    trials = study_trials(repo)
    assert len(finished(trials)) == 5, out
    experiments = experiments_by_name(json.loads(dvc("exp", "show", "--json", cwd=repo).stdout))
    for t in trials:
        name = f"s-{t.number}"
        if t.state.name != "COMPLETE":
            assert name not in experiments, f"{name} is {t.state.name} but has an experiment"
            continue
        exp = experiments[name]
        assert exp["error"] is None, exp
        params = exp["params"]["params.yaml"]["data"]["train"]
        assert params["lr"] == pytest.approx(t.params["train.lr"]) and params["evaluations"] == 3
        assert params["warmup_ratio"] == pytest.approx(t.params["train.warmup_ratio"])
        score = exp["metrics"]["reports/evaluate/metrics.json"]["data"]["val"]["f1_macro"]
        assert score == t.value
        assert f"trial {t.number}: val.f1_macro {t.value:.4f}" in out
    baseline = trials[0]
    assert baseline.user_attrs.get("baseline") and baseline.params["train.lr"] == 2e-3
    assert baseline.state.name == "COMPLETE" and baseline.value >= 0.8, baseline  # the tiny task is learnable


def test_the_hopeless_trial_is_pruned_at_an_early_evaluation_and_trains_less(one_fold):
    repo, out, _, _ = one_fold
    hopeless = study_trials(repo)[2]
    assert hopeless.params["train.lr"] == 1e-9
    assert hopeless.state.name == "PRUNED", (hopeless.state, out)
    assert hopeless.user_attrs["pruned_at"] in ("evaluation 1 of 3", "evaluation 2 of 3")
    done, planned = hopeless.user_attrs["steps fold 0"]
    assert 0 < done <= planned * 2 / 3 + 1, (done, planned)  # stopped at the 1st or 2nd of 3 evaluations
    assert f"trial 2: pruned at {hopeless.user_attrs['pruned_at']}" in out
    log = (repo / "tuning/s/trial-2.log").read_text()
    assert re.search(r"^train@0: pruned in [\d.]+ s$", log, re.M), log
    assert not (repo / "checkpoints/fold-0").exists(), "a pruned trial left its checkpoints"


def test_upstream_stages_ran_once_and_the_workspace_is_untouched(one_fold):
    repo, _, ran, before = one_fold
    trials = study_trials(repo)
    complete = sum(t.state.name == "COMPLETE" for t in trials)
    assert {stage: ran[stage] for stage in ("fetch", "preprocess", "tokenize", "split")} == \
        {"fetch": 1, "preprocess": 1, "tokenize": 1, "split": 1}, ran
    assert ran["train@0"] == 5 and ran["evaluate"] == complete, ran
    assert (repo / "params.yaml").read_text() == before
    assert run(["git", "status", "--porcelain"], repo).stdout == ""  # tuning/ is ignored; nothing else changed
    assert not list((repo / ".dvc/tmp/exps").glob("standalone/tmp*")), "a trial's temporary copy was left"


def test_show_lists_every_trial_best_first(one_fold):
    repo, _, _, _ = one_fold
    out = tune(repo, "--top", "3", module="tune.show").stdout
    header, *rows = out.splitlines()[1:]
    assert header.split()[:3] == ["trial", "state", "val.f1_macro"]
    values = [float(row.split()[2]) for row in rows]
    assert len(rows) == 3 and values == sorted(values, reverse=True), out
    assert re.search(r"\d trials: \d complete, \d pruned; pruning saved \d+% of the training steps", out), out


def test_rerunning_resumes_the_study_without_repeating_a_trial(one_fold, tmp_path):
    repo, _, _, _ = one_fold
    out = tune(repo, "--trials", "6", stage_log=tmp_path / "stages.log").stdout
    trials = study_trials(repo)
    assert len(finished(trials)) == 6 and "5 of 6 trials done" in out, out
    assert re.findall(r"^trial (\d+) \(", out, re.M) == ["5"], out  # only the new one ran
    assert set(stage_runs(tmp_path / "stages.log")) <= {"train@0", "predict_test", "evaluate"}
    assert "6 of 6 trials done" in tune(repo, "--trials", "6").stdout  # done: nothing more runs


def test_the_report_draws_its_figures_in_chromium(one_fold):
    sync_playwright = require_module("playwright.sync_api", "playwright").sync_playwright
    repo, _, _, _ = one_fold
    tune(repo, module="tune.report")
    page_file = repo / "tuning/s/report.html"
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(p), args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(page_file.as_uri())
            # plotly draws each figure as svg.main-svg inside .js-plotly-plot; five figures, each drawn
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 5",
                                   timeout=RENDER_TIMEOUT_MS)
            drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].map(
                div => div.querySelectorAll('path, .point, .trace').length)""")
            text = page.inner_text("body")
        finally:
            browser.close()
    assert not errors, errors
    assert all(url.startswith("file://") for url in requests), requests
    assert len(drawn) == 5 and all(n > 0 for n in drawn), drawn
    assert "Optimization history" in text and "pruned" in text


def test_blend_of_the_two_best_is_scored_on_the_validation_rows(one_fold):
    repo, _, _, _ = one_fold
    out = tune(repo, "--top", "2", module="tune.blend").stdout
    metrics = json.loads((repo / "tuning/s/blend/metrics.json").read_text())
    members = metrics["members"]
    assert len(members) == 2 and all(re.fullmatch(r"s-\d+", m) for m in members)
    # recompute the blend from the members' own files: the mean of their validation probabilities
    import dvc.api

    read = lambda path, rev: pd.read_csv(io.StringIO(dvc.api.read(path, repo=str(repo), rev=rev)))
    oof = [read("predictions/fold-0/oof.csv", m) for m in members]
    labels = list(oof[0].columns[1:])
    train = read("data/processed/train.csv", members[0])
    truth = train["label"].to_numpy()[oof[0]["row"]]
    mean = np.mean([o[labels].to_numpy() for o in oof], axis=0)
    expected = f1_score(truth, np.array(labels)[mean.argmax(axis=1)], average="macro")
    assert metrics["val"]["blend"]["f1_macro"] == pytest.approx(expected, abs=1e-4)
    for m, frame in zip(members, oof):
        own = f1_score(truth, np.array(labels)[frame[labels].to_numpy().argmax(axis=1)], average="macro")
        assert metrics["val"][m]["f1_macro"] == pytest.approx(own, abs=1e-4)
    submission = pd.read_csv(repo / "tuning/s/blend/submission.csv")
    assert submission["id"].tolist() == read("data/processed/test.csv", members[0])["id"].tolist()
    assert "blend" in out


def test_the_best_trial_applied_to_the_workspace_reruns_nothing(one_fold):
    repo, _, _, _ = one_fold
    best = max((t for t in study_trials(repo) if t.state.name == "COMPLETE"), key=lambda t: t.value)
    out = tune(repo, "--apply", module="tune.best").stdout
    assert f"experiment s-{best.number}" in out
    params = yaml.safe_load((repo / "params.yaml").read_text())["train"]
    assert params["lr"] == pytest.approx(best.params["train.lr"])
    assert repro(repo) == set()  # its outputs came with it: the run is reproduced, nothing to do
    evaluation = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    assert evaluation["val"]["f1_macro"] == best.value
    run(["git", "checkout", "--", "."], repo)  # the workspace as the module's other tests expect it
    dvc("checkout", "--force", cwd=repo)


def test_three_folds_a_hopeless_trial_stops_before_its_second_fold(tmp_path, tiny_data_dir, tiny_model_dir):
    repo = tune_repo(tmp_path / "repo", tiny_data_dir, tiny_model_dir, trials=3, cv__folds=[0, 1, 2])
    out = tune(repo, "--enqueue", GOOD, "--enqueue", HOPELESS, stage_log=tmp_path / "stages.log").stdout
    trials = study_trials(repo)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"], out
    assert "pruner median (by fold)" in out
    hopeless = trials[2]
    assert hopeless.params["train.lr"] == 1e-9 and hopeless.user_attrs["pruned_at"] == "fold 1"
    assert list(hopeless.intermediate_values) == [0]  # fold 0's score was what stopped it
    ran = stage_runs(tmp_path / "stages.log")
    assert ran["train@0"] == 3 and ran["train@1"] == 3 and ran["train@2"] == 2 and ran["evaluate"] == 2, ran
    assert "pruned: trial 2 of study 's' scored too low on the folds before fold 1" in \
        (repo / "tuning/s/trial-2.log").read_text()
    # fold 0 of the pruned trial stays cached: the same params restore it instead of training it
    replay = dvc("exp", "run", "--temp", "-n", "replay", "-S", "train.lr=1.0e-09",
                 "-S", f"train.warmup_ratio={yaml_value(hopeless.params['train.warmup_ratio'])}", "train@0", cwd=repo)
    assert "Stage 'train@0' is cached" in replay.stdout and "Running stage 'train@0'" not in replay.stdout, replay.stdout


@pytest.fixture(scope="module")
def pg():
    """One PostgreSQL server for this module's tests, each with studies of its own names."""
    with postgres_server() as server:
        yield server


def tuner_process(repo, *args, env=None, sigint_ignored=False):
    """python -m tune running in the background; sigint_ignored: started as a script's background job is, with
    SIGINT ignored, which a child inherits (a test runner's worker was seen to pass that on too)."""
    environ = dict(stage_env(), **(env or {}))
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    return subprocess.Popen([sys.executable, "-m", "tune", *args], cwd=repo, env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=ignore)


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def guards(repo):
    """The tune.guard processes of this repo's trials still running."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if "tune.guard" in (p.info["cmdline"] or []) and p.info["cwd"] == str(repo):
                found.append(p)
        except psutil.Error:
            pass
    return found


def test_a_stopped_and_a_killed_worker_resume_from_the_checkpoint(tmp_path, tiny_data_dir, tiny_model_dir):
    # a long enough trial to stop in the middle, checkpoints every few steps, heartbeats every 2 s
    repo = tune_repo(tmp_path / "repo", tiny_data_dir, tiny_model_dir, trials=1, train__epochs=12,
                     machine__checkpoint_steps=5, tune__heartbeat=2, tune__pruner="none")
    checkpoints = repo / "checkpoints/fold-0"
    # Ctrl-C: the tuner passes it to the trial, whose train stage saves a checkpoint; the study is kept. The
    # tuner starts with SIGINT ignored, as a background job would: it must still stop
    tuner = tuner_process(repo, sigint_ignored=True)
    wait_for(lambda: list(checkpoints.glob("checkpoint-*")), 300, "a first checkpoint")
    tuner.send_signal(signal.SIGINT)
    out = tuner.communicate(timeout=300)[0]
    assert tuner.returncode == 130, out
    assert "interrupted" in out and "trial 0's params first, from its checkpoint" in out, out
    assert list(checkpoints.glob("checkpoint-*")) and not guards(repo)
    # resumed: trial 0's params again, from that checkpoint; then the worker is killed outright
    tuner = tuner_process(repo)
    wait_for(lambda: re.search(r"^step \d+/\d+", log_text(repo, 1).partition("resuming from")[2], re.M),
             300, "trial 1 to resume and train")
    tuner.kill()  # SIGKILL: no handler runs; the guard stops the trial, which saves a checkpoint
    tuner.wait()
    wait_for(lambda: not guards(repo), 120, "the orphaned trial to stop")
    assert "stopped by SIGINT" in log_text(repo, 1) or "saving a checkpoint" in log_text(repo, 1)
    time.sleep(5)  # past twice the heartbeat: the killed worker's trial is stale now
    out = tune(repo).stdout
    trials = study_trials(repo)
    states = [t.state.name for t in trials]
    assert states == ["FAIL", "FAIL", "COMPLETE"], (states, out)
    assert trials[1].user_attrs.get("retry_of") == 0 and trials[1].params == trials[0].params
    retried = trials[2]  # the killed worker's trial, failed by its missing heartbeat and run again
    assert retried.params == trials[0].params and retried.state.name == "COMPLETE", out
    assert "resuming from" in log_text(repo, 2), log_text(repo, 2)
    assert not checkpoints.exists()


def log_text(repo, number):
    path = repo / f"tuning/s/trial-{number}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def test_two_workers_in_two_clones_share_one_postgres_study(tmp_path, tiny_data_dir, tiny_model_dir, pg):
    origin = tune_repo(tmp_path / "origin", tiny_data_dir, tiny_model_dir, trials=3)
    dvc("remote", "add", "-d", "shared", str(tmp_path / "dvc-remote"), cwd=origin)
    commit_all(origin, "a shared DVC remote")
    workers = [clone(origin, tmp_path / f"worker{k}") for k in (1, 2)]
    env = {"TUNE_STORAGE": pg.url()}  # the password stays out of argv and params.yaml
    running = [tuner_process(w, "--push", "origin", env=env) for w in workers]
    outputs = [p.communicate(timeout=1200)[0] for p in running]
    assert all(p.returncode == 0 for p in running), outputs
    trials = study_trials(origin, url=pg.url())
    third = clone(origin, tmp_path / "third")
    best_out = tune(third, "--apply", "--pull", "origin", module="tune.best", env=env).stdout
    done = finished(trials)
    assert len(done) == 3, [t.state for t in trials]  # the budget, every worker together: not one more
    started = [t for t in trials if not t.user_attrs.get("over_budget")]
    numbers = [int(n) for out in outputs for n in re.findall(r"^trial (\d+) \(", out, re.M)]
    assert sorted(numbers) == sorted(set(numbers)) and len(numbers) == len(started), outputs
    params = [tuple(sorted(t.params.items())) for t in done]
    assert len(params) == len(set(params)), params  # no parameter set ran twice
    assert all(re.findall(r"^trial \d+ \(", out, re.M) for out in outputs), "a worker ran no trial"
    pushed = run(["git", "for-each-ref", "--format=%(refname:lstrip=-1)", "refs/exps"], origin).stdout.split()
    assert {f"s-{t.number}" for t in done if t.state.name == "COMPLETE"} <= set(pushed), pushed
    best = max((t for t in done if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert f"experiment s-{best.number}" in best_out
    assert repro(third) == set()  # pulled with its outputs: nothing to rerun
    for text in [*outputs, best_out, *(p.read_text(errors="replace") for w in workers
                                        for p in (w / "tuning").rglob("*") if p.is_file() and p.suffix != ".db")]:
        assert pg.password not in text


# a worker of a study whose trials take a moment and do no training: every third fails, every fourth is
# pruned; it prints the numbers of the trials it ran
BUDGET_WORKER = """
import sys, time
import optuna
from tune import budget

optuna.logging.set_verbosity(optuna.logging.ERROR)
study = optuna.load_study(study_name="b", storage=sys.argv[1])
ran = []

def objective(trial):
    ran.append(trial.number)
    x = trial.suggest_float("x", 0, 1)
    time.sleep(0.3)
    if trial.number % 3 == 2:
        raise ValueError("a failed trial")
    if trial.number % 4 == 3:
        raise optuna.TrialPruned()
    return x

budget.optimize(study, objective, int(sys.argv[2]), catch=(ValueError,))
print(*ran)
"""


def test_three_workers_sharing_a_postgres_study_finish_exactly_its_trials(pg):
    import optuna

    url = pg.url().replace("postgresql://", "postgresql+psycopg://")
    optuna.create_study(study_name="b", storage=url)
    workers = [subprocess.Popen([sys.executable, "-c", BUDGET_WORKER, url, "5"], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [w.communicate(timeout=300) for w in workers]
    assert all(w.returncode == 0 for w in workers), outputs
    trials = optuna.load_study(study_name="b", storage=url).get_trials(deepcopy=False)
    # counting the finished trials alone (MaxTrialsCallback), the workers finished 6 of 5 here
    assert len(finished(trials)) == 5, [(t.number, t.state.name) for t in trials]
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    ran = [int(n) for out, _ in outputs for n in out.split()]
    assert len(ran) == len(set(ran))  # no trial ran in two workers
    assert any(t.state.name == "FAIL" and not t.user_attrs.get("over_budget") for t in trials)  # failures ran
    assert any(t.state.name == "PRUNED" for t in trials)  # and did not count; pruned ones did


def test_a_trial_over_the_budget_is_given_back_and_a_stale_one_frees_its_slot(tmp_path):
    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.trial import TrialState

    from tune import budget

    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'b.db'}", heartbeat_interval=1, grace_period=1,
                                         heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
    study = optuna.create_study(study_name="b", storage=storage)
    first = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    study.enqueue_trial({"x": 0.25}, user_attrs={"enqueued": True})
    second = study.ask()  # asked while the first runs, with a budget of 1: the queued params come back
    assert study.trials[second.number].system_attrs["fixed_params"] == {"x": 0.25}
    assert budget.within(study, first._trial_id, 1) and not budget.within(study, second._trial_id, 1)
    budget.give_back(study, second._trial_id)
    study.tell(second, state=TrialState.FAIL)
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert [(t.params or t.system_attrs["fixed_params"], t.user_attrs) for t in waiting] == \
        [({"x": 0.25}, {"enqueued": True})]
    assert budget.used(study) == 1
    # the first trial's worker dies: no heartbeat after the first; once stale it is failed and retried
    storage.record_heartbeat(first._trial_id)
    time.sleep(2.5)
    assert budget.used(study) == 0
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.FAIL, TrialState.WAITING, TrialState.WAITING], states
    third = study.ask()  # the queued params, within the budget now
    assert study.trials[third.number].system_attrs["fixed_params"] == {"x": 0.25}
    assert budget.within(study, third._trial_id, 1)


def test_bad_settings_stop_before_any_trial_in_one_line(tmp_path, tiny_data_dir, tiny_model_dir):
    repo = tune_repo(tmp_path / "repo", tiny_data_dir, tiny_model_dir,
                     tune__space={"train.weight_decay": {"low": 0, "high": 0.1, "log": True}})
    result = tune(repo, check=False)
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    assert result.stderr == ("error: params.yaml: tune.space train.weight_decay: a log scale needs low above 0, "
                             "not 0\n")
    assert not (repo / "tuning").exists()


def test_a_wrong_password_or_no_server_is_one_line_without_the_password(tmp_path, tiny_data_dir, tiny_model_dir, pg):
    repo = tune_repo(tmp_path / "repo", tiny_data_dir, tiny_model_dir)
    wrong = tune(repo, "--storage", pg.url(password="not-the-password-7f3a"), check=False)
    nobody = tune(repo, check=False, env={"TUNE_STORAGE": f"postgresql://tuner:s3cret-9b@127.0.0.1:{free_port()}/x"})
    for result, password, reason in ((wrong, "not-the-password-7f3a", "password authentication failed"),
                                     (nobody, "s3cret-9b", "Connection refused")):
        assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: tune storage postgresql") and reason in lines[0], lines
        assert password not in result.stdout + result.stderr
    assert not list((repo / "tuning").glob("s/trial-*"))


def test_two_workers_starting_together_never_draw_the_same_params_and_a_rerun_draws_the_same(tmp_path):
    """Two workers on one study, each with its own sampler of the same tune.seed, asking in turns as they
    would starting together: seeded once each (TPESampler(seed=42), as before), their first random trials
    drew the same x; seeded per trial (tune.sampling.SeededPerTrial), every trial draws its own. The same
    study run again, alone, draws what the two workers drew, trial for trial."""
    import optuna

    from tune.sampling import SeededPerTrial

    def draws(make_sampler, workers, name):
        storage = f"sqlite:///{tmp_path / name}.db"
        optuna.create_study(study_name=name, storage=storage)
        studies = [optuna.load_study(study_name=name, storage=storage, sampler=make_sampler()) for _ in range(workers)]
        xs = {}
        for turn in range(6):  # each asks before any trial is told: all are running at once
            trial = studies[turn % workers].ask()
            xs[trial.number] = trial.suggest_float("x", 0, 1)
        return [xs[n] for n in sorted(xs)]

    options = dict(constant_liar=True, n_startup_trials=4)
    seeded_once = draws(lambda: optuna.samplers.TPESampler(seed=42, **options), 2, "once")
    assert seeded_once[0] == seeded_once[1]  # the bug: both workers' first trial, the same params
    per_trial = draws(lambda: SeededPerTrial(42, **options), 2, "per-trial")
    assert len(set(per_trial)) == 6
    assert draws(lambda: SeededPerTrial(42, **options), 1, "alone") == per_trial
