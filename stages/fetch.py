"""Fetch stage: put the raw CSVs in data/raw/ (train.csv, and test.csv and sample_submission.csv when
there are).

fetch.source is the builtin `tweets` corpus, a Google Drive file id or share link, a Drive
folder or Google Sheet link, an http(s) URL to a .csv or an archive (.zip, .tar.gz, .tgz),
or a local file or folder. Everything lands in a temp folder first and is checked (not an
HTML page, checksum, archive entries stay inside, CSV parses and has the columns); only
then is data/raw/ replaced, so a failed fetch leaves the old data/raw/ untouched.
"""
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

from fetching.archives import extract
from fetching.builtin import BUILTIN, write_builtin
from fetching.checks import check_csv, page_error, parse_pins, pick_files, record, sniff
from fetching.download import Net, download_drive_folder, download_file
from fetching.sources import archive_kind, parse_source
from pipeline.command import interactive, run_main
from pipeline.outputs import atomic_dir
from pipeline.settings import PipelineError, Range, check_kind, load_params
from reading.csvfiles import column_names

# not used here: the tests and users reach these as fetch.<name>

OUT = Path("data/raw")


def collect(source, work, net, train_file="train.csv", test_file="test.csv", sha256=None,
            text_column="text", label_column="sentiment", sample_submission_file=None):
    """Fetch `source` into the folder `work`; return {"train": path[, "test": path][, "sample_submission":
    path]}, all checked. text_column and label_column: a column name or a list of them (text pairs add
    theirs to text_column)."""
    kind, ref = parse_source(source)
    if kind == "builtin":
        train_file, test_file, sample_submission_file = "train.csv", "test.csv", None
    texts = text_column if isinstance(text_column, list) else [text_column]
    wanted = [("train", train_file, texts + (label_column if isinstance(label_column, list) else [label_column]))]
    if test_file:
        wanted.append(("test", test_file, texts))  # test sets may be unlabelled
    if sample_submission_file:
        wanted.append(("sample_submission", sample_submission_file, []))

    if kind == "builtin":
        label, path = BUILTIN, write_builtin(work / "builtin")
    elif kind == "local":
        label, path = ref, Path(ref)
        if not (path.is_file() or path.is_dir()):  # a device or a pipe: nothing to copy or list
            raise PipelineError(f"fetch.source {ref!r} is neither a regular file nor a folder")
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
            if test_file or sample_submission_file:
                raise PipelineError(f"{label} is a single CSV, so there is no {test_file or sample_submission_file}: "
                                    f"set fetch.{'test_file' if test_file else 'sample_submission_file'}: null, "
                                    f"or use a folder or archive holding {'both' if len(wanted) == 2 else 'all three'}")
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

    options are collect()'s: train_file, test_file, sha256, text_column, label_column, sample_submission_file.
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
                "sample_submission_file": (str, None), "sha256": (str, dict, None),
                "timeout": (float, Range(0, low_open=True)), "retries": (int, Range(0, 100))}


def main():
    params = load_params("fetch", FETCH_PARAMS)
    preprocess = load_params("preprocess")
    # the columns fetch checks each CSV for: the texts (and a pair's second texts), and train's labels
    kinds = {"text_column": (str, list), "text_pair_column": (str, list, None), "label_column": (str, list)}
    columns = {key: column_names(check_kind(preprocess.get(key), kind, f"params.yaml: preprocess.{key}"), key)
               for key, kind in kinds.items() if preprocess.get(key) is not None}
    net = replace(net_settings(params), quiet=not interactive())
    fetch_source(params["source"], OUT, net, train_file=params["train_file"], test_file=params["test_file"],
                 sha256=params["sha256"], text_column=columns["text_column"] + columns.get("text_pair_column", []),
                 label_column=columns["label_column"], sample_submission_file=params["sample_submission_file"])
    return [OUT]


if __name__ == "__main__":
    run_main(main)
