"""Small helpers the stages share: checked params, outputs published atomically, credentials kept
out of messages, the stage entry point (run_main), unpadded token ids as flat tensors. CSV files
are in stages/csvfiles.py, model resolution in stages/models.py."""
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

PARAMS_FILE = "params.yaml"


class PipelineError(Exception):
    """A problem the user can fix; the stage prints its message on one line and exits 1."""


KIND_NAMES = {int: "a whole number", float: "a number", str: "a string", bool: "true or false",
              dict: "a mapping", list: "a list", None: "null"}


@dataclass(frozen=True)
class Range:
    """The numbers a setting allows, for load_params: e.g. Range(0, 1, low_open=True, high_open=True)
    is above 0 and below 1; Range(1) is at least 1."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x):
        return ((x > self.low if self.low_open else x >= self.low)
                and (x < self.high if self.high_open else x <= self.high))

    def __str__(self):
        low = f"{'above' if self.low_open else 'at least'} {self.low:g}" if self.low > -math.inf else ""
        high = f"{'below' if self.high_open else 'at most'} {self.high:g}" if self.high < math.inf else ""
        return " and ".join(filter(None, [low, high]))


SEEDS = Range(0, 2**32 - 1)  # what numpy and scikit-learn take as a seed


def load_params(section, expected=None, path=PARAMS_FILE):
    """Return one section of params.yaml as a dict, checked against `expected` when given.

    `expected` maps each key to the kinds it accepts, e.g. {"epochs": (float, Range(0, low_open=True)),
    "batch_size": (int, "auto", Range(1)), "test_file": (str, None)}: a type, None, a literal
    string, and for numbers a Range. An unknown, missing, mistyped or out-of-range key is a
    one-line error naming it and what was expected.
    """
    with open(path, encoding="utf-8") as f:
        params = yaml.safe_load(f) or {}
    if section not in params:
        raise PipelineError(f"{path}: missing section {section!r}")
    values = dict(params[section] or {})
    if expected is None:
        return values
    unknown = [k for k in values if k not in expected]
    if unknown:
        raise PipelineError(f"{path}: unknown key {section}.{unknown[0]}; "
                            f"{section} takes {', '.join(expected)}")
    for key, kinds in expected.items():
        if key not in values:
            raise PipelineError(f"{path}: {section}.{key} is missing; expected {describe(kinds)}")
        values[key] = check_kind(values[key], kinds, f"{path}: {section}.{key}")
    return values


def describe(kinds):
    """What a params spec allows, in words: "a whole number at least 1 or 'auto'"."""
    limits = " ".join(str(k) for k in kinds if isinstance(k, Range))
    return " or ".join(repr(k) if isinstance(k, str) else KIND_NAMES[k] + (f" {limits}" if limits and k in (int, float) else "")
                       for k in kinds if not isinstance(k, Range))


def check_kind(value, kinds, name):
    """`value` if it is one of `kinds` (and inside their Range, if a number); numbers written as
    strings (YAML reads `1e-4` as a string) become floats where a number is expected."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    allowed = next((k for k in kinds if isinstance(k, Range)), Range())
    for kind in kinds:
        if (kind is None and value is None) or (isinstance(kind, str) and value == kind):
            return value
        number = None
        if kind is int and is_number and float(value).is_integer():
            number = int(value)
        elif kind is float and is_number:
            number = float(value)
        elif kind is float and isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if math.isfinite(number) and number in allowed:
                return number
            break  # a number out of range: say what the range is
        if kind in (str, bool, dict, list) and isinstance(value, kind):
            return value
    raise PipelineError(f"{name} must be {describe(kinds)}, not {value!r}")


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


URL_USERINFO_RE = re.compile(r"(?<=://)[^/\s@]+@")
SECRET_QUERY_RE = re.compile(
    r"(?<=[?&])((?:access_)?token|key|api_?key|sig|signature|secret|password|auth|"
    r"x-amz-credential|x-amz-signature|x-amz-security-token)=[^&\s#:'\"]+", re.IGNORECASE)


