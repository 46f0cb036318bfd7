"""The techniques table (docs/techniques.md): validation macro-F1 (mean ± std over seeds) and time per
epoch relative to the defaults, for the defaults, each technique alone, and the best combination.

    python -m bench.techniques                 # 2,000 train / 1,000 validation tweets, 1 epoch, 3 seeds
    python -m bench.techniques --train 256 --val 256   # what a loaded 2-core machine managed (docs/techniques.md)
    python -m bench.techniques --only "averaging ema" --seeds 1 2 3 4 5

The embedded tweets and MiniLM, trained as the train stage trains them (training_arguments,
techniques.plug_in, CountingTrainer), in fp32 (train.mixed_precision false: the CPU's bf16 choice is
timed per process and could differ between rows), one torch thread. A fraction of the rows, drawn
once (stratified, seed 0); the seeds are train.seed (the head's init, the order of batches). Runs go
seed by seed, every row within a seed, the defaults first and last; a row's time ratio is against
the mean of those two defaults runs of its seed, then averaged over the seeds (on a loaded machine
the load still moves in between: docs/techniques.md says how much it did).
The best combination takes, of each family (averaging, adversarial, loss, ...), the row that gained
most over the defaults, if any gained; "none gained" when no row did.
"""
import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
from sklearn.model_selection import train_test_split
from transformers import set_seed
from transformers.trainer_callback import PrinterCallback

from bench.common import NO_CHECKPOINTS, load_average, load_corpus, tokenize_texts
from modeling.models import load_model, make_collator, resolve_model
from pipeline.settings import load_params
from tasks.shapes import SHAPES
from training import techniques
from training.arguments import training_arguments
from training.learning_rate import learning_rate
from training.rows import TokenizedDataset
from training.settings import TRAIN_PARAMS
from training.speed import Throughput
from training.trainer import CountingTrainer, ValidationScores, evaluated_at_end

MAX_LENGTH = 64  # tweets: 99.9% of them fit (tokenize.max_length auto gives about this)
# (row name, family, settings): each technique alone, at the values write-ups use
ROWS = [
    ("defaults", None, {}),
    ("layer_lr_decay 0.9, head_lr_multiple 10", "layers", {"layer_lr_decay": 0.9, "head_lr_multiple": 10.0}),
    ("reinit_layers 1", "reinit", {"reinit_layers": 1}),
    ("averaging ema (decay 0.99, from 50%)", "averaging", {"averaging": "ema"}),
    ("averaging swa (from 50%)", "averaging", {"averaging": "swa"}),
    ("adversarial fgm (epsilon 1)", "adversarial", {"adversarial": "fgm"}),
    ("adversarial awp (lr 1, eps 0.01)", "adversarial", {"adversarial": "awp"}),
    ("class_weights balanced", "loss", {"class_weights": "balanced"}),
    ("focal_gamma 2", "loss", {"focal_gamma": 2.0}),
]


def sample(texts, labels, n_train, n_val):
    """A stratified draw of n_train + n_val rows (seed 0), split stratified into train and validation."""
    rows = np.arange(len(texts))
    chosen, _ = train_test_split(rows, train_size=n_train + n_val, stratify=labels, random_state=0)
    train, val = train_test_split(chosen, train_size=n_train, stratify=[labels[i] for i in chosen], random_state=0)
    return train, val


def run(settings, base, seed, tokenizer_source, data, classes):
    """(validation macro-F1, seconds in training epochs) of one training run."""
    params = {**base, **settings, "seed": seed}
    sequences, labels, train_rows, val_rows = data
    set_seed(seed)
    tokenizer, model = load_model(tokenizer_source, classes, dropout=params["dropout"],
                                  freeze_embeddings=params["freeze_embeddings"])
    shape = SHAPES["classification"]
    train_set = TokenizedDataset.rows(sequences, labels, train_rows)
    val_rows = sorted(val_rows, key=lambda i: len(sequences[i]))
    val_set = TokenizedDataset.rows(sequences, labels, val_rows)
    with tempfile.TemporaryDirectory() as folder:
        params = {**params, "lr": learning_rate(params["lr"], model, params["lora_rank"], say=lambda *_: None)}
        args = training_arguments(params, NO_CHECKPOINTS, folder, "cpu", params["effective_batch_size"], 1)
        extra, callbacks = techniques.plug_in(params, model, args, shape, classes,
                                              [labels[i] for i in train_rows], say=lambda *a: None)
        throughput, scores = Throughput(), ValidationScores(shape)
        trainer = CountingTrainer(model=model, args=args, train_dataset=train_set, eval_dataset=val_set,
                                  data_collator=make_collator(tokenizer, "cpu"), compute_metrics=scores,
                                  callbacks=callbacks, throughput=throughput, **extra)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        if not evaluated_at_end(trainer.state):
            trainer.evaluate()
    return scores.latest["f1_macro"], throughput.seconds


