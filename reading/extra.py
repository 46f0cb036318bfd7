"""pretrain.extra_file: unlabelled texts of the competition's domain, which the pretrain stage adds to the
train and test texts. Checked whether pretraining is on or off, so a wrong path is said at once; and
light (no torch), so that the stage off imports nothing heavy."""
from pathlib import Path

from pipeline.settings import PipelineError
from reading.csvfiles import read_csv


def extra_files(path):
    """The files of pretrain.extra_file: the file itself, or the .csv and .txt files in a folder (sorted)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise PipelineError(f"params.yaml: pretrain.extra_file {path} does not exist: name a CSV file or a "
                            "folder of .csv/.txt files of unlabelled texts, or null")
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in (".csv", ".txt") and p.is_file())
    if not files:
        raise PipelineError(f"params.yaml: pretrain.extra_file {path} is a folder without .csv or .txt files")
    return files


def extra_texts(files, column):
    """The texts of the extra files: column `column` of each CSV, each line of each .txt file."""
    texts = []
    for path in files:
        if path.suffix.lower() == ".txt":
            texts += path.read_text(encoding="utf-8", errors="replace").splitlines()
            continue
        frame = read_csv(path)
        if column not in frame:
            raise PipelineError(f"{path} has no column {column!r} (pretrain.extra_column); its columns: "
                                f"{', '.join(map(repr, frame.columns))}")
        texts += frame[column].tolist()
    return texts
