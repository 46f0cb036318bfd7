"""python -m tune.show: the study's trials, best first: score, state, params, experiment, time, and the
training steps pruning saved. `--top N` shows the N best; python -m tune prints it when it ends."""
import argparse
import sys

from pipeline.command import run_main
from training.progress import duration
from tune.study import add_study_options, open_existing, ranked, steps_saved, study_facts, trial_rows


def cell(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows, metric, keys):
    """Rows of trials as aligned text columns."""
    header = ["trial", "state", metric, *keys, "experiment", "time", "note"]
    lines = [[str(r.number), r.state.lower(), cell(r.value), *(cell(r.params.get(k)) for k in keys),
              r.experiment or "", duration(r.seconds) if r.seconds else "", r.note] for r in rows]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(text.ljust(width) for text, width in zip(line, widths)).rstrip()
                     for line in [header, *lines])


def summary(rows):
    states = {}
    for r in rows:
        states[r.state.lower()] = states.get(r.state.lower(), 0) + 1
    text = f"{len(rows)} trials: " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    saved = steps_saved(rows)
    if saved is not None:
        run, total = sum(r.steps[0] for r in rows), sum(r.steps[1] for r in rows)
        text += f"; pruning saved {saved:.0%} of the training steps ({run:,} run of {total:,.0f})"
    timed = [r for r in rows if r.seconds and r.train_seconds]
    if timed:
        overhead = sum(r.seconds - r.train_seconds for r in timed) / len(timed)
        text += f"; {overhead:.1f} s per trial outside its train stages"
    return text


def print_table(study, top=None):
    metric, direction, folds = study_facts(study)
    rows = trial_rows(study, folds)
    keys = sorted({k for r in rows for k in r.params})
    shown = ranked(rows, direction)[:top] if top else ranked(rows, direction)
    print(f"study {study.study_name!r} ({direction} {metric}, {folds} fold(s)); {summary(rows)}")
    print(table(shown, metric, keys))


def main():
    parser = argparse.ArgumentParser(prog="python -m tune.show", description="the trials of a study, best first")
    add_study_options(parser)
    parser.add_argument("--top", type=int, help="show only the N best trials")
    args = parser.parse_args(sys.argv[1:])
    print_table(open_existing(args), args.top)


if __name__ == "__main__":
    run_main(main, tool="tune.show")
