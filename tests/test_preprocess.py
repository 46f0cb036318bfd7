import pandas as pd
import pytest

from stages.common import PipelineError, read_csv, write_csv
from stages.preprocess import (check_known_labels, clean_frame, clean_text, require_columns,
                               sort_labels, split_train_val)

ALL_ON = dict(lowercase=True, unescape_html=True, replace_urls=True, replace_mentions=True,
              normalize_whitespace=True)


def test_clean_text_applies_each_switch():
    raw = "  @Bob said &amp;amp; https://t.co/abc \n www.x.com  GREAT "
    assert clean_text(raw, **ALL_ON) == "@user said & http http great"
    assert clean_text(raw, lowercase=False, unescape_html=False, replace_urls=False,
                      replace_mentions=False, normalize_whitespace=False) == raw


def test_clean_text_keeps_emails_and_is_idempotent():
    text = "mail me at bob@example.com &lt;3"
    once = clean_text(text, **ALL_ON)
    assert once == "mail me at bob@example.com <3"
    assert clean_text(once, **ALL_ON) == once


def test_labels_like_na_survive_reading(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("text,label\nhello,NA\nworld,None\nagain,null\n", encoding="utf-8")
    assert read_csv(path)["label"].tolist() == ["NA", "None", "null"]


def test_text_with_carriage_return_round_trips(tmp_path):
    df = pd.DataFrame({"text": ["line one\rstill one", "two, \"quoted\"\nthree"], "label": ["a", "b"]})
    write_csv(df, tmp_path / "x.csv")
    assert read_csv(tmp_path / "x.csv").equals(df)


def test_missing_column_names_file_and_lists_found():
    df = pd.DataFrame({"body": ["x"], "sentiment": ["a"]})
    with pytest.raises(PipelineError, match=r"train.csv: missing column\(s\) 'text'; found 'body', 'sentiment'"):
        require_columns(df, ["text", "sentiment"], "data/raw/train.csv")


def test_clean_frame_drops_texts_that_clean_to_nothing():
    df = pd.DataFrame({"t": ["ok", "   ", "&amp;"], "y": ["a", "b", "c"]})
    out = clean_frame(df, "t", "y", ALL_ON)
    assert out["text"].tolist() == ["ok", "&"]


def test_sort_labels_numeric_then_text():
    assert sort_labels(["10", "2", "1"]) == ["1", "2", "10"]
    assert sort_labels(["pos", "neg", "neu"]) == ["neg", "neu", "pos"]


def test_split_is_stratified_seeded_and_keeps_singletons_in_train():
    df = pd.DataFrame({"text": [f"t{i}" for i in range(101)], "label": ["a"] * 60 + ["b"] * 40 + ["c"]})
    train, val = split_train_val(df, 0.2, seed=3)
    again_train, _ = split_train_val(df, 0.2, seed=3)
    assert train["text"].tolist() == again_train["text"].tolist()
    assert set(train["text"]).isdisjoint(val["text"]) and len(train) + len(val) == 101
    assert val["label"].value_counts().to_dict() == {"a": 12, "b": 8}
    assert "c" in set(train["label"])


def test_unseen_test_label_is_an_error():
    test = pd.DataFrame({"label": ["a", "z", ""]})
    with pytest.raises(PipelineError, match=r"test.csv: label\(s\) \['z'\] never occur in the training data"):
        check_known_labels(test, ["a", "b"], "data/raw/test.csv")
