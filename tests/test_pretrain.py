"""The pretrain stage: masked-language-model pretraining on the competition's texts. Unit tests of its pure
parts (training/mlm.py: the corpus, the held-out split, the masks, the loss; training/pretrained.py), its
settings stopping it in one line before any work, its off switch writing the same bytes whatever the data,
and one small end-to-end run of the real `dvc` CLI on the tiny data and BERT: the held-out loss falls, a
change of train.* or cv.folds leaves it cached, and a killed run resumes from its checkpoint."""
import json
import math
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file
from transformers import BertForMaskedLM, BertModel, TrainingArguments

from pipeline.settings import PipelineError
from reading import extra
from stages import pretrain
from tests.test_pipeline import REPO, dvc, init_pipeline_repo, set_params, stage_env
from training import checkpoint, mlm
from training.pretrained import start_model

OFF = b'{\n  "pretrained": false\n}\n'
# 342 texts to train on, 11 optimizer steps an epoch: the random tiny BERT learns the few words of the
# tiny data fast (held-out MLM loss 10.4 -> 5.3 here)
E2E_PARAMS = dict(pretrain__epochs=3, pretrain__lr=3e-3, pretrain__batch_size=32)


# ---- the pure parts ----------------------------------------------------------------------------

def test_the_corpus_is_every_distinct_text_of_train_test_pairs_and_extra_in_order():
    train = pd.DataFrame({"text": ["a b", "c d", "a b", "  "], "text_pair": ["e", "a b", "f", "g"], "label": "x"})
    test = pd.DataFrame({"text": ["h", "c d"], "id": ["1", "2"]})
    assert mlm.corpus([train, test], ["i", "h", ""]) == ["a b", "c d", "e", "f", "g", "h", "i"]
    assert mlm.corpus([test]) == ["h", "c d"]


def test_extra_texts_are_a_csv_column_and_the_lines_of_txt_files(tmp_path):
    folder = tmp_path / "extra"
    (folder / "more").mkdir(parents=True)
    pd.DataFrame({"body": ["x y", "z"], "n": ["1", "2"]}).to_csv(folder / "a.csv", index=False)
    (folder / "more" / "b.txt").write_text("first line\nsecond line\n")
    (folder / "notes.md").write_text("not read")
    files = extra.extra_files(folder)
    assert [p.name for p in files] == ["a.csv", "b.txt"]
    assert extra.extra_texts(files, "body") == ["x y", "z", "first line", "second line"]
    assert extra.extra_files(folder / "a.csv") == [folder / "a.csv"]
    with pytest.raises(PipelineError, match=r"a\.csv has no column 'text' \(pretrain\.extra_column\); its columns: 'body', 'n'$"):
        extra.extra_texts(files, "text")
    with pytest.raises(PipelineError, match=r"^params\.yaml: pretrain\.extra_file \S+/nothing\.csv does not exist"):
        extra.extra_files(tmp_path / "nothing.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipelineError, match="a folder without .csv or .txt files"):
        extra.extra_files(tmp_path / "empty")


def test_the_held_out_split_is_disjoint_complete_and_drawn_by_the_seed():
    trained, held = mlm.held_out_split(200, 0.05, seed=3)
    assert len(held) == 10 and len(trained) == 190
    assert not set(trained) & set(held) and set(trained) | set(held) == set(range(200))
    again, _ = mlm.held_out_split(200, 0.05, seed=3)
    other, _ = mlm.held_out_split(200, 0.05, seed=4)
    assert list(again) == list(trained) and list(other) != list(trained)
    assert [len(part) for part in mlm.held_out_split(2, 0.05, seed=0)] == [1, 1]  # at least one of each
    assert [len(part) for part in mlm.held_out_split(3, 0.5, seed=0)] == [1, 2]


def test_the_held_out_masks_are_fixed_by_the_seed_and_mask_the_share_asked(tokenizer):
    from tests.conftest import make_rows

    sequences = tokenizer(make_rows(300, seed=1)["text"].tolist())["input_ids"]
    batches = mlm.masked_once(tokenizer, sequences, 0.15, seed=0, batch_size=64)
    assert len(batches) == 5
    again = mlm.masked_once(tokenizer, sequences, 0.15, seed=0, batch_size=64)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(batches, again) for k in ("input_ids", "labels"))
    other = mlm.masked_once(tokenizer, sequences, 0.15, seed=1, batch_size=64)
    assert not torch.equal(batches[0]["labels"], other[0]["labels"])
    originals = [torch.tensor(ids) for ids in sequences]
    chosen = maskable = replaced = 0
    for i, batch in enumerate(batches):
        for row, (ids, labels) in enumerate(zip(batch["input_ids"], batch["labels"])):
            original = originals[64 * i + row]
            masked = labels[:len(original)] != -100
            assert (labels[len(original):] == -100).all()  # padding never
            special = torch.tensor([t in tokenizer.all_special_ids for t in original.tolist()])
            assert not (masked & special).any()  # [CLS] and [SEP] never
            assert torch.equal(labels[:len(original)][masked], original[masked])  # the label is the token masked
            chosen += int(masked.sum())
            maskable += int((~special).sum())
            replaced += int((ids[:len(original)][masked] == tokenizer.mask_token_id).sum())
    assert maskable > 3000
    assert abs(chosen / maskable - 0.15) < 0.03  # about 4.5 standard deviations
    assert abs(replaced / chosen - 0.8) < 0.1
    assert mlm.masked_count(batches) == chosen


