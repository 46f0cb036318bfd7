"""The training techniques (training/techniques.py and its parts): their pure cores against values worked
out by hand or by another library, then end to end through the real `dvc repro` on the tiny pipeline:
each setting is named in the log, changes the trained weights, reruns only train and what follows it,
and keeps the outputs' form, for each task shape (one run per shape with several techniques at once)."""
import json
import math
import re
import signal

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from sklearn.utils.class_weight import compute_class_weight
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from pipeline.settings import PipelineError
from training import adversarial, averaging, layerwise, losses, techniques


@pytest.fixture
def tiny_bert():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=16, max_position_embeddings=16, num_labels=3)
    return BertForSequenceClassification(config)


def batch(n=4, length=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(5, 40, (n, length), generator=g), "labels": torch.tensor([0, 1, 2, 1][:n])}


# ---- layer-wise learning rates --------------------------------------------------------------------

def expected_rate(name, lr=1e-3, decay=0.5, head=10.0):
    """By hand for the 3-layer BERT: the top layer (and the pooler) at lr, each one below half that, the
    embeddings below layer 0, the classifier at 10 x lr."""
    if name.startswith("classifier."):
        return lr * head
    if ".embeddings." in name:
        return lr * decay ** 3
    layer = re.search(r"encoder\.layer\.(\d)\.", name)
    return lr * decay ** (2 - int(layer[1])) if layer else lr  # bert.pooler: as the top layer


def test_the_optimizer_trainer_builds_holds_a_rate_per_layer(tiny_bert, tmp_path):
    tiny_bert.bert.embeddings.word_embeddings.weight.requires_grad_(False)  # frozen: left out, as by Trainer
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, weight_decay=0.01, use_cpu=True,
                             report_to="none", optim="adamw_torch")
    trainer = Trainer(model=tiny_bert, args=args,
                      optimizer_cls_and_kwargs=layerwise.optimizer_factory(args, tiny_bert, 0.5, 10.0))
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, torch.optim.AdamW)
    held = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            held[p] = (group["lr"], group["weight_decay"])
    names = {p: n for n, p in tiny_bert.named_parameters()}
    trained = [n for n, p in tiny_bert.named_parameters() if p.requires_grad]
    assert sorted(names[p] for p in held) == sorted(trained)
    for p, (lr, wd) in held.items():
        name = names[p]
        assert lr == pytest.approx(expected_rate(name)), name
        assert wd == (0.0 if name.endswith("bias") or "LayerNorm" in name else 0.01), name
    assert {round(lr, 9) for lr, _ in held.values()} == {1.25e-4, 2.5e-4, 5e-4, 1e-3, 1e-2}


def test_reinitialising_the_top_layer_changes_it_and_the_pooler_only(tiny_bert):
    before = {n: p.detach().clone() for n, p in tiny_bert.named_parameters()}
    names = layerwise.reinitialise_top(tiny_bert, 1)
    changed = {n for n, p in tiny_bert.named_parameters() if not torch.equal(p, before[n])}
    weights = {n for n in names if n.endswith("weight") and "LayerNorm" not in n}  # biases init to 0, LN to 1
    assert weights and weights <= changed
    assert all(".layer.2." in n or ".pooler." in n for n in names)
    assert not any(".layer.1." in n or "embeddings" in n or "classifier" in n for n in changed)


# ---- weight averaging -----------------------------------------------------------------------------

def test_ema_and_swa_updates_match_a_hand_computation():
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0]), torch.tensor([0.0, 4.0])
    ema, swa = averaging.WeightAverage("ema", decay=0.9), averaging.WeightAverage("swa")
    for w in (a, b, c):
        ema.update({"w": w})
        swa.update({"w": w})
    first = a  # the first update copies the weights
    second = 0.9 * first + 0.1 * b
    assert torch.allclose(ema.average["w"], 0.9 * second + 0.1 * c)  # [0.981, 2.016]
    assert torch.allclose(swa.average["w"], torch.tensor([4 / 3, 4 / 3]))


def test_swapping_the_average_in_and_out_restores_the_weights_bit_for_bit(tiny_bert):
    weights = averaging.trained_weights(tiny_bert)
    average = averaging.WeightAverage("ema", 0.5)
    average.update(weights)
    with torch.no_grad():
        for p in weights.values():
            p.add_(0.1)
    mine = {n: p.detach().clone() for n, p in weights.items()}
    average.update(weights)
    expected = {n: p - 0.05 for n, p in mine.items()}
    average.swap(weights)
    assert all(torch.allclose(weights[n], expected[n], atol=1e-6) for n in weights)
    average.swap(weights)
    assert all(torch.equal(weights[n], mine[n]) for n in weights)


