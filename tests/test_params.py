"""Every key of params.yaml, given a value it does not allow, stops the stage that reads it before
that stage reads any data: exit code 1, one `error:` line naming the key, no traceback, nothing
written. Each case runs the stage's module as `python -m stages.<stage>` runs it (as __main__) in an
empty folder holding only the repository's params.yaml with that one value changed, in a process
forked from this one once it has imported the stages: importing torch and transformers, about 2 s a
process, was nearly all of a case's time (110 s for the table)."""
import importlib
import multiprocessing
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.settings import PipelineError, check_kind, describe

REPO = Path(__file__).resolve().parents[1]
NOT_A_BOOL = "maybe"
BOOLEANS = ["preprocess.drop_duplicates",
            "model.trust_remote_code", "train.group_by_length", "train.mixed_precision", "train.tf32",
            "train.fused_adamw", "machine.pin_memory", "train.freeze_embeddings", "train.compile",
            "train.keep_best", "train.gradient_checkpointing", "train.adamw_8bit", "distill.test_rows"]
# key: the values outside what it allows (zero, negative, too large, a wrong word or kind, as applies)
BAD_VALUES = {
    "fetch.source": [5], "fetch.train_file": [5], "fetch.test_file": [5], "fetch.sample_submission_file": [5],
    "fetch.sha256": [5],
    "fetch.timeout": [0, -1], "fetch.retries": [-1, 101, 1.5],
    "task.kind": ["regresion", 5], "task.label_separator": ["", " ", 5],
    "task.metric": ["f2", 5, "rmse"],  # rmse scores regression, not the default classification
    "preprocess.text_column": [5, [], ["a", "a"]], "preprocess.text_pair_column": [5, [], [1]],
    "preprocess.label_column": [["a"], 5],  # a list of 0/1 columns is multi-label, not classification
    "preprocess.id_column": [5],
    "preprocess.steps": ["lowercase", None, ["shout"], ["lowercase", "lowercase"], [5], [["lowercase"]]],
    "model.name": [5],
    "tokenize.max_length": [1, 0, "longest"], "tokenize.length_percentile": [0, 101],
    "tokenize.truncation": ["middle", 5, None], "tokenize.head_tokens": [0, 1.5, "half"], "tokenize.stride": [-1, 0.5],
    "cv.folds": [0, 3, [], [1, 2]],
    "split.val_size": [0, 1, -0.1], "split.seed": [-1, 2**32],
    "baseline.word_ngrams": [-1, 6, 1.5], "baseline.char_ngrams": [1, 9, -1], "baseline.max_features": [0],
    "baseline.min_df": [0], "baseline.regularization": [0, -1, "strong"], "baseline.seed": [-1, 2**32],
    "train.epochs": [0, -1], "train.batch_size": [0, "max", 7], "train.effective_batch_size": [0],
    "train.lr": [0, 2, "fast"], "train.weight_decay": [-0.1, 1.5], "train.warmup_ratio": [1, -0.1],
    "train.max_grad_norm": [-1], "train.seed": [-1, 2**32], "machine.loader_workers": [-1],
    "machine.checkpoint_steps": [0, 2.5], "machine.checkpoint_minutes": [0, -1], "machine.checkpoint_dir": [5, None],
    "train.num_processes": [0], "train.dropout": [1, -0.1, "none"],
    "train.evaluations": [0, "epochs"], "train.compile": [1, "auto"],
    "train.patience": [0, 1.5, "auto"], "train.lora_rank": [-1, 1.5, "auto"], "train.lora_alpha": [0, -1],
    "train.lora_modules": ["query", [], [5]], "train.load_in_4bit": ["yes", 4, None],
    "train.layer_lr_decay": [0, 1.5], "train.head_lr_multiple": [0, 2000], "train.reinit_layers": [-1, 1.5],
    "train.averaging": ["mean"], "train.average_decay": [1, -0.1], "train.average_from": [1, -0.1],
    "train.adversarial": ["pgd"], "train.adversarial_from": [-1], "train.fgm_epsilon": [0], "train.awp_lr": [0],
    "train.awp_eps": [-0.01], "train.class_weights": ["equal", 5, [1, 2]], "train.focal_gamma": [-1, 11],
    "train.loss": ["huber", 5, "mse"],  # mse trains regression, not the default classification
    "pretrain.epochs": [-1, "some"], "pretrain.lr": [0, 2], "pretrain.batch_size": [0, 1.5],
    "pretrain.max_length": [1, 1.5], "pretrain.mask_probability": [0, 1, 1.5], "pretrain.held_out": [0, 0.6],
    "pretrain.extra_file": [5, "missing.csv"], "pretrain.extra_column": [5], "pretrain.seed": [-1, 2**32],
    "tune.study": ["a/b", 5], "tune.trials": [0], "tune.metric": ["val.f2", 5], "tune.direction": ["up"],
    "pseudo.folds": [0, "all"], "pseudo.labels": ["medium", 5], "pseudo.threshold": [0.4, 1.5], "pseudo.share": [0, 1.5],
    "pseudo.seed": [-1], "distill.students": [5, ["small"]], "distill.epochs": [0], "distill.lr": [0, 2],
    "distill.speed_rows": [0, 1.5], "evaluate.submit": [5],
    "tune.seed": [-1], "tune.pruner": ["always"], "tune.pruner_startup": [-1, 101, 1.5], "tune.evaluations": [0], "tune.heartbeat": [0, 3601],
    "tune.storage": [5, "postgresql://tuner:hunter2@db/studies"],
    "tune.space": [{}, {"train.nope": {"low": 1, "high": 2}}, {"train.lr": {"low": 0.1, "high": 0.01}}],
    **{key: [NOT_A_BOOL] for key in BOOLEANS},
}
# the module that checks each section first (dvc.yaml lists every stage that reads it; python -m tune
# reads the tune section, which no stage does)
MODULE_OF = {"fetch": "stages.fetch", "task": "stages.preprocess", "preprocess": "stages.preprocess", "model": "stages.tokenize",
             "tokenize": "stages.tokenize", "cv": "stages.split", "split": "stages.split", "baseline": "stages.baseline", "pretrain": "stages.pretrain", "train": "stages.train",
             "machine": "stages.train", "tune": "tune", "pseudo": "stages.pseudo", "distill": "stages.distill",
             "evaluate": "stages.evaluate"}


