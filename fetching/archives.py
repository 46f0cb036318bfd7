"""Archives and folders: an archive with any entry that would land outside the extraction
folder is refused whole, the rest is extracted; and finding a wanted file at the top of a
folder or one folder down.
"""
import posixpath
import re
import stat
import tarfile
import zipfile

from fetching.failures import shorten
from pipeline.settings import PipelineError


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