class FixedLogits(torch.nn.Module):
    """A stand-in model: the logits given for each batch, in turn."""

    def __init__(self, logits):
        super().__init__()
        self.logits = list(logits)

    def forward(self, input_ids, attention_mask):
        return SimpleNamespace(logits=self.logits.pop(0))


def test_the_held_out_loss_is_the_mean_over_masked_tokens_whatever_the_batches():
    rng = np.random.default_rng(0)
    logits = [rng.normal(size=(2, 3, 5)), rng.normal(size=(1, 4, 5))]
    labels = [np.array([[-100, 2, -100], [-100, -100, -100]]), np.array([[0, 4, -100, 1]])]
    batches = [{"input_ids": torch.zeros(y.shape, dtype=torch.long), "attention_mask": torch.ones(y.shape, dtype=torch.long),
                "labels": torch.tensor(y)} for y in labels]
    # by hand: -log softmax of the true class at each of the 4 masked tokens, averaged
    losses = [np.log(np.exp(x[b, t]).sum()) - x[b, t, y[b, t]]
              for x, y in zip(logits, labels) for b, t in zip(*np.nonzero(y != -100))]
    scores = mlm.held_out_scores(FixedLogits(torch.tensor(x, dtype=torch.float32) for x in logits), batches)
    assert scores["loss"] == pytest.approx(np.mean(losses), abs=1e-4)
    assert scores["perplexity"] == pytest.approx(math.exp(np.mean(losses)), rel=1e-3)


def masked_batches(tokenizer, seed=0):
    texts = ["the cat sat on the mat", "a storm is coming to the coast tonight", "fire", "no news today at all"]
    return mlm.masked_once(tokenizer, tokenizer(texts)["input_ids"], 0.3, seed, batch_size=4)


def trained_weights(model_dir, tokenizer, tmp_path, masked_only):
    """The tiny BERT's weights after 3 steps of the pretrain stage's Trainer, which scores the masked tokens
    only (masked_only) or every token (its head None: the model's own forward and loss)."""
    torch.manual_seed(0)  # the new MLM head
    lm = BertForMaskedLM.from_pretrained(model_dir)
    head = mlm.masked_lm_head(lm) if masked_only else None
    texts = [f"tweet number {i} about fire and floods in the city" for i in range(12)]
    args = TrainingArguments(output_dir=str(tmp_path / f"out-{masked_only}"), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=1e-3, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
                             seed=0)
    trainer = mlm.MaskedTokensTrainer(model=lm, head=head, args=args,
                                      train_dataset=[{"input_ids": ids} for ids in tokenizer(texts)["input_ids"]],
                                      data_collator=mlm.BatchSeededMasking(tokenizer, 0.3, 0))
    scored = []  # tokens the head scored at each call: a 2-d input is the masked tokens alone
    lm.cls.register_forward_hook(lambda module, inputs, output: scored.append(tuple(inputs[0].shape[:-1])))
    trainer.train()
    return {name: value.detach().clone() for name, value in lm.state_dict().items()}, scored