# ---- adversarial training -------------------------------------------------------------------------

def test_fgm_moves_each_texts_embeddings_by_epsilon_along_the_gradient_and_undoes_it(tiny_bert):
    tiny_bert.eval()  # no dropout: passes comparable
    tiny_bert.bert.embeddings.word_embeddings.weight.requires_grad_(False)  # works frozen too
    inputs = batch()
    params = {n: p.detach().clone() for n, p in tiny_bert.named_parameters()}
    clean = tiny_bert(**inputs).logits.detach()
    fgm = adversarial.FGM(tiny_bert, epsilon=0.5)
    with fgm.watch(tiny_bert):
        tiny_bert(**inputs).loss.backward()
    grad = fgm.seen.grad.clone()
    delta = fgm.perturbation()
    assert torch.allclose(delta.flatten(1).norm(dim=1), torch.full((4,), 0.5), atol=1e-5)
    cosine = F.cosine_similarity(delta.flatten(1), grad.flatten(1))
    assert torch.allclose(cosine, torch.ones(4), atol=1e-5)
    with fgm.perturbed(tiny_bert):
        attacked = tiny_bert(**inputs)
    assert attacked.loss > F.cross_entropy(clean, inputs["labels"])  # up the gradient: the loss rises
    assert torch.equal(tiny_bert(**inputs).logits.detach(), clean)  # the hook is gone
    assert all(torch.equal(p, params[n]) for n, p in tiny_bert.named_parameters())
    assert fgm.attacks == 1


def test_awp_perturbs_weights_within_eps_and_restores_them_exactly(tiny_bert):
    tiny_bert.eval()
    inputs = batch()
    before = {n: p.detach().clone() for n, p in tiny_bert.named_parameters()}
    tiny_bert(**inputs).loss.backward()
    awp = adversarial.AWP(tiny_bert, lr=1.0, eps=0.01)
    clean_loss = tiny_bert(**inputs).loss.item()
    with awp.perturbed(tiny_bert):
        moved = {n: p.detach().clone() for n, p in tiny_bert.named_parameters()}
        attacked_loss = tiny_bert(**inputs).loss.item()
    name = "bert.encoder.layer.0.attention.self.query.weight"
    diff = (moved[name] - before[name]).abs()
    assert diff.max() > 0 and torch.all(diff <= 0.01 * before[name].abs() + 1e-7)
    assert torch.equal(moved["classifier.bias"], before["classifier.bias"])  # biases are not attacked
    assert attacked_loss > clean_loss
    assert all(torch.equal(p, before[n]) for n, p in tiny_bert.named_parameters())


# ---- imbalanced classes ---------------------------------------------------------------------------

def test_balanced_weights_are_scikit_learns():
    labels = [0, 0, 0, 0, 1, 2, 2, 0, 1, 0]
    assert np.allclose(losses.balanced_class_weights(labels, 3),
                       compute_class_weight("balanced", classes=np.arange(3), y=labels))
    indicators = np.array([[1, 0], [1, 1], [0, 0], [1, 0]])
    assert np.allclose(losses.balanced_pos_weights(indicators), [1 / 3, 3.0])


def test_weighted_and_focal_losses_match_torch_and_a_hand_computation():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 1.0]])
    labels = torch.tensor([0, 2])
    weight = torch.tensor([2.0, 1.0, 0.5])
    plain = F.cross_entropy(logits, labels, weight=weight, reduction="sum") / 2
    assert torch.allclose(losses.classification_loss(logits, labels, weight), plain)
    p0 = math.exp(2) / (math.exp(2) + 1 + math.exp(-1))
    p1 = math.exp(1) / (2 * math.exp(0.5) + math.exp(1))
    by_hand = (2.0 * (1 - p0) ** 2 * -math.log(p0) + 0.5 * (1 - p1) ** 2 * -math.log(p1)) / 2
    assert losses.classification_loss(logits, labels, weight, gamma=2).item() == pytest.approx(by_hand, rel=1e-5)
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    ml_logits = torch.tensor([[0.3, -1.2], [2.0, 0.1]])
    pos = torch.tensor([3.0, 0.5])
    reference = torch.nn.BCEWithLogitsLoss(pos_weight=pos)(ml_logits, targets)
    assert torch.allclose(losses.multilabel_loss(ml_logits, targets, pos), reference)
    s = torch.sigmoid(ml_logits)
    right = torch.where(targets == 1, s, 1 - s)
    bce = -(targets * pos * torch.log(s) + (1 - targets) * torch.log(1 - s))
    assert torch.allclose(losses.multilabel_loss(ml_logits, targets, pos, gamma=1), ((1 - right) * bce).mean())
    # over an accumulated step: the sum over its micro-batches' rows, over all of them
    halves = sum(losses.classification_loss(logits[i:i + 1], labels[i:i + 1], weight, reduction_total=2) for i in (0, 1))
    assert torch.allclose(halves, plain)


