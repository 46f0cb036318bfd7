"""Outputs published atomically: a stage's folder or JSON file is either the old complete one or the new
one, never a mix."""
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_dir(final):
    """Yield a temp folder beside `final`; on success it replaces `final`, on error it is removed.

    A kill at any moment leaves either the old complete folder or the new one, never a mix.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the published folder should not be
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def write_json(path, data):
    """Write JSON through a temp file and rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


def size_of(path):
    """'3 files, 4.2 MB' for a folder, '1.3 kB' for a file."""
    path = Path(path)
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    total = sum(p.stat().st_size for p in files)
    size = next(f"{total / 10**e:.1f} {unit}" for e, unit in ((9, "GB"), (6, "MB"), (3, "kB"), (0, "bytes"))
                if total >= 10**e or e == 0)
    return f"{len(files)} file{'s' * (len(files) != 1)}, {size}" if path.is_dir() else size
