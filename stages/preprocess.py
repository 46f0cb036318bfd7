"""preprocess: clean the raw CSVs once, de-duplicate, read the labels, save CSVs and what the later
stages need to know about the data.

Reads data/raw/{train,test,sample_submission}.csv; writes data/processed/:
- train.csv: `text` (and `text_pair` for text pairs) and `label`, the label in the processed form of
  its shape (tasks/labels.py);
- test.csv: `id`, the texts and `label` (empty when the test file has none), in the order of
  sample_submission.csv when there is one;
- labels.json: the classes (none for regression);
- shape.json: the task shape and how the texts and labels were read and cleaned (the train stage keeps
  a copy beside each model, so that python -m predict prepares a new file the same way);
- submission.json: the submission's header (sample_submission.csv's, else the shape's), whether its
  class columns hold probabilities (task.metric scores them) and the test file's id column.
Every check runs before anything is written, so a bad input leaves the previous data/processed as it was.

Several text columns (a list in preprocess.text_column) are cleaned one by one and joined with
COLUMN_JOIN, which the tokenize stage replaces by the tokenizer's separator token ([SEP] for BERT).
Row numbers in messages count the header as row 1, as a spreadsheet does.
"""
from pathlib import Path

import pandas as pd

from pipeline.command import run_main
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import PARAMS_FILE, PipelineError, load_params
from reading.cleaning import STEPS, check_steps, clean_frame, clean_test_frame
from reading.csvfiles import column_names, read_csv, require_columns, row_numbers, write_csv

# the label readers' helpers, also reached as preprocess.<name>
from tasks.labels import NUMBER_RE
from tasks.scores import ON_PROBABILITIES
from tasks.shapes import SHAPES, task_params
from tasks.submission import check_header

RAW = Path("data/raw")
TRAIN_CSV = RAW / "train.csv"
TEST_CSV = RAW / "test.csv"
SAMPLE_CSV = RAW / "sample_submission.csv"
OUT = Path("data/processed")

SHOWN = 5  # rows or ids a message lists before "and N more"
COLUMNS_HINT = "set preprocess.text_column / label_column / id_column"  # when a raw file lacks a column
# what each preprocess.* key accepts; load_params turns anything else into a one-line error (a list of
# columns is checked further by column_names, the steps by check_steps)
PREPROCESS_PARAMS = {"text_column": (str, list), "text_pair_column": (str, list, None), "label_column": (str, list),
                     "id_column": (str, None), "steps": (list,), "drop_duplicates": (bool,)}


def preprocess_params():
    """The preprocess section, checked. A cleaning switch left from before preprocess.steps (lowercase: true)
    and a bad list of steps get messages that name the steps, ahead of load_params' own."""
    section = load_params("preprocess")
    switches = [key for key in section if key in STEPS]
    if switches:
        on = [key for key in STEPS if key in switches and section[key] is True]  # in the order they ran
        them = "it" if len(switches) == 1 else "them"
        raise PipelineError(f"{PARAMS_FILE}: preprocess.{', '.join(switches)} "
                            f"{'is now a step' if len(switches) == 1 else 'are now steps'}: delete {them}"
                            + (f" and list {', '.join(on)} in preprocess.steps" if on else
                               "; preprocess.steps lists the steps to apply"))
    if "steps" in section:
        check_steps(section["steps"])
    return load_params("preprocess", PREPROCESS_PARAMS)


def require_rows(df, path):
    if df.empty:
        raise PipelineError(f"{path}: a header ({', '.join(map(repr, df.columns))}) but no rows")


def check_unique_ids(ids, column, path):
    repeated = ids[ids.duplicated(keep=False)]
    if len(repeated):
        groups = repeated.groupby(repeated, sort=False).groups
        listed = "; ".join(f"{value!r} ({row_numbers(rows)})" for value, rows in list(groups.items())[:SHOWN])
        more = f"; and {len(groups) - SHOWN} more" if len(groups) > SHOWN else ""
        raise PipelineError(f"{path}: {len(groups)} id(s) in {column!r} occur more than once: "
                            f"{listed}{more}; the submission needs one row per id")


def order_by_sample(test, sample_ids, id_column, path, test_path):
    """The test rows in the order of the sample submission's ids, each id spelled as there ("7" and
    "007" are one id when every id is a number). Without an id column, the sample's ids name the test
    rows in order."""
    sample_ids = sample_ids.reset_index(drop=True)
    check_unique_ids(sample_ids, sample_ids.name, path)
    if id_column is None:
        if len(sample_ids) != len(test):
            raise PipelineError(f"{path}: {len(sample_ids):,} rows, and {test_path} {len(test):,}: without "
                                "preprocess.id_column the sample's ids name the test rows in order, so the counts must match")
        return test.assign(id=sample_ids.to_numpy())
    keys = {"as written": (test["id"], sample_ids)}
    if all(NUMBER_RE.fullmatch(v) for v in pd.concat([test["id"], sample_ids])):
        from decimal import Decimal
        keys["as numbers"] = (test["id"].map(Decimal), sample_ids.map(Decimal))
    for test_keys, sample_keys in keys.values():
        position = pd.Series(range(len(test)), index=test_keys.to_numpy())
        if set(sample_keys) == set(test_keys):
            ordered = test.iloc[position[sample_keys.to_numpy()].to_numpy()].reset_index(drop=True)
            return ordered.assign(id=sample_ids.to_numpy())
    test_keys, sample_keys = list(keys.values())[-1]
    missing = sample_ids[~sample_keys.isin(set(test_keys))]
    extra = test["id"][~test_keys.isin(set(sample_keys))]
    problem = (f"id {missing.iloc[0]!r} ({row_numbers(missing.index[:1])}) is not in {test_path}'s {id_column!r}"
               if len(missing) else f"{test_path}'s id {extra.iloc[0]!r} is not in it")
    raise PipelineError(f"{path}: {problem} ({len(missing)} of the sample's ids missing there, {len(extra)} of the "
                        "test ids missing here); the submission takes the sample's ids and order")


