import torch
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from stages.evaluate import classification_metrics
from stages.train import predict_logits


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
