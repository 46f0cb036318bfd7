"""Fetch stage: pure functions, the builtin corpus, local files, folders and archives."""
import hashlib
import posixpath
import stat
import tarfile
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fetching.archives import pick, unsafe_entry
from fetching.builtin import split_builtin
from fetching.download import url_file_name
from fetching.failures import advice, first_sentence, page_text, shorten
from pipeline.settings import PipelineError
from stages import fetch
from tests.fetch_helpers import TEST, TRAIN, error_line, make_tgz, make_zip, old_raw, run_stage, snapshot, write_params

NET = fetch.Net(timeout=2, retries=0, backoff=0.01)
ID = "1AbCdEfGhIjKlMnOpQrStUvWxYz012345"  # a Drive-id-shaped string


# ---- parse_source ------------------------------------------------------------------------

@pytest.mark.parametrize("source, expected", [
    ("tweets", ("builtin", "tweets")),
    (ID, ("drive_file", ID)),
    (f"https://drive.google.com/file/d/{ID}/view?usp=sharing", ("drive_file", ID)),
    (f"https://drive.google.com/file/u/1/d/{ID}/view", ("drive_file", ID)),
    (f"https://drive.google.com/open?id={ID}", ("drive_file", ID)),
    (f"https://drive.google.com/uc?id={ID}", ("drive_file", ID)),
    (f"https://drive.google.com/uc?export=download&id={ID}", ("drive_file", ID)),
    (f"https://drive.usercontent.google.com/download?id={ID}&export=download", ("drive_file", ID)),
    (f"https://drive.google.com/drive/folders/{ID}?usp=sharing", ("drive_folder", ID)),
    (f"https://drive.google.com/drive/u/0/folders/{ID}", ("drive_folder", ID)),
    (f"https://docs.google.com/spreadsheets/d/{ID}/edit#gid=42",
     ("sheet", f"https://docs.google.com/spreadsheets/d/{ID}/export?format=csv&gid=42")),
    (f"https://docs.google.com/spreadsheets/d/{ID}/edit?usp=sharing",
     ("sheet", f"https://docs.google.com/spreadsheets/d/{ID}/export?format=csv")),
    ("https://example.com/data/train.csv", ("url", "https://example.com/data/train.csv")),
    ("HTTP://example.com/d.zip", ("url", "HTTP://example.com/d.zip")),
])
def test_parse_source(source, expected):
    assert fetch.parse_source(source) == expected


def test_parse_source_local_and_unknown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.csv").write_bytes(TRAIN)
    assert fetch.parse_source("mine.csv") == ("local", "mine.csv")
    with pytest.raises(PipelineError, match="is not a local file or folder"):
        fetch.parse_source("nope.csv")
    with pytest.raises(PipelineError, match="no file or folder id"):
        fetch.parse_source("https://drive.google.com/drive/my-drive")


# ---- small pure helpers ------------------------------------------------------------------

@pytest.mark.parametrize("head, kind", [
    (b"<!DOCTYPE html><html>", "html"), (b"\n  <html lang=en>", "html"), (b"\xef\xbb\xbf<HTML>", "html"),
    (b"PK\x03\x04rest", "zip"), (b"\x1f\x8b\x08", "gzip"), (b"text,label\n<html>,x\n", "text"),
    (b"\xff\xfet\x00e\x00", "text"), (b"\x00\x01\x02", "binary"),
])
def test_sniff(head, kind):
    assert fetch.sniff(head) == kind


@pytest.mark.parametrize("name, head, kind", [
    ("data.zip", b"", "zip"), ("DATA.ZIP", b"", "zip"), ("d.tar.gz", b"", "tar"), ("d.TGZ", b"", "tar"),
    ("train.csv", b"PK\x03\x04", None), ("download", b"PK\x03\x04", "zip"), ("download", b"\x1f\x8b", "tar"),
    ("download", b"a,b\n", None), ("data.xlsx", b"PK\x03\x04", None),
])
def test_archive_kind(name, head, kind):
    assert fetch.archive_kind(name, head) == kind


def test_url_file_name():
    assert url_file_name("https://h/a/b/train%20set.csv?dl=1") == "train_set.csv"
    assert url_file_name("https://h/") == "download"
    assert url_file_name("https://h/..%2F..%2Fevil.csv") == "evil.csv"


@pytest.mark.parametrize("name, link, bad", [
    ("data/train.csv", None, False), ("../x", None, True), ("a/../../x", None, True),
    ("/etc/passwd", None, True), ("C:/x", None, True), ("..\\x", None, True),
    ("data/link", "train.csv", False), ("data/link", "../train.csv", False),
    ("data/link", "../../x", True), ("link", "/etc/passwd", True),
])
def test_unsafe_entry(name, link, bad):
    assert bool(unsafe_entry(name, link)) == bad


