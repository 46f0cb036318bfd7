from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipeline.settings import PipelineError
from reading.cleaning import STEPS, as_steps, clean_frame, clean_test_frame, clean_text
from reading.csvfiles import read_csv, require_columns, row_numbers, write_csv
from tasks.labels import check_known_labels, sort_labels, unify_numeric_labels

ALL_STEPS = list(STEPS)
# params.yaml's default steps
DEFAULT = ["unescape_html", "replace_urls", "replace_mentions", "normalize_whitespace"]


def test_clean_text_applies_each_step():
    raw = "  @Bob said &amp;amp; https://t.co/abc \n www.x.com  GREAT "
    assert clean_text(raw, ALL_STEPS) == "@user said & http http great"
    assert clean_text(raw, []) == raw
    assert clean_text(raw, ["replace_mentions"]) == raw.replace("@Bob", "@user")
    assert clean_text(raw, ["lowercase", "normalize_whitespace"]) == "@bob said &amp;amp; https://t.co/abc www.x.com great"


# Tweets with entities, URLs, mentions and odd whitespace, and what the cleaning of the default params.yaml
# gave for them before preprocess.steps (its switches lowercase false, the four others true): the default
# list must give the same texts.
TWEETS = {
    "@united thanks &amp;amp; see you at http://t.co/x1Y2 ! ": "@user thanks & see you at http !",
    "RT @Jo_Ann: &lt;3 this\n\nwww.Example.com/a?b=1&amp;c=2   #love": "RT @user: <3 this http #love",
    "\u00a0&quot;Delayed&quot;\tagain\u2026 @AmericanAir @ 5pm": '"Delayed" again\u2026 @user @ 5pm',
    "mail bob@example.com&#44; or&#10;call @bob_2 &AMP; &#64;alice": "mail bob@example.com, or call @user & @user",
    "HTTPS://T.CO/ABC&gt;@x": "http",
    "@Bob  SAID &AMP;AELIG; www.x.com": "@user SAID &AELIG; http",  # lowercase off: no entity made
}


@pytest.mark.parametrize("raw", TWEETS)
def test_the_default_steps_clean_as_the_default_switches_did(raw):
    assert clean_text(raw, DEFAULT) == TWEETS[raw]


def test_params_yaml_holds_the_default_steps():
    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    assert params["preprocess"]["steps"] == DEFAULT


def test_a_run_trained_before_steps_cleans_with_its_switches():
    # pipeline.json's "cleaning" of such a run: its switches, lowercase on
    old = {"lowercase": True, "unescape_html": True, "replace_urls": True, "replace_mentions": False,
           "normalize_whitespace": True}
    assert as_steps(old) == ["unescape_html", "lowercase", "replace_urls", "normalize_whitespace"]
    assert as_steps(DEFAULT) == DEFAULT
    raw = pd.DataFrame({"text": ["@Bob  SAID &AMP;AELIG; www.x.com", ""]})
    cleaned = clean_test_frame(raw, "text", None, as_steps(old))
    assert cleaned["text"].tolist() == ["@bob said \u00e6 http", ""]


def test_clean_text_keeps_emails_and_is_idempotent():
    text = "mail me at bob@example.com &lt;3"
    once = clean_text(text, ALL_STEPS)
    assert once == "mail me at bob@example.com <3"
    assert clean_text(once, ALL_STEPS) == once


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
        require_columns(df, ["text", "sentiment"], "data/raw/train.csv", "set preprocess.text_column")
    wide = pd.DataFrame(columns=[f"c{i}" for i in range(25)])
    with pytest.raises(PipelineError, match=r"^t.csv: missing column\(s\) 'text'; found 'c0', .*, 'c19' and 5 more \(hint\)$"):
        require_columns(wide, ["text"], "t.csv", "hint")


def test_clean_frame_drops_texts_that_clean_to_nothing():
    df = pd.DataFrame({"t": ["ok", "   ", "&amp;"], "y": ["a", "b", "c"]})
    out = clean_frame(df, "t", "y", ALL_STEPS)
    assert out["text"].tolist() == ["ok", "&"]


def test_sort_labels_numeric_then_text():
    assert sort_labels(["10", "2", "1"]) == ["1", "2", "10"]
    assert sort_labels(["pos", "neg", "neu"]) == ["neg", "neu", "pos"]


def test_unseen_test_label_is_an_error():
    test = pd.DataFrame({"label": ["a", "z", ""]})
    with pytest.raises(PipelineError, match=r"test.csv: label\(s\) \['z'\] never occur in the training data"):
        check_known_labels(test, ["a", "b"], "data/raw/test.csv")


