"""python -m tune.blend: the mean of several experiments' class probabilities, the blend competitors
submit. Scores it on the out-of-fold (or holdout) rows next to each member's own score, so you see
whether blending beats the best single trial, and writes its submission.

    python -m tune.blend --top 3              # the study's three best trials
    python -m tune.blend tweets-4 tweets-9    # any experiments (of one data set and split)

Every member must have been trained on the same processed data and split (dvc.lock says so); each
member's test probabilities are its own fold ensemble (evaluate's), and the blend averages those.
Single-label classification only (task.kind classification, text pairs included): a multi-label blend
would need its threshold chosen again, a regression one its values averaged; not done yet.
"""
import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from pipeline.command import run_main
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import PipelineError
from predicting import folds
from predicting.ensemble import combine_out_of_fold, mean_test_probabilities
from tasks.scores import classification_metrics
from tune.best import local_experiments
from tune.settings import TUNING
from tune.study import add_study_options, open_existing, ranked, study_facts, trial_rows

SHARED = ("preprocess", "split")  # stages whose outputs every member must share


def read(path, rev):
    import dvc.api

    try:
        return dvc.api.read(str(path), rev=rev)
    except Exception as e:  # a file missing from that experiment, or its outputs not in this cache
        raise PipelineError(f"{path} of experiment {rev}: cannot be read ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}); dvc exp pull it first") from None


def lock(rev):
    shown = subprocess.run(["git", "show", f"{rev}:dvc.lock"], capture_output=True, text=True)
    if shown.returncode:
        raise PipelineError(f"experiment {rev}: no dvc.lock ({shown.stderr.strip()})")
    return yaml.safe_load(shown.stdout)["stages"]


def experiment_ref(name):
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"],
                          capture_output=True, text=True).stdout.split()
    found = [r for r in refs if r.rsplit("/", 1)[-1] == name]
    if not found:
        raise PipelineError(f"no experiment {name} in this clone (dvc exp pull <git remote> {name})")
    return found[0]


def check_classification(members):
    """Only single-label runs blend here (their class probabilities, argmax): one line for the others."""
    for name in members:
        shown = subprocess.run(["git", "show", f"{experiment_ref(name)}:params.yaml"], capture_output=True, text=True)
        kind = ((yaml.safe_load(shown.stdout) or {}).get("task") or {}).get("kind", "classification")
        if kind != "classification":
            raise PipelineError(f"experiment {name} is task.kind {kind}: python -m tune.blend averages the class "
                                "probabilities of single-label classification runs only")


def check_same_data(members):
    """Members trained on other data or folds cannot be averaged row by row."""
    digests = {name: [lock(experiment_ref(name))[stage]["outs"][0]["md5"] for stage in SHARED] for name in members}
    first = members[0]
    for name in members[1:]:
        if digests[name] != digests[first]:
            raise PipelineError(f"experiments {first} and {name} were trained on other data or folds "
                                f"({'/'.join(SHARED)} differ): only runs of one split blend row by row")


def member_probabilities(name, labels, row_folds, n_test):
    """(out-of-fold rows, their probabilities, test probabilities or None) of one experiment."""
    ref = experiment_ref(name)
    fold_count = folds.fold_count(row_folds)
    oof, tests = [], []
    for k in range(fold_count):
        prefix = folds.outputs(k)["predictions"]
        oof.append(folds_probabilities(read(prefix / "oof.csv", ref), labels, f"{prefix}/oof.csv of {name}"))
        if n_test:
            path = folds.outputs(k)["test"]
            tests.append(folds_probabilities(read(path, ref), labels, f"{path} of {name}"))
    rows, probabilities = combine_out_of_fold(row_folds, oof)
    return rows, probabilities, mean_test_probabilities(tests, n_test) if n_test else None


def folds_probabilities(text, labels, name):
    frame = pd.read_csv(io.StringIO(text))
    if [str(c) for c in frame.columns[1:]] != list(labels):
        raise PipelineError(f"{name}: classes {list(frame.columns[1:])}, not {labels}")
    return frame["row"].to_numpy(), frame.iloc[:, 1:].to_numpy(dtype=np.float64)