def test_scoring_only_the_masked_tokens_trains_the_same_weights_as_the_models_own_loss(tiny_model_dir, tokenizer, tmp_path):
    lm = BertForMaskedLM.from_pretrained(tiny_model_dir)
    assert mlm.masked_lm_head(lm) is lm.cls
    batch = masked_batches(tokenizer)[0]
    scores, labels = mlm.masked_token_scores(lm, lm.cls, batch)
    assert len(labels) == int((batch["labels"] != -100).sum()) > 0
    # the same loss as the model's own forward over every token, and the same gradients
    own = lm(**batch).loss
    own.backward()
    own_grads = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}
    lm.zero_grad()
    torch.nn.functional.cross_entropy(scores, labels).backward()
    assert torch.nn.functional.cross_entropy(scores, labels).item() == pytest.approx(own.item(), abs=1e-5)
    # within fp32 rounding of the tensor's own scale: the two losses sum the same terms in another order
    # (seen: 1.4e-6 apart in a position embedding's gradient whose largest entry is ~1e-2, on an AMD EPYC)
    for name, grad in own_grads.items():
        torch.testing.assert_close(dict(lm.named_parameters())[name].grad, grad, rtol=1e-4,
                                   atol=1e-6 + 1e-4 * float(grad.abs().max()), msg=lambda m: f"{name}: {m}")
    # through the stage's Trainer: 3 steps each way reach the same weights
    masked_only, scored_masked = trained_weights(tiny_model_dir, tokenizer, tmp_path, True)
    every_token, scored_every = trained_weights(tiny_model_dir, tokenizer, tmp_path, False)
    assert len(scored_masked) == len(scored_every) == 3
    assert all(len(shape) == 1 for shape in scored_masked), scored_masked  # (masked tokens,)
    assert all(len(shape) == 2 for shape in scored_every), scored_every  # (texts, tokens)
    assert sum(n for n, in scored_masked) < sum(a * b for a, b in scored_every) / 2
    for name, weight in every_token.items():
        torch.testing.assert_close(masked_only[name], weight, rtol=1e-4, atol=1e-5, msg=name)
    assert not torch.equal(masked_only["cls.predictions.transform.dense.weight"],
                           BertForMaskedLM.from_pretrained(tiny_model_dir).cls.predictions.transform.dense.weight)