PARTS = st.sampled_from(["a", "b.csv", "..", ".", "", "C:", "\\"])


@given(st.lists(PARTS, max_size=5).map("/".join), st.none() | st.lists(PARTS, max_size=5).map("/".join))
def test_entries_judged_safe_stay_inside(name, link):
    if unsafe_entry(name, link) is None:
        root = "/x/root"
        for path in [name] + ([posixpath.join(posixpath.dirname(name), link)] if link is not None else []):
            target = posixpath.normpath(posixpath.join(root, path))
            assert target == root or target.startswith(root + "/")


def test_pick():
    paths = ["README.md", "wrap/test.csv", "wrap/train.csv", "__MACOSX/train.csv"]
    assert pick(paths, "train.csv", "a.zip") == "wrap/train.csv"
    assert pick(["train.csv", "x/train.csv"], "train.csv", "a.zip") == "train.csv"
    with pytest.raises(PipelineError, match=r"no dev.csv at the top .*wrap/test.csv, wrap/train.csv"):
        pick(paths, "dev.csv", "a.zip")
    with pytest.raises(PipelineError, match="in several folders"):
        pick(["a/train.csv", "b/train.csv"], "train.csv", "a.zip")


def test_parse_pins():
    digest = "A" * 64
    assert fetch.parse_pins(None, "x.csv") == {}
    assert fetch.parse_pins(digest, "x.csv") == {"x.csv": "a" * 64}
    assert fetch.parse_pins({"train.csv": digest}, None) == {"train.csv": "a" * 64}
    with pytest.raises(PipelineError, match="the source is a folder"):
        fetch.parse_pins(digest, None)
    with pytest.raises(PipelineError, match="is not a sha256 digest"):
        fetch.parse_pins({"train.csv": "abc"}, None)


def test_page_text_and_advice():
    quota = ('<html><head><title>Google Drive - Quota exceeded</title></head><body>'
             '<p class="uc-error-subcaption">Too many users have viewed or downloaded this file '
             'recently.</p></body></html>')
    assert page_text(quota).startswith("Too many users")
    assert "quota" in advice(page_text(quota))
    signin = "<html><title>Sign in - Google Accounts</title></html>"
    assert page_text(signin) == "Sign in - Google Accounts"
    assert "Anyone with the link" in advice("Sign in - Google Accounts")
    # every error one line: whitespace collapsed, cut with an ellipsis to the limit (200 unless given)
    assert shorten("a  b\n c", 5) == "a b c" and shorten("abcdef", 5) == "abcd…"
    assert shorten("x" * 200) == "x" * 200 and shorten("x" * 201) == "x" * 199 + "…"
    assert first_sentence("Quota exceeded. Try later.") == "Quota exceeded." and len(first_sentence("y" * 300)) == 120
    assert page_text("z" * 300) == "z" * 119 + "…"  # no title: the page's start, as a sentence


def test_net_settings():
    assert fetch.net_settings({"timeout": 60, "retries": 3}) == fetch.Net(timeout=60.0, retries=3)
    for bad, message in [({"timeout": 0, "retries": 3}, "fetch.timeout must be a positive number"),
                         ({"timeout": "1m", "retries": 3}, "fetch.timeout must be a positive number"),
                         ({"timeout": 5, "retries": -1}, "fetch.retries must be a whole number"),
                         ({"timeout": 5, "retries": 1.5}, "fetch.retries must be a whole number")]:
        with pytest.raises(PipelineError, match=message):
            fetch.net_settings(bad)


# ---- check_csv ---------------------------------------------------------------------------

def test_check_csv(tmp_path):
    f = tmp_path / "t.csv"
    f.write_bytes(b"\xef\xbb\xbftext,sentiment\nh\xe9llo,positive\n")  # BOM and latin-1 bytes
    assert fetch.check_csv(f, "t.csv", ["text", "sentiment"]) == 1
    with pytest.raises(PipelineError, match=r"t.csv: missing column\(s\) 'label'; found 'text', 'sentiment' \(set "):
        fetch.check_csv(f, "t.csv", ["text", "label"])
    for data, message in [(b"", "the file is empty"), (b"text,sentiment\n", "has a header but no rows"),
                          (b"<!doctype html><title>Oops</title>", "got an HTML page \\('Oops'\\)"),
                          (b"PK\x03\x04zzz", "not a CSV \\(it is a zip file\\)"),
                          (b'text,sentiment\n"unclosed,x\n',
                           "t.csv: not a valid CSV \\(the double quote opened in row 2 is never closed\\)")]:
        f.write_bytes(data)
        with pytest.raises(PipelineError, match=message):
            fetch.check_csv(f, "t.csv", ["text"])