def test_explicit_class_weights_name_every_class_or_say_which_not():
    assert np.allclose(techniques.class_weights({"b": 2, "a": 0.5}, "classification", ["a", "b"], [0, 1]), [0.5, 2])
    with pytest.raises(PipelineError, match="no weight for b: give one weight for each of a, b"):
        techniques.class_weights({"a": 1}, "classification", ["a", "b"], [0, 1])
    with pytest.raises(PipelineError, match="unknown classes c"):
        techniques.class_weights({"a": 1, "b": 1, "c": 1}, "classification", ["a", "b"], [0, 1])
    with pytest.raises(PipelineError, match="train.class_weights b: must be a number above 0"):
        techniques.class_weights({"a": 1, "b": 0}, "classification", ["a", "b"], [0, 1])
    with pytest.raises(PipelineError, match="task.kind regression has none"):
        techniques.loss_function({"class_weights": "balanced", "focal_gamma": 0}, "regression", [], [])


# ---- end to end: the real `dvc repro` on the tiny pipeline ---------------------------------------

DOWNSTREAM = {"train@0", "predict_test", "evaluate"}


def saved_weights(repo, fold=0):
    return load_file(repo / f"models/fold-{fold}/model.safetensors")


def curve(repo, name):
    lines = (repo / f"reports/train/fold-0/plots/metrics/{name}.tsv").read_text().splitlines()[1:]
    return [(int(step), float(value)) for step, value in (line.split("\t") for line in lines)]


@pytest.fixture(scope="module")
def defaults(pipeline):
    """The shared tiny pipeline at its settings (every technique off): its weights, oof and lr curve."""
    from tests.test_pipeline import settle

    repo, _ = pipeline
    settle(repo)
    return {"weights": saved_weights(repo), "oof": pd.read_csv(repo / "predictions/fold-0/oof.csv"),
            "lr": curve(repo, "learning_rate")}


def val_probabilities(repo):
    """The saved model's class probabilities for the validation rows, computed here from the tokenized
    rows (fp32, one text at a time): what oof.csv must hold if it came from the saved weights."""
    from transformers import AutoModelForSequenceClassification

    from reading.tokens import unpack_sequences

    sequences, _ = unpack_sequences(load_file(repo / "data/tokenized/train.safetensors"))
    rows = np.flatnonzero(pd.read_csv(repo / "data/split/folds.csv")["fold"] == 0)
    model = AutoModelForSequenceClassification.from_pretrained(repo / "models/fold-0").eval()
    with torch.no_grad():
        return rows, np.stack([torch.softmax(model(torch.tensor([sequences[i]])).logits[0], -1).numpy() for i in rows])


def check_run(repo, defaults, ran, log, named):
    assert ran == DOWNSTREAM, ran  # a train.* key: train and what reads its outputs, nothing upstream
    assert named in log, log
    weights = saved_weights(repo)
    assert any(not torch.allclose(weights[k], defaults["weights"][k], atol=1e-6) for k in weights), \
        "the setting left the trained weights as they were"
    oof = pd.read_csv(repo / "predictions/fold-0/oof.csv")
    assert list(oof.columns) == list(defaults["oof"].columns) and sorted(oof["row"]) == sorted(defaults["oof"]["row"])
    val = pd.read_json(repo / "reports/evaluate/metrics.json", typ="series")["val"]
    assert val["f1_macro"] >= 0.6, val  # three classes: chance about 0.33
    return weights, oof


