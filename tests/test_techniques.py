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


def test_reinitialising_none_all_or_too_many_layers(tiny_bert):
    before = {n: p.detach().clone() for n, p in tiny_bert.named_parameters()}
    assert layerwise.reinitialise_top(tiny_bert, 0) == []
    assert all(torch.equal(p, before[n]) for n, p in tiny_bert.named_parameters())
    top = layerwise.reinitialise_top(tiny_bert, 1)
    assert {n.split(".")[3] for n in top if ".layer." in n} == {"2"} and "bert.pooler.dense.weight" in top
    names = layerwise.reinitialise_top(tiny_bert, 3)
    assert {n.split(".")[3] for n in names if ".layer." in n} == {"0", "1", "2"}
    assert not any("embeddings" in n or "classifier" in n for n in names)
    with pytest.raises(ValueError, match="the model has 3 layers; cannot re-initialise 4"):
        layerwise.reinitialise_top(tiny_bert, 4)


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


def test_the_averaging_callback_averages_from_its_step_scores_the_average_and_keeps_it_at_the_end(tmp_path, capsys):
    """Trainer's events by hand, 4 optimizer steps leaving the weight at 1, 2, 3, 4, evaluations at steps 1, 3
    and 4, checkpoints at steps 1 and 3. swa from train.average_from 0.25: steps after step 1, so 2, 3, 4."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    def train(callback, model, steps, checkpoints=(), stop_after=4):
        args, control = SimpleNamespace(process_index=0, output_dir=str(tmp_path)), TrainerControl()
        state = TrainerState(max_steps=4, global_step=steps[0] - 1)
        callback.on_train_begin(args, state, control)
        scored = []
        for step in steps[:stop_after - steps[0] + 1]:
            with torch.no_grad():
                model.weight.fill_(step)  # what the optimizer step made of the weights
            state.global_step, control.should_evaluate = step, step != 2
            callback.on_step_end(args, state, control)
            if control.should_evaluate:
                scored.append(model.weight.item())
                callback.on_evaluate(args, state, control)
                control.should_evaluate = False
            if step in checkpoints:
                (tmp_path / f"checkpoint-{step}").mkdir()
                callback.on_save(args, state, control)
        callback.on_train_end(args, state, control)
        return scored, model.weight.item()

    model = torch.nn.Linear(1, 1, bias=False)
    assert train(averaging.AveragingCallback(model, "swa", 0.99, 0.25), model, [1, 2, 3, 4], checkpoints=(1, 3)) == (
        [1.0, 2.5, 3.0], 3.0)  # evaluated: the weights, the mean of 2, 3, then of 2, 3, 4, which the model keeps
    assert "the model keeps the swa of the weights of 3 optimizer steps (at most 1 from the last step's)" in (
        capsys.readouterr().out)
    assert not (tmp_path / "checkpoint-1" / averaging.FILE).exists()  # nothing averaged yet
    saved = load_file(tmp_path / "checkpoint-3" / averaging.FILE)
    assert saved["weight"].item() == 2.5  # the average at the checkpoint, not the weights evaluated in its place
    # resumed from the checkpoint: the same average goes on
    model = torch.nn.Linear(1, 1, bias=False)
    resumed = averaging.AveragingCallback(model, "swa", 0.99, 0.25, resume=tmp_path / "checkpoint-3")
    assert train(resumed, model, [4]) == ([3.0], 3.0)
    # from a checkpoint before averaging started, nothing was lost: nothing to say
    assert train(averaging.AveragingCallback(model, "swa", 0.99, 0.25, resume=tmp_path / "checkpoint-1"), model,
                 [2, 3, 4]) == ([2.5, 3.0], 3.0)
    assert "the average starts again" not in capsys.readouterr().out
    # a checkpoint without the average: said, and the average starts again
    (tmp_path / "checkpoint-3" / averaging.FILE).unlink()
    restarted = averaging.AveragingCallback(model, "swa", 0.99, 0.25, resume=tmp_path / "checkpoint-3")
    assert train(restarted, model, [4]) == ([4.0], 4.0)
    assert "checkpoint-3 has no averaged.safetensors; the average starts again at step 4" in capsys.readouterr().out
    # stopped early (patience): the last evaluation's weights were given back; the model keeps its own
    model = torch.nn.Linear(1, 1, bias=False)
    assert train(averaging.AveragingCallback(model, "ema", 0.5, 0.0), model, [1, 2, 3, 4], stop_after=3) == (
        [1.0, 2.25], 3.0)  # ema at 0.5 of 1, 2, 3: 1, 1.5, 2.25


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


def test_awp_moves_each_weight_up_its_gradient_scaled_by_its_norm_as_worked_by_hand():
    model = torch.nn.Sequential(*[torch.nn.Linear(2 if i == 0 else 1, 1, bias=i == 1) for i in range(5)])
    with torch.no_grad():
        for layer, weight in zip(model, ([[1.0, -2.0]], 3.0, 2.0, 4.0, 5.0)):
            layer.weight.copy_(torch.tensor(weight).expand_as(layer.weight))
        model[1].bias.fill_(0.5)
    model[4].weight.requires_grad_(False)
    for layer, grad in zip(model, ([[3.0, 4.0]], 0.0, 1.0, float("inf"), 1.0)):
        layer.weight.grad = torch.tensor(grad).expand_as(layer.weight).clone()
    model[1].bias.grad = torch.ones(1)
    awp = adversarial.make("awp", model, 1, fgm_epsilon=1.0, awp_lr=0.1, awp_eps=0.1)
    assert (awp.lr, awp.eps, awp.start_epoch) == (0.1, 0.1, 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # lr x gradient / |gradient| x |weight|, then within 10% of each weight: [1, -2] by 0.1 x [0.6, 0.8] x sqrt(5)
    step = 0.1 * np.array([0.6, 0.8]) * math.sqrt(5)  # [0.134, 0.179]
    with awp.perturbed(model):
        assert model[0].weight.detach().numpy()[0] == pytest.approx([1.1, -2.0 + step[1]], abs=1e-6)  # 1.1: clamped
        assert model[2].weight.item() == pytest.approx(2.2, abs=1e-6)  # a gradient of norm 1: 0.1 x 2
        # left alone: a zero or infinite gradient, a bias, a frozen weight
        assert [model[1].weight.item(), model[1].bias.item(), model[3].weight.item(), model[4].weight.item()] == [
            3.0, 0.5, 4.0, 5.0]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and awp.attacks == 1
    assert adversarial.make("none", model, 0, 1.0, 1.0, 0.01) is None
    assert [awp.active(epoch) for epoch in (None, 0.99, 1.0, 2.5)] == [False, False, True, True]


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
    one_hot = F.one_hot(labels, 3).float()
    weight = torch.tensor([2.0, 1.0, 0.5])
    plain = F.cross_entropy(logits, labels, weight=weight, reduction="sum") / 2
    assert torch.allclose(losses.cross_entropy(logits, one_hot, weight).sum() / 2, plain)
    p0 = math.exp(2) / (math.exp(2) + 1 + math.exp(-1))
    p1 = math.exp(1) / (2 * math.exp(0.5) + math.exp(1))
    by_hand = (2.0 * (1 - p0) ** 2 * -math.log(p0) + 0.5 * (1 - p1) ** 2 * -math.log(p1)) / 2
    assert (losses.cross_entropy(logits, one_hot, weight, gamma=2).sum() / 2).item() == pytest.approx(by_hand, rel=1e-5)
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    ml_logits = torch.tensor([[0.3, -1.2], [2.0, 0.1]])
    pos = torch.tensor([3.0, 0.5])
    reference = torch.nn.BCEWithLogitsLoss(pos_weight=pos)(ml_logits, targets)
    assert torch.allclose(losses.binary_cross_entropy(ml_logits, targets, pos).mean(), reference)
    s = torch.sigmoid(ml_logits)
    right = torch.where(targets == 1, s, 1 - s)
    bce = -(targets * pos * torch.log(s) + (1 - targets) * torch.log(1 - s))
    assert torch.allclose(losses.binary_cross_entropy(ml_logits, targets, pos, gamma=1).mean(), ((1 - right) * bce).mean())
    values, truth = torch.tensor([[0.5], [-1.0]]), torch.tensor([1.0, 1.0])
    assert torch.allclose(losses.mean_squared_error(values, truth).mean(), F.mse_loss(values.view(-1), truth))
    # over an accumulated step: the sum over its micro-batches' rows, over all of them
    loss = losses.TaskLoss("cross_entropy", "classification", weight)
    halves = sum(loss({"logits": logits[i:i + 1]}, labels[i:i + 1], num_items_in_batch=2) for i in (0, 1))
    assert torch.allclose(halves, plain)


def test_balanced_weights_of_a_missing_or_constant_class_are_1():
    assert np.allclose(losses.balanced_class_weights([0, 0, 1], 3), [3 / 4, 3 / 2, 1])  # class 2: no row
    indicators = np.array([[1, 0, 1], [1, 0, 0], [np.nan, np.nan, np.nan], [1, 0, 1]])  # a row unlabelled
    assert np.allclose(losses.balanced_pos_weights(indicators), [1, 1, 1 / 2])  # always, never, 2 of 3


def test_soft_targets_cost_cross_entropy_against_probabilities_and_trainer_gets_each_loss_by_its_labels():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 1.0]])
    weight = torch.tensor([2.0, 1.0, 0.5])
    labels = torch.tensor([0, 2])
    targets = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.5, 0.5]])
    p = np.exp(logits.numpy()) / np.exp(logits.numpy()).sum(axis=1, keepdims=True)
    t = targets.numpy()
    cross = -(t * np.log(p)).sum(axis=1)
    row_weight, q = t @ weight.numpy(), (t * p).sum(axis=1)  # [1.7, 0.75]
    by_hand = (row_weight * (1 - q) ** 2 * cross).sum() / 5
    assert (losses.cross_entropy(logits, targets, weight, 2.0).sum() / 5).item() == pytest.approx(by_hand, rel=1e-5)
    # Trainer's compute_loss_func: class indices, probabilities, or 0/1 per class, over the step's rows; Trainer
    # counts label elements (num_items_in_batch), 3 per row of probabilities, 1 per class index
    outputs = {"logits": logits}
    hard = losses.TaskLoss("cross_entropy", "classification", [2.0, 1.0, 0.5])(outputs, labels, num_items_in_batch=4)
    assert torch.allclose(hard, F.cross_entropy(logits, labels, weight=weight, reduction="sum") / 4)
    soft = losses.TaskLoss("cross_entropy", "classification")
    assert soft(outputs, targets).item() == pytest.approx(cross.mean(), rel=1e-5)
    assert soft(outputs, targets, num_items_in_batch=12).item() == pytest.approx(cross.sum() / 4, rel=1e-5)  # 4 rows
    tags = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    multilabel = losses.TaskLoss("binary_cross_entropy", "multilabel", [3.0, 1.0, 1.0])(outputs, tags,
                                                                                       num_items_in_batch=2)
    assert torch.allclose(multilabel, F.binary_cross_entropy_with_logits(
        logits, tags, pos_weight=torch.tensor([3.0, 1.0, 1.0]), reduction="sum") / 2)
    s = 1 / (1 + np.exp(-logits.numpy()))  # focal at gamma 2: each term times (1 - p of the right 0/1) squared
    right, tags_np = np.where(tags.numpy() == 1, s, 1 - s), tags.numpy()
    bce = -(tags_np * np.log(s) + (1 - tags_np) * np.log(1 - s))
    assert losses.binary_cross_entropy(logits, tags, gamma=2.0).mean().item() == pytest.approx(
        ((1 - right) ** 2 * bce).mean(), rel=1e-5)
    regression = losses.TaskLoss("mse", "regression")({"logits": torch.tensor([[0.5], [2.0]])}, torch.tensor([1.0, 1.0]),
                                                      num_items_in_batch=2)
    assert regression.item() == pytest.approx((0.25 + 1.0) / 2)


def test_a_new_loss_is_one_function_and_one_line(monkeypatch):
    """A loss added to the registry trains where train.loss names it, for the task kinds its line says."""
    def squared_hinge(logits, targets, weights=None, gamma=0.0):
        return (torch.clamp(1 - (2 * targets - 1) * logits, min=0) ** 2).sum(dim=1)

    monkeypatch.setitem(losses.LOSSES, "squared_hinge", (("classification",), squared_hinge))
    params = {"loss": "squared_hinge", "class_weights": "none", "focal_gamma": 0}
    loss, said = techniques.loss_function(params, "classification", "cross_entropy", ["a", "b"], [0, 1])
    logits, labels = torch.tensor([[0.5, -0.5], [2.0, 0.0]]), torch.tensor([0, 1])
    by_hand = ((1 - 0.5) ** 2 + (1 - 0.5) ** 2 + 3.0 ** 2 + 1.0 ** 2) / 2  # each row's classes, one-hot targets
    assert loss({"logits": logits}, labels).item() == pytest.approx(by_hand) and said == "train.loss squared_hinge"
    with pytest.raises(PipelineError, match="train.loss squared_hinge trains classification, not task.kind regression"):
        techniques.loss_name(params, "regression", "mse")


def test_explicit_class_weights_name_every_class_or_say_which_not():
    assert np.allclose(techniques.class_weights({"b": 2, "a": 0.5}, "classification", ["a", "b"], [0, 1]), [0.5, 2])
    with pytest.raises(PipelineError, match="no weight for b: give one weight for each of a, b"):
        techniques.class_weights({"a": 1}, "classification", ["a", "b"], [0, 1])
    with pytest.raises(PipelineError, match="unknown classes c"):
        techniques.class_weights({"a": 1, "b": 1, "c": 1}, "classification", ["a", "b"], [0, 1])
    with pytest.raises(PipelineError, match="train.class_weights b: must be a number above 0"):
        techniques.class_weights({"a": 1, "b": 0}, "classification", ["a", "b"], [0, 1])
    with pytest.raises(PipelineError, match="task.kind regression has none"):
        techniques.loss_name({"loss": "auto", "class_weights": "balanced", "focal_gamma": 0}, "regression", "mse")


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
