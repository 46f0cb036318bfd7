import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from sklearn.metrics import f1_score
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from pipeline.settings import PipelineError
from predicting.ensemble import combine_out_of_fold, mean_test_probabilities
from predicting.inference import predict_logits
from stages.evaluate import main as evaluate_main
from stages.evaluate import spread
from tasks.scores import THRESHOLDS, classification_metrics

REPO = Path(__file__).resolve().parents[1]


def test_classification_metrics():
    m = classification_metrics([0, 0, 1, 2], [0, 1, 1, 2], ["a", "b", "c"])
    assert m["accuracy"] == 0.75
    assert m["per_class"]["a"] == {"precision": 1.0, "recall": 0.5, "f1": 0.6667, "support": 2}
    assert m["f1_macro"] == round((2 / 3 + 2 / 3 + 1) / 3, 4)


def test_sorted_dynamic_batches_give_the_logits_of_max_length_padding(tiny_model_dir, tokenizer):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=3).eval()
    texts = ["great", "the flight was awful and late again", "a meeting on tuesday", "love it", "ok"]
    sequences = tokenizer(texts)["input_ids"]
    dynamic = predict_logits(model, DataCollatorWithPadding(tokenizer), sequences, batch_size=2, device="cpu")
    padded = tokenizer(texts, padding="max_length", max_length=64, return_tensors="pt")
    with torch.no_grad():
        reference = model(**padded).logits
    assert torch.allclose(dynamic, reference, atol=1e-5)


def test_out_of_fold_rows_are_combined_in_row_order_and_checked_against_the_split():
    row_folds = np.array([1, 0, 1, 0, -1])
    oof = [(np.array([3, 1]), np.array([[0.9, 0.1], [0.2, 0.8]])), (np.array([0, 2]), np.array([[0.6, 0.4], [0.3, 0.7]]))]
    rows, probs = combine_out_of_fold(row_folds, oof)
    assert rows.tolist() == [0, 1, 2, 3] and probs[:, 0].tolist() == [0.6, 0.2, 0.3, 0.9]
    with pytest.raises(PipelineError, match=r"predictions/fold-0/oof.csv holds other rows than fold 0"):
        combine_out_of_fold(np.array([1, 0, 0, 0, -1]), oof)
    tests = [(np.arange(2), np.array([[0.2, 0.8], [1.0, 0.0]])), (np.arange(2), np.array([[0.6, 0.4], [0.0, 1.0]]))]
    assert np.allclose(mean_test_probabilities(tests, 2), [[0.4, 0.6], [0.5, 0.5]])
    with pytest.raises(PipelineError, match=r"predictions/test/fold-0.csv does not hold the 3 rows"):
        mean_test_probabilities(tests, 3)
    summary = spread([{"accuracy": 0.8, "f1_macro": 0.7}, {"accuracy": 0.9, "f1_macro": 0.8}])
    assert summary["f1_macro_mean"] == 0.75 and summary["f1_macro_std"] == round(float(np.std([0.7, 0.8], ddof=1)), 4)
    assert summary["per_fold"] == {"0": {"accuracy": 0.8, "f1_macro": 0.7}, "1": {"accuracy": 0.9, "f1_macro": 0.8}}


# Hand-made out-of-fold probabilities of three classes over 80 rows, on which micro- and macro-F1 choose
# different thresholds: food (40 rows have it) is found whole from 0.36 down, music and sports (4 rows
# each) only above 0.55 and 0.6, where half of food is lost. Micro-F1 counts rows: 0.36; macro-F1 counts
# classes: 0.61 (ties go to the threshold nearest 0.5).
CLASSES = ["food", "music", "sports"]
CHOSEN = {"f1_macro": 0.61, "f1_micro": 0.36}
# the test rows: each has a probability between 0.5 and one of the two thresholds
TEST_PROBABILITIES = [[0.55, 0.1, 0.7], [0.4, 0.1, 0.1], [0.9, 0.58, 0.1]]
SUBMITTED = {"f1_macro": ["sports", "", "food"], "f1_micro": ["food|sports", "food", "food|music"]}  # at 0.5: "food|sports", "", "food|music"


