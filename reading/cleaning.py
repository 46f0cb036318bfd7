"""Cleaning texts and the frames of cleaned texts that preprocess writes and the predict tool prepares a
new file with. Each cleaning step is a plain function of one text, named in STEPS; preprocess.steps lists
the ones to apply, in order.

To add a step (a Korean spacing step, say), write a function of one text that returns it cleaned and leaves
its own output as it is, and add it to STEPS under the name preprocess.steps is to list. tests/test_clean_properties.py
then checks it, alone and with the others; name it in params.yaml's comment on preprocess.steps."""
import html
import re

import pandas as pd

from pipeline.settings import PARAMS_FILE, PipelineError
from reading.csvfiles import COLUMN_JOIN, column_names

URL_RE = re.compile(r"(?:https?://|www\.)\S+", re.IGNORECASE)
MENTION_RE = re.compile(r"(?<!\w)@\w+")
WHITESPACE_RE = re.compile(r"\s+")
PASSES = 10  # clean_text's bound on passes over the steps (these settle in at most 4, the last changing nothing)


def lowercase(text):
    return text.lower()


def unescape_html(text):
    """&amp; -> &, &lt; -> <, until none is left: tweets often carry double-escaped entities (&amp;amp;)."""
    previous = None
    while previous != text:
        previous, text = text, html.unescape(text)
    return text


def replace_urls(text):
    return URL_RE.sub("http", text)


def replace_mentions(text):
    return MENTION_RE.sub("@user", text)


def normalize_whitespace(text):
    return WHITESPACE_RE.sub(" ", text).strip()


# every step preprocess.steps can name, in the order a model trained before preprocess.steps applied its switches
STEPS = {"unescape_html": unescape_html, "lowercase": lowercase, "replace_urls": replace_urls,
         "replace_mentions": replace_mentions, "normalize_whitespace": normalize_whitespace}


def check_steps(steps):
    """preprocess.steps, or a one-line error unless it is a list of step names, each at most once."""
    if (not isinstance(steps, list) or any(not isinstance(name, str) or name not in STEPS for name in steps)
            or len(set(steps)) < len(steps)):
        raise PipelineError(f"{PARAMS_FILE}: preprocess.steps must be a list of step names, each at most once, "
                            f"from {', '.join(STEPS)}; not {steps!r}")
    return steps


def as_steps(cleaning):
    """A trained run's "cleaning" (pipeline.json) as a list of steps: a list as it is; the dict of switches
    that a model trained before preprocess.steps holds, as its true switches in STEPS' order."""
    return [name for name in STEPS if cleaning.get(name)] if isinstance(cleaning, dict) else cleaning


def clean_text(text, steps):
    """The text with each of `steps` (names in STEPS) applied in order. Idempotent: cleaning a cleaned text
    changes nothing."""
    # One step can make work for another (lowercasing "&AELIG" makes the entity "&aelig"), so the list is
    # applied again while the text still changes: a text that one pass leaves as it is, a second cleaning
    # leaves as it is too. PASSES bounds it against a step that never settles.
    for _ in range(PASSES):
        previous = text
        for name in steps:
            text = STEPS[name](text)
        if text == previous:
            break
    return text


def clean_columns(df, columns, steps):
    """Each row's cleaned text; with several columns each is cleaned, then they are joined by COLUMN_JOIN
    (a row whose every column cleans to nothing gives "")."""
    cleaned = [df[c].map(lambda t: clean_text(t, steps)) for c in columns]
    if len(cleaned) == 1:
        return cleaned[0]
    joined = pd.concat(cleaned, axis=1).agg(COLUMN_JOIN.join, axis=1)
    return joined.where(joined.str.strip(COLUMN_JOIN) != "", "")


def clean_frame(df, text_column, label_column, steps, pair_column=None):
    """Cleaned `text` (and `text_pair`) columns, and `label` (label_column's, stripped) when label_column
    names one column, keeping df's index (row numbers); rows whose texts clean to nothing are dropped.
    text_column and pair_column are a column name or a list of them (joined: clean_columns)."""
    out = pd.DataFrame({"text": clean_columns(df, column_names(text_column, "text_column"), steps)}, index=df.index)
    if pair_column:
        out["text_pair"] = clean_columns(df, column_names(pair_column, "text_pair_column"), steps)
    if isinstance(label_column, str):
        out["label"] = df[label_column].str.strip() if label_column in df else ""
    return out[(out["text"] != "") | (out.get("text_pair", "") != "")]


def clean_test_frame(raw, text_column, id_column, steps, pair_column=None):
    """The test rows cleaned (`id`, `text`, maybe `text_pair`); every row is kept, even an empty one:
    the submission needs a prediction for each."""
    test = pd.DataFrame({"id": raw[id_column] if id_column else range(len(raw)),
                         "text": clean_columns(raw, column_names(text_column, "text_column"), steps)})
    if pair_column:
        test["text_pair"] = clean_columns(raw, column_names(pair_column, "text_pair_column"), steps)
    return test.reset_index(drop=True)
