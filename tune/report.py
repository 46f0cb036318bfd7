"""python -m tune.report: the study as one HTML page that opens offline (plotly.js inlined once): the
trials' table, the optimization history, parameter importances, parallel coordinates, slices and each
trial's validation curve (its intermediate scores), Optuna's own figures. Written to
tuning/<study>/report.html; python -m tune writes it when it ends."""
import argparse
import html
import os
import sys
import warnings

from pipeline.command import run_main
from tune.settings import TUNING
from tune.show import summary, table
from tune.study import add_study_options, open_existing, ranked, study_facts, trial_rows

FIGURES = (("Optimization history", "plot_optimization_history"),
           ("Parameter importances", "plot_param_importances"),
           ("Parallel coordinates", "plot_parallel_coordinate"),
           ("Slices: the score against each parameter", "plot_slice"),
           ("Each trial's validation scores as it ran (what the pruner saw)", "plot_intermediate_values"))


def figures(study):
    """(title, plotly figure or the reason there is none) for each of FIGURES."""
    import optuna.visualization as plots

    for title, name in FIGURES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna's experimental-feature notices
                yield title, getattr(plots, name)(study)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:  # too few trials for this figure yet
            yield title, f"not drawn yet: {e}"


def page(study):
    metric, direction, folds = study_facts(study)
    rows = trial_rows(study, folds)
    keys = sorted({k for r in rows for k in r.params})
    parts = [f"<h1>Study {html.escape(study.study_name)}</h1>",
             f"<p>{html.escape(direction)} {html.escape(metric)} over {folds} fold(s); {html.escape(summary(rows))}</p>",
             f"<pre>{html.escape(table(ranked(rows, direction), metric, keys))}</pre>"]
    inlined = False
    for title, figure in figures(study):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if isinstance(figure, str):
            parts.append(f"<p>{html.escape(figure)}</p>")
        else:  # plotly.js once, in the first figure: the page then opens with no network
            parts.append(figure.to_html(full_html=False, include_plotlyjs=not inlined))
            inlined = True
    return ("<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
            f"<title>Study {html.escape(study.study_name)}</title>"
            "<style>body{font-family:sans-serif;margin:2em} pre{font-size:12px}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def write(study, path=None):
    path = path or TUNING / study.study_name / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(page(study), encoding="utf-8")
    tmp.replace(path)
    return path


def main():
    parser = argparse.ArgumentParser(prog="python -m tune.report", description="the study as an HTML page")
    add_study_options(parser)
    args = parser.parse_args(sys.argv[1:])
    print(f"wrote {write(open_existing(args))}")


if __name__ == "__main__":
    run_main(main, tool="tune.report")