class MixingHead(torch.nn.Module):
    """A head whose score at a token reads the others (their mean): scored on the masked tokens alone it
    would see other neighbours than in the model's forward."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, hidden):
        return self.head(hidden + hidden.mean(dim=-2, keepdim=True))


def test_a_head_that_reads_other_tokens_is_found_out_and_the_model_scores_every_token(tiny_model_dir, tokenizer):
    lm = BertForMaskedLM.from_pretrained(tiny_model_dir)
    batch = masked_batches(tokenizer)[0]
    assert mlm.head_reads_each_token_alone(lm, lm.cls, batch)
    lm.cls = MixingHead(lm.cls)
    assert mlm.masked_lm_head(lm) is lm.cls
    assert not mlm.head_reads_each_token_alone(lm, lm.cls, batch)
    lm.extra = torch.nn.Linear(2, 2)  # two modules besides the encoder (ModernBERT's head and decoder): none taken
    assert mlm.masked_lm_head(lm) is None


def test_the_saved_encoder_keeps_the_checkpoints_pooler(tiny_model_dir):
    lm = BertForMaskedLM.from_pretrained(tiny_model_dir)  # built without the pooler
    with torch.no_grad():
        lm.bert.encoder.layer[0].output.dense.weight.add_(1.0)  # as if trained
    saved = mlm.with_pooler(lm, BertModel.from_pretrained(tiny_model_dir))
    original = BertModel.from_pretrained(tiny_model_dir)
    assert torch.equal(saved.pooler.dense.weight, original.pooler.dense.weight)
    assert torch.equal(saved.encoder.layer[0].output.dense.weight, lm.bert.encoder.layer[0].output.dense.weight)


def test_start_model_is_the_pretrained_folder_only_when_it_pretrained(tmp_path):
    folder = tmp_path / "pretrained"
    assert start_model("minilm", folder) == "minilm"  # not there (a stage run on its own)
    folder.mkdir()
    (folder / "pretrained.json").write_bytes(OFF)
    assert start_model("minilm", folder) == "minilm"
    (folder / "pretrained.json").write_text(json.dumps({"pretrained": True, "model": "minilm"}))
    assert start_model("minilm", folder) == str(folder)


def test_pretrain_checkpoints_sit_beside_the_folds():
    assert checkpoint.folder(2, "cp") == checkpoint.root("cp") / "fold-2"


# ---- the stage's settings, before any work -----------------------------------------------------

def write_params(folder, **changes):
    """The repository's params.yaml in folder, with section__key=value changes."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        params[section][key] = value
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture
def no_model(monkeypatch):
    """The stage must stop (or finish, when off) before it loads a model: loading one fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(transformers.AutoModelForMaskedLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def test_off_writes_the_same_bytes_whatever_the_data_and_loads_nothing(tmp_path, monkeypatch, no_model):
    write_params(tmp_path)  # pretrain.epochs 0, the default; no data at all
    monkeypatch.chdir(tmp_path)
    assert pretrain.main() == [pretrain.PRETRAINED, pretrain.METRICS]
    assert (tmp_path / "models/pretrained/pretrained.json").read_bytes() == OFF
    assert (tmp_path / "reports/pretrain/metrics.json").read_bytes() == OFF
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "models/pretrained/pretrained.json", "params.yaml", "reports/pretrain/metrics.json"]


def test_off_the_stage_imports_neither_torch_nor_transformers(tmp_path):
    # seconds of imports in every `dvc repro` of a new project, for two small files
    write_params(tmp_path)
    loaded = subprocess.run([sys.executable, "-c", "import runpy, sys; runpy.run_module('stages.pretrain', "
                             "run_name='__main__'); print(sorted({'torch', 'transformers', 'peft'} & set(sys.modules)))"],
                            cwd=tmp_path, env={**stage_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.splitlines()[-1] == "[]", loaded.stdout
    assert (tmp_path / "models/pretrained/pretrained.json").read_bytes() == OFF


@pytest.mark.parametrize("changes, message", [
    (dict(pretrain__mask_probability=1.5), "params.yaml: pretrain.mask_probability must be a number above 0 and below 1, not 1.5"),
    (dict(pretrain__held_out=0), "params.yaml: pretrain.held_out must be a number above 0 and at most 0.5, not 0"),
    (dict(pretrain__extra_file="missing.csv"), "params.yaml: pretrain.extra_file missing.csv does not exist"),
], ids=["mask_probability", "held_out", "extra_file"])
def test_a_bad_setting_stops_the_stage_before_any_work(tmp_path, monkeypatch, no_model, changes, message):
    write_params(tmp_path, pretrain__epochs=1, **changes)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError) as error:
        pretrain.main()
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    assert [p.name for p in tmp_path.iterdir()] == ["params.yaml"]


def test_an_extra_csv_without_the_column_is_one_line_naming_file_column_and_columns(tmp_path):
    pd.DataFrame({"body": ["a text"], "source": ["web"]}).to_csv(tmp_path / "extra.csv", index=False)
    write_params(tmp_path, pretrain__epochs=1, pretrain__extra_file="extra.csv")
    env = dict(stage_env(), PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-m", "stages.pretrain"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == ("error: extra.csv has no column 'text' (pretrain.extra_column); its columns: "
                             "'body', 'source'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra.csv", "params.yaml"]


# ---- end to end: the real dvc CLI ----------------------------------------------------------------

def repro_pretrain(cwd):
    """`dvc repro pretrain`: (the stages it ran or restored from the run cache, its log)."""
    result = dvc("repro", "pretrain", cwd=cwd)
    ran = re.findall(r"Running stage '([^']+)'|Stage '([^']+)' is cached - skipping run", result.stdout)
    return {running or cached for running, cached in ran}, result.stdout + result.stderr


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    """A pipeline repo after `dvc repro pretrain` with pretraining on; yields (repo, stages run, log)."""
    repo = init_pipeline_repo(tmp_path_factory.mktemp("pretrain"), tiny_data_dir, tiny_model_dir, **E2E_PARAMS)
    ran, log = repro_pretrain(repo)
    yield repo, ran, log


def test_pretraining_lowers_the_held_out_loss_and_keeps_the_pooler(repo, tiny_model_dir):
    repo, ran, log = repo
    assert ran == {"fetch", "preprocess", "pretrain"}
    metrics = json.loads((repo / "reports/pretrain/metrics.json").read_text())
    loss = metrics["mlm_loss"]
    assert loss["after"] < loss["before"] - 1, metrics
    assert metrics["texts"] == {"trained": 342, "held_out": 18, "extra": 0}  # 360 distinct train + test texts
    assert re.search(rf"^pretrain: MLM loss on 18 held-out texts {loss['before']:.2f} -> {loss['after']:.2f} "
                     r"\(perplexity [\d.]+ -> [\d.]+\) in \d+ s$", log, re.M), log
    assert "Traceback" not in log and "\r" not in log
    assert "the masked-LM head scores the masked tokens only" in log, log
    assert json.loads((repo / "models/pretrained/pretrained.json").read_text())["pretrained"] is True
    assert start_model("minilm", repo / "models/pretrained") == str(repo / "models/pretrained")
    saved, original = load_file(repo / "models/pretrained/model.safetensors"), load_file(tiny_model_dir / "model.safetensors")
    assert saved.keys() == original.keys()  # the encoder and its pooler, as model.name has them
    assert torch.equal(saved["pooler.dense.weight"], original["pooler.dense.weight"])
    assert not torch.equal(saved["encoder.layer.0.output.dense.weight"], original["encoder.layer.0.output.dense.weight"])
    assert not (repo / "checkpoints/pretrain").exists()


def test_changing_train_or_cv_folds_never_reruns_pretrain(repo):
    repo, _, _ = repo
    set_params(repo, train__lr=5e-4, cv__folds=[0, 1])
    ran, log = repro_pretrain(repo)
    assert ran == set() and "Stage 'pretrain' didn't change, skipping" in log, log
    assert json.loads(dvc("status", "--json", "pretrain", cwd=repo).stdout) == {}


def test_a_killed_run_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_one(repo):
    repo, _, _ = repo
    uninterrupted = (json.loads((repo / "reports/pretrain/metrics.json").read_text()),
                     load_file(repo / "models/pretrained/model.safetensors"))
    set_params(repo, machine__checkpoint_steps=3)  # the machine section: no stage declares it
    folder = repo / "checkpoints/pretrain"
    command = [sys.executable, "-m", "stages.pretrain"]
    process = subprocess.Popen(command, cwd=repo, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(step >= 9 and checkpoint.progress(path) for step, path in checkpoint.checkpoints(folder).items()):
            assert process.poll() is None, f"it ended before a checkpoint:\n{process.communicate()[0]}"
            assert time.monotonic() < deadline, "no checkpoint after 120 s"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == -signal.SIGKILL
    rerun = subprocess.run(command, cwd=repo, env=stage_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    resumed = re.search(r"^resuming from checkpoints/pretrain/checkpoint-(\d+): step (\d+) of 33$", rerun.stdout, re.M)
    assert resumed and 9 <= int(resumed[2]) < 33, rerun.stdout
    assert "ignoring" not in rerun.stdout
    metrics, weights = json.loads((repo / "reports/pretrain/metrics.json").read_text()), load_file(repo / "models/pretrained/model.safetensors")
    assert metrics["steps"] == 33 and metrics["mlm_loss"] == uninterrupted[0]["mlm_loss"]
    for name, tensor in uninterrupted[1].items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-6), name
    assert not folder.exists(), "checkpoints are removed after a successful run"
