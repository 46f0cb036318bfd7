"""Reading the label column(s) of a raw CSV into the processed form, one reader per task shape (the
shapes in tasks/shapes.py point at theirs). Processed labels are text in every shape, in the column
`label`, empty for an unlabelled test row:
- classification: the class name; surrounding spaces dropped, "NA" or "None" stay class names, and one
  number spelled several ways ("1", "1.0", "+1") is one class, named by its most common spelling;
- multilabel: a JSON list of class names (`[]` for a row with none), from one column of classes joined
  by task.label_separator ("sports|music", empty for none) or from one 0/1 column per class;
- regression: the number as written.
Row numbers in messages count the header as row 1, as a spreadsheet does.
"""
import json
import re
from decimal import Decimal

import pandas as pd

from pipeline.settings import PipelineError
from reading.csvfiles import row_numbers

NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")  # no nan, inf, 1_0
SHOWN = 5  # values a message lists before "and N more"


def require_labels(labels, label_column, path):
    empty = labels.index[labels == ""]
    if len(empty):
        raise PipelineError(f"{path}: {len(empty)} row(s) have an empty {label_column!r} "
                            f"({row_numbers(empty)}); fill or remove them")


def label_cells(raw, column, path, known):
    """The label column's cells, stripped; None in a file without it (an unlabelled test file). Train's
    rows (known None) must each have one."""
    if column not in raw:
        return None
    cells = raw[column].str.strip()
    if known is None:
        require_labels(cells, column, path)
    return cells


def unify_numeric_labels(labels, known=()):
    """Map spellings of one number ("1", "1.0", "+1") to one: a spelling in `known` (train's
    labels, for test), else the most common one. Returns (labels, {old spelling: new})."""
    counts = labels.value_counts()
    spellings = [s for s in set(labels) | set(known) if NUMBER_RE.fullmatch(s)]
    canonical = {}
    # known spellings first, then the most common (ties: the shortest, then alphabetical)
    for s in sorted(spellings, key=lambda s: (s not in known, -counts.get(s, 0), len(s), s)):
        canonical.setdefault(Decimal(s), s)
    merged = {s: canonical[Decimal(s)] for s in sorted(counts.index)
              if NUMBER_RE.fullmatch(s) and canonical[Decimal(s)] != s}
    return labels.replace(merged), merged


def sort_labels(labels):
    """Numbers in numeric order (2 before 10) when every label is one, else alphabetically."""
    labels = set(labels)
    if all(NUMBER_RE.fullmatch(s) for s in labels):
        return sorted(labels, key=lambda s: (Decimal(s), s))
    return sorted(labels)


def check_known_labels(df, labels, path):
    unseen = sorted(set(df["label"]) - set(labels) - {""})
    if unseen:
        raise PipelineError(f"{path}: label(s) {unseen} never occur in the training data "
                            f"(train has {labels})")


def report_merged(merged, labels, path):
    """Say which label spellings unify_numeric_labels merged; `labels` are those before it."""
    if merged:
        print(f"{path}: one number, several spellings: " + ", ".join(
            f"{old!r} -> {new!r} ({(labels == old).sum()} row(s))" for old, new in merged.items()))


# ---- classification ----------------------------------------------------------------------

def read_class_labels(raw, columns, separator, path, known=None):
    """The class of each row of `raw` (train: known None, every row labelled; test: `known` are train's
    classes, and a file without the column is unlabelled)."""
    column = columns[0]
    labels = label_cells(raw, column, path, known)
    if labels is None:
        return pd.Series("", index=raw.index)
    unified, merged = unify_numeric_labels(labels, known=known or ())
    report_merged(merged, labels, path)
    if known is not None:
        check_known_labels(pd.DataFrame({"label": unified}), known, path)
    return unified


def class_list(labels, columns, separator, path):
    """The classes, in the order of the model's outputs."""
    classes = sort_labels(labels)
    if len(classes) < 2:
        raise PipelineError(f"{path}: {columns[0]!r} has a single class {classes}; classification needs at least two")
    if len(classes) > 20 and all(NUMBER_RE.fullmatch(c) for c in classes) and any(
            Decimal(c) != Decimal(c).to_integral_value() for c in classes):
        print(f"{path}: {len(classes)} classes, all numbers, some with fractions (e.g. {classes[len(classes) // 2]!r}): "
              "if this is a score to predict, set task.kind: regression")
    return classes


