"""The students end to end: the real `dvc repro` of a two-fold run with pseudo-label students
(pseudo@0, pseudo@1) and a distilled student (distill@small), on the tiny data and BERT. Checked against
what is independent of the code under test: the teacher's own files, scikit-learn's scores, the saved
model's config, and which stages DVC reran."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from sklearn.metrics import accuracy_score, f1_score

from tasks.shapes import SHAPES
from tests.test_cv import logged_repro
from tests.test_pipeline import init_pipeline_repo, set_params, stage_env
from training.rows import pseudo_labels
from training.speed import tcmalloc_library

CLASSES = ["negative", "neutral", "positive"]
# the README's order: pretrain -> train -> pseudo and distill -> evaluate (a short pretraining: its wiring, not its gain)
STUDENTS = dict(cv__folds=[0, 1], pseudo__folds=[0, 1], distill__students={"small": {"model": None, "layers": 1}},
                distill__epochs=10, distill__lr=2e-3, distill__test_rows=True, train__mixed_precision=False, pretrain__epochs=1,
                pretrain__max_length=32)


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """The run, under tcmalloc as the train log's line says to run it (LD_PRELOAD=<its library> dvc repro)."""
    repo = init_pipeline_repo(tmp_path_factory.mktemp("students") / "repo", tiny_data_dir, tiny_model_dir, **STUDENTS)
    assert tcmalloc_library(), "tcmalloc is not installed: bash scripts/install-system-packages.sh installs it"
    ran, log = logged_repro(repo, env={"LD_PRELOAD": tcmalloc_library()})
    return repo, ran, log


def probabilities(path):
    frame = pd.read_csv(path)
    assert list(frame.columns) == ["row", *CLASSES], path
    return frame["row"].to_numpy(), frame[CLASSES].to_numpy()


def test_every_stage_runs_once_teachers_then_students_then_evaluate(run):
    _, ran, log = run
    assert ran.index("predict_test") < min(ran.index(s) for s in ("pseudo@0", "pseudo@1", "distill@small"))
    assert ran[-1] == "evaluate" and {"train@0", "train@1", "pseudo@0", "pseudo@1", "distill@small"} <= set(ran)
    assert "student fold 0: 60 of 60 test rows pseudo-labelled by teacher fold 0 (soft labels, share 1)" in log
    assert ran[:3] == ["fetch", "preprocess", "pretrain"] and "pretrain: MLM loss on" in log
    # every teacher and pseudo student starts from the pretrained encoder; the distilled one from its first layer
    assert log.count("loaded models/pretrained; ") == 4 and "loaded models/pretrained (its first 1 layers)" in log


def test_every_training_stage_runs_once_under_the_allocator_the_log_names(run):
    """LD_PRELOAD reaches each training stage, students included, through dvc: each trains under tcmalloc,
    as its metrics say, and none prints the line suggesting it."""
    repo, ran, log = run
    stages = ["train@0", "train@1", "pseudo@0", "pseudo@1", "distill@small"]
    assert all(ran.count(stage) == 1 for stage in stages), ran
    assert "memory allocator: glibc's malloc" not in log, log
    assert log.count("student fold 1: 60 of 60 test rows pseudo-labelled") == 1
    assert log.count("distill@small: learning the out-of-fold outputs of") == 1
    for report in ("train/fold-0", "train/fold-1", "pseudo/fold-0", "pseudo/fold-1", "distill/small"):
        assert json.loads((repo / f"reports/{report}/metrics.json").read_text())["allocator"] == "tcmalloc", report


def test_student_fold_k_learned_teacher_fold_ks_own_test_outputs_not_the_ensembles(run):
    """Fold safety, read from the written files: a student trained on the ensemble's test outputs (every
    other teacher saw fold K's validation rows) would fail here, since the mean differs from fold K's."""
    repo = run[0]
    teachers = [probabilities(repo / f"predictions/test/fold-{k}.csv")[1] for k in (0, 1)]
    mean = np.mean(teachers, axis=0)
    for k in (0, 1):
        rows, learned = probabilities(repo / f"students/pseudo/fold-{k}/predictions/pseudo_labels.csv")
        assert rows.tolist() == list(range(60))
        np.testing.assert_allclose(learned, teachers[k], atol=1e-6)
        assert np.abs(learned - mean).max() > 1e-3, "the folds agree: this run cannot tell a leak from fold safety"


def test_the_distilled_student_learned_the_mean_of_every_folds_test_outputs(run):
    """distill.test_rows: the student is not a fold, so every teacher may teach it the test rows; it learns
    their mean, not one fold's (the folds differ here, so one fold's outputs would fail)."""
    repo, _, log = run
    teachers = [probabilities(repo / f"predictions/test/fold-{k}.csv")[1] for k in (0, 1)]
    rows, learned = probabilities(repo / "students/distill/small/predictions/test_targets.csv")
    assert rows.tolist() == list(range(60)) and "distill.test_rows: also the ensemble's outputs of the 60 test texts" in log
    np.testing.assert_allclose(learned, (teachers[0] + teachers[1]) / 2, atol=1e-6)
    assert min(np.abs(learned - t).max() for t in teachers) > 1e-3, "the folds agree: one fold's would pass too"