def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def best_combination(results):
    """Of each family, the row with the largest mean gain over the defaults, if above 0: merged settings."""
    base = statistics.mean(results["defaults"]["f1"])
    chosen = {}
    for name, family, settings in ROWS[1:]:
        gain = statistics.mean(results[name]["f1"]) - base
        if gain > 0 and (family not in chosen or gain > chosen[family][0]):
            chosen[family] = (gain, name, settings)
    merged = {}
    for _, _, settings in chosen.values():
        merged.update(settings)
    return merged, [name for _, name, _ in chosen.values()]


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.techniques", description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2000, help="training rows (default 2000)")
    parser.add_argument("--val", type=int, default=1000, help="validation rows (default 1000)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--only", nargs="*", help="row names to run (a prefix each); default all")
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    base = {**load_params("train", TRAIN_PARAMS), "epochs": options.epochs, "mixed_precision": False,
            "batch_size": "auto"}
    texts, labels, _ = load_corpus(load_params("preprocess"))
    source = resolve_model("minilm")
    tokenizer, _ = load_model(source, ["0", "1", "2"])
    train_rows, val_rows = sample(texts, labels, options.train, options.val)
    sequences, _ = tokenize_texts(tokenizer, texts, MAX_LENGTH)
    data = (sequences, labels, train_rows, val_rows)
    classes = ["0", "1", "2"]
    rows = [r for r in ROWS if not options.only or r[0] == "defaults" or any(r[0].startswith(o) for o in options.only)]
    print(f"{len(train_rows):,} train / {len(val_rows):,} validation tweets, {options.epochs:g} epoch(s), "
          f"seeds {options.seeds}, {options.threads} thread(s); load average {load_average()}", flush=True)
    results = {name: {"f1": [], "ratio": [], "seconds": []} for name, _, _ in rows}
    for seed in options.seeds:
        seconds_of = {}
        for name, _, settings in [*rows, rows[0]]:  # the defaults first and last: the load may change in between
            start = time.perf_counter()
            f1, seconds = run(settings, base, seed, source, data, classes)
            print(f"seed {seed} {name}: macro-F1 {f1:.4f}, epoch {seconds:.1f} s "
                  f"({time.perf_counter() - start:.0f} s with loading and evaluation)", flush=True)
            if name in seconds_of:  # the second defaults run: the same seed, so the same score
                seconds_of[name] = (seconds_of[name] + seconds) / 2
                continue
            seconds_of[name] = seconds
            results[name]["f1"].append(f1)
        for name in seconds_of:  # relative to the mean of the two defaults runs around them
            results[name]["ratio"].append(seconds_of[name] / seconds_of["defaults"])
            results[name]["seconds"].append(seconds_of["defaults"] if name == "defaults" else seconds_of[name])
    combined, names = best_combination(results) if len(rows) == len(ROWS) else ({}, [])
    if len(names) > 1:  # one name alone is a row already
        label = "best combination: " + " + ".join(names)
        results[label] = {"f1": [], "ratio": []}
        for seed, s_base in zip(options.seeds, results["defaults"]["seconds"]):
            f1, seconds = run(combined, base, seed, source, data, classes)
            results[label]["f1"].append(f1)
            results[label]["ratio"].append(seconds / s_base)
            print(f"seed {seed} {label}: macro-F1 {f1:.4f}, {seconds / s_base:.2f}x the defaults' epoch", flush=True)
    elif len(rows) == len(ROWS):
        print("best combination: " + (f"{names[0]} alone (one family gained)" if names else "none gained over the defaults"))
    print(f"\nload average at the end {load_average()}\n")
    base_f1 = results["defaults"]["f1"]
    print("| setting | val macro-F1 (mean ± std) | gain | time per epoch |\n|---|---|---|---|")
    for name, result in results.items():
        mean, std = mean_std(result["f1"])
        gains = [a - b for a, b in zip(result["f1"], base_f1)]
        gain = "" if name == "defaults" else f"{statistics.mean(gains):+.4f}"
        print(f"| {name} | {mean:.4f} ± {std:.4f} | {gain} | {statistics.mean(result['ratio']):.2f}x |")


if __name__ == "__main__":
    main()