def params_keys():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    return {f"{section}.{key}" for section, values in params.items() for key in values}


def test_every_key_has_bad_values():
    assert set(BAD_VALUES) == params_keys()


def run_stage_with(tmp_path, key, value):
    section, name = key.split(".")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params[section][name] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", MODULE_OF[section]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def run_module_in(folder, module, args=()):
    """The child: `python -m module *args` in folder, its output to files there (read, then removed, by the parent)."""
    os.chdir(folder)
    for fd, name in ((1, ".stdout"), (2, ".stderr")):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)  # not pytest's capture
    sys.argv = [module, *args]
    # pytest's import hook claims every *_test.py (stages/predict_test.py) and cannot hand runpy its code
    sys.meta_path[:] = [finder for finder in sys.meta_path if type(finder).__name__ != "AssertionRewritingHook"]
    for name in (module, f"{module}.__main__"):  # imported by the parent: run afresh, as python -m does
        sys.modules.pop(name, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)  # a SystemExit's code is the exit code


def run_stage_forked(tmp_path, key, value):
    """run_stage_with's CompletedProcess, from a fork of this process."""
    section, name = key.split(".")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params[section][name] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    child = multiprocessing.get_context("fork").Process(target=run_module_in, args=(str(tmp_path), MODULE_OF[section]))
    child.start()
    child.join(timeout=120)
    output = {}
    for stream in ("stdout", "stderr"):
        path = tmp_path / f".{stream}"
        output[stream] = path.read_text()
        path.unlink()
    return subprocess.CompletedProcess([MODULE_OF[section]], child.exitcode, output["stdout"], output["stderr"])


