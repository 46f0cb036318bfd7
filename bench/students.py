"""python -m bench.students: the stages competitions are won with, side by side on the embedded tweets
with MiniLM (the defaults, whose test file has labels), in one fresh pipeline repo, one `dvc repro` per row:

1. the default pipeline (one fold);
2. the same after pretrain (masked-language-model pretraining on the train and test texts);
3. two folds (the teachers the students need);
4. one pseudo-label round: a student per fold, each on teacher K's test outputs;
5. a distilled student: MiniLM's first --layers layers, on the out-of-fold outputs;
and after row 2, train.lr changed: which stages a second `dvc repro` reruns (pretrain must not).

Prints each row's validation/out-of-fold and test macro-F1, each stage's wall time (the stage's own
"wrote ... in N s" line) and a markdown table. Every number is from this run; compare rows, not machines.

    python -m bench.students      # 2 CPU cores: rows 1, 2 took 36 min quiet; rows 3-5 2 h beside the tests
    python -m bench.students --pretrain-epochs 0.5 --layers 3 --work /tmp/students
    python -m bench.students --rows 3,4,5                 # the students only (4 and 5 need the folds of 3)
    python -m bench.students --rows 5 --work W --reuse    # row 5 on the teachers an earlier --work W run trained
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def command(args, cwd):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(map(str, args))} failed in {cwd}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def fresh_repo(work):
    """This project's tracked files (as a clone has them) in a new git + DVC repo."""
    repo = work / "pipeline"
    files = command(["git", "ls-files", "-co", "--exclude-standard"], REPO).splitlines()
    for name in files:
        if (REPO / name).is_file() and not name.startswith(("tests/", "notebooks/")):
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, repo / name)
    for args in (["git", "init", "-q"], ["git", "add", "-A"],
                 ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "pipeline"]):
        command(args, repo)
    return repo


def set_params(repo, changes):
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        section, key = dotted.split(".", 1)
        params[section][key] = value
    path.write_text(yaml.safe_dump(params, sort_keys=False, allow_unicode=True))


def repro(repo, name, changes, log_dir):
    """`dvc repro` after changes: (stages run, {stage: seconds}, wall seconds, metrics)."""
    set_params(repo, changes)
    start = time.perf_counter()
    out = command([sys.executable, "-m", "dvc", "repro"], repo)
    wall = time.perf_counter() - start
    (log_dir / f"{name}.log").write_text(out)
    ran = re.findall(r"Running stage '([^']+)'", out)
    seconds = stage_seconds(out)
    metrics = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    print(f"{name}: ran {', '.join(ran) or 'nothing'} in {wall:.0f} s", flush=True)
    return ran, seconds, wall, metrics


def stage_seconds(out):
    """{stage: seconds} from each stage's last line, "<stage>: wrote ... in N s" (run_main prints it)."""
    found = {}
    for line in out.splitlines():
        match = re.match(r"^([a-z_]+(?:@\S+)?): wrote .* in ([\d.]+) s$", line)
        if match:
            found[match[1]] = float(match[2])
    return found


def f1(scores):
    return f"{scores['f1_macro']:.4f}" if scores and scores.get("f1_macro") is not None else "-"


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.students", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-epochs", type=float, default=1.0, help="pretrain.epochs of row 2 (default 1)")
    parser.add_argument("--layers", type=int, default=3, help="the distilled student's layers (MiniLM has 6)")
    parser.add_argument("--work", type=Path, help="where to build the repo (default: a temporary folder)")
    parser.add_argument("--rows", default="1,2,3,4,5", help="which rows to run (default all; 4 and 5 need 3)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a params.yaml change for every row, e.g. train.epochs=0.05 for a quick look")
    parser.add_argument("--reuse", action="store_true",
                        help="keep WORK/pipeline from an earlier run (its code as it was copied then), e.g. its teachers")
    args = parser.parse_args()
    every_row = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    work = args.work or Path(tempfile.mkdtemp(prefix="students-"))
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.reuse and (work / "pipeline" / "dvc.lock").exists():
        repo = work / "pipeline"
    else:
        shutil.rmtree(work / "pipeline", ignore_errors=True)
        repo = fresh_repo(work)
    if not (repo / ".dvc").is_dir():  # a clone has the project's .dvc/
        command([sys.executable, "-m", "dvc", "init", "-q"], repo)
    print(f"repo: {repo}; logs: {logs}", flush=True)

    chosen = {int(r) for r in args.rows.split(",")}
    rows, pretrain, small, rerun, rerun_wall = [], None, None, None, 0.0
    if 1 not in chosen:
        set_params(repo, every_row)
    if 1 in chosen:
        _, seconds, wall, m = repro(repo, "1-default", every_row, logs)
        rows.append(("default (1 fold)", f1(m["val"]), f1(m.get("test")), seconds, wall))
    if 2 in chosen:
        _, seconds, wall, m = repro(repo, "2-pretrain", {"pretrain.epochs": args.pretrain_epochs}, logs)
        pretrain = json.loads((repo / "reports/pretrain/metrics.json").read_text())
        rows.append((f"pretrain {args.pretrain_epochs:g} epoch(s), then the same fine-tune", f1(m["val"]),
                     f1(m.get("test")), seconds, wall))
        lr = yaml.safe_load((repo / "params.yaml").read_text())["train"]["lr"]
        rerun, _, rerun_wall, _ = repro(repo, "2b-train-lr", {"train.lr": 1.5e-4 if lr == "auto" else float(lr) * 1.5}, logs)  # pretrain must stay
        repro(repo, "2c-train-lr-back", {"train.lr": lr}, logs)  # DVC's run cache restores row 2
    if 3 in chosen:
        _, seconds, wall, m = repro(repo, "3-two-folds", {"pretrain.epochs": 0, "cv.folds": [0, 1]}, logs)
        rows.append(("2 folds: the teachers (OOF / ensemble)", f1(m["oof"]), f1(m.get("test")), seconds, wall))
    if 4 in chosen:
        _, seconds, wall, m = repro(repo, "4-pseudo", {"pseudo.folds": [0, 1]}, logs)
        rows.append(("one pseudo-label round (students' OOF / ensemble)", f1(m["pseudo"]["oof"]),
                     f1(m["pseudo"].get("test")), seconds, wall))
    if 5 in chosen:
        _, seconds, wall, m = repro(repo, "5-distill",
                                    {"distill.students": {"small": {"model": None, "layers": args.layers}}}, logs)
        small = m["distill"]["small"]
        described = (f"distilled student, {args.layers} of 6 layers (agreement {small.get('agreement', float('nan')):.4f}, "
                     f"{small['speed']['speedup']:.2f}x the ensemble's rows/s)")
        rows.append((described, "-", f1(small.get("test")), seconds, wall))
        rows.append(("fold 0 alone (test)", "-", f1(m.get("single_fold", {}).get("test")), {}, 0.0))

    print("\n| row | val / OOF macro-F1 | test macro-F1 | stages' own seconds | repro wall s |")
    print("|---|---|---|---|---|")
    for name, val, test, times, wall in rows:
        print(f"| {name} | {val} | {test} | {', '.join(f'{s} {t:.0f}' for s, t in times.items()) or '-'} | {wall:.0f} |")
    if pretrain:
        print(f"\npretrain: {json.dumps(pretrain)}")
        print(f"row 2, then train.lr x1.5: `dvc repro` ran {', '.join(rerun)} ({rerun_wall:.0f} s); pretrain "
              f"{'RERAN' if 'pretrain' in rerun else 'did not rerun'}")
    if small:
        print(f"distilled student: {json.dumps(small)}")


if __name__ == "__main__":
    main()