def test_layer_wise_rates_reach_the_scheduler(pipeline, defaults):
    from tests.test_pipeline import settle

    repo, _ = pipeline
    ran, log = settle(repo, with_log=True, train__layer_lr_decay=0.8, train__head_lr_multiple=5.0)
    check_run(repo, defaults, ran, log, "train.layer_lr_decay 0.8: encoder layers")
    # the curve logs the first group's rate, the embeddings': lr x 0.8^2 (2 layers) at every logged step
    got, plain = curve(repo, "learning_rate"), defaults["lr"]
    assert [s for s, _ in got] == [s for s, _ in plain]
    assert [v for _, v in got] == pytest.approx([0.64 * v for _, v in plain], rel=1e-6)


def test_ema_weights_are_saved_and_give_the_out_of_fold_predictions(pipeline, defaults):
    from tests.test_pipeline import settle

    repo, _ = pipeline
    ran, log = settle(repo, with_log=True, train__averaging="ema", train__average_decay=0.9, train__average_from=0.5)
    _, oof = check_run(repo, defaults, ran, log, "train.averaging ema: an exponential moving average (decay 0.9)")
    kept = re.search(r"keeps the ema of the weights of (\d+) optimizer steps \(at most ([\d.e-]+) from", log)
    steps = 170  # 270 train rows, 16 a step: 17 steps x 10 epochs
    assert kept and int(kept[1]) == steps - steps // 2 and float(kept[2]) > 0, log
    rows, expected = val_probabilities(repo)
    oof = oof.set_index("row").loc[rows]
    assert np.allclose(oof.to_numpy(), expected, atol=1e-4)


@pytest.mark.parametrize("kind, named", [("fgm", "train.adversarial fgm: epsilon 1 on the word embeddings, from epoch 5"),
                                         ("awp", "train.adversarial awp: lr 1, eps 0.01 on the weights, from epoch 5")])
def test_adversarial_passes_run_from_their_epoch_on(pipeline, defaults, kind, named):
    from tests.test_pipeline import settle

    repo, _ = pipeline
    ran, log = settle(repo, with_log=True, train__adversarial=kind, train__adversarial_from=5)
    check_run(repo, defaults, ran, log, named)
    # epochs 5 to 9 of 10: half of the 170 micro-batches took a second, perturbed pass
    assert f"train.adversarial {kind}: 85 of 170 micro-batches trained twice" in log, log


def test_balanced_focal_loss_weighs_the_training_rows_classes(pipeline, defaults):
    from tests.test_pipeline import settle

    repo, _ = pipeline
    ran, log = settle(repo, with_log=True, train__class_weights="balanced", train__focal_gamma=2.0)
    check_run(repo, defaults, ran, log, "train.focal_gamma 2: focal loss")
    labels = pd.read_csv(repo / "data/processed/train.csv")["label"]
    folds = pd.read_csv(repo / "data/split/folds.csv")["fold"]
    trained = labels[folds != 0]
    classes = sorted(set(labels))
    weights = compute_class_weight("balanced", classes=np.array(classes), y=trained.to_numpy())
    assert ("train.class_weights balanced: class weights " +
            ", ".join(f"{c} {w:.3g}" for c, w in zip(classes, weights))) in log, log


# ---- the other task shapes, and K folds: several techniques at once in one run each ----------------

def shape_run(tmp_path_factory, tiny_model_dir, name, make, n, **params):
    """A pipeline repo of one shape (tests/shape_data.py), reproduced once with params; (repo, dvc's log)."""
    from tests.shape_data import write_data
    from tests.test_pipeline import init_pipeline_repo, repro

    base = tmp_path_factory.mktemp(name)
    source = write_data(base / "source", make, n, 30)
    repo = init_pipeline_repo(base / "repo", source, tiny_model_dir, train__epochs=3, train__effective_batch_size=16,
                              train__mixed_precision=False, **params)
    ran, log = repro(repo, with_log=True)
    return repo, ran, log


