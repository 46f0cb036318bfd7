"""Checking what arrived, before anything is published: what a file's first bytes say it is
(an HTML page is a refusal, not data), the sha256 pins of fetch.sha256, and that each CSV
parses as preprocess reads it and has the columns.
"""
import hashlib
import re

from fetching.archives import list_files, pick
from fetching.failures import advice, page_text
from pipeline.settings import PipelineError
from reading.csvfiles import read_csv, require_columns


def sniff(head):
    """What a file's first bytes say it is: html, zip, gzip, binary or text."""
    start = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if start.startswith((b"<!doctype html", b"<html", b"<head", b"<body")):
        return "html"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if b"\x00" in head and not head.startswith((b"\xff\xfe", b"\xfe\xff")):  # UTF-16 has NULs
        return "binary"
    return "text"


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_pins(sha256, whole):
    """fetch.sha256 as {file name: hex}; a bare digest pins `whole`, the one file fetched."""
    if sha256 is None:
        return {}
    if isinstance(sha256, str):
        if whole is None:
            raise PipelineError("fetch.sha256 is one digest but the source is a folder; pin each "
                                "file instead, e.g. {train.csv: <digest>, test.csv: <digest>}")
        sha256 = {whole: sha256}
    if not isinstance(sha256, dict):
        raise PipelineError("fetch.sha256 must be null, one hex digest, or {file name: digest}")
    pins = {}
    for name, digest in sha256.items():
        pins[str(name)] = str(digest).strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", pins[str(name)]):
            raise PipelineError(f"fetch.sha256 for {name}: {digest!r} is not a sha256 digest "
                                "(64 hex characters)")
    return pins


def check_pin(name, digest, pins):
    want = pins.get(name)
    if want is not None and want != digest:
        raise PipelineError(f"{name}: sha256 is {digest} but fetch.sha256 pins {want}; the source "
                            "changed or the download is wrong: if the new file is right, pin its digest")


def page_error(head, what, expected):
    """The error for an HTML page where data was expected, quoting the page's message."""
    said = page_text(head.decode("utf-8", "replace"))
    return PipelineError(f"{what}: got an HTML page ({said!r}) instead of {expected}: {advice(said)}")


def check_csv(path, what, columns):
    """Check a file is a CSV with the columns, read as preprocess reads it (encoding and
    delimiter detected); bytes are published as they are, so only read."""
    with open(path, "rb") as f:
        head = f.read(4096)
    kind = sniff(head)
    if kind == "html":
        raise page_error(head, what, "a CSV")
    if kind != "text":
        raise PipelineError(f"{what}: not a CSV (it is a {kind} file); "
                            "fetch takes .csv files and .zip/.tar.gz/.tgz archives")
    df = read_csv(path, what)
    require_columns(df, columns, what, "set preprocess.text_column/preprocess.label_column to match the file")
    if df.empty:
        raise PipelineError(f"{what}: has a header but no rows")
    return len(df)


def record(name, path, origin, pins, digests):
    """Log one line per file (name, size, sha256, origin) and check its pin."""
    digest = sha256_of(path)
    print(f"fetch: {name}: {path.stat().st_size:,} bytes, sha256 {digest}, from {origin}", flush=True)
    check_pin(name, digest, pins)
    digests[name] = digest


def pick_files(folder, label, wanted, pins, digests):
    """Find, log, pin-check and column-check each wanted (role, name, columns) inside folder."""
    files = {}
    paths = list_files(folder)
    for role, name, columns in wanted:
        rel = pick(paths, name, label)
        files[role] = folder / rel
        record(name, files[role], f"{label}: {rel}", pins, digests)
        check_csv(files[role], f"{label}: {rel}", columns)
    return files