CASES = [(key, value) for key, values in BAD_VALUES.items() for value in values]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(key, repr(value)): (its folder, the finished stage)} for every case."""
    for module in set(MODULE_OF.values()):  # imported once, here; each case's process is a fork of this one
        importlib.import_module(f"{module}.__main__" if module == "tune" else module)
    runs = {}
    for key, value in CASES:  # one at a time
        folder = tmp_path_factory.mktemp("params")
        runs[key, repr(value)] = folder, run_stage_forked(folder, key, value)
    return runs


@pytest.mark.parametrize("key, value", CASES)
def test_a_value_out_of_range_stops_the_stage_with_one_line(runs, key, value):
    tmp_path, result = runs[key, repr(value)]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: params.yaml: ") and key in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"], "the stage wrote something"


def test_the_error_says_what_is_allowed(tmp_path):
    assert run_stage_with(tmp_path, "train.lr", 0).stderr == (
        "error: params.yaml: train.lr must be a number above 0 and at most 1 or 'auto', not 0\n")
    assert run_stage_with(tmp_path, "tokenize.max_length", "longest").stderr == (
        "error: params.yaml: tokenize.max_length must be a whole number at least 2 or 'auto', not 'longest'\n")
    assert run_stage_with(tmp_path, "preprocess.steps", ["lowercase", "shout"]).stderr == (
        "error: params.yaml: preprocess.steps must be a list of step names, each at most once, from unescape_html, "
        "lowercase, replace_urls, replace_mentions, normalize_whitespace; not ['lowercase', 'shout']\n")
    assert run_stage_with(tmp_path, "train.batch_size", 7).stderr == (
        "error: params.yaml: train.batch_size 7 does not divide the 32 examples each process takes per "
        "optimizer step (train.effective_batch_size / train.num_processes): use auto or one of 1, 2, 4, 8, 16, 32\n")


# ---- what the [brackets] of params.yaml say, against the checks ---------------------------------

NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


def specs():
    """{section.key: the kinds load_params checks it against}, from the modules that check each section."""
    from modeling.models import MODEL_PARAMS
    from stages.baseline import BASELINE_PARAMS
    from stages.distill import DISTILL_PARAMS
    from stages.evaluate import EVALUATE_PARAMS
    from stages.fetch import FETCH_PARAMS
    from stages.preprocess import PREPROCESS_PARAMS
    from stages.pretrain import PRETRAIN_PARAMS
    from stages.pseudo import PSEUDO_PARAMS
    from stages.split import CV_PARAMS, SPLIT_PARAMS
    from stages.tokenize import TOKENIZE_PARAMS
    from tasks.shapes import TASK_PARAMS
    from training.settings import MACHINE_PARAMS, TRAIN_PARAMS
    from tune.settings import TUNE_PARAMS

    sections = {"fetch": FETCH_PARAMS, "task": TASK_PARAMS, "preprocess": PREPROCESS_PARAMS, "model": MODEL_PARAMS,
                "tokenize": TOKENIZE_PARAMS, "cv": CV_PARAMS, "split": SPLIT_PARAMS, "train": TRAIN_PARAMS,
                "machine": MACHINE_PARAMS, "tune": TUNE_PARAMS, "baseline": BASELINE_PARAMS,
                "pretrain": PRETRAIN_PARAMS, "pseudo": PSEUDO_PARAMS, "distill": DISTILL_PARAMS, "evaluate": EVALUATE_PARAMS}
    return {f"{section}.{key}": kinds for section, spec in sections.items() for key, kinds in spec.items()}


def balanced(text):
    """The [bracketed] text that `text` starts with (brackets inside it kept), without the outer pair."""
    depth = 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth == 0:
            return text[1:i]
    raise AssertionError(f"an unclosed bracket: {text!r}")


def brackets(path=REPO / "params.yaml"):
    """{section.key: its [brackets]' text or None}: the key's own comment when it starts with "[", else
    the comment lines above it from the one that starts with "# [" (lines joined by spaces)."""
    found, section, block = {}, None, []
    for line in path.read_text().splitlines():
        if re.match(r"^\w+:", line):
            section, block = line.split(":")[0], []
        elif re.match(r"^  #", line):
            block.append(line.strip()[1:].strip())
        elif key := re.match(r"^  (\w+):", line):
            inline = line.split(" # ", 1)[1].strip() if " # " in line else ""
            starts = [i for i, text in enumerate(block) if text.startswith("[")]
            text = inline if inline.startswith("[") else " ".join(block[starts[0]:]) if starts else ""
            found[f"{section}.{key.group(1)}"] = balanced(text) if text else None
            block = []
    return found


def accepts(value, kinds):
    try:
        check_kind(value, kinds, "key")
        return True
    except PipelineError:
        return False


def numeric_bounds(text):
    """(low, low_open, high, high_open) that a bracket's text states before any ';' (None: not stated)."""
    text = text.split(";")[0]
    low = high = None
    low_open = high_open = False
    if m := re.search(rf"\babove ({NUMBER})", text):
        low, low_open = float(m[1]), True
    if m := re.search(rf"\b(?:at least ({NUMBER})|({NUMBER}) or more)", text):
        low = float(m[1] or m[2])
    if m := re.search(rf"\bat most ({NUMBER})", text):
        high = float(m[1])
    if m := re.search(rf"(?<!to )\bbelow ({NUMBER})", text):
        high, high_open = float(m[1]), True
    if m := re.search(rf"(?<![\w-])({NUMBER}) to (below )?({NUMBER}\b)?", text):
        low = float(m[1])
        if m[3]:
            high, high_open = float(m[3]), bool(m[2])
    return low, low_open, high, high_open


def test_numeric_bounds_read_the_brackets_words():
    assert numeric_bounds("0 to 1") == (0, False, 1, False)
    assert numeric_bounds("above 0, at most 100") == (0, True, 100, False)
    assert numeric_bounds("model, or 0 to below 1") == (0, False, 1, True)
    assert numeric_bounds("above 0, below 1") == (0, True, 1, True)
    assert numeric_bounds("null, or 1 or more") == (1, False, None, False)
    assert numeric_bounds("auto, or 2 to the model's limit (512 for BERT)") == (2, False, None, False)
    assert numeric_bounds("1 or more; on GPUs at most their number") == (1, False, None, False)
    assert numeric_bounds("true/false") == (None, False, None, False)


def bracket_disagreements(key, text, kinds):
    """What `text`, a key's [brackets], says that load_params' check (`kinds`) does not do."""
    wrong = []
    words = {"null": None, "true": True, "false": False}
    if (text == "true/false") != (kinds == (bool,)):
        wrong.append(f"says [{text}], checked as {describe(kinds)}")
    for literal in (k for k in kinds if isinstance(k, str)):
        if not re.search(rf"(?<![\w.]){re.escape(literal)}(?![\w.])", text):
            wrong.append(f"[{text}] does not name {literal!r}, which is allowed")
    if None in kinds and "null" not in text:
        wrong.append(f"[{text}] does not say null, which is allowed")
    items = [item.strip() for item in re.split(r",|;| or (?!more)", text)]
    for item in items:  # a list's brackets may name its items (preprocess.steps: test_the_steps_brackets_name_every_step)
        named = words.get(item, item)
        if re.fullmatch(r"[a-z][a-z0-9_]*", item) and not accepts(named, kinds) and not accepts([named], kinds):
            wrong.append(f"[{text}] names {item!r}, which is refused")
    numeric = [k for k in kinds if k in (int, float)]
    if not numeric or list in kinds:
        return wrong
    step = 1 if numeric == [int] else 1e-6
    low, low_open, high, high_open = numeric_bounds(text)
    probes = []  # (value, accepted by what the bracket says)
    if low is not None:
        probes += [(low, not low_open), (low - step, False), (low + step, True)]
        if high is None:
            probes.append((low + 10**6, True))
    if high is not None:
        probes += [(high, not high_open), (high + step, False), (high - step, True), (high + 0.5 if step < 1 else high + 1, False)]
    for value, allowed in probes:
        value = int(value) if numeric == [int] else value
        if accepts(value, kinds) != allowed:
            wrong.append(f"[{text}] {'allows' if allowed else 'refuses'} {value!r}, the check {'refuses' if allowed else 'allows'} it")
    return wrong


def test_the_steps_brackets_name_every_step():
    from reading.cleaning import STEPS

    assert brackets()["preprocess.steps"] == "a list of step names: " + ", ".join(STEPS)


def test_every_key_says_in_brackets_what_its_check_allows():
    """Each key's [brackets] in params.yaml against the kinds and Range load_params checks it with: a
    [0 to 1] key takes 0 and 1 and refuses -1e-6 and 1.5, [above 0] refuses 0, [true/false] is a switch,
    a word it names is taken, a word it allows (auto, null) is named."""
    found, checked = brackets(), specs()
    assert set(found) == set(checked) == params_keys()
    assert [key for key, text in found.items() if text is None] == [], "keys without [brackets] in params.yaml"
    wrong = {key: problems for key, text in found.items() if (problems := bracket_disagreements(key, text, checked[key]))}
    assert wrong == {}
