"""train: fine-tune the model on the tokenized train split with transformers' Trainer.

Reads data/tokenized/{train,val}.safetensors and data/processed/labels.json; writes the model
folder models/model (weights as safetensors, tokenizer, label mapping in config.json) and the
training curves in reports/train (dvclive: loss, learning rate, val accuracy/F1, epoch time,
and speed/*: examples and real tokens per second, padding fraction, peak memory, batch size).
Runs on the GPU when there is one (mixed precision, batch size probed to fit), else on the CPU (fp32).
"""
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file
from sklearn.metrics import accuracy_score, f1_score
from transformers import (AutoModelForSequenceClassification, AutoTokenizer,
                          DataCollatorWithPadding, TrainingArguments, set_seed)
from transformers.integrations import DVCLiveCallback
from transformers.utils import is_torch_tf32_available

from stages.common import PipelineError, atomic_dir, load_params, resolve_model, run_main, unpack_sequences
from stages.speed import (CountingTrainer, Throughput, autocast_dtype, out_of_memory_in_training,
                          peak_memory, pick_batch_size, use_expandable_segments)

TOKENIZED = Path("data/tokenized")
LABELS = Path("data/processed/labels.json")
OUT = Path("models/model")
LIVE_DIR = Path("reports/train")
# what each train.* key accepts; load_params turns anything else into a one-line error
TRAIN_PARAMS = {"epochs": (int, float), "batch_size": (int, "auto"), "effective_batch_size": (int,),
                "lr": (float,), "weight_decay": (float,), "warmup_ratio": (float,), "max_grad_norm": (float,),
                "seed": (int,), "group_by_length": (bool,), "mixed_precision": (bool,), "tf32": (bool,),
                "fused_adamw": (bool,), "pin_memory": (bool,), "loader_workers": (int,)}


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


def make_collator(tokenizer, device):
    """Pads each batch to its own longest text; on GPU to a multiple of 8, the tensor cores' tile."""
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if device == "cuda" else None)


def training_arguments(params, output_dir, device, batch_size, accumulation):
    cuda = device == "cuda"
    dtype = autocast_dtype(params["mixed_precision"])
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=params["epochs"],
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size * 2,  # no gradients kept: twice the batch fits
        gradient_accumulation_steps=accumulation,
        learning_rate=params["lr"],
        weight_decay=params["weight_decay"],
        warmup_steps=params["warmup_ratio"],  # a float below 1 is a fraction of all steps
        max_grad_norm=params["max_grad_norm"],
        lr_scheduler_type="linear",
        seed=params["seed"],
        train_sampling_strategy="group_by_length" if params["group_by_length"] else "random",
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,  # with a gradient scaler
        tf32=params["tf32"] if cuda and is_torch_tf32_available() else None,  # None: leave torch's setting
        optim="adamw_torch_fused" if params["fused_adamw"] else "adamw_torch",
        dataloader_pin_memory=params["pin_memory"] and cuda,
        # on the CPU, loader workers would take cores from the model
        dataloader_num_workers=params["loader_workers"] if cuda else 0,
        dataloader_persistent_workers=cuda and params["loader_workers"] > 0,
        eval_strategy="epoch",
        save_strategy="no",  # the finished model is saved once, below, into models/model
        logging_strategy="steps",
        logging_steps=0.02,  # a fraction: about 50 points on the loss curve whatever the data size
        report_to="none",  # dvclive is attached explicitly, to write into reports/train
    )


def main():
    params = load_params("train", TRAIN_PARAMS)
    model_source = resolve_model(load_params("model")["name"])
    labels = json.loads(LABELS.read_text(encoding="utf-8"))
    use_expandable_segments()

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

    batch_size, accumulation, seq_len = pick_batch_size(
        model, train_set.sequences, params["batch_size"], params["effective_batch_size"],
        params["mixed_precision"], device)
    print(f"batch: {batch_size} per step x {accumulation} accumulated = {batch_size * accumulation} per "
          f"optimizer step; longest batch {seq_len} tokens; "
          f"{autocast_dtype(params['mixed_precision']) or torch.float32}")

    from dvclive import Live  # here, not at the top: the benchmark imports this module where dvclive is not

    live = Live(dir=str(LIVE_DIR), dvcyaml=None, save_dvc_exp=False)
    throughput = Throughput()
    with tempfile.TemporaryDirectory() as scratch:
        trainer = CountingTrainer(
            model=model,
            args=training_arguments(params, scratch, device, batch_size, accumulation),
            train_dataset=train_set,
            eval_dataset=val_set,
            data_collator=make_collator(tokenizer, device),
            compute_metrics=compute_metrics,
            callbacks=[LiveCallback(live=live)],
            throughput=throughput,
        )
        try:
            trainer.train()
        except torch.cuda.OutOfMemoryError:
            raise PipelineError(out_of_memory_in_training(batch_size, seq_len)) from None

    speed = {**throughput.summary(), **peak_memory(), "batch_size": batch_size,
             "gradient_accumulation_steps": accumulation}
    print(f"speed: {speed}")
    for name, value in speed.items():
        live.log_metric(f"speed/{name}", value, plot=False)
    live.make_summary()
    with atomic_dir(OUT) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


if __name__ == "__main__":
    run_main(main)