# ---- the builtin -------------------------------------------------------------------------

def test_split_builtin_is_stratified_and_deterministic():
    df = pd.DataFrame({"sentiment": ["a"] * 60 + ["b"] * 30 + ["c"] * 10,
                       "confidence": 1.0, "text": [f"t{i}" for i in range(100)]})
    train, test = split_builtin(df)
    assert len(test) == 10 and len(train) == 90
    assert test["sentiment"].value_counts().to_dict() == {"a": 6, "b": 3, "c": 1}
    assert set(train["text"]).isdisjoint(test["text"])
    assert list(split_builtin(df)[1]["text"]) == list(test["text"])


def test_builtin(tmp_path):
    files = fetch.collect("tweets", tmp_path, NET)
    train = pd.read_csv(files["train"], encoding="utf-8")
    test = pd.read_csv(files["test"], encoding="utf-8")
    assert list(train.columns) == list(test.columns) == ["sentiment", "confidence", "text"]
    assert len(train) + len(test) == 38158
    assert abs(len(test) - 3816) <= 1
    assert train["text"].str.contains("\r").any()  # bare CRs inside tweets survive the round trip
    assert set(test["sentiment"]) == {"negative", "neutral", "positive"}
    files["train"].read_bytes().decode("utf-8")  # written as UTF-8 (the corpus is latin-1)


# ---- local files, folders and archives ---------------------------------------------------

def test_local_csv_is_copied_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = b"text,sentiment\nh\xe9llo,positive\n"  # latin-1: published as it is
    Path("mine.csv").write_bytes(raw)
    assert fetch.fetch_source("mine.csv", Path("data/raw"), NET, test_file=None) == ["train"]
    assert Path("data/raw/train.csv").read_bytes() == raw
    assert sorted(p.name for p in Path("data/raw").iterdir()) == ["train.csv"]
    assert Path("mine.csv").read_bytes() == raw  # the input is untouched


@pytest.mark.parametrize("delimiter", [";", "\t"])
def test_a_csv_is_checked_as_preprocess_reads_it(tmp_path, monkeypatch, capsys, delimiter):
    # preprocess detects the delimiter, so fetch must not refuse what preprocess would read
    monkeypatch.chdir(tmp_path)
    raw = TRAIN.replace(b",", delimiter.encode())
    Path("mine.csv").write_bytes(raw)
    assert fetch.fetch_source("mine.csv", Path("data/raw"), NET, test_file=None) == ["train"]
    assert Path("data/raw/train.csv").read_bytes() == raw
    assert f"mine.csv: columns are separated by {delimiter!r}, not commas" in capsys.readouterr().out


def test_local_folder_one_level_down(tmp_path):
    (tmp_path / "src" / "wrap").mkdir(parents=True)
    (tmp_path / "src" / "wrap" / "train.csv").write_bytes(TRAIN)
    (tmp_path / "src" / "wrap" / "test.csv").write_bytes(TEST)
    files = fetch.collect(str(tmp_path / "src"), tmp_path / "work", NET)
    assert files["train"].read_bytes() == TRAIN and files["test"].read_bytes() == TEST


@pytest.mark.parametrize("name, make", [("d.zip", make_zip), ("D.TGZ", make_tgz),
                                        ("d.tar.gz", make_tgz)])
def test_local_archive(tmp_path, name, make):
    (tmp_path / "work").mkdir()
    (tmp_path / name).write_bytes(make({"data/train.csv": TRAIN, "data/test.csv": TEST}))
    files = fetch.collect(str(tmp_path / name), tmp_path / "work", NET)
    assert files["train"].read_bytes() == TRAIN and files["test"].read_bytes() == TEST


def test_archive_checksums(tmp_path, capsys):
    archive = tmp_path / "d.zip"
    archive.write_bytes(make_zip({"train.csv": TRAIN, "test.csv": TEST}))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    fetch.collect(str(archive), tmp_path / "w1", NET, sha256=digest)
    assert f"d.zip: {archive.stat().st_size:,} bytes, sha256 {digest}" in capsys.readouterr().out
    pins = {"train.csv": hashlib.sha256(TRAIN).hexdigest(), "test.csv": hashlib.sha256(TEST).hexdigest()}
    fetch.collect(str(archive), tmp_path / "w2", NET, sha256=pins)
    with pytest.raises(PipelineError, match=f"d.zip: sha256 is {digest} but fetch.sha256 pins 0000"):
        fetch.collect(str(archive), tmp_path / "w3", NET, sha256="0" * 64)
    with pytest.raises(PipelineError, match="fetch.sha256 names dev.csv, but fetch got d.zip, train.csv, test.csv"):
        fetch.collect(str(archive), tmp_path / "w4", NET, sha256={"dev.csv": "0" * 64})