def test_the_students_scores_are_scikit_learns_on_their_files(run):
    repo = run[0]
    metrics = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    train = pd.read_csv(repo / "data/processed/train.csv")
    test = pd.read_csv(repo / "data/processed/test.csv")
    index = {c: i for i, c in enumerate(CLASSES)}
    y_train, y_test = train["label"].map(index).to_numpy(), test["label"].map(index).to_numpy()
    oof = [probabilities(repo / f"students/pseudo/fold-{k}/predictions/oof.csv") for k in (0, 1)]
    rows = np.concatenate([r for r, _ in oof])
    predicted = np.concatenate([p for _, p in oof]).argmax(axis=1)
    assert sorted(rows.tolist()) == list(range(len(train)))
    assert metrics["pseudo"]["oof"]["f1_macro"] == pytest.approx(f1_score(y_train[rows], predicted, average="macro"), abs=1e-4)
    student_mean = np.mean([probabilities(repo / f"students/pseudo/fold-{k}/predictions/test.csv")[1] for k in (0, 1)], axis=0)
    assert metrics["pseudo"]["test"]["accuracy"] == pytest.approx(accuracy_score(y_test, student_mean.argmax(axis=1)), abs=1e-4)
    distilled = probabilities(repo / "students/distill/small/predictions/test.csv")[1]
    teachers = np.mean([probabilities(repo / f"predictions/test/fold-{k}.csv")[1] for k in (0, 1)], axis=0)
    small = metrics["distill"]["small"]
    assert small["test"]["f1_macro"] == pytest.approx(f1_score(y_test, distilled.argmax(axis=1), average="macro"), abs=1e-4)
    assert small["agreement"] == pytest.approx((distilled.argmax(axis=1) == teachers.argmax(axis=1)).mean(), abs=1e-4)
    fold0 = probabilities(repo / "predictions/test/fold-0.csv")[1]
    assert metrics["single_fold"]["test"]["accuracy"] == pytest.approx(accuracy_score(y_test, fold0.argmax(axis=1)), abs=1e-4)
    for scores in (metrics["pseudo"]["oof"], metrics["pseudo"]["test"], small["test"]):
        assert scores["f1_macro"] >= 0.8, scores  # the keyword task: the students learn it too


