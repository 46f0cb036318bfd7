"""Where fetch.source points: the builtin corpus, a local file or folder, an http(s) URL, a
Google Drive file or folder, or a Google Sheet; and whether a fetched file is an archive.
"""
import os
import re
import urllib.parse

from fetching.builtin import BUILTIN
from fetching.checks import sniff
from pipeline.settings import PipelineError

ARCHIVES = {".zip": "zip", ".tar.gz": "tar", ".tgz": "tar"}
DRIVE_HOSTS = {"drive.google.com", "docs.google.com", "drive.usercontent.google.com"}
DRIVE_ID = re.compile(r"[-\w]{25,}")  # Drive ids are long url-safe strings


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


def archive_kind(name, head=b""):
    """zip, tar or None (a CSV) from the file name; a name without any suffix is sniffed."""
    low = name.lower()
    for suffix, kind in ARCHIVES.items():
        if low.endswith(suffix):
            return kind
    if "." not in low:  # e.g. a URL like .../download: only the bytes can tell
        return {"zip": "zip", "gzip": "tar"}.get(sniff(head))
    return None
