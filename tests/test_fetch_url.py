"""Fetch from plain http URLs, against a local server on 127.0.0.1 (no internet)."""
import hashlib
import time
from pathlib import Path

import pytest

from stages import fetch
from tests.fetch_helpers import TEST, TRAIN, error_line, expect_failure, make_zip, old_raw, run_stage, snapshot, write_params
from tests.http_servers import html_page, refused_url, send, send_file, serve

BIG = TRAIN + b"".join(b"row %d,positive\n" % i for i in range(5000))  # ~90 kB
HUGE = TRAIN + b"".join(b"row %d,positive\n" % i for i in range(60000))  # ~1.2 MB, over gdown's 512 KiB chunk


def net(retries=0, timeout=2):
    return fetch.Net(timeout=timeout, retries=retries, backoff=0.01)


def app_from(routes):
    """An app answering path -> handler(req); 404 for anything else."""
    def app(req, host, url):
        routes.get(url.path, lambda r: send(r, 404, b"not found"))(req)
    return app


def bodies(server):
    return [path for _, path, _ in server.log]


def test_csv_and_zip(tmp_path, capsys):
    routes = {"/d/train.csv": lambda r: send_file(r, TRAIN),
              "/d/data.zip": lambda r: send_file(r, make_zip({"wrap/train.csv": TRAIN,
                                                              "wrap/test.csv": TEST}), "application/zip")}
    with serve(app_from(routes)) as server:
        files = fetch.collect(f"{server.url}/d/train.csv", tmp_path / "w1", net(), test_file=None)
        assert files["train"].read_bytes() == TRAIN
        digest = hashlib.sha256(TRAIN).hexdigest()
        assert f"train.csv: {len(TRAIN)} bytes, sha256 {digest}, from {server.url}/d/train.csv" \
            in capsys.readouterr().out
        files = fetch.collect(f"{server.url}/d/data.zip?dl=1", tmp_path / "w2", net())
        assert files["test"].read_bytes() == TEST


def test_retries_a_503_then_succeeds(tmp_path):
    answers = iter([lambda r: send(r, 503, b"busy")] * 2)
    routes = {"/t.csv": lambda r: next(answers, lambda r: send_file(r, TRAIN))(r)}
    with serve(app_from(routes)) as server:
        files = fetch.collect(f"{server.url}/t.csv", tmp_path, net(retries=2), test_file=None)
        assert files["train"].read_bytes() == TRAIN
        assert len(server.log) == 3


def test_resumes_a_dropped_download_with_range(tmp_path):
    calls = []

    def flaky(req):  # the first answer stops after 800 kB; later ones honour Range
        calls.append(req.headers.get("Range"))
        send_file(req, HUGE, cut=800_000 if len(calls) == 1 else None)

    with serve(app_from({"/t.csv": flaky})) as server:
        files = fetch.collect(f"{server.url}/t.csv", tmp_path, net(retries=1), test_file=None)
    assert files["train"].read_bytes() == HUGE
    assert calls == [None, "bytes=524288-"]  # gdown kept the whole 512 KiB chunks it had


def url_failures():
    """(handler, retries, timeout, expected message after '<url>: ')"""
    signin = html_page("Sign in - Google Accounts")
    return [
        (lambda r: send(r, 404, b"nope"), 0, 2,
         "the server answered 404 Not Found (1 attempt); check the URL"),
        (lambda r: send(r, 403, b"no"), 0, 2,
         "the server answered 403 Forbidden (1 attempt); the server refused access; make the file public"),
        (lambda r: send(r, 500, b"oops"), 1, 2,
         "the server answered 500 Internal Server Error (2 attempts); the server failed; "
         "try again later, or use a mirror"),
        (lambda r: send(r, 200, signin, "text/html"), 0, 2,
         "got an HTML page ('Sign in - Google Accounts') instead of a CSV or archive: the file is "
         "not shared publicly, or no longer exists: share it as 'Anyone with the link' and check the link"),
        (lambda r: send(r, 200, html_page("Welcome to nginx!"), "text/html"), 0, 2,
         "got an HTML page ('Welcome to nginx!') instead of a CSV or archive: use a direct download link "
         "(open the link in a browser: it should download, not show a page) or a mirror"),
        (lambda r: send_file(r, BIG, cut=1000), 0, 2,
         f"the download was cut short (1 attempt; the server announced {len(BIG)} bytes); "
         "run fetch again, or raise fetch.retries"),
        (lambda r: send_file(r, BIG, cut=1000), 1, 2,  # the retry is cut short too
         f"the download was cut short (2 attempts; the server announced {len(BIG)} bytes); "
         "run fetch again, or raise fetch.retries"),
        (lambda r: send_file(r, BIG, stall=True), 0, 0.5,
         "no data for 0.5 s (1 attempt); check your network, or raise fetch.timeout"),
        (lambda r: r.server.stop.wait(30), 0, 0.5,  # silent before any header
         "no data for 0.5 s (1 attempt); check your network, or raise fetch.timeout"),
    ]


