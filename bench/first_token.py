"""Predicting with the last layer computing the first token only (training/first_token.py) against the full
last layer: the embedded MiniLM over the embedded test tweets, tokenized as the tokenize stage does, in
batches as predict_test makes them; in the order full, first token, first token, full, full, first token,
so that a change in the machine's load affects both alike, after an untimed warm-up of each. Prints rows/s of each, the ratio, and the
largest difference between the two sides' logits. (Training's side by side: python -m bench.candidates
--only full_last_layer.)

    python -m bench.first_token
"""
import argparse
import os
import time

import torch
from transformers import AutoTokenizer
from transformers import logging as hf_logging

from bench.common import REPO, load_average, load_corpus, minilm_model, recipe, stage_max_length
from pipeline.settings import load_params
from predicting.inference import make_collator, predict_logits
from reading.tokens import tokenize_texts
from stages.preprocess import PREPROCESS_PARAMS
from stages.tokenize import TOKENIZE_PARAMS
from stages.train import TRAIN_PARAMS
from training import first_token
from modeling.models import resolve_model
from modeling.precision import cpu_isa

ORDER = (False, True, True, False, False, True)  # first token only?


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, help="predict only the first ROWS test texts (default: all)")
    parser.add_argument("--batch", type=int, default=64, help="texts per batch (predict_test: twice the training batch)")
    opts = parser.parse_args()
    hf_logging.disable_progress_bar()
    os.chdir(REPO)
    source = resolve_model("minilm")
    tokenizer = AutoTokenizer.from_pretrained(source)
    train_texts, _, texts = load_corpus(load_params("preprocess", PREPROCESS_PARAMS))
    texts = texts[:opts.rows]
    tokenize = load_params("tokenize", TOKENIZE_PARAMS)
    max_length = stage_max_length(tokenizer, source, train_texts, tokenize)
    sequences, _ = tokenize_texts(tokenizer, texts, max_length)
    model = minilm_model(**recipe(load_params("train", TRAIN_PARAMS)))
    collator = make_collator(tokenizer, "cpu")
    print(f"predicting {len(sequences):,} test texts (max_length {max_length}) in batches of {opts.batch} on cpu "
          f"({cpu_isa()}), {torch.get_num_threads()} torch threads, load average {load_average()}; fp32")
    print(first_token.choose(model, first_token.check_batch(collator, sequences)))
    layer = first_token.last_layer(model)
    seconds, logits = {False: 0.0, True: 0.0}, {}
    for cut in (False, True):  # untimed: the first calls of each shape pick kernels and grow the allocator
        (first_token.enable if cut else first_token.disable)(layer)
        predict_logits(model, collator, sequences[:4 * opts.batch], opts.batch, "cpu")
    for cut in ORDER:
        (first_token.enable if cut else first_token.disable)(layer)
        start = time.perf_counter()
        logits[cut] = predict_logits(model, collator, sequences, opts.batch, "cpu")
        seconds[cut] += time.perf_counter() - start
    runs = ORDER.count(True)
    full, cut = (runs * len(sequences) / seconds[side] for side in (False, True))
    print(f"first token only {cut:.0f} rows/s vs the full last layer {full:.0f} rows/s, {runs} runs each: "
          f"{cut / full:.2f}x; largest logit difference {(logits[True] - logits[False]).abs().max().item():.1e} "
          f"(load average {load_average()})")


if __name__ == "__main__":
    main()
