"""Downloading with gdown: a URL, a Drive file or a Sheet, or the wanted files of a Drive
folder; 5xx/429 answers are retried with backoff, and every failure becomes a one-line error.
"""
import os
import posixpath
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import gdown
import requests
from gdown.exceptions import DownloadError

from fetching.archives import pick
from fetching.failures import explain_failure
from pipeline.command import redact
from pipeline.settings import PipelineError

RETRY_STATUS = {429, 500, 502, 503, 504}  # answers that often succeed on a later try


@dataclass(frozen=True)
class Net:
    timeout: float          # seconds without data before an attempt gives up
    retries: int            # extra attempts after a transient failure
    backoff: float = 1.0    # first wait before retrying a 5xx/429 answer; doubles each time
    cookies_file: str | None = None  # gdown saves Drive cookies here; keep it in a temp folder
    quiet: bool = False     # no progress bar: it would fill a log file (fetch logs each file once)

    def gdown_args(self):
        return dict(quiet=self.quiet, timeout=self.timeout, retries=self.retries,
                    cookies_file=self.cookies_file)


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
        gdown_args = dict(net.gdown_args(), quiet=net.quiet or redact(ref) != ref)
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
