"""python -m bench.checkpoint_write [--dir FOLDER]: how long the train stage's checkpoint takes to write,
and how big it is, for the embedded MiniLM and a bert-base-sized BERT (randomly initialised: no
download), each after one real training step so AdamW's state exists. Trainer writes it as in the
stage (weights, optimizer, scheduler, RNG states); the time is from the end of the step to Trainer's
on_save. Point --dir at the folder you would use for machine.checkpoint_dir (on Colab, a folder of
your mounted Drive) to pick machine.checkpoint_minutes: the writing costs write time / interval."""
import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback

from modeling.models import resolve_model


class SaveTimer(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_save(self, args, state, control, **kwargs):
        self.seconds = time.perf_counter() - self.start


class Texts(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"input_ids": torch.arange(1000, 1032), "attention_mask": torch.ones(32, dtype=torch.long),
                "labels": torch.tensor(i % 3)}


def checkpoint_write(model, folder):
    """(seconds to write one checkpoint into folder, its size in bytes)."""
    timer = SaveTimer()
    args = TrainingArguments(output_dir=str(folder), max_steps=1, per_device_train_batch_size=2, save_strategy="steps",
                             save_steps=1, report_to="none", disable_tqdm=True, logging_strategy="no", use_cpu=True)
    trainer = Trainer(model=model, args=args, train_dataset=Texts(), callbacks=[timer])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
    return timer.seconds, size


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_write", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary folder on this disk)")
    opts = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    models = {"MiniLM (the embedded model)": lambda: AutoModelForSequenceClassification.from_pretrained(
                  resolve_model("minilm"), num_labels=3),
              "bert-base-sized (110M parameters)": lambda: BertForSequenceClassification(BertConfig(num_labels=3))}
    for name, make in models.items():
        folder = Path(tempfile.mkdtemp(prefix="checkpoint-write-", dir=opts.dir))
        try:
            seconds, size = checkpoint_write(make(), folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(f"{name}: one checkpoint {size / 1e9:.2f} GB written in {seconds:.1f} s ({size / 1e6 / seconds:,.0f} MB/s); "
              f"every 10 minutes that is {seconds / 600:.1%} of the time")


if __name__ == "__main__":
    main()