def test_multilabel_takes_pos_weight_focal_swa_awp_and_layer_rates(tmp_path_factory, tiny_model_dir):
    from tests.shape_data import TOPICS, multilabel_rows

    repo, ran, log = shape_run(tmp_path_factory, tiny_model_dir, "ml", multilabel_rows, 200, task__kind="multilabel",
                               preprocess__text_column=["title", "body"], preprocess__label_column="tags",
                               train__class_weights="balanced", train__focal_gamma=1.0, train__averaging="swa",
                               train__adversarial="awp", train__layer_lr_decay=0.9)
    for named in ("train.layer_lr_decay 0.9", "train.averaging swa", "train.adversarial awp:", "train.focal_gamma 1",
                  "keeps the swa of the weights", "micro-batches trained twice"):
        assert named in log, (named, log)
    # pos_weight: negatives / positives of each class among the training rows, worked out here
    tags = pd.read_csv(repo / "data/processed/train.csv", keep_default_na=False)["label"]
    folds = pd.read_csv(repo / "data/split/folds.csv")["fold"]
    trained = [set(json.loads(t)) for t in tags[folds != 0]]  # preprocess writes a row's classes as a JSON list
    topics = sorted(TOPICS)
    expected = [sum(t not in row for row in trained) / sum(t in row for row in trained) for t in topics]
    assert ("train.class_weights balanced: pos_weight " + ", ".join(f"{t} {w:.3g}" for t, w in zip(topics, expected))) in log
    oof = pd.read_csv(repo / "predictions/fold-0/oof.csv")
    assert list(oof.columns) == ["row", *topics] and oof[topics].apply(lambda c: c.between(0, 1).all()).all()
    assert sorted(oof["row"]) == sorted(np.flatnonzero(folds == 0))


def test_regression_with_two_folds_takes_ema_fgm_reinit_and_layer_rates(tmp_path_factory, tiny_model_dir):
    from tests.shape_data import regression_rows

    repo, ran, log = shape_run(tmp_path_factory, tiny_model_dir, "reg", regression_rows, 160, task__kind="regression",
                               preprocess__label_column="score", cv__folds=[0, 1], train__averaging="ema",
                               train__adversarial="fgm", train__reinit_layers=1, train__layer_lr_decay=0.9,
                               train__head_lr_multiple=3.0)
    assert {"train@0", "train@1", "evaluate"} <= ran
    for named in ("train.reinit_layers 1: the top layers re-initialised", "train.head_lr_multiple 3",
                  "train.averaging ema", "train.adversarial fgm: epsilon 1 on the word embeddings"):
        assert log.count(named) == 2, (named, log)  # once in each fold
    folds = pd.read_csv(repo / "data/split/folds.csv")["fold"]
    oof = pd.concat([pd.read_csv(repo / f"predictions/fold-{k}/oof.csv") for k in (0, 1)])
    assert list(oof.columns) == ["row", "value"] and np.isfinite(oof["value"]).all()
    assert sorted(oof["row"]) == sorted(np.flatnonzero(folds >= 0))
    evaluation = pd.read_json(repo / "reports/evaluate/metrics.json", typ="series")
    assert np.isfinite(evaluation["oof"]["rmse"])


# ---- resuming: the average is part of the checkpoint -----------------------------------------------

def test_a_resumed_ema_run_ends_as_an_uninterrupted_one(tmp_path_factory, tiny_data_dir, tiny_model_dir):
    from tests.test_pipeline import dvc
    from tests.test_resume import CHECKPOINTS, RESUME_PARAMS, copy_repo, interrupt_training, tokenized_repo

    root = tmp_path_factory.mktemp("ema-resume")
    # decay 0.99 from the first step: an average restarted at the checkpoint would weigh its steps 0.99^62 = 0.54
    # less than the uninterrupted one, far apart from it
    base = tokenized_repo(root / "base", tiny_data_dir, tiny_model_dir, **RESUME_PARAMS, train__averaging="ema",
                          train__average_decay=0.99, train__average_from=0.0)
    reference = copy_repo(base, root / "reference")
    dvc("repro", "train", cwd=reference)
    repo = copy_repo(base, root / "repo")
    interrupt_training(repo, signal.SIGTERM)
    saved = [p for p in (repo / CHECKPOINTS).glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    assert saved and all((p / averaging.FILE).is_file() for p in saved)
    rerun = dvc("repro", "train", cwd=repo).stdout
    assert "resuming from" in rerun and "has no averaged.safetensors" not in rerun, rerun
    expected, got = saved_weights(reference), saved_weights(repo)
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=0, atol=1e-6), name


def test_the_settings_go_into_tunes_space():
    from tune.settings import parse_dimension

    params = {"train": {k: None for k in techniques.TECHNIQUE_PARAMS}}
    assert parse_dimension("train.averaging", {"choices": ["none", "ema", "swa"]}, params).choices == ("none", "ema", "swa")
    assert parse_dimension("train.layer_lr_decay", {"low": 0.8, "high": 1.0}, params).high == 1.0
    assert parse_dimension("train.class_weights", {"choices": ["none", "balanced"]}, params).choices
    with pytest.raises(PipelineError, match="train.adversarial"):
        parse_dimension("train.adversarial", {"choices": ["none", "pgd"]}, params)
