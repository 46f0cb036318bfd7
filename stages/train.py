"""train: fine-tune the model on the tokenized train split with transformers' Trainer.

Reads data/tokenized/{train,val}.safetensors and data/processed/labels.json; writes the model
folder models/model (weights as safetensors, tokenizer, label mapping in config.json) and the
training curves in reports/train (dvclive: loss, learning rate, val accuracy/F1, epoch time).
Runs on the GPU when there is one, else on the CPU.
"""
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from dvclive import Live
from safetensors.torch import load_file
from sklearn.metrics import accuracy_score, f1_score
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, Trainer, TrainingArguments, set_seed)
from transformers.integrations import DVCLiveCallback

from stages.common import atomic_dir, load_params, resolve_model, run_main, unpack_sequences

TOKENIZED = Path("data/tokenized")
LABELS = Path("data/processed/labels.json")
OUT = Path("models/model")
LIVE_DIR = Path("reports/train")


class TokenizedDataset(torch.utils.data.Dataset):
    """Unpadded token ids and label ids, as the tokenize stage saved them."""

    def __init__(self, path):
        self.sequences, self.labels = unpack_sequences(load_file(path))

    def __len__(self):
        return len(self.sequences)

    def __getitem__(self, i):
        return {"input_ids": self.sequences[i], "labels": self.labels[i]}


def compute_metrics(eval_pred):
    logits, labels = eval_pred
    predictions = np.argmax(logits, axis=-1)
    return {"accuracy": accuracy_score(labels, predictions),
            "f1_macro": f1_score(labels, predictions, average="macro")}


class LiveCallback(DVCLiveCallback):
    """dvclive's Trainer callback, stepping by optimizer step (not by log call) and timing epochs."""

    def on_log(self, args, state, control, **kwargs):
        if self.live is not None:
            self.live.step = state.global_step
        super().on_log(args, state, control, **kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.epoch_start = time.perf_counter()

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.live is not None:
            self.live.log_metric("epoch_time_s", round(time.perf_counter() - self.epoch_start, 1))


def training_arguments(params, output_dir):
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=params["epochs"],
        per_device_train_batch_size=params["batch_size"],
        per_device_eval_batch_size=params["batch_size"] * 2,
        learning_rate=params["lr"],
        weight_decay=params["weight_decay"],
        warmup_steps=params["warmup_ratio"],  # a float below 1 is a fraction of all steps
        max_grad_norm=params["max_grad_norm"],
        lr_scheduler_type="linear",
        seed=params["seed"],
        eval_strategy="epoch",
        save_strategy="no",  # the finished model is saved once, below, into models/model
        logging_strategy="steps",
        logging_steps=0.02,  # a fraction: about 50 points on the loss curve whatever the data size
        report_to="none",  # dvclive is attached explicitly, to write into reports/train
    )


def main():
    params = load_params("train")
    model_source = resolve_model(load_params("model")["name"])
    labels = json.loads(LABELS.read_text(encoding="utf-8"))

    set_seed(params["seed"])  # before the model is built: seeds the new classifier head
    tokenizer = AutoTokenizer.from_pretrained(model_source)
    # transformers prints a table listing the classifier head as MISSING: that is expected for
    # a fresh head, so say it in one line instead
    transformers.logging.set_verbosity_error()
    model = AutoModelForSequenceClassification.from_pretrained(
        model_source, num_labels=len(labels),
        id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    transformers.logging.set_verbosity_warning()
    print(f"loaded {model_source}; the {len(labels)}-class classifier head is new (randomly initialised)")
    train_set = TokenizedDataset(TOKENIZED / "train.safetensors")
    val_set = TokenizedDataset(TOKENIZED / "val.safetensors")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"training on {device}: {len(train_set)} train / {len(val_set)} val examples, labels {labels}")

    live = Live(dir=str(LIVE_DIR), dvcyaml=None, save_dvc_exp=False)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(
            model=model,
            args=training_arguments(params, scratch),
            train_dataset=train_set,
            eval_dataset=val_set,
            data_collator=DataCollatorWithPadding(tokenizer),
            compute_metrics=compute_metrics,
            callbacks=[LiveCallback(live=live)],
        )
        trainer.train()

    with atomic_dir(OUT) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


if __name__ == "__main__":
    run_main(main)
