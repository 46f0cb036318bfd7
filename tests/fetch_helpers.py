"""Shared helpers for the fetch tests: tiny CSVs, archives and a runner for the real stage."""
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest
import yaml

from pipeline.settings import PipelineError
from stages import fetch

REPO = Path(__file__).resolve().parents[1]
TRAIN = b"text,sentiment\ngood movie,positive\nbad movie,negative\n"
TEST = b"id,text\n1,fine movie\n"


def make_zip(entries):
    """Bytes of a zip holding {name: bytes}."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    return buf.getvalue()


def make_tgz(entries, links=()):
    """Bytes of a .tar.gz holding {name: bytes}, plus (name, target, kind) links (SYMTYPE/LNKTYPE)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        for name, target, kind in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            t.addfile(info)
    return buf.getvalue()


def write_params(folder, **fetch):
    """params.yaml in folder with the project's fetch section (short timeouts, no retries) and the
    preprocess columns, overridden: read from the project's params.yaml, so a new fetch key reaches
    these tests as it reaches a user."""
    project = yaml.safe_load((REPO / "params.yaml").read_text())
    params = {"fetch": {**project["fetch"], "timeout": 2, "retries": 0, **fetch},
              "preprocess": {key: project["preprocess"][key] for key in ("text_column", "label_column")}}
    (Path(folder) / "params.yaml").write_text(yaml.safe_dump(params))


def run_stage(folder, env=None, timeout=60):
    """Run `python -m stages.fetch` in folder; return the CompletedProcess."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "stages.fetch"], cwd=folder, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def error_line(proc):
    """The stage's one-line error (the last stderr line), checking it is one `error:` line."""
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def old_raw(folder):
    """Put an old complete data/raw in folder; return its contents for comparing later."""
    raw = Path(folder) / "data" / "raw"
    raw.mkdir(parents=True)
    (raw / "train.csv").write_bytes(b"text,sentiment\nold,positive\n")
    return snapshot(folder)


def snapshot(folder):
    """Every path under data/ with its bytes (None for folders)."""
    data = Path(folder) / "data"
    if not data.exists():
        return {}
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(data.rglob("*"))}


def expect_failure(folder, source, net, **options):
    """Run fetch.fetch_source into folder/data/raw over an old data/raw and return its error,
    after checking that data/ is unchanged and no temp file (download, .part, cookies) is left."""
    folder = Path(folder)
    before = old_raw(folder)
    private = folder / "tmp"
    private.mkdir()
    saved, tempfile.tempdir = tempfile.tempdir, str(private)  # where fetch makes its work folder
    try:
        with pytest.raises(PipelineError) as e:
            fetch.fetch_source(source, folder / "data" / "raw", net, **options)
    finally:
        tempfile.tempdir = saved
    assert snapshot(folder) == before
    assert list(private.iterdir()) == []
    return str(e.value)
