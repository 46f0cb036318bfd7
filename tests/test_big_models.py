"""Big encoders on a small GPU (training/lowmemory.py, training/lora.py): gradient checkpointing gives the
gradients of a plain step; LoRA trains only its adapters and the head, and its merged model computes
what the adapted one does; AdamW's state as the batch-size probe reserves it is what the optimizer
holds. End to end, a LoRA run through the real `dvc repro` trains, and predict_test and python -m
predict load its saved model as any other; with train.keep_best, that of its best evaluation."""
import json
import math
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from sklearn.metrics import f1_score
from transformers import AutoModelForSequenceClassification

from pipeline.settings import PipelineError
from tests.test_pipeline import REPO, settle, stage_env
from training import lora, lowmemory

TEXTS = ["the flight was awful", "great crew and wonderful food", "the meeting is on tuesday", "love it"]
OFF = {"gradient_checkpointing": False, "load_in_4bit": False, "lora_rank": 0, "lora_alpha": 16,
       "lora_modules": lora.ALL_LINEAR, "fused_adamw": False, "adamw_8bit": False}


def tiny(tiny_model_dir, seed=0):
    """The tiny BERT with a new 3-class head, dropout off, fp32: every step deterministic."""
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def batch(tokenizer):
    inputs = tokenizer(TEXTS, padding=True, return_tensors="pt")
    return {**inputs, "labels": torch.tensor([0, 2, 1, 2])}


def test_gradient_checkpointing_gives_the_gradients_of_a_plain_step(tiny_model_dir, tokenizer):
    grads, forwards = {}, {}
    for on in (False, True):
        model = lowmemory.prepare(tiny(tiny_model_dir), {**OFF, "gradient_checkpointing": on}, "cpu", say=lambda _: None)
        model.train()
        calls = []  # the first layer's forward runs again in the backward pass when checkpointed
        model.bert.encoder.layer[0].attention.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        model(**batch(tokenizer)).loss.backward()
        grads[on] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        forwards[on] = len(calls)
    assert forwards == {False: 1, True: 2}, "gradient checkpointing did not recompute the layer"
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 20
    for name, grad in grads[False].items():
        assert torch.allclose(grads[True][name], grad, rtol=1e-5, atol=1e-7), name


def lora_parameters(model, rank, layers):
    """LoRA's parameter count computed by hand: rank x (inputs + outputs) for each adapted linear layer."""
    linear = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return sum(rank * (linear[name].in_features + linear[name].out_features) for name in layers)