@pytest.mark.parametrize("archive, entry", [
    (make_zip({"train.csv": TRAIN, "../evil.csv": b"x"}), "../evil.csv"),
    (make_zip({"train.csv": TRAIN, "/tmp/evil.csv": b"x"}), "/tmp/evil.csv"),
    (make_tgz({"train.csv": TRAIN, "../evil.csv": b"x"}), "../evil.csv"),
    (make_tgz({"train.csv": TRAIN, "/tmp/evil.csv": b"x"}), "/tmp/evil.csv"),
    (make_tgz({"train.csv": TRAIN}, [("out", "../..", tarfile.SYMTYPE)]), "out"),
    (make_tgz({"train.csv": TRAIN}, [("pw", "/etc/passwd", tarfile.SYMTYPE)]), "pw"),
    (make_tgz({"train.csv": TRAIN}, [("hard", "../../etc/passwd", tarfile.LNKTYPE)]), "hard"),
    (make_tgz({"train.csv": TRAIN}, [("fifo", "", tarfile.FIFOTYPE)]), "fifo"),
])
def test_archive_escapes_are_refused_before_writing(tmp_path, archive, entry):
    src = tmp_path / ("d.zip" if archive.startswith(b"PK") else "d.tgz")
    src.write_bytes(archive)
    with pytest.raises(PipelineError, match=f"refusing the archive: entry '{entry}' (would land "
                                             "outside|is a link to .*, outside|is a device)"):
        fetch.extract(src, fetch.archive_kind(src.name), tmp_path / "x", src.name)
    assert list((tmp_path / "x").iterdir()) == []  # nothing was written, not even train.csv
    assert not (tmp_path / "evil.csv").exists()


def test_zip_symlink_out_is_refused(tmp_path):
    src = tmp_path / "d.zip"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("train.csv", TRAIN)
        info = zipfile.ZipInfo("link")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        z.writestr(info, "../../etc/passwd")
    with pytest.raises(PipelineError, match="entry 'link' is a link to '../../etc/passwd', outside"):
        fetch.extract(src, "zip", tmp_path / "x", "d.zip")


def test_broken_archive(tmp_path):
    src = tmp_path / "d.zip"
    src.write_bytes(b"PK\x03\x04 this is not really a zip")
    with pytest.raises(PipelineError, match="d.zip: not a readable zip archive"):
        fetch.extract(src, "zip", tmp_path / "x", "d.zip")


# ---- the real stage, as a subprocess -----------------------------------------------------

def test_stage_builtin(tmp_path):
    write_params(tmp_path)
    proc = run_stage(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["raw"]  # no temp leftovers
    assert sorted(p.name for p in (tmp_path / "data/raw").iterdir()) == ["test.csv", "train.csv"]
    assert proc.stdout.count("sha256 ") == 2


@pytest.mark.parametrize("setup, fetch_params, message", [
    (lambda d: None, {"source": "missing.csv"},
     "error: fetch.source 'missing.csv' is not a local file or folder, an http(s) URL, "
     "a Google Drive link or id, or 'tweets'"),
    # the stage extracts into <temp folder>/fetch-*/extracted: this entry would land in the temp folder itself
    (lambda d: (d / "evil.zip").write_bytes(make_zip({"train.csv": TRAIN, "../../evil.csv": b"x"})),
     {"source": "evil.zip"},
     "error: evil.zip: refusing the archive: entry '../../evil.csv' would land outside the "
     "extraction folder (absolute path or '..'); repack it without that entry"),
    (lambda d: (d / "one.csv").write_bytes(TRAIN), {"source": "one.csv"},
     "error: one.csv is a single CSV, so there is no test.csv: set fetch.test_file: null, "
     "or use a folder or archive holding both"),
    (lambda d: (d / "one.csv").write_bytes(b"body,label\nx,y\n"), {"source": "one.csv", "test_file": None},
     "error: one.csv: missing column(s) 'text', 'sentiment'; found 'body', 'label' "
     "(set preprocess.text_column/preprocess.label_column to match the file)"),
])
def test_stage_failures_keep_old_data(tmp_path, setup, fetch_params, message):
    setup(tmp_path)
    write_params(tmp_path, **fetch_params)
    before = old_raw(tmp_path)
    temp = tmp_path / "tmp"  # the stage's temp folder, where its work folder and anything escaping it go
    temp.mkdir()
    proc = run_stage(tmp_path, env={"TMPDIR": str(temp)})
    assert error_line(proc) == message
    assert snapshot(tmp_path) == before
    assert list(temp.iterdir()) == [], "a file escaped the work folder, or the work folder was left behind"
