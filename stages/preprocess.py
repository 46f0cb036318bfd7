"""preprocess: clean the raw CSVs once, de-duplicate, split train/val, save CSVs and the label list.

Reads data/raw/{train,test}.csv; writes data/processed/{train,val,test}.csv and labels.json.
Every output CSV has the columns `text` and `label` (test: `id`, `text` and `label`, the
label empty when the test file has none).
"""
import html
import re
from pathlib import Path

import pandas as pd
from sklearn.model_selection import train_test_split

from stages.common import (PipelineError, atomic_dir, load_params, read_csv, run_main, write_csv,
                           write_json)

RAW = Path("data/raw")
OUT = Path("data/processed")

URL_RE = re.compile(r"(?:https?://|www\.)\S+", re.IGNORECASE)
MENTION_RE = re.compile(r"(?<!\w)@\w+")
WHITESPACE_RE = re.compile(r"\s+")


def clean_text(text, lowercase=False, unescape_html=True, replace_urls=True,
               replace_mentions=True, normalize_whitespace=True):
    """Return the cleaned text. Idempotent: cleaning a cleaned text changes nothing."""
    if unescape_html:
        # unescape until stable: tweets often carry double-escaped entities (&amp;amp;)
        previous = None
        while previous != text:
            previous, text = text, html.unescape(text)
    if replace_urls:
        text = URL_RE.sub("http", text)
    if replace_mentions:
        text = MENTION_RE.sub("@user", text)
    if lowercase:
        text = text.lower()
    if normalize_whitespace:
        text = WHITESPACE_RE.sub(" ", text).strip()
    return text


def require_columns(df, columns, path):
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise PipelineError(
            f"{path}: missing column(s) {', '.join(map(repr, missing))}; "
            f"found {', '.join(map(repr, df.columns))} (set preprocess.text_column / label_column)")


def sort_labels(labels):
    """Numbers in numeric order (2 before 10), anything else alphabetically."""
    labels = set(labels)
    try:
        return sorted(labels, key=float)
    except ValueError:
        return sorted(labels)


def clean_frame(df, text_column, label_column, options):
    """Cleaned `text` and `label` columns; rows whose text cleans to nothing are dropped."""
    out = pd.DataFrame({
        "text": df[text_column].map(lambda t: clean_text(t, **options)),
        "label": df[label_column].str.strip() if label_column in df else "",
    })
    return out[out["text"] != ""]


def split_train_val(df, val_size, seed):
    """Stratified, seeded split. Classes too small to stratify stay whole in train."""
    counts = df["label"].value_counts()
    rare = df["label"].isin(counts[counts < 2].index)
    train, val = train_test_split(df[~rare], test_size=val_size, random_state=seed,
                                  stratify=df.loc[~rare, "label"])
    if rare.any():
        print(f"{rare.sum()} row(s) of classes with a single example kept in train only: "
              f"{sorted(df.loc[rare, 'label'])}")
    return pd.concat([train, df[rare]]), val


def check_known_labels(df, labels, path):
    unseen = sorted(set(df["label"]) - set(labels) - {""})
    if unseen:
        raise PipelineError(f"{path}: label(s) {unseen} never occur in the training data "
                            f"(train has {labels})")


def main():
    params = load_params("preprocess")
    text_col, label_col, id_col = params["text_column"], params["label_column"], params["id_column"]
    options = {k: params[k] for k in ("lowercase", "unescape_html", "replace_urls",
                                      "replace_mentions", "normalize_whitespace")}

    train_path = RAW / "train.csv"
    raw = read_csv(train_path)
    require_columns(raw, [text_col, label_col], train_path)
    train = clean_frame(raw, text_col, label_col, options)
    print(f"{train_path}: {len(raw)} rows, {len(raw) - len(train)} dropped for empty text")
    if (train["label"] == "").any():
        raise PipelineError(f"{train_path}: {(train['label'] == '').sum()} row(s) have an empty "
                            f"{label_col!r}; fill or remove them")
    if params["drop_duplicates"]:
        before = len(train)
        train = train.drop_duplicates("text")
        print(f"{before - len(train)} duplicate text(s) dropped")
    labels = sort_labels(train["label"])
    if len(labels) < 2:
        raise PipelineError(f"{train_path}: {label_col!r} has a single class {labels}; "
                            "classification needs at least two")
    train, val = split_train_val(train, params["val_size"], params["seed"])
    print(f"train {len(train)} rows, val {len(val)} rows, labels {labels}")

    test_path = RAW / "test.csv"
    test = None
    if test_path.exists():
        raw_test = read_csv(test_path)
        require_columns(raw_test, [text_col] + ([id_col] if id_col else []), test_path)
        # every test row is kept, even an empty one: the submission needs a prediction for each
        test = pd.DataFrame({
            "id": raw_test[id_col] if id_col else range(len(raw_test)),
            "text": raw_test[text_col].map(lambda t: clean_text(t, **options)),
            "label": raw_test[label_col].str.strip() if label_col in raw_test else "",
        })
        check_known_labels(test, labels, test_path)
        print(f"test {len(test)} rows, {'with' if (test['label'] != '').any() else 'without'} labels")

    with atomic_dir(OUT) as tmp:
        write_csv(train, tmp / "train.csv")
        write_csv(val, tmp / "val.csv")
        if test is not None:
            write_csv(test, tmp / "test.csv")
        write_json(tmp / "labels.json", labels)


if __name__ == "__main__":
    run_main(main)
