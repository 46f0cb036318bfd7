"""pipeline/: params checked by kind and Range (load_params), and folders published atomically (atomic_dir)."""
import os

import pytest

from pipeline.outputs import atomic_dir
from pipeline.settings import PipelineError, load_params

TRAIN = {"epochs": (int,), "lr": (float,), "batch_size": (int, "auto"), "note": (str, None)}


def write(tmp_path, text):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


def test_load_params_checks_and_converts(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 2\n  lr: 1e-4\n  batch_size: auto\n  note: null\n")
    assert load_params("train", TRAIN, path=path) == {"epochs": 2, "lr": 1e-4, "batch_size": "auto", "note": None}


@pytest.mark.parametrize("body, message", [
    ("epochs: 2\n  lr: 0.1\n  batch_size: 8\n  note: x\n  lrr: 1",
     "params.yaml: unknown key train.lrr; train takes epochs, lr, batch_size, note"),
    ("epochs: two\n  lr: 0.1\n  batch_size: 8\n  note: x",
     "params.yaml: train.epochs must be a whole number, not 'two'"),
    ("epochs: 2.5\n  lr: 0.1\n  batch_size: 8\n  note: x",
     "params.yaml: train.epochs must be a whole number, not 2.5"),
    ("epochs: 2\n  lr: fast\n  batch_size: 8\n  note: x",
     "params.yaml: train.lr must be a number, not 'fast'"),
    ("epochs: 2\n  lr: 0.1\n  batch_size: max\n  note: x",
     "params.yaml: train.batch_size must be a whole number or 'auto', not 'max'"),
    ("epochs: true\n  lr: 0.1\n  batch_size: 8\n  note: x",
     "params.yaml: train.epochs must be a whole number, not True"),
    ("epochs: 2\n  lr: 0.1\n  note: x",
     "params.yaml: train.batch_size is missing; expected a whole number or 'auto'"),
])
def test_load_params_names_the_bad_key(tmp_path, body, message):
    path = write(tmp_path, "train:\n  " + body + "\n")
    with pytest.raises(PipelineError) as e:
        load_params("train", TRAIN, path=path)
    assert str(e.value) == str(path.parent / message)


def test_missing_section(tmp_path):
    with pytest.raises(PipelineError, match="missing section 'train'"):
        load_params("train", TRAIN, path=write(tmp_path, "model:\n  name: x\n"))


def test_atomic_dir_replaces_on_success_and_keeps_old_on_error(tmp_path):
    final = tmp_path / "out"
    final.mkdir()
    (final / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("killed")
    assert os.listdir(final) == ["old.txt"] and os.listdir(tmp_path) == ["out"]
    with atomic_dir(final) as tmp:
        (tmp / "new.txt").write_text("new")
    assert os.listdir(final) == ["new.txt"] and os.listdir(tmp_path) == ["out"]


def test_redact_masks_credentials_in_urls():
    from pipeline.command import redact
    text = ("failed: https://bob:s3cret@host/x.csv and https://h/f.csv?X-Amz-Signature=abc&x=1"
            " and http://h/?token=t0k#frag")
    assert redact(text) == ("failed: https://***@host/x.csv and https://h/f.csv?X-Amz-Signature=***&x=1"
                            " and http://h/?token=***#frag")
    assert redact("http://h/x.csv?token=t0k: the server answered 404") == \
        "http://h/x.csv?token=***: the server answered 404"
    assert redact("https://drive.google.com/uc?id=1abc&export=download") == \
        "https://drive.google.com/uc?id=1abc&export=download"


def test_model_params_warn_when_remote_code_is_trusted(tmp_path, monkeypatch, capsys):
    from modeling.models import model_params
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "model:\n  name: minilm\n  trust_remote_code: false\n")
    assert model_params() == {"name": "minilm", "trust_remote_code": False}
    assert capsys.readouterr().out == ""
    write(tmp_path, "model:\n  name: org/custom\n  trust_remote_code: true\n")
    assert model_params()["trust_remote_code"] is True
    assert "warning: model.trust_remote_code is true: loading 'org/custom' may run Python code" in capsys.readouterr().out
    write(tmp_path, "model:\n  name: minilm\n  trust_remote_code: yes please\n")
    with pytest.raises(PipelineError, match="model.trust_remote_code must be true or false, not 'yes please'"):
        model_params()
