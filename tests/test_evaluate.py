import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from pipeline.settings import PipelineError
from predicting.ensemble import combine_out_of_fold, mean_test_probabilities
from predicting.inference import predict_logits
from stages.evaluate import spread
from tasks.scores import classification_metrics


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
