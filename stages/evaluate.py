"""evaluate: score the trained model on val (and test, when it has labels); write the submission.

Reads models/model, data/tokenized/ and data/processed/test.csv (for the ids); writes
reports/evaluate/metrics.json (accuracy, macro-F1, per-class precision/recall/F1),
reports/evaluate/confusion_<split>.csv (DVC confusion-matrix plots) and submission/submission.csv.
"""
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file
from sklearn.metrics import accuracy_score, f1_score, precision_recall_fscore_support
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from stages.common import (atomic_dir, load_params, model_params, read_csv, run_main,
                           unpack_sequences, write_csv, write_json)

MODEL = Path("models/model")
TOKENIZED = Path("data/tokenized")
TEST_CSV = Path("data/processed/test.csv")
REPORTS = Path("reports/evaluate")
SUBMISSION = Path("submission")
# what each evaluate.* key accepts; load_params turns anything else into a one-line error
EVALUATE_PARAMS = {"batch_size": (int,)}


@torch.inference_mode()
def predict_logits(model, collator, sequences, batch_size, device):
    """Logits (n, num_labels) in input order. Batches hold texts of similar length (sorted by
    length), so padding each batch to its own longest text wastes little."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    logits = torch.empty(len(sequences), model.config.num_labels)
    for start in range(0, len(order), batch_size):
        batch_index = order[start:start + batch_size]
        batch = collator([{"input_ids": sequences[i]} for i in batch_index]).to(device)
        logits[batch_index] = model(**batch).logits.float().cpu()
    return logits


def predict_split(model, collator, split, batch_size, device):
    """(true label ids, predicted label ids) for one tokenized split."""
    sequences, y_true = unpack_sequences(load_file(TOKENIZED / f"{split}.safetensors"))
    logits = predict_logits(model, collator, sequences, batch_size, device)
    return y_true, logits.argmax(-1).tolist()


def classification_metrics(y_true, y_pred, labels):
    """accuracy, macro-F1 and per-class precision/recall/F1 (keyed by label name)."""
    ids = list(range(len(labels)))
    precision, recall, f1, support = precision_recall_fscore_support(
        y_true, y_pred, labels=ids, zero_division=0)
    return {
        "accuracy": round(accuracy_score(y_true, y_pred), 4),
        "f1_macro": round(f1_score(y_true, y_pred, labels=ids, average="macro", zero_division=0), 4),
        "per_class": {labels[i]: {"precision": round(precision[i], 4), "recall": round(recall[i], 4),
                                  "f1": round(f1[i], 4), "support": int(support[i])} for i in ids},
    }


def main():
    batch_size = load_params("evaluate", EVALUATE_PARAMS)["batch_size"]
    remote_code = model_params()["trust_remote_code"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForSequenceClassification.from_pretrained(
        MODEL, trust_remote_code=remote_code).to(device).eval()
    # on GPU, pad each batch to a multiple of 8 (the tensor cores' tile); the CPU gains nothing from it
    collator = DataCollatorWithPadding(AutoTokenizer.from_pretrained(MODEL, trust_remote_code=remote_code),
                                       return_tensors="pt",
                                       pad_to_multiple_of=8 if device == "cuda" else None)
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]

    y_true, y_pred = predict_split(model, collator, "val", batch_size, device)
    metrics = {"val": classification_metrics(y_true, y_pred, labels)}
    confusion = pd.DataFrame({"actual": [labels[y] for y in y_true],
                              "predicted": [labels[p] for p in y_pred]})
    submission = None
    if (TOKENIZED / "test.safetensors").exists():
        y_true, y_pred = predict_split(model, collator, "test", batch_size, device)
        submission = pd.DataFrame({"id": read_csv(TEST_CSV)["id"], "label": [labels[p] for p in y_pred]})
        if all(y >= 0 for y in y_true):  # unlabelled test rows carry -1
            metrics["test"] = classification_metrics(y_true, y_pred, labels)
    for split, m in metrics.items():
        print(f"{split}: accuracy {m['accuracy']}, macro-F1 {m['f1_macro']}")

    with atomic_dir(REPORTS) as tmp:
        write_json(tmp / "metrics.json", metrics)
        write_csv(confusion, tmp / "confusion_val.csv")
    # the folder is written even with no test file, so DVC always finds its declared output
    with atomic_dir(SUBMISSION) as tmp:
        if submission is not None:
            submission.to_csv(tmp / "submission.csv", index=False)
            print(f"wrote {SUBMISSION / 'submission.csv'} ({len(submission)} rows)")


if __name__ == "__main__":
    run_main(main)