def test_lora_trains_its_adapters_and_the_head_and_nothing_else(tiny_model_dir, tokenizer):
    base = tiny(tiny_model_dir)
    head = sum(p.numel() for p in base.classifier.parameters())
    targets = lora.target_modules(base, lora.ALL_LINEAR)
    # the tiny BERT's 2 layers: query, key, value, attention output, intermediate, output; and the pooler
    assert len(targets) == 2 * 6 + 1 and not any(t.startswith("classifier") for t in targets)
    expected = lora_parameters(base, 4, targets) + head
    frozen_before = {k: v.clone() for k, v in base.state_dict().items()}
    model = lowmemory.prepare(base, {**OFF, "lora_rank": 4, "lora_alpha": 8}, "cpu", say=lambda _: None)
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trained.values()) == expected
    assert all("lora_" in name or ".classifier." in name for name in trained), sorted(trained)
    optimizer = torch.optim.AdamW(trained.values(), lr=1e-2)
    model.train()
    for _ in range(3):
        model(**batch(tokenizer)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    lora_b = [p for name, p in trained.items() if "lora_B" in name]
    assert all(p.abs().max() > 0 for p in lora_b), "LoRA's B starts at zero and must have trained"
    model.eval()
    with torch.no_grad():
        adapted = model(**batch(tokenizer)).logits
        plain = lora.merged(model)
        assert not lora.is_wrapped(plain) and type(plain).__name__ == "BertForSequenceClassification"
        merged = plain(**batch(tokenizer)).logits
    assert torch.allclose(merged, adapted, atol=1e-5), (merged - adapted).abs().max()
    weights = plain.state_dict()
    assert weights.keys() == frozen_before.keys()  # a plain model: no adapter or wrapper keys
    assert torch.equal(weights["bert.embeddings.word_embeddings.weight"], frozen_before["bert.embeddings.word_embeddings.weight"])
    assert not torch.equal(weights["bert.encoder.layer.0.attention.self.query.weight"],
                           frozen_before["bert.encoder.layer.0.attention.self.query.weight"])  # W + BA merged in
    assert not torch.equal(weights["classifier.weight"], frozen_before["classifier.weight"])


def test_lora_goes_to_the_layers_named_and_an_unknown_name_is_one_line(tiny_model_dir):
    model = tiny(tiny_model_dir)
    assert lora.target_modules(model, ["query", "value"]) == [
        f"bert.encoder.layer.{i}.attention.self.{m}" for i in (0, 1) for m in ("query", "value")]
    with pytest.raises(PipelineError, match=r"train.lora_modules names 'q_proj', which BertForSequenceClassification "
                                            r"has no linear layer called; its layers are called dense, key, query, value"):
        lora.target_modules(model, ["query", "q_proj"])
    for bad in ([], [5], "query"):
        with pytest.raises(PipelineError, match="train.lora_modules must be all-linear or a list"):
            lora.check_modules(bad)


def test_the_probe_holds_the_adamw_state_the_optimizer_allocates(tiny_model_dir, tokenizer):
    model = tiny(tiny_model_dir)
    model.get_input_embeddings().weight.requires_grad_(False)  # train.freeze_embeddings: no state for it
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(**batch(tokenizer)).loss.backward()
    optimizer.step()
    held = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    assert lowmemory.adamw_state_bytes(model) == held
    # bitsandbytes' 8-bit moments, by hand: a byte each and a fp32 scale per 256, for tensors of 4096 or more
    # elements that are not embeddings; fp32 moments for the rest
    layer = torch.nn.Sequential(torch.nn.Embedding(5000, 8), torch.nn.Linear(100, 100))
    assert lowmemory.adamw_state_bytes(layer, eight_bit=True) == (
        8 * 5000 * 8 + 2 * (10000 + 4 * math.ceil(10000 / 256)) + 8 * 100)
    assert lowmemory.adamw_state_bytes(layer) == 8 * (40000 + 10000 + 100)


def test_8bit_adamw_is_cuda_only_and_says_so_elsewhere():
    assert lowmemory.optimizer(True, False, "cpu") == ("adamw_torch_fused", None)
    name, line = lowmemory.optimizer(True, True, "cpu")
    assert name == "adamw_torch_fused" and "CUDA GPUs only" in line and "fp32" in line
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(PipelineError, match="pip install bitsandbytes"):
            lowmemory.optimizer(True, True, "cuda")
    else:
        assert lowmemory.optimizer(True, True, "cuda")[0] == "adamw_bnb_8bit"


def eval_curve(repo, metric):
    """(step, value) of each evaluation, as dvclive logged it."""
    lines = (repo / f"reports/train/fold-0/plots/metrics/eval/{metric}.tsv").read_text().splitlines()[1:]
    return [(int(step), float(value)) for step, value in (line.split("\t") for line in lines)]


def test_a_lora_run_keeps_its_best_evaluation_and_predicts_with_it(pipeline, tiny_model_dir, tmp_path):
    # LoRA at lr 2e-2 on the tiny BERT: it learns in its first epoch (macro-F1 0.54), then the high rate throws
    # it off (0.25 at the end with torch 2.13 on a CPU, 0.18 with 2.14); train.keep_best keeps the best epoch;
    # gradient checkpointing on as well. At lr 1e-2 the end was 0.07 below the best with torch 2.13 and tied
    # with it with 2.14: a margin too thin for what the test is about.
    repo, _ = pipeline
    settle(repo)
    full = load_file(repo / "models/fold-0/model.safetensors")
    ran, log = settle(repo, with_log=True, train__lora_rank=8, train__lora_alpha=16, train__lr=2e-2,
                      train__gradient_checkpointing=True, train__keep_best=True)
    assert {"train@0", "predict_test", "evaluate"} <= ran
    assert "train.lora_rank 8: LoRA (alpha 16) on all-linear of the encoder, the head trained fully" in log, log
    assert "train.gradient_checkpointing: each layer's activations are recomputed" in log
    saved = load_file(repo / "models/fold-0/model.safetensors")
    assert saved.keys() == full.keys()  # merged: a plain model, loaded as any other
    assert not (repo / "models/fold-0/adapter_config.json").exists()
    loaded = load_file(tiny_model_dir / "model.safetensors")
    query = "encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(saved[f"bert.{query}"], loaded[query])  # the adapters merged into the weights
    # the best evaluation, not the last: the case this test is about
    curve = eval_curve(repo, "f1_macro")
    best_step, best_f1 = max(curve, key=lambda point: (point[1], -point[0]))  # a tie: the earlier
    assert best_step < curve[-1][0] and curve[-1][1] < best_f1 - 0.01, curve
    assert f"train.keep_best: kept the weights of the evaluation at step {best_step}, f1_macro {best_f1:.4f}" in log, log
    assert json.loads((repo / "reports/train/fold-0/metrics.json").read_text())["kept_evaluation"]["step"] == best_step
    # the out-of-fold predictions are that evaluation's: their macro-F1, recomputed, is its score
    oof = pd.read_csv(repo / "predictions/fold-0/oof.csv", index_col="row")
    labels = json.loads((repo / "data/processed/labels.json").read_text())
    processed = pd.read_csv(repo / "data/processed/train.csv")
    truth = processed["label"].iloc[oof.index].map(labels.index)
    assert f1_score(truth, oof[labels].to_numpy().argmax(1), average="macro") == pytest.approx(best_f1, abs=1e-4)
    evaluation = json.loads((repo / "reports/evaluate/metrics.json").read_text())
    # above chance (3 classes): LoRA on the tiny BERT's frozen random weights learns far less than on a pretrained
    # encoder (fully fine-tuned it passes 0.8)
    assert evaluation["val"]["accuracy"] >= 0.5 and evaluation["test"]["accuracy"] >= 0.5, evaluation
    # python -m predict on the validation rows, with the saved (best, merged) model, gives the out-of-fold
    # probabilities the training computed at that evaluation with the adapters unmerged
    processed.iloc[oof.index].assign(id=oof.index).to_csv(tmp_path / "val.csv", index=False)
    subprocess.run([sys.executable, "-m", "predict", str(tmp_path / "val.csv"), "--out", str(tmp_path / "out.csv"),
                    "--probabilities", str(tmp_path / "p.csv")], cwd=repo, env=stage_env(), check=True,
                   capture_output=True, text=True)
    predicted = pd.read_csv(tmp_path / "p.csv").set_index("id")
    assert np.abs(predicted.loc[oof.index, labels].to_numpy() - oof[labels].to_numpy()).max() < 1e-4


@pytest.mark.parametrize("key, spec, expected", [
    ("train.lora_rank", {"choices": [0, 8, 16]}, "one of [0, 8, 16]"),
    ("train.lora_alpha", {"low": 8, "high": 64, "log": True}, "8 to 64 (log scale)"),
    ("train.gradient_checkpointing", {"choices": [False, True]}, "one of [False, True]"),
    ("train.keep_best", {"choices": [False, True]}, "one of [False, True]"),
    ("train.patience", {"choices": [None, 2]}, "one of [None, 2]"),
    ("train.adamw_8bit", {"choices": [False, True]}, "one of [False, True]"),
])
def test_the_settings_go_into_tunes_search_space(key, spec, expected):
    import yaml

    from tune.settings import parse_dimension

    assert str(parse_dimension(key, spec, yaml.safe_load((REPO / "params.yaml").read_text()))) == expected


def test_a_bad_lora_setting_in_the_search_space_is_one_line():
    import yaml

    from tune.settings import parse_dimension

    with pytest.raises(PipelineError, match="tune.space train.lora_rank: choice must be a whole number at least 0"):
        parse_dimension("train.lora_rank", {"choices": [8, -1]}, yaml.safe_load((REPO / "params.yaml").read_text()))


def lora_trainer(tiny_model_dir, tokenizer, folder, max_steps):
    from transformers import DataCollatorWithPadding, TrainingArguments

    from training.speed import Throughput
    from training.trainer import CountingTrainer

    model = lowmemory.prepare(tiny(tiny_model_dir), {**OFF, "lora_rank": 4, "lora_alpha": 8}, "cpu", say=lambda _: None)
    data = [{"input_ids": ids, "labels": i % 3} for i, ids in enumerate(tokenizer(TEXTS * 8)["input_ids"])]
    args = TrainingArguments(output_dir=str(folder), max_steps=max_steps, learning_rate=1e-2, per_device_train_batch_size=8,
                             save_strategy="steps", save_steps=2, report_to="none", use_cpu=True, seed=0,
                             disable_tqdm=True)
    return model, CountingTrainer(model=model, args=args, train_dataset=data, throughput=Throughput(),
                                  data_collator=DataCollatorWithPadding(tokenizer))


def test_a_lora_run_resumes_from_a_checkpoint_of_its_adapters(tiny_model_dir, tokenizer, tmp_path):
    model, trainer = lora_trainer(tiny_model_dir, tokenizer, tmp_path / "whole", 4)
    trainer.train()  # saves checkpoint-2 on its way
    whole = lora.merged(model).state_dict()
    saved = sorted(p.name for p in (tmp_path / "whole/checkpoint-2").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved, saved  # adapters and head only
    model, trainer = lora_trainer(tiny_model_dir, tokenizer, tmp_path / "resumed", 4)
    trainer.train(resume_from_checkpoint=str(tmp_path / "whole/checkpoint-2"))
    assert trainer.state.global_step == 4
    resumed, initial = lora.merged(model).state_dict(), tiny(tiny_model_dir).state_dict()
    for name, weight in whole.items():
        assert torch.allclose(resumed[name], weight, atol=1e-6), name
    assert sum(not torch.equal(whole[name], initial[name]) for name in whole) > 10  # the adapted layers and the head