def blend(members, out):
    check_classification(members)
    check_same_data(members)
    ref = experiment_ref(members[0])
    labels = json.loads(read("data/processed/labels.json", ref))
    index = {name: i for i, name in enumerate(labels)}
    row_folds = pd.read_csv(io.StringIO(read(folds.FOLDS_CSV, ref)))["fold"].astype(int).to_numpy()
    y_train = np.array([index[y] for y in pd.read_csv(io.StringIO(read("data/processed/train.csv", ref)),
                                                          dtype=str, keep_default_na=False)["label"]])
    test = test_frame(ref)
    split = "val" if folds.fold_count(row_folds) == 1 else "oof"
    scores, oofs, tests = {}, [], []
    for name in members:
        rows, probabilities, test_probabilities = member_probabilities(name, labels, row_folds,
                                                                       len(test) if test is not None else 0)
        oofs.append(probabilities)
        tests.append(test_probabilities)
        scores[name] = classification_metrics(y_train[rows], probabilities.argmax(axis=1), labels)
    mean_oof = np.mean(oofs, axis=0)
    scores["blend"] = classification_metrics(y_train[rows], mean_oof.argmax(axis=1), labels)
    metrics = {"members": members, split: {name: {k: s[k] for k in ("accuracy", "f1_macro")} for name, s in scores.items()}}
    with atomic_dir(out) as tmp:
        if test is not None:
            mean_test = np.mean(tests, axis=0)
            predicted = mean_test.argmax(axis=1)
            pd.DataFrame({"id": test["id"], "label": [labels[p] for p in predicted]}).to_csv(tmp / "submission.csv", index=False)
            pd.concat([test[["id"]], pd.DataFrame(mean_test, columns=labels)], axis=1).to_csv(
                tmp / "probabilities.csv", index=False, float_format=folds.DECIMALS)
            if (test["label"] != "").all():
                metrics["test"] = {k: v for k, v in classification_metrics(
                    [index[y] for y in test["label"]], predicted, labels).items() if k != "per_class"}
        write_json(tmp / "metrics.json", metrics)
    return metrics, split


def test_frame(ref):
    try:
        return pd.read_csv(io.StringIO(read("data/processed/test.csv", ref)), dtype=str, keep_default_na=False)
    except PipelineError:
        return None


def main():
    parser = argparse.ArgumentParser(prog="python -m tune.blend", description="average experiments' probabilities")
    add_study_options(parser)
    parser.add_argument("experiments", nargs="*", help="experiment names (default: the study's --top best)")
    parser.add_argument("--top", type=int, default=3, help="with no names: the study's N best trials (default 3)")
    parser.add_argument("--out", type=Path, help="output folder (default tuning/<study>/blend)")
    args = parser.parse_args(sys.argv[1:])
    members = args.experiments
    study_name = None
    if not members:
        study = open_existing(args)
        metric, direction, fold_count = study_facts(study)
        members = [r.experiment for r in ranked(trial_rows(study, fold_count), direction) if r.value is not None][:args.top]
        study_name = study.study_name
    if len(members) < 2:
        raise PipelineError(f"a blend needs two experiments or more; got {members}")
    missing = [m for m in members if m not in local_experiments()]
    if missing:
        raise PipelineError(f"experiment(s) {', '.join(missing)} not in this clone: dvc exp pull <git remote> {missing[0]}")
    out = args.out or TUNING / (study_name or "blends") / "blend"
    metrics, split = blend(members, out)
    width = max(map(len, metrics[split]))
    for name, score in metrics[split].items():
        print(f"{name.ljust(width)}  {split} accuracy {score['accuracy']:.4f}, macro-F1 {score['f1_macro']:.4f}")
    if "test" in metrics:
        print(f"{'blend'.ljust(width)}  test accuracy {metrics['test']['accuracy']:.4f}, macro-F1 {metrics['test']['f1_macro']:.4f}")
    print(f"tune.blend: wrote {out} (submission.csv, probabilities.csv, metrics.json)")


if __name__ == "__main__":
    run_main(main, tool="tune.blend")