def main():
    params = preprocess_params()
    task = task_params()
    shape = SHAPES[task["kind"]]
    text_cols = column_names(params["text_column"], "text_column")
    pair_cols = column_names(params["text_pair_column"], "text_pair_column") if params["text_pair_column"] is not None else []
    label_cols = column_names(params["label_column"], "label_column")
    separated = not isinstance(params["label_column"], list)  # one column of labels, not one 0/1 column per class
    if not separated and shape.kind != "multilabel":
        raise PipelineError(f"params.yaml: preprocess.label_column lists columns ({', '.join(label_cols)}), one 0/1 "
                            f"column per class: that is task.kind multilabel, not {shape.kind}")
    separator = task["label_separator"] if shape.kind == "multilabel" and separated else None
    id_col = params["id_column"]
    steps = params["steps"]

    train_path, test_path = TRAIN_CSV, TEST_CSV
    raw = read_csv(train_path)
    require_columns(raw, text_cols + pair_cols + label_cols, train_path, COLUMNS_HINT)
    require_rows(raw, train_path)
    train = clean_frame(raw, text_cols, None, steps, pair_cols)
    dropped = raw.index.difference(train.index)
    print(f"{train_path}: {len(raw):,} rows, {len(dropped):,} dropped for empty text"
          + (f" ({row_numbers(dropped)})" if len(dropped) else ""))
    train["label"] = shape.read_labels(raw.loc[train.index], label_cols, separator, train_path)
    if params["drop_duplicates"]:
        before = len(train)
        train = train.drop_duplicates(["text", "text_pair"] if pair_cols else "text")
        print(f"{before - len(train):,} duplicate text(s) dropped")
    labels = shape.label_list(train["label"], label_cols, separator, train_path)
    if task["metric"] == "qwk" and not all(NUMBER_RE.fullmatch(c) for c in labels):
        raise PipelineError(f"{train_path}: task.metric qwk scores ordered classes, so the classes must be numbers "
                            f"(1, 2, 3, ...), not {labels}")
    target = train["label"].astype(float) if not labels else None
    print(f"train {len(train):,} rows, " + (f"labels {labels}" if labels else
                                            f"target from {target.min():g} to {target.max():g}, mean {target.mean():.4g}"))

    test = None
    if test_path.exists():
        raw_test = read_csv(test_path)
        require_columns(raw_test, text_cols + pair_cols + ([id_col] if id_col else []), test_path, COLUMNS_HINT)
        require_rows(raw_test, test_path)
        if id_col:
            check_unique_ids(raw_test[id_col], id_col, test_path)
        test = clean_test_frame(raw_test, text_cols, id_col, steps, pair_cols)
        test["label"] = shape.read_labels(raw_test, label_cols, separator, test_path, known=labels).to_numpy()
        empty = (test["text"] == "") & (test.get("text_pair", "") == "")
        print(f"test {len(test):,} rows ({empty.sum():,} with empty text), "
              f"{'with' if (test['label'] != '').any() else 'without'} labels")
    header = shape.default_header(labels, separated)
    if SAMPLE_CSV.exists():
        if test is None:
            raise PipelineError(f"{SAMPLE_CSV}: a sample submission, but no test file to predict (fetch.test_file)")
        sample = read_csv(SAMPLE_CSV)
        require_rows(sample, SAMPLE_CSV)
        header = check_header(list(sample.columns), shape, labels, SAMPLE_CSV)
        test = order_by_sample(test, sample[header[0]], id_col, SAMPLE_CSV, test_path)
        print(f"{SAMPLE_CSV}: the submission takes its columns ({', '.join(header)}) and its order of ids")

    with atomic_dir(OUT) as tmp:
        write_csv(train, tmp / "train.csv")
        if test is not None:
            write_csv(test, tmp / "test.csv")
        write_json(tmp / "labels.json", labels)
        write_json(tmp / "shape.json", {"kind": shape.kind, "text_columns": text_cols, "pair_columns": pair_cols,
                                        "label_columns": label_cols, "label_separator": separator, "cleaning": steps})
        write_json(tmp / "submission.json", {"id_column": id_col, "header": header,
                                             "probabilities": task["metric"] in ON_PROBABILITIES})
    return [OUT]


if __name__ == "__main__":
    run_main(main)
