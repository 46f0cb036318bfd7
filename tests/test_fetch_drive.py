"""Fetch from Google Drive through gdown's real code, against a fake Drive on 127.0.0.1.

The fake Drive (tests/http_servers.py) sits behind a CONNECT proxy that speaks TLS with a
certificate for drive.google.com & co. from a test CA; gdown reaches it through the
HTTPS_PROXY and REQUESTS_CA_BUNDLE settings that requests already honours. Nothing is patched.
"""
import hashlib

import certifi
import pytest

from stages import fetch
from tests.fetch_helpers import TEST, TRAIN, error_line, expect_failure, make_zip, old_raw, run_stage, snapshot, write_params
from tests.http_servers import FakeDrive, make_tls, serve

HUGE = TRAIN + b"".join(b"row %d,positive\n" % i for i in range(60000))  # over gdown's 512 KiB chunk
ZIP = make_zip({"competition/train.csv": TRAIN, "competition/test.csv": TEST})


def drive_id(tag):
    return f"1{tag}".ljust(33, "x")  # Drive ids are 25+ url-safe characters


CSV, BIGZIP, QUOTA, PRIVATE, DELETED, CUT, EVIL = map(drive_id, ["csv", "zip", "quota", "private",
                                                                 "deleted", "cut", "evil"])
F_TRAIN, F_TEST, F_EXTRA, F_SUB = map(drive_id, ["ftrain", "ftest", "fextra", "fsub"])
FOLDER, NESTED, PRIVATE_FOLDER, GONE_FOLDER = map(drive_id, ["folder", "nested", "privfolder", "gone"])
SHEET, PRIVATE_SHEET = drive_id("sheet"), drive_id("privsheet")


def fake_drive():
    return FakeDrive(
        files={CSV: ("train.csv", TRAIN, "direct"), BIGZIP: ("competition.zip", ZIP, "confirm"),
               QUOTA: ("train.csv", TRAIN, "quota"), PRIVATE: ("train.csv", TRAIN, "private"),
               CUT: ("big.csv", HUGE, "cut_once"), EVIL: ("../../evil.csv", TRAIN, "direct"),
               F_TRAIN: ("train.csv", TRAIN, "direct"), F_TEST: ("test.csv", TEST, "direct"),
               F_EXTRA: ("huge.bin", b"\0" * 1000, "direct")},
        folders={FOLDER: ("competition", [(F_TRAIN, "train.csv", "file"), (F_TEST, "test.csv", "file"),
                                          (F_EXTRA, "huge.bin", "file"), (F_SUB, "more", "folder")]),
                 F_SUB: ("more", [(F_EXTRA, "other.bin", "file")]),
                 NESTED: ("nested", [(F_SUB, "data", "folder")]), GONE_FOLDER: None},
        sheets={SHEET: TRAIN, PRIVATE_SHEET: None})


@pytest.fixture
def drive(tmp_path, monkeypatch):
    """Start the fake Drive; point requests at it (proxy + CA); yield (server, env for subprocesses)."""
    ctx, bundle = make_tls(tmp_path)
    app = fake_drive()
    with serve(app, tls=ctx) as server:
        env = {"HTTPS_PROXY": server.url, "https_proxy": server.url,
               "REQUESTS_CA_BUNDLE": str(bundle), "CURL_CA_BUNDLE": str(bundle)}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        for key in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(key, raising=False)
        server.fake = app
        yield server, env


def net(tmp_path, retries=0):
    return fetch.Net(timeout=2, retries=retries, backoff=0.01,
                     cookies_file=str(tmp_path / "cookies.txt"))


def requested(server):
    return [f"{host}{path}" for host, path, _ in server.log]


@pytest.mark.parametrize("source", [
    CSV, f"https://drive.google.com/file/d/{CSV}/view?usp=sharing",
    f"https://drive.google.com/open?id={CSV}", f"https://drive.google.com/uc?id={CSV}",
    f"https://drive.google.com/uc?export=download&id={CSV}",
])
def test_drive_file_every_link_form(drive, tmp_path, source):
    server, _ = drive
    files = fetch.collect(source, tmp_path / "w", net(tmp_path), test_file=None)
    assert files["train"].read_bytes() == TRAIN
    assert requested(server) == [f"drive.google.com/uc?id={CSV}",
                                 f"drive.usercontent.google.com/download?id={CSV}&export=download"]


def test_large_zip_behind_virus_scan_warning(drive, tmp_path, capsys):
    server, _ = drive
    digest = hashlib.sha256(ZIP).hexdigest()
    files = fetch.collect(BIGZIP, tmp_path / "w", net(tmp_path), sha256=digest)
    assert files["train"].read_bytes() == TRAIN and files["test"].read_bytes() == TEST
    assert any("confirm=t" in r and "uuid=0a1b2c3d-test" in r for r in requested(server))
    out = capsys.readouterr().out
    assert f"competition.zip: {len(ZIP):,} bytes, sha256 {digest}, from Drive file {BIGZIP}" in out
    assert f"train.csv: {len(TRAIN)} bytes" in out and "competition.zip): competition/train.csv" in out


def test_resumes_a_dropped_drive_download(drive, tmp_path):
    server, _ = drive
    files = fetch.collect(CUT, tmp_path / "w", net(tmp_path, retries=1), test_file=None)
    assert files["train"].read_bytes() == HUGE
    ranges = [headers.get("Range") for _, _, headers in server.log]
    assert ranges[-1] == "bytes=524288-"


def test_sheet_is_exported_as_csv(drive, tmp_path):
    server, _ = drive
    source = f"https://docs.google.com/spreadsheets/d/{SHEET}/edit#gid=7"
    files = fetch.collect(source, tmp_path / "w", net(tmp_path), test_file=None)
    assert files["train"].read_bytes() == TRAIN
    assert requested(server) == [f"docs.google.com/spreadsheets/d/{SHEET}/export?format=csv&gid=7"]