def redact(text):
    """`text` with credentials in URLs masked: user:password@ and token-like query values."""
    text = URL_USERINFO_RE.sub("***@", text)
    return SECRET_QUERY_RE.sub(lambda m: f"{m[1]}=***", text)


def stage_name(argv):
    """The stage a command line runs, as dvc.yaml names it: `python -m stages.train --fold 2` is train@2."""
    name = Path(argv[0]).stem
    if "--fold" in argv[1:-1]:
        name += "@" + argv[argv.index("--fold") + 1]
    return name


def size_of(path):
    """'3 files, 4.2 MB' for a folder, '1.3 kB' for a file."""
    path = Path(path)
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    total = sum(p.stat().st_size for p in files)
    size = next(f"{total / 10**e:.1f} {unit}" for e, unit in ((9, "GB"), (6, "MB"), (3, "kB"), (0, "bytes"))
                if total >= 10**e or e == 0)
    return f"{len(files)} file{'s' * (len(files) != 1)}, {size}" if path.is_dir() else size


def interactive():
    """Whether a person watches this process in a terminal (both output streams are one). Progress
    bars redraw one line with carriage returns: in a log file (`dvc queue logs`, `dvc repro > log`,
    CI) each would become one endless line, so stages print plain lines there instead."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def seconds_since_start():
    """Wall time since this process started, imports included (Linux: from /proc), else since
    this module was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - IMPORTED


IMPORTED = time.perf_counter()


def run_main(main, tool=None):
    """Run a stage's main(); a PipelineError becomes one line on stderr and exit code 1. When main
    returns the paths it wrote, a last line says what they hold and how long the stage took. A tool
    that drives the pipeline from outside (tool: its name, e.g. "tune") is not a stage run."""
    name = tool or stage_name(sys.argv)
    log = os.environ.get("PIPELINE_STAGE_LOG")
    if log and not tool:  # tests set this to see which stage commands really executed
        with open(log, "a", encoding="utf-8") as f:
            f.write(name + "\n")
    try:
        written = main()
    except PipelineError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        sys.exit(1)
    except FileNotFoundError as e:  # an input of an earlier stage: this one was run on its own
        print(f"error: {e.filename} does not exist: run the stages before {name} first (`dvc repro {name}` "
              "runs them)", file=sys.stderr)
        sys.exit(1)
    if written:
        outputs = "; ".join(f"{path} ({size_of(path)})" for path in written)
        print(f"{name}: wrote {outputs} in {seconds_since_start():.1f} s", flush=True)


def pack_sequences(sequences, labels, token_types=None):
    """Variable-length token ids as flat tensors: no padding stored, no pickle needed to load. Labels are
    class ids (int64), or floats (multi-label rows, regression targets); token_types, segment ids of
    text pairs, are stored the same way as the ids."""
    import torch  # here, not at the top: fetch and preprocess need no torch

    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat = [token for s in sequences for token in s]
    floats = any(isinstance(y, (float, list)) for y in labels)
    tensors = {"input_ids": torch.tensor(flat, dtype=torch.int32), "offsets": offsets,
               "labels": torch.tensor(labels, dtype=torch.float32 if floats else torch.int64)}
    if token_types is not None:
        tensors["token_type_ids"] = torch.tensor([t for s in token_types for t in s], dtype=torch.int32)
    return tensors


def unpack_sequences(tensors):
    """Inverse of pack_sequences: (list of token id lists, list of labels; -1 or NaN = no label)."""
    return unpack_flat(tensors, "input_ids"), tensors["labels"].tolist()


def unpack_flat(tensors, name):
    """The lists of one flat tensor of pack_sequences (input_ids, token_type_ids); None when absent."""
    if name not in tensors:
        return None
    ids, offsets = tensors[name].tolist(), tensors["offsets"].tolist()
    return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