# ---- bad-input helpers (the stage-level cases are in test_bad_input.py) --------------------

def test_lowercasing_never_leaves_an_entity_for_a_second_cleaning():
    # "&AElig" is an entity, "&AELIG" is not, but lowercasing it gives "&aelig", which is
    assert clean_text("&AELIG", ["unescape_html", "lowercase"]) == "\u00e6"
    assert clean_text("&amp;Hellip;", ["unescape_html", "lowercase"]) == "\u2026"
    assert clean_text("&AELIG", ["lowercase", "unescape_html"]) == "\u00e6"


@pytest.mark.parametrize("labels, expected", [
    (["10", "2", "1.5"], ["1.5", "2", "10"]),
    (["nan", "2", "1"], ["1", "2", "nan"]),  # "nan" is a name: float order would be undefined
    (["inf", "1_0", "1"], ["1", "1_0", "inf"]),
    (["b", "2", "a"], ["2", "a", "b"]),
])
def test_sort_labels_orders_numbers_only_when_all_are_plain_numbers(labels, expected):
    assert sort_labels(labels) == expected
    assert sort_labels(reversed(labels)) == expected


def test_unify_numeric_labels_prefers_train_spelling_then_most_common():
    labels = pd.Series(["1", "1.0", "1.0", "01", "2", "x", "1e0"])
    unified, merged = unify_numeric_labels(labels)
    assert merged == {"1": "1.0", "01": "1.0", "1e0": "1.0"}
    assert unified.tolist() == ["1.0", "1.0", "1.0", "1.0", "2", "x", "1.0"]
    unified, merged = unify_numeric_labels(pd.Series(["1.00", "3", ""]), known=["1", "2"])
    assert (unified.tolist(), merged) == (["1", "3", ""], {"1.00": "1"})


def test_row_numbers_count_the_header_and_cap_the_list():
    assert row_numbers(pd.Index([0])) == "row 2"
    assert row_numbers(pd.Index(range(8))) == "rows 2, 3, 4, 5, 6 and 3 more"


def test_blank_lines_skipped_but_a_one_column_whitespace_text_kept(tmp_path):
    (tmp_path / "two.csv").write_text("text,label\na,x\n\n  \nb,y\n")
    assert read_csv(tmp_path / "two.csv")["text"].tolist() == ["a", "b"]
    (tmp_path / "one.csv").write_text("text\na\n  \nb\n\n\n")
    assert read_csv(tmp_path / "one.csv")["text"].tolist() == ["a", "  ", "b"]


def test_cp1252_fallback_keeps_utf8_characters(tmp_path, capsys):
    (tmp_path / "t.csv").write_bytes("text\nnaïve\n".encode() + b"\x93quoted\x94 \x81\n")
    assert read_csv(tmp_path / "t.csv")["text"].tolist() == ["naïve", "\u201cquoted\u201d \x81"]
    assert "3 byte(s) read as cp1252, the first (0x93) at byte offset 12, line 3" in capsys.readouterr().out


def test_only_korean_text_is_read_as_cp949():
    from reading.csvfiles import korean_text

    korean = "text,label\n이 영화 정말 재미있어요,긍정\n똠방각하,부정\n"
    assert korean_text(korean.encode("cp949")) == korean
    assert korean_text(korean.encode("euc_kr", errors="ignore")).startswith("text,label\n이 영화")
    # Western text in cp1252 may decode as CP949 (é and the letter after it make an extra syllable):
    # it does not read as Korean
    for western in ("été à la plage, déjà vu\n", "Grüße aus München\n", "naïve café\n"):
        assert korean_text(western.encode("cp1252")) is None, western
    assert korean_text(b"plain ascii\n") is None


def test_western_capitals_that_decode_as_cp949_syllables_are_read_as_cp1252(tmp_path, capsys):
    """An accented capital (0xC0-0xC6 in cp1252) and the plain letter after it are one of CP949's extra
    syllables, so these names decode cleanly as CP949 (Åsa: 흒a); they are Western text all the same."""
    western = "name,city\nÅsa Åberg,Älmhult\nÁGUA ÀS,Ávila\n"
    data = western.encode("cp1252")
    assert data.decode("cp949") == "name,city\n흒a 휻erg,훜mhult\n핯UA 픓,햢ila\n"
    (tmp_path / "t.csv").write_bytes(data)
    frame = read_csv(tmp_path / "t.csv")
    assert frame["name"].tolist() == ["Åsa Åberg", "ÁGUA ÀS"] and frame["city"].tolist() == ["Älmhult", "Ávila"]
    said = capsys.readouterr().out
    assert "read as cp1252" in said and "CP949" not in said, said
