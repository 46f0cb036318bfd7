"""preprocess: clean the raw CSVs once, de-duplicate, save CSVs and the label list.

Reads data/raw/{train,test}.csv; writes data/processed/{train,test}.csv and labels.json (the split
stage then decides which training rows each fold validates on).
Every output CSV has the columns `text` and `label` (test: `id`, `text` and `label`, the
label empty when the test file has none). Every check runs before anything is written, so a
bad input leaves the previous data/processed as it was.

Labels are text: "NA", "None" or "null" are class names, surrounding spaces are dropped, and
numbers spelled two ways ("1" and "1.0") are one class, named by its most common spelling.
Row numbers in messages count the header as row 1, as a spreadsheet does.
"""
import html
import re
from decimal import Decimal
from pathlib import Path

import pandas as pd
from stages.common import PipelineError, atomic_dir, load_params, run_main, write_json
from stages.csvfiles import read_csv, write_csv

TRAIN_CSV = Path("data/raw/train.csv")
TEST_CSV = Path("data/raw/test.csv")
OUT = Path("data/processed")

URL_RE = re.compile(r"(?:https?://|www\.)\S+", re.IGNORECASE)
MENTION_RE = re.compile(r"(?<!\w)@\w+")
WHITESPACE_RE = re.compile(r"\s+")
NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")  # no nan, inf, 1_0
SHOWN = 5  # rows or ids a message lists before "and N more"
# the preprocess.* switches that clean_text takes as keyword arguments
CLEANING_SWITCHES = ("lowercase", "unescape_html", "replace_urls", "replace_mentions", "normalize_whitespace")
# what each preprocess.* key accepts; load_params turns anything else into a one-line error
PREPROCESS_PARAMS = {"text_column": (str,), "label_column": (str,), "id_column": (str, None),
                     **{switch: (bool,) for switch in CLEANING_SWITCHES},
                     "drop_duplicates": (bool,)}


def clean_text(text, lowercase=False, unescape_html=True, replace_urls=True,
               replace_mentions=True, normalize_whitespace=True):
    """Return the cleaned text. Idempotent: cleaning a cleaned text changes nothing."""
    # Unescape until stable: tweets often carry double-escaped entities (&amp;amp;). Lowercase in
    # the same loop: lowercasing can make an entity ("&Hellip;" -> "&hellip;", an ellipsis), so
    # lowercasing after the loop left texts that a second cleaning changed.
    previous = None
    while previous != text:
        previous = text
        if unescape_html:
            text = html.unescape(text)
        if lowercase:
            text = text.lower()
    if replace_urls:
        text = URL_RE.sub("http", text)
    if replace_mentions:
        text = MENTION_RE.sub("@user", text)
    if normalize_whitespace:
        text = WHITESPACE_RE.sub(" ", text).strip()
    return text


def require_columns(df, columns, path):
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise PipelineError(
            f"{path}: missing column(s) {', '.join(map(repr, missing))}; "
            f"found {', '.join(map(repr, df.columns))} (set preprocess.text_column / label_column / id_column)")


def require_rows(df, path):
    if df.empty:
        raise PipelineError(f"{path}: a header ({', '.join(map(repr, df.columns))}) but no rows")


def row_numbers(index):
    """'rows 2, 5, 9' for positions in a frame read from a CSV (the header is row 1)."""
    rows = [str(i + 2) for i in index]
    shown = ", ".join(rows[:SHOWN])
    more = f" and {len(rows) - SHOWN} more" if len(rows) > SHOWN else ""
    return f"row{'s' if len(rows) > 1 else ''} {shown}{more}"


def clean_frame(df, text_column, label_column, options):
    """Cleaned `text` and `label` columns, keeping df's index (row numbers); rows whose text
    cleans to nothing are dropped."""
    out = pd.DataFrame({
        "text": df[text_column].map(lambda t: clean_text(t, **options)),
        "label": df[label_column].str.strip() if label_column in df else "",
    }, index=df.index)
    return out[out["text"] != ""]


