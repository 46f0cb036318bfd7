"""Bad input: each case runs the real `python -m stages.preprocess` (then `python -m stages.split`,
as `dvc repro` does) in a temporary folder with a params.yaml and data/raw/ written here, and checks
the exact line the user sees. A failing run must leave the previous data/processed and data/split
exactly as they were; a run that copes must say what it did.
The model-name cases call resolve_model, which tokenize and train call before loading."""
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from huggingface_hub import constants

from modeling.models import resolve_model
from pipeline.settings import PipelineError
from tests.http_servers import refused_url, send, serve

REPO = Path(__file__).resolve().parents[1]
HEADER = "text,sentiment\n"
GOOD_ROWS = "".join(f"{word} day {i},{label}\n" for i in range(10)
                    for word, label in (("good", "pos"), ("bad", "neg"), ("meh", "neu")))


def stage_env(**extra):
    return dict(os.environ, PYTHONPATH=str(REPO), **extra)


@pytest.fixture
def work(tmp_path):
    """A folder holding params.yaml (the repo's) and an old data/processed from an earlier run."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "data/raw").mkdir(parents=True)
    old = tmp_path / "data/processed"
    old.mkdir()
    (old / "train.csv").write_text("text,label\nold,a\n")
    (old / "labels.json").write_text('["a"]\n')
    (tmp_path / "data/split").mkdir()
    (tmp_path / "data/split/folds.csv").write_text("row,fold\n0,0\n")
    return tmp_path


def set_params(work, section="preprocess", **changes):
    path = work / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params[section].update(changes)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def write_raw(work, train=None, test=None):
    """Write data/raw/train.csv and test.csv: str is written as UTF-8, bytes as they are."""
    for name, content in (("train.csv", train), ("test.csv", test)):
        if content is not None:
            data = content.encode("utf-8") if isinstance(content, str) else content
            (work / "data/raw" / name).write_bytes(data)


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def run_stage(work, stage):
    result = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=work, env=stage_env(),
                            capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr


def fails_with(work, message, stage="preprocess"):
    """Run preprocess (and split, when it is the stage expected to fail); assert the stage fails
    with exactly `message` on one line and writes nothing."""
    if stage == "split":
        code, out, err = run_stage(work, "preprocess")
        assert code == 0, out + err
    before = snapshot(work / "data")
    code, out, err = run_stage(work, stage)
    assert (code, err) == (1, f"error: {message}\n"), out + err
    assert snapshot(work / "data") == before  # the old output survived, no temp folder is left
    return out


def succeeds(work):
    """Run preprocess and split; return (their output, {train, val, test: frame}, labels), where
    train and val are the processed training rows the (one) fold trains and validates on."""
    output = ""
    for stage in ("preprocess", "split"):
        code, out, err = run_stage(work, stage)
        assert code == 0, out + err
        output += out
    assert not list((work / "data").glob(".*.tmp-*")), "a temp folder was left behind"
    processed = work / "data/processed"
    frames = {p.stem: pd.read_csv(p, dtype=str, keep_default_na=False) for p in processed.glob("*.csv")}
    folds = pd.read_csv(work / "data/split/folds.csv")["fold"]
    frames["train"], frames["val"] = frames["train"][folds != 0], frames["train"][folds == 0]
    return output, frames, json.loads((processed / "labels.json").read_text())


# ---- the file itself ---------------------------------------------------------------------

@pytest.mark.parametrize("content", [b"", b"\n \r\n"])
def test_empty_file(work, content):
    write_raw(work, train=content)
    fails_with(work, f"data/raw/train.csv: the file is empty ({len(content)} bytes): expected a "
                     "header line naming the columns, then one row per example")


def test_header_only(work):
    write_raw(work, train=HEADER)
    fails_with(work, "data/raw/train.csv: a header ('text', 'sentiment') but no rows")


def test_header_only_test_file(work):
    write_raw(work, train=HEADER + GOOD_ROWS, test="id,text\n")
    fails_with(work, "data/raw/test.csv: a header ('id', 'text') but no rows")


def test_unquoted_delimiter_in_a_text(work):
    write_raw(work, train=HEADER + "fine,pos\nnot, fine at all,neg\n" + GOOD_ROWS)
    fails_with(work, "data/raw/train.csv: not a valid CSV (Expected 2 fields in line 3, saw 3); a text "
                     "holding the delimiter ',' or a newline must be in double quotes")


def test_quote_never_closed(work):
    write_raw(work, train=HEADER + "ok,pos\n\"unterminated,neg\nfine,pos\n" + GOOD_ROWS)
    fails_with(work, "data/raw/train.csv: not a valid CSV (the double quote opened in row 3 is never "
                     "closed); a text holding the delimiter ',' or a newline must be in double quotes")


def test_unquoted_delimiter_in_the_first_row(work):
    # pandas would silently make the first column an index; read_csv refuses instead
    write_raw(work, train=HEADER + "not, fine,neg\n" + GOOD_ROWS)
    fails_with(work, "data/raw/train.csv: line 2 has more fields than the header (2: 'text', "
                     "'sentiment'); a text holding the delimiter ',' must be in double quotes")


@pytest.mark.parametrize("delimiter", [";", "\t"])
def test_other_delimiters_are_detected(work, delimiter):
    rows = GOOD_ROWS.replace(",", delimiter) + f'"a, b; c"{delimiter}pos\n'
    write_raw(work, train=HEADER.replace(",", delimiter) + rows)
    out, frames, labels = succeeds(work)
    assert f"data/raw/train.csv: columns are separated by {delimiter!r}, not commas" in out
    assert labels == ["neg", "neu", "pos"]
    assert "a, b; c" in set(frames["train"]["text"]) | set(frames["val"]["text"])


def test_utf8_bom_is_dropped(work):
    write_raw(work, train=b"\xef\xbb\xbf" + (HEADER + GOOD_ROWS).encode())
    out, frames, labels = succeeds(work)
    assert labels == ["neg", "neu", "pos"] and "not UTF-8" not in out


def test_utf16_with_bom_is_read(work):
    # what Excel's "Unicode text" export writes: UTF-16 with a byte order mark, tab-separated
    write_raw(work, train=(HEADER + GOOD_ROWS + "café crème,pos\n").replace(",", "\t").encode("utf-16"))
    out, frames, labels = succeeds(work)
    assert "café crème" in set(frames["train"]["text"]) | set(frames["val"]["text"])


def test_cp1252_bytes_are_decoded_and_located(work):
    # UTF-8 text ("naïve") with two Windows-1252 bytes in it: 0xE9 (é) and 0x93 (a left quote)
    # after a UTF-8 BOM, which the byte offset counts: the file is what the user has on disk
    data = b"\xef\xbb\xbf" + (HEADER + "naïve,pos\n").encode() + b"caf\xe9 \x93ok,neg\n" + GOOD_ROWS.encode()
    write_raw(work, train=data)
    out, frames, labels = succeeds(work)
    assert data[32:33] == b"\xe9"
    assert ("data/raw/train.csv: not UTF-8: 2 byte(s) read as cp1252, the first (0xe9) at byte "
            "offset 32, line 3: caf\\xe9 \\x93ok,neg\n") in out
    texts = set(frames["train"]["text"]) | set(frames["val"]["text"])
    assert {"naïve", "café \u201cok"} <= texts


def test_quoted_newlines_commas_and_quotes_round_trip(work):
    set_params(work, steps=["unescape_html", "replace_urls", "replace_mentions"], drop_duplicates=False)
    tricky = ["line one\nline two", "a, b, and c", 'she said "hi"', "cr\ronly", " padded "]
    raw = pd.DataFrame({"text": tricky * 2, "sentiment": ["pos"] * 5 + ["neg"] * 5})
    # quoted as csv.writer does with QUOTE_ALL; unquoted, a bare "\r" ends a row in any reader
    raw.to_csv(work / "data/raw/train.csv", index=False, quoting=csv.QUOTE_ALL)
    raw.assign(id=range(10)).to_csv(work / "data/raw/test.csv", index=False, quoting=csv.QUOTE_ALL)
    out, frames, labels = succeeds(work)
    assert sorted(pd.concat([frames["train"], frames["val"]])["text"]) == sorted(tricky * 2)
    assert frames["test"]["text"].tolist() == tricky * 2


# ---- params ------------------------------------------------------------------------------

def test_misspelled_preprocess_key(work):
    set_params(work, lowercse=True)
    write_raw(work, train=HEADER + GOOD_ROWS)
    fails_with(work, "params.yaml: unknown key preprocess.lowercse; preprocess takes text_column, text_pair_column, "
                     "label_column, "
                     "id_column, steps, drop_duplicates")


def test_a_cleaning_switch_from_before_steps_says_what_to_write(work):
    set_params(work, lowercase=True)
    write_raw(work, train=HEADER + GOOD_ROWS)
    fails_with(work, "params.yaml: preprocess.lowercase is now a step: delete it and list lowercase in preprocess.steps")
    # a whole preprocess section of then: every switch named at once, and the list they made
    set_params(work, lowercase=False, unescape_html=True, replace_urls=True, replace_mentions=False,
               normalize_whitespace=True)
    fails_with(work, "params.yaml: preprocess.lowercase, unescape_html, replace_urls, replace_mentions, "
                     "normalize_whitespace are now steps: delete them and list unescape_html, replace_urls, "
                     "normalize_whitespace in preprocess.steps")
    path = work / "params.yaml"
    params = yaml.safe_load(path.read_text())
    for switch in ("lowercase", "unescape_html", "replace_urls", "normalize_whitespace"):
        del params["preprocess"][switch]
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    fails_with(work, "params.yaml: preprocess.replace_mentions is now a step: delete it; preprocess.steps lists "
                     "the steps to apply")


def test_mistyped_split_value(work):
    set_params(work, "split", val_size="ten percent")
    write_raw(work, train=HEADER + GOOD_ROWS)
    fails_with(work, "params.yaml: split.val_size must be a number above 0 and below 1, not 'ten percent'",
               stage="split")


# ---- columns -----------------------------------------------------------------------------

def test_missing_text_column(work):
    write_raw(work, train="body,sentiment\nhi,pos\n")
    fails_with(work, "data/raw/train.csv: missing column(s) 'text'; found 'body', 'sentiment' "
                     "(set preprocess.text_column / label_column / id_column)")


def test_missing_label_column(work):
    write_raw(work, train="text,label,source\nhi,pos,web\n")
    fails_with(work, "data/raw/train.csv: missing column(s) 'sentiment'; found 'text', 'label', "
                     "'source' (set preprocess.text_column / label_column / id_column)")


def test_missing_id_column(work):
    set_params(work, id_column="id")
    write_raw(work, train=HEADER + GOOD_ROWS, test="ID,text\n1,hi\n")
    fails_with(work, "data/raw/test.csv: missing column(s) 'id'; found 'ID', 'text' "
                     "(set preprocess.text_column / label_column / id_column)")


def test_spaces_around_column_names_are_ignored(work):
    write_raw(work, train="text , sentiment\n" + GOOD_ROWS)
    assert succeeds(work)[2] == ["neg", "neu", "pos"]


# ---- texts -------------------------------------------------------------------------------

def test_empty_texts_are_dropped_and_counted(work):
    write_raw(work, train=HEADER + ",pos\n   ,neg\n\"\t\n\",neu\n" + GOOD_ROWS)
    out, frames, labels = succeeds(work)
    assert "data/raw/train.csv: 33 rows, 3 dropped for empty text (rows 2, 3, 4)" in out
    assert len(frames["train"]) + len(frames["val"]) == 30


def test_empty_test_texts_are_kept_for_the_submission(work):
    write_raw(work, train=HEADER + GOOD_ROWS, test="text\nhello\n \n")
    out, frames, labels = succeeds(work)
    assert frames["test"]["text"].tolist() == ["hello", ""]
    assert "test 2 rows (1 with empty text), without labels" in out


def test_extremely_long_text_is_kept_whole(work):
    # longer than the csv module's default field limit (131072); tokenize counts the truncation
    long_text = "word " * 60_000
    write_raw(work, train=HEADER + GOOD_ROWS, test=f"text\n{long_text}\nshort\n")
    out, frames, labels = succeeds(work)
    assert frames["test"]["text"].tolist() == [long_text.strip(), "short"]


# ---- labels ------------------------------------------------------------------------------

def test_missing_labels_name_the_rows(work):
    rows = GOOD_ROWS.splitlines(keepends=True)
    empty = ["x,\n", "y, \n"] * 4
    write_raw(work, train=HEADER + "".join(rows[:2] + empty + rows[2:]))
    fails_with(work, "data/raw/train.csv: 8 row(s) have an empty 'sentiment' (rows 4, 5, 6, 7, 8 "
                     "and 3 more); fill or remove them")


def test_labels_pandas_would_turn_into_nan_stay_labels(work):
    names = ["None", "NA", "null", "n/a", "NaN", "#N/A"]
    write_raw(work, train=HEADER + "".join(f"text {i} {n},{n}\n" for n in names for i in range(3)))
    out, frames, labels = succeeds(work)
    assert labels == sorted(names)
    assert set(frames["val"]["label"]) == set(names)


def test_label_with_surrounding_whitespace_is_stripped(work):
    write_raw(work, train=HEADER + GOOD_ROWS + 'extra one," pos "\nextra two,\tneg\t\n')
    out, frames, labels = succeeds(work)
    assert labels == ["neg", "neu", "pos"]


def test_numbers_spelled_differently_are_one_class(work):
    set_params(work, id_column="id")
    rows = "".join(f"t{i},{label}\n" for i, label in enumerate(["1", "1", "1.0", " 1", "+1"] + ["2"] * 4 + ["10"] * 4))
    write_raw(work, train=HEADER + rows, test="id,text,sentiment\na,x,1.00\nb,y,10\nc,z,2e0\n")
    out, frames, labels = succeeds(work)
    assert labels == ["1", "2", "10"]  # numeric order, the most common spelling
    assert ("data/raw/train.csv: one number, several spellings: '+1' -> '1' (1 row(s)), "
            "'1.0' -> '1' (1 row(s))") in out  # " 1" is "1": surrounding spaces never count
    assert ("data/raw/test.csv: one number, several spellings: '1.00' -> '1' (1 row(s)), "
            "'2e0' -> '2' (1 row(s))") in out
    assert frames["test"]["label"].tolist() == ["1", "10", "2"]


def test_single_class(work):
    write_raw(work, train=HEADER + "a,pos\nb,pos\n")
    fails_with(work, "data/raw/train.csv: 'sentiment' has a single class ['pos']; classification "
                     "needs at least two")


def test_class_with_one_example_stays_in_train(work):
    write_raw(work, train=HEADER + GOOD_ROWS + "lonely,rare\n")
    out, frames, labels = succeeds(work)
    assert "1 row(s) of classes with a single example kept in train only: ['rare']" in out
    assert "rare" in set(frames["train"]["label"]) and "rare" in labels
    assert set(frames["val"]["label"]) == {"pos", "neg", "neu"}


def test_every_class_with_one_example(work):
    write_raw(work, train=HEADER + "a,x\nb,y\nc,z\n")
    fails_with(work, "data/processed/train.csv: no validation split possible: each of the 3 classes "
                     "has a single example; every class needs two or more", stage="split")


def test_more_folds_than_a_class_has_texts(work):
    set_params(work, "cv", folds=[0, 1, 2, 3, 4])
    write_raw(work, train=HEADER + GOOD_ROWS + "r1,rare\nr2,rare\nr3,rare\nr3,rare\n")  # 3 distinct texts
    fails_with(work, "data/processed/train.csv: too few distinct texts for 5 folds ('rare' has 3); every class "
                     "needs at least one per fold: use at most 3 folds in cv.folds, or more examples of those "
                     "classes", stage="split")


@pytest.mark.parametrize("folds", [[], [1, 2]])
def test_folds_that_are_not_0_to_k_minus_1(work, folds):
    set_params(work, "cv", folds=folds)
    write_raw(work, train=HEADER + GOOD_ROWS)
    fails_with(work, "params.yaml: cv.folds must list the folds 0 to K-1: [0] for one model on a holdout split, "
                     f"or e.g. [0, 1, 2, 3, 4] for 5-fold cross-validation; not {folds!r}", stage="split")


def test_folds_given_as_a_number(work):
    # `dvc repro` stops at dvc.yaml's foreach before any stage runs (tests/test_cv.py); the stage says it too
    set_params(work, "cv", folds=3)
    write_raw(work, train=HEADER + GOOD_ROWS)
    fails_with(work, "params.yaml: cv.folds must be a list, not 3", stage="split")



def test_a_fold_the_split_does_not_have(work):
    # `python -m stages.train --fold K` run by hand, after a split into fewer folds
    before = snapshot(work)
    result = subprocess.run([sys.executable, "-m", "stages.train", "--fold", "2"], cwd=work, env=stage_env(),
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (1, "error: --fold 2: data/split/folds.csv has folds 0 to 0 "
                                                     "(cv.folds): rerun `dvc repro split`, or pick one of those\n")
    assert snapshot(work) == before

def test_smaller_than_a_batch_still_gets_a_validation_row_per_class(work):
    # 6 rows, 3 classes: val_size 0.1 asks for 1 validation row, and stratifying needs 3
    write_raw(work, train=HEADER + "".join(GOOD_ROWS.splitlines(keepends=True)[:6]))
    out, frames, labels = succeeds(work)
    assert ("split.val_size 0.1 of 6 rows gives 1 validation row(s); taking 3, so train and "
            "validation each hold all 3 classes") in out
    assert sorted(frames["val"]["label"]) == sorted(frames["train"]["label"]) == ["neg", "neu", "pos"]


def test_unseen_test_label(work):
    write_raw(work, train=HEADER + GOOD_ROWS, test="text,sentiment\nhi,pos\nyo,angry\n")
    fails_with(work, "data/raw/test.csv: label(s) ['angry'] never occur in the training data "
                     "(train has ['neg', 'neu', 'pos'])")


# ---- ids ---------------------------------------------------------------------------------

def test_duplicate_test_ids(work):
    set_params(work, id_column="id")
    write_raw(work, train=HEADER + GOOD_ROWS, test="id,text\n7,a\n8,b\n7,c\n9,d\n8,e\n7,f\n")
    fails_with(work, "data/raw/test.csv: 2 id(s) in 'id' occur more than once: '7' (rows 2, 4, "
                     "7); '8' (rows 3, 6); the submission needs one row per id")


# ---- model.name --------------------------------------------------------------------------

@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty model cache and a hub address where nothing listens: a machine without network."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", refused_url().removesuffix("/train.csv"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_unknown_model_name_without_network(no_hub):
    with pytest.raises(PipelineError) as e:
        resolve_model("bert-base-uncsed")
    message, reason = str(e.value).split(" (ConnectError: ")
    assert message == (
        f"model.name 'bert-base-uncsed' is neither a builtin model (minilm) nor a local folder "
        f"({no_hub}/bert-base-uncsed); as a hub id it needs network to download once: it is not in "
        f"the cache {no_hub}/hub, and {constants.ENDPOINT} cannot be reached")
    assert "refused" in reason.lower()


def test_unknown_model_name_offline_mode(no_hub, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PipelineError, match=r"it is not in the cache .*/hub, and HF_HUB_OFFLINE is set$"):
        resolve_model("org/model")


@pytest.mark.parametrize("name", ["./models/mine", "/no/such/folder", "a/b/c"])
def test_model_name_that_is_no_folder_and_no_hub_id(no_hub, name):
    with pytest.raises(PipelineError) as e:
        resolve_model(name)
    assert str(e.value) == (f"model.name {name!r} is neither a builtin model (minilm) nor a local "
                            f"folder ({(no_hub / name).resolve()}), nor a Hugging Face hub id "
                            "(name or owner/name)")


def test_folder_without_config(no_hub):
    (no_hub / "mine").mkdir()
    with pytest.raises(PipelineError, match=r"^model.name 'mine' is a folder without config.json; "):
        resolve_model("mine")


def test_model_the_hub_does_not_have(no_hub, monkeypatch):
    def hub(req, host, url):  # what huggingface.co answers for a missing or private repo
        send(req, 404, b'{"error": "Repository not found"}', "application/json",
             {"X-Error-Code": "RepoNotFound"})

    with serve(hub) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        with pytest.raises(PipelineError) as e:
            resolve_model("org/missing")
    assert str(e.value) == (
        f"model.name 'org/missing' is neither a builtin model (minilm) nor a local folder "
        f"({no_hub}/org/missing), and the hub at {server.url} has no model 'org/missing' (or it is "
        "private: log in with `hf auth login`)")
    assert [path for _, path, _ in server.log] == ["/api/models/org/missing"]


def test_cached_model_is_used_without_network(no_hub, tiny_model_dir, capsys):
    snapshot = no_hub / "hub/models--org--tiny/snapshots/0123abc"
    shutil.copytree(tiny_model_dir, snapshot)
    (no_hub / "hub/models--org--tiny/refs").mkdir()
    (no_hub / "hub/models--org--tiny/refs/main").write_text("0123abc")
    assert resolve_model("org/tiny") == str(snapshot)
    assert f"using the cached copy {snapshot}" in capsys.readouterr().out


def test_tokenize_stage_reports_the_model_name_in_one_line(tmp_path):
    """The user's view: the real tokenize stage fails at once, in one line, with no network."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["model"]["name"] = "nobody/nothing"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "data/processed").mkdir(parents=True)
    (tmp_path / "data/processed/labels.json").write_text('["a", "b"]')
    endpoint = refused_url().removesuffix("/train.csv")
    result = subprocess.run([sys.executable, "-m", "stages.tokenize"], cwd=tmp_path, timeout=120,
                            env=stage_env(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=endpoint),
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.startswith("error: model.name 'nobody/nothing' is neither a builtin model")
    assert result.stderr.count("\n") == 1 and f"{endpoint} cannot be reached" in result.stderr
    assert not (tmp_path / "data/tokenized").exists()


def test_max_length_above_what_the_model_takes(tmp_path, tiny_model_dir):
    # the tiny model has 128 positions: 512 used to end in a traceback inside the model's embeddings
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    params["model"]["name"], params["tokenize"]["max_length"] = str(tiny_model_dir), 512
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "data/processed").mkdir(parents=True)
    (tmp_path / "data/processed/labels.json").write_text('["a", "b"]')
    (tmp_path / "data/processed/train.csv").write_text("text,label\nhello,a\nworld,b\n")
    result = subprocess.run([sys.executable, "-m", "stages.tokenize"], cwd=tmp_path, timeout=120,
                            env=stage_env(), capture_output=True, text=True)
    assert (result.returncode, result.stderr) == (1, (
        f"error: params.yaml: tokenize.max_length 512 is more than model.name '{tiny_model_dir}' takes (128 "
        "tokens): set it to at most 128, or auto\n")), result.stdout + result.stderr
    assert not (tmp_path / "data/tokenized").exists() and not (tmp_path / "reports").exists()


# ---- encodings -----------------------------------------------------------------------------

def test_korean_saved_in_cp949_is_read_as_korean(work):
    # what Excel on a Korean Windows and Dacon's downloads save: CP949, EUC-KR with 8,822 more syllables
    # (똠 is one of them, outside EUC-KR)
    rows = "".join(f"{text} {i},{label}\n" for i in range(10) for text, label in
                   (("정말 재미있는 영화", "긍정"), ("별로였다 지루함", "부정"), ("똠방각하 그냥 그랬다", "보통")))
    write_raw(work, train=(HEADER + rows).encode("cp949"))
    out, frames, labels = succeeds(work)
    assert "data/raw/train.csv: not UTF-8: read as CP949 (Korean; EUC-KR is part of it)" in out
    assert "cp1252" not in out
    assert labels == ["긍정", "보통", "부정"]
    texts = set(frames["train"]["text"]) | set(frames["val"]["text"])
    assert {"정말 재미있는 영화 0", "똠방각하 그냥 그랬다 9"} <= texts