def threshold_rows():
    truth, probabilities = np.zeros((80, 3), dtype=int), np.full((80, 3), 0.1)
    truth[:40, 0], probabilities[:20, 0], probabilities[20:40, 0] = 1, 0.9, 0.36
    truth[40:44, 1], probabilities[40:44, 1], probabilities[44:50, 1] = 1, 0.8, 0.55
    truth[50:54, 2], probabilities[50:54, 2], probabilities[54:60, 2] = 1, 0.8, 0.6
    return truth, probabilities


def evaluate_folder(folder, metric):
    """What evaluate reads, written by hand: a one-fold multi-label run's processed data, split and
    prediction files, and params.yaml's task section with task.metric `metric`."""
    truth, probabilities = threshold_rows()
    for path in ("data/processed", "data/split", "predictions/fold-0", "predictions/test"):
        (folder / path).mkdir(parents=True)
    labels = [json.dumps([c for c, on in zip(CLASSES, row) if on]) for row in truth]
    pd.DataFrame({"text": [f"text {i}" for i in range(80)], "label": labels}).to_csv(folder / "data/processed/train.csv", index=False)
    pd.DataFrame({"id": ["t0", "t1", "t2"], "text": ["a", "b", "c"], "label": ""}).to_csv(folder / "data/processed/test.csv", index=False)
    (folder / "data/processed/labels.json").write_text(json.dumps(CLASSES))
    (folder / "data/processed/shape.json").write_text(json.dumps({"kind": "multilabel", "label_separator": "|"}))
    (folder / "data/processed/submission.json").write_text(json.dumps({"id_column": "id", "header": ["id", "label"],
                                                                       "probabilities": False}))
    pd.DataFrame({"fold": 0}, index=range(80)).to_csv(folder / "data/split/folds.csv", index=False)
    pd.DataFrame(probabilities, columns=CLASSES).rename_axis("row").reset_index().to_csv(
        folder / "predictions/fold-0/oof.csv", index=False)
    pd.DataFrame(TEST_PROBABILITIES, columns=CLASSES).rename_axis("row").reset_index().to_csv(
        folder / "predictions/test/fold-0.csv", index=False)
    (folder / "predictions/baseline").mkdir(parents=True)  # evaluate scores the baseline beside the model
    (folder / "reports/tokenize").mkdir(parents=True)  # the tokenizer's fit, which the verdict may name
    (folder / "reports/tokenize/lengths.json").write_text(json.dumps({"tokens": {}}))
    pd.DataFrame(probabilities, columns=CLASSES).rename_axis("row").reset_index().to_csv(
        folder / "predictions/baseline/oof.csv", index=False)
    pd.DataFrame(TEST_PROBABILITIES, columns=CLASSES).rename_axis("row").reset_index().to_csv(
        folder / "predictions/baseline/test.csv", index=False)
    # the baseline verdict reads train.*; which students to score and whose outputs to submit, the project's
    params = {k: v for k, v in yaml.safe_load((REPO / "params.yaml").read_text()).items()
              if k in ("train", "pseudo", "distill", "evaluate")}
    (folder / "params.yaml").write_text(yaml.safe_dump({"task": {"kind": "multilabel", "label_separator": "|",
                                                                 "metric": metric}, **params}))
    return truth, probabilities


@pytest.mark.parametrize("metric", ["f1_macro", "f1_micro"])
def test_the_multilabel_threshold_follows_task_metric_and_decides_the_submission(metric, tmp_path, monkeypatch):
    truth, probabilities = evaluate_folder(tmp_path, metric)
    other = {"f1_macro": "f1_micro", "f1_micro": "f1_macro"}[metric]
    by = {m: [f1_score(truth, (probabilities >= t).astype(int), average=m[3:]) for t in THRESHOLDS] for m in CHOSEN}
    assert by[metric][list(THRESHOLDS).index(CHOSEN[metric])] == pytest.approx(max(by[metric]))  # the data's premise
    assert by[metric][list(THRESHOLDS).index(CHOSEN[other])] < max(by[metric]) - 0.1
    monkeypatch.chdir(tmp_path)
    evaluate_main()
    reported = json.loads(Path("reports/evaluate/metrics.json").read_text())["val"]
    assert reported["threshold"] == CHOSEN[metric]
    assert reported[metric] == pytest.approx(max(by[metric]), abs=1e-4)
    submission = pd.read_csv("submission/submission.csv", dtype=str, keep_default_na=False)
    assert submission["id"].tolist() == ["t0", "t1", "t2"] and submission["label"].tolist() == SUBMITTED[metric]
