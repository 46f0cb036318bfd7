"""Cleaning texts (HTML entities, URLs, mentions, whitespace, case) and the frames of cleaned texts that
preprocess writes and the predict tool prepares a new file with."""
import html
import re

import pandas as pd

from reading.csvfiles import COLUMN_JOIN, column_names

URL_RE = re.compile(r"(?:https?://|www\.)\S+", re.IGNORECASE)


MENTION_RE = re.compile(r"(?<!\w)@\w+")


WHITESPACE_RE = re.compile(r"\s+")


# the preprocess.* switches that clean_text takes as keyword arguments
CLEANING_SWITCHES = ("lowercase", "unescape_html", "replace_urls", "replace_mentions", "normalize_whitespace")


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


def clean_columns(df, columns, options):
    """Each row's cleaned text; with several columns each is cleaned, then they are joined by COLUMN_JOIN
    (a row whose every column cleans to nothing gives "")."""
    cleaned = [df[c].map(lambda t: clean_text(t, **options)) for c in columns]
    if len(cleaned) == 1:
        return cleaned[0]
    joined = pd.concat(cleaned, axis=1).agg(COLUMN_JOIN.join, axis=1)
    return joined.where(joined.str.strip(COLUMN_JOIN) != "", "")


def clean_frame(df, text_column, label_column, options, pair_column=None):
    """Cleaned `text` (and `text_pair`) columns, and `label` (label_column's, stripped) when label_column
    names one column, keeping df's index (row numbers); rows whose texts clean to nothing are dropped.
    text_column and pair_column are a column name or a list of them (joined: clean_columns)."""
    out = pd.DataFrame({"text": clean_columns(df, column_names(text_column, "text_column"), options)}, index=df.index)
    if pair_column:
        out["text_pair"] = clean_columns(df, column_names(pair_column, "text_pair_column"), options)
    if isinstance(label_column, str):
        out["label"] = df[label_column].str.strip() if label_column in df else ""
    return out[(out["text"] != "") | (out.get("text_pair", "") != "")]


def clean_test_frame(raw, text_column, id_column, options, pair_column=None):
    """The test rows cleaned (`id`, `text`, maybe `text_pair`); every row is kept, even an empty one:
    the submission needs a prediction for each."""
    test = pd.DataFrame({"id": raw[id_column] if id_column else range(len(raw)),
                         "text": clean_columns(raw, column_names(text_column, "text_column"), options)})
    if pair_column:
        test["text_pair"] = clean_columns(raw, column_names(pair_column, "text_pair_column"), options)
    return test.reset_index(drop=True)