def require_labels(df, label_column, path):
    empty = df.index[df["label"] == ""]
    if len(empty):
        raise PipelineError(f"{path}: {len(empty)} row(s) have an empty {label_column!r} "
                            f"({row_numbers(empty)}); fill or remove them")


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


def check_unique_ids(ids, column, path):
    repeated = ids[ids.duplicated(keep=False)]
    if len(repeated):
        groups = repeated.groupby(repeated, sort=False).groups
        listed = "; ".join(f"{value!r} ({row_numbers(rows)})" for value, rows in list(groups.items())[:SHOWN])
        more = f"; and {len(groups) - SHOWN} more" if len(groups) > SHOWN else ""
        raise PipelineError(f"{path}: {len(groups)} id(s) in {column!r} occur more than once: "
                            f"{listed}{more}; the submission needs one row per id")


def clean_test_frame(raw, text_column, label_column, id_column, options):
    """The test rows cleaned; every row is kept, even an empty one: the submission needs a
    prediction for each."""
    return pd.DataFrame({
        "id": raw[id_column] if id_column else range(len(raw)),
        "text": raw[text_column].map(lambda t: clean_text(t, **options)),
        "label": raw[label_column].str.strip() if label_column in raw else "",
    })


def report_merged(merged, labels, path):
    """Say which label spellings unify_numeric_labels merged; `labels` are those before it."""
    if merged:
        print(f"{path}: one number, several spellings: " + ", ".join(
            f"{old!r} -> {new!r} ({(labels == old).sum()} row(s))" for old, new in merged.items()))


def main():
    params = load_params("preprocess", PREPROCESS_PARAMS)
    text_col, label_col, id_col = params["text_column"], params["label_column"], params["id_column"]
    options = {k: params[k] for k in CLEANING_SWITCHES}

    train_path, test_path = TRAIN_CSV, TEST_CSV
    raw = read_csv(train_path)
    require_columns(raw, [text_col, label_col], train_path)
    require_rows(raw, train_path)
    train = clean_frame(raw, text_col, label_col, options)
    dropped = raw.index.difference(train.index)
    print(f"{train_path}: {len(raw):,} rows, {len(dropped):,} dropped for empty text"
          + (f" ({row_numbers(dropped)})" if len(dropped) else ""))
    require_labels(train, label_col, train_path)
    unified, merged = unify_numeric_labels(train["label"])
    report_merged(merged, train["label"], train_path)
    train["label"] = unified
    if params["drop_duplicates"]:
        before = len(train)
        train = train.drop_duplicates("text")
        print(f"{before - len(train):,} duplicate text(s) dropped")
    labels = sort_labels(train["label"])
    if len(labels) < 2:
        raise PipelineError(f"{train_path}: {label_col!r} has a single class {labels}; "
                            "classification needs at least two")
    print(f"train {len(train):,} rows, labels {labels}")

    test = None
    if test_path.exists():
        raw_test = read_csv(test_path)
        require_columns(raw_test, [text_col] + ([id_col] if id_col else []), test_path)
        require_rows(raw_test, test_path)
        if id_col:
            check_unique_ids(raw_test[id_col], id_col, test_path)
        test = clean_test_frame(raw_test, text_col, label_col, id_col, options)
        unified, merged = unify_numeric_labels(test["label"], known=labels)
        report_merged(merged, test["label"], test_path)
        test["label"] = unified
        check_known_labels(test, labels, test_path)
        print(f"test {len(test):,} rows ({(test['text'] == '').sum():,} with empty text), "
              f"{'with' if (test['label'] != '').any() else 'without'} labels")

    with atomic_dir(OUT) as tmp:
        write_csv(train, tmp / "train.csv")
        if test is not None:
            write_csv(test, tmp / "test.csv")
        write_json(tmp / "labels.json", labels)
    return [OUT]


if __name__ == "__main__":
    run_main(main)