def test_the_distilled_student_is_smaller_and_predict_uses_it_alone(run, tmp_path):
    repo = run[0]
    student = json.loads((repo / "students/distill/small/model/config.json").read_text())
    teacher = json.loads((repo / "models/fold-0/config.json").read_text())
    assert (student["num_hidden_layers"], teacher["num_hidden_layers"]) == (1, 2)
    speed = json.loads((repo / "students/distill/small/predictions/speed.json").read_text())
    assert speed["rows"] == 60 and speed["student_rows_per_s"] > 0 and speed["ensemble_rows_per_s"] > 0
    out = tmp_path / "labels.csv"
    result = subprocess.run([sys.executable, "-m", "predict", "data/raw/test.csv", "--out", str(out), "--student", "small"],
                            cwd=repo, env=stage_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "with student small" in result.stdout
    distilled = probabilities(repo / "students/distill/small/predictions/test.csv")[1]
    assert pd.read_csv(out)["label"].tolist() == [CLASSES[i] for i in distilled.argmax(axis=1)]


def test_a_bundle_of_the_student_predicts_inside_itself_as_the_student_does(run, tmp_path):
    """python -m bundle --student small: the student alone, and python -m predict run inside the bundle (its own
    copy of the code) labels the test rows as the student's test outputs say."""
    from predicting.bundling import distributions_of, needed_code
    from tests.test_kaggle import bundle, closure, wheel_of
    from tests.test_pipeline import REPO

    repo = run[0]
    pypi = tmp_path / "pypi"
    pypi.mkdir()
    for dist in closure(distributions_of(needed_code(REPO)[1])).values():
        if dist.metadata["Name"] != "torch":
            wheel_of(dist, pypi)
    made = bundle(repo, tmp_path / "bundle", pypi, "--student", "small")
    assert made.returncode == 0, made.stdout + made.stderr
    info = json.loads((tmp_path / "bundle/bundle.json").read_text())
    assert info["models"] == ["students/distill/small/model"] and info["student"] == "small"
    assert not (tmp_path / "bundle/models").exists()
    out = tmp_path / "labels.csv"
    env = {k: v for k, v in stage_env().items() if k != "PYTHONPATH"}  # the bundle's code, not this project's
    result = subprocess.run([sys.executable, "-m", "predict", str(repo / "data/raw/test.csv"), "--out", str(out),
                             "--student", "small"], cwd=tmp_path / "bundle", env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    distilled = probabilities(repo / "students/distill/small/predictions/test.csv")[1]
    assert pd.read_csv(out)["label"].tolist() == [CLASSES[i] for i in distilled.argmax(axis=1)]


def test_evaluate_submits_what_evaluate_submit_names(run):
    repo = run[0]
    distilled = probabilities(repo / "students/distill/small/predictions/test.csv")[1]
    try:
        set_params(repo, evaluate__submit="small")
        ran, _ = logged_repro(repo)
        assert ran == ["evaluate"], ran
        submitted = pd.read_csv(repo / "submission/probabilities.csv")[CLASSES].to_numpy()
        np.testing.assert_allclose(submitted, distilled, atol=1e-6)
        set_params(repo, evaluate__submit="medium")
        result = subprocess.run([sys.executable, "-m", "stages.evaluate"], cwd=repo, env=stage_env(), capture_output=True, text=True)
        expected = ("error: params.yaml: evaluate.submit 'medium': the run has teachers, students, small (students: "
                    "pseudo.folds; a name: distill.students)")
        assert result.returncode == 1 and result.stderr.splitlines() == [expected], result.stderr
    finally:
        set_params(repo, evaluate__submit="teachers")
        logged_repro(repo)


def test_a_student_bigger_than_its_teacher_stops_in_one_line_before_any_work(run, tmp_path):
    repo = run[0]
    params = yaml.safe_load((repo / "params.yaml").read_text())
    for student, expected in [({"model": None, "layers": 3}, "distill.students.small.layers 3: "),
                              ({"model": None, "layers": None}, "distill.students.small: the student (")]:
        params["distill"]["students"] = {"small": student}
        folder = tmp_path / str(student["layers"])
        folder.mkdir()
        (folder / "params.yaml").write_text(yaml.safe_dump(params))
        result = subprocess.run([sys.executable, "-m", "stages.distill", "--student", "small"], cwd=folder,
                                env={**stage_env(), "PYTHONPATH": str(repo)}, capture_output=True, text=True)
        lines = result.stderr.splitlines()
        assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"error: params.yaml: {expected}"), result.stderr
        assert sorted(p.name for p in folder.iterdir()) == ["params.yaml"]


def test_what_reruns_after_a_teacher_a_pseudo_and_a_distill_setting_changes(run):
    """Teachers changed: every student reruns, nothing before the teachers does (pretrain, on here, included);
    a pseudo or distill setting: its students and evaluate only. Fewer epochs make the teachers' rerun cheap.
    The last test of the module: it leaves the repo changed."""
    repo = run[0]
    set_params(repo, train__epochs=2, machine__checkpoint_minutes=5)  # not a setting of the results: no stage reruns for it
    ran, _ = logged_repro(repo)
    assert sorted(ran) == sorted(["train@0", "train@1", "predict_test", "pseudo@0", "pseudo@1", "distill@small",
                                  "evaluate"]), ran
    set_params(repo, pseudo__share=0.5)
    ran, _ = logged_repro(repo)
    assert sorted(ran) == ["evaluate", "pseudo@0", "pseudo@1"], ran
    assert len(pd.read_csv(repo / "students/pseudo/fold-0/predictions/pseudo_labels.csv")) == 30
    set_params(repo, distill__epochs=3)
    ran, _ = logged_repro(repo)
    assert ran == ["distill@small", "evaluate"], ran


# ---- the pure part: which test rows, and which targets ----------------------------------------

def test_pseudo_labels_soft_hard_and_share_as_worked_by_hand():
    outputs = np.array([[0.95, 0.03, 0.02], [0.5, 0.3, 0.2], [0.05, 0.05, 0.9], [0.1, 0.85, 0.05]])
    shape = SHAPES["classification"]
    rows, targets = pseudo_labels(outputs, shape, "soft", 0.9, 1.0, 0)
    assert rows.tolist() == [0, 1, 2, 3] and np.array_equal(targets, outputs)
    rows, targets = pseudo_labels(outputs, shape, "hard", 0.9, 1.0, 0)
    assert rows.tolist() == [0, 2] and targets.tolist() == [[1, 0, 0], [0, 0, 1]]
    rows, targets = pseudo_labels(outputs, shape, "hard", 0.85, 1.0, 0)
    assert rows.tolist() == [0, 2, 3] and targets[2].tolist() == [0, 1, 0]
    rows, _ = pseudo_labels(outputs, shape, "soft", 0.9, 0.5, 0)
    assert len(rows) == 2 and set(rows) <= {0, 1, 2, 3}
    # multi-label: a row counts when every class is that sure either way
    tags = np.array([[0.97, 0.02], [0.97, 0.6], [0.01, 0.04]])
    rows, targets = pseudo_labels(tags, SHAPES["multilabel"], "hard", 0.95, 1.0, 0)
    assert rows.tolist() == [0, 2] and targets.tolist() == [[1, 0], [0, 0]]
    rows, _ = pseudo_labels(tags, SHAPES["multilabel"], "hard", 0.96, 1.0, 0)  # 1 - 0.04: sure enough, just
    assert rows.tolist() == [0, 2]
    # regression: the values, which the student standardises as its labels
    assert SHAPES["regression"].soft_targets(np.array([[3.5], [-1.0]])) == [3.5, -1.0]
    assert SHAPES["regression"].confident is None