def test_bare_sheet_id_takes_gdowns_docs_path(drive, tmp_path):
    server, _ = drive
    files = fetch.collect(SHEET, tmp_path / "w", net(tmp_path), test_file=None)
    assert files["train"].read_bytes() == TRAIN and files["train"].name == "Sheet1.csv"
    assert requested(server) == [f"drive.google.com/uc?id={SHEET}", f"drive.google.com/open?id={SHEET}",
                                 f"docs.google.com/spreadsheets/d/{SHEET}/edit?usp=drive_web",
                                 f"docs.google.com/spreadsheets/d/{SHEET}/export?format=csv"]


def test_folder_downloads_only_the_named_files(drive, tmp_path):
    server, _ = drive
    source = f"https://drive.google.com/drive/folders/{FOLDER}?usp=sharing"
    files = fetch.collect(source, tmp_path / "w", net(tmp_path))
    assert files["train"].read_bytes() == TRAIN and files["test"].read_bytes() == TEST
    assert not any(F_EXTRA in r and "download" in r for r in requested(server))


def test_folder_one_level_down(drive, tmp_path):
    server, _ = drive
    server.fake.folders[F_SUB] = ("data", [(F_TRAIN, "train.csv", "file"), (F_TEST, "test.csv", "file")])
    files = fetch.collect(f"https://drive.google.com/drive/folders/{NESTED}", tmp_path / "w",
                          net(tmp_path))
    assert files["train"] == tmp_path / "w/folder/data/train.csv"


def test_remote_file_name_cannot_escape(drive, tmp_path):
    files = fetch.collect(EVIL, tmp_path / "w", net(tmp_path), test_file=None)
    assert files["train"].parent == tmp_path / "w/download"  # gdown made it ".._.._evil.csv"
    assert not list(tmp_path.rglob("evil.csv"))


def drive_failures():
    not_public = ("Drive says 'Cannot retrieve the public link of the file.': the file is not "
                  "shared publicly, or no longer exists: share it as 'Anyone with the link' and "
                  "check the link")
    return [
        (QUOTA, f"Drive file {QUOTA}: Drive says 'Too many users have viewed or downloaded this file "
                "recently.': the file's download quota is used up: wait (up to 24 h), or copy it to "
                "your own Drive or another host and point fetch.source at the copy"),
        (PRIVATE, f"Drive file {PRIVATE}: {not_public}"),
        (DELETED, f"Drive file {DELETED}: {not_public}"),
        (f"https://docs.google.com/spreadsheets/d/{PRIVATE_SHEET}/edit",
         f"Google Sheet https://docs.google.com/spreadsheets/d/{PRIVATE_SHEET}/export?format=csv: "
         "got an HTML page ('Sign in - Google Accounts') instead of a CSV or archive: the file is "
         "not shared publicly, or no longer exists: share it as 'Anyone with the link' and check "
         "the link"),
        (f"https://drive.google.com/drive/folders/{PRIVATE_FOLDER}",
         f"Drive folder {PRIVATE_FOLDER}: Drive lists no files; share the folder as "
         "'Anyone with the link' and check the link"),
        (f"https://drive.google.com/drive/folders/{GONE_FOLDER}",
         f"Drive folder {GONE_FOLDER}: Drive would not list the folder (status 404): share it as "
         "'Anyone with the link' and check the link"),
        (f"https://drive.google.com/drive/folders/{F_SUB}",
         f"Drive folder {F_SUB}: no train.csv at the top or one folder down (CSV files there: "
         "none); set fetch.train_file/fetch.test_file"),
    ]


@pytest.mark.parametrize("source, message", drive_failures())
def test_drive_failures(drive, tmp_path, source, message):
    assert expect_failure(tmp_path, source, net(tmp_path), test_file=None) == message


def test_untrusted_certificate(drive, tmp_path, monkeypatch):
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", certifi.where())  # the public CAs, not the test CA
    assert expect_failure(tmp_path, CSV, net(tmp_path), test_file=None) == (
        f"Drive file {CSV}: the TLS certificate check failed (certificate verify failed); check the "
        "URL, or set REQUESTS_CA_BUNDLE to your network's CA certificates")


# ---- the real stage, as a subprocess -----------------------------------------------------

def test_stage_drive_zip_then_quota(drive, tmp_path):
    server, env = drive
    work = tmp_path / "repo"
    work.mkdir()
    write_params(work, source=f"https://drive.google.com/file/d/{BIGZIP}/view?usp=sharing")
    proc = run_stage(work, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (work / "data/raw/train.csv").read_bytes() == TRAIN
    assert (work / "data/raw/test.csv").read_bytes() == TEST
    assert "\r" not in proc.stderr  # no progress bar redrawing itself in a log (it shows on a terminal)
    assert not list(work.rglob("cookies.txt"))  # gdown's cookies went to the temp folder

    before = snapshot(work)
    write_params(work, source=QUOTA, test_file=None)
    proc = run_stage(work, env=env)
    assert error_line(proc).startswith(f"error: Drive file {QUOTA}: Drive says 'Too many users")
    assert snapshot(work) == before


def test_stage_private_folder(drive, tmp_path):
    server, env = drive
    write_params(tmp_path, source=f"https://drive.google.com/drive/folders/{PRIVATE_FOLDER}")
    before = old_raw(tmp_path)
    proc = run_stage(tmp_path, env=env)
    assert error_line(proc) == (f"error: Drive folder {PRIVATE_FOLDER}: Drive lists no files; share "
                                "the folder as 'Anyone with the link' and check the link")
    assert snapshot(tmp_path) == before