@pytest.mark.parametrize("handler, retries, timeout, message", url_failures())
def test_url_failures(tmp_path, handler, retries, timeout, message):
    with serve(app_from({"/train.csv": handler})) as server:
        url = f"{server.url}/train.csv"
        start = time.monotonic()
        error = expect_failure(tmp_path, url, net(retries, timeout), test_file=None)
    assert error == f"{url}: {message}"
    assert time.monotonic() - start < 10


def test_connection_refused(tmp_path):
    url = refused_url()
    assert expect_failure(tmp_path, url, net(retries=1), test_file=None) == (
        f"{url}: could not connect (connection refused, 2 attempts); check the URL and your network")


# ---- the real stage, as a subprocess -----------------------------------------------------

def no_leftovers(folder):
    """No temp folders, partial downloads or cookies anywhere under folder."""
    return [p.name for p in Path(folder).rglob("*")
            if p.name.endswith(".part") or p.name.startswith((".raw.tmp", "fetch-", "cookies"))]


def test_stage_interrupted_then_rerun(tmp_path):
    state = {"cut": True}
    routes = {"/train.csv": lambda r: send_file(r, BIG, cut=1000 if state["cut"] else None)}
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with serve(app_from(routes)) as server:
        write_params(tmp_path, source=f"{server.url}/train.csv", test_file=None)
        before = old_raw(tmp_path)
        proc = run_stage(tmp_path, env={"TMPDIR": str(tmp)})
        assert error_line(proc) == (f"error: {server.url}/train.csv: the download was cut short "
                                    f"(1 attempt; the server announced {len(BIG)} bytes); "
                                    "run fetch again, or raise fetch.retries")
        assert snapshot(tmp_path) == before
        assert no_leftovers(tmp_path) == [] and list(tmp.iterdir()) == []

        state["cut"] = False  # the network is back: the rerun gets the whole file
        proc = run_stage(tmp_path, env={"TMPDIR": str(tmp)})
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "data/raw/train.csv").read_bytes() == BIG
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["raw"]
    assert no_leftovers(tmp_path) == [] and list(tmp.iterdir()) == []


def test_stage_checksum_mismatch(tmp_path):
    wrong = "0" * 64
    digest = hashlib.sha256(TRAIN).hexdigest()
    with serve(app_from({"/train.csv": lambda r: send_file(r, TRAIN)})) as server:
        write_params(tmp_path, source=f"{server.url}/train.csv", test_file=None, sha256=wrong)
        before = old_raw(tmp_path)
        proc = run_stage(tmp_path)
        assert error_line(proc) == (f"error: train.csv: sha256 is {digest} but fetch.sha256 pins "
                                    f"{wrong}; the source changed or the download is wrong: if the "
                                    "new file is right, pin its digest")
        assert snapshot(tmp_path) == before

        write_params(tmp_path, source=f"{server.url}/train.csv", test_file=None, sha256=digest)
        assert run_stage(tmp_path).returncode == 0
    assert (tmp_path / "data/raw/train.csv").read_bytes() == TRAIN


def test_stage_html_page(tmp_path):
    page = html_page("Google Drive - Quota exceeded",
                     '<p class="uc-error-subcaption">Too many users have viewed or downloaded '
                     'this file recently.</p>')
    with serve(app_from({"/d.zip": lambda r: send(r, 200, page, "text/html")})) as server:
        write_params(tmp_path, source=f"{server.url}/d.zip")
        before = old_raw(tmp_path)
        proc = run_stage(tmp_path)
    assert error_line(proc) == (
        f"error: {server.url}/d.zip: got an HTML page ('Too many users have viewed or downloaded "
        "this file recently.') instead of a CSV or archive: the file's download quota is used up: wait "
        "(up to 24 h), or copy it to your own Drive or another host and point fetch.source at the copy")
    assert snapshot(tmp_path) == before


def test_credentials_in_a_url_never_reach_the_output(tmp_path):
    routes = {"/ok.csv": lambda r: send_file(r, TRAIN)}
    with serve(app_from(routes)) as server:
        secret_ok = server.url.replace("://", "://bob:hunter2@") + "/ok.csv?token=t0psecret"
        write_params(tmp_path, source=secret_ok, test_file=None)
        done = run_stage(tmp_path)
        assert done.returncode == 0, done.stderr
        write_params(tmp_path, source=secret_ok.replace("/ok.csv", "/missing.csv"), test_file=None)
        failed = run_stage(tmp_path)
    assert "404" in error_line(failed)
    for output in (done.stdout, done.stderr, failed.stdout, failed.stderr):
        assert "hunter2" not in output and "t0psecret" not in output
    assert "token=***" in done.stdout and "***@" in error_line(failed)