# ---- multilabel --------------------------------------------------------------------------

def split_joined(text, separator):
    """The classes of one cell of classes joined by `separator`: stripped, empty ones dropped, each once."""
    return list(dict.fromkeys(part.strip() for part in text.split(separator) if part.strip()))


def read_multilabels(raw, columns, separator, path, known=None):
    """The classes of each row as a JSON list; from one joined column (`columns` has one name and
    separator is used) or one 0/1 column per class. Test rows of a file without the label column(s)
    are unlabelled ("")."""
    present = [c for c in columns if c in raw]
    if known is not None and (not present or separator is not None and (raw[columns[0]].str.strip() == "").all()):
        return pd.Series("", index=raw.index)
    if separator is not None:
        rows = raw[columns[0]].map(lambda cell: split_joined(cell, separator))
    else:
        if known is not None and len(present) < len(columns):
            missing = [c for c in columns if c not in raw]
            raise PipelineError(f"{path}: has {', '.join(map(repr, present))} but not {', '.join(map(repr, missing))}: "
                                "a labelled test file needs every class column, an unlabelled one none")
        flags = {c: zero_one(raw[c], c, path) for c in columns}
        rows = pd.Series([[c for c in columns if flags[c][i]] for i in range(len(raw))], index=raw.index)
    if known is not None:
        unseen = sorted({c for row in rows for c in row} - set(known))
        if unseen:
            raise PipelineError(f"{path}: label(s) {unseen} never occur in the training data (train has {known})")
    return rows.map(lambda row: json.dumps(row, ensure_ascii=False))


def zero_one(values, column, path):
    """A 0/1 column as booleans ("1", "1.0", "0", " 0 " all count); anything else is an error naming rows."""
    stripped = values.str.strip()
    numbers = stripped.map(lambda v: Decimal(v) if NUMBER_RE.fullmatch(v) else None)
    bad = stripped.index[~numbers.isin([Decimal(0), Decimal(1)])]
    if len(bad):
        shown = ", ".join(repr(v) for v in stripped[bad][:SHOWN])
        raise PipelineError(f"{path}: column {column!r} must hold 0 or 1 in every row (one column per class); "
                            f"{row_numbers(bad)} hold {shown}")
    return (numbers == Decimal(1)).to_numpy()


def multilabel_list(labels, columns, separator, path):
    """The classes: the class columns in their order, or every class the joined column names, sorted."""
    if separator is None:
        return list(columns)
    classes = sort_labels({c for row in labels for c in json.loads(row)})
    if not classes:
        raise PipelineError(f"{path}: no row of {columns[0]!r} names a class; a multi-label task needs some "
                            "(check task.label_separator, or list one 0/1 column per class in preprocess.label_column)")
    return classes


# ---- regression --------------------------------------------------------------------------

def read_numbers(raw, columns, separator, path, known=None):
    """The target of each row, as written; every train row must have one, a test row may be empty."""
    column = columns[0]
    values = label_cells(raw, column, path, known)
    if values is None:
        return pd.Series("", index=raw.index)
    bad = values.index[(values != "") & ~values.map(lambda v: bool(NUMBER_RE.fullmatch(v)))]
    if len(bad):
        shown = ", ".join(repr(v) for v in values[bad][:SHOWN])
        raise PipelineError(f"{path}: {len(bad)} row(s) of {column!r} are not numbers ({row_numbers(bad)}: {shown}); "
                            "task.kind regression needs a number in every row")
    return values


def no_classes(labels, columns, separator, path):
    """Regression has no classes; the target must vary for there to be anything to learn."""
    if labels.map(Decimal).nunique() < 2:
        raise PipelineError(f"{path}: {columns[0]!r} holds a single value ({labels.iloc[0]!r}); regression needs "
                            "at least two")
    return []
