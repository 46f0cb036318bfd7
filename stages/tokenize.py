"""tokenize: turn the processed CSVs into token ids with the model's fast tokenizer.

Reads data/processed/; writes data/tokenized/{train,val,test}.safetensors (unpadded: padding
happens per batch at training time) and reports/tokenize/lengths.json, the token-length
statistics and the max_length used (chosen from the train lengths when tokenize.max_length is auto).
"""
import gc
import json
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from stages.common import (PipelineError, atomic_dir, load_params, model_params, pack_sequences,
                           read_csv, resolve_model, run_main, write_json)

PROCESSED = Path("data/processed")
OUT = Path("data/tokenized")
METRICS = Path("reports/tokenize/lengths.json")
SPLITS = ("train", "val", "test")
# what each tokenize.* key accepts; load_params turns anything else into a one-line error
TOKENIZE_PARAMS = {"max_length": (int, "auto"), "length_percentile": (float,)}


@contextmanager
def gc_paused():
    """Pause Python's cycle collector: turning the tokenizer's output into a list per text creates
    tens of thousands of lists, each creation counting towards a collection that walks the whole
    heap, and none can be part of a cycle. About a fifth faster on the embedded corpus."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def encode(tokenizer, texts, **options):
    """Token ids of each text, from one batched call to the fast (Rust) tokenizer. Only the ids are
    asked for: building attention masks and token type ids for every text costs about a fifth more."""
    with gc_paused():
        encoded = tokenizer(texts, return_attention_mask=False, return_token_type_ids=False, **options)
    return encoded["input_ids"]


def truncate(tokenizer, texts, ids, max_length):
    """ids cut to max_length. Only the few texts that are too long are tokenized again, with
    truncation=True: the tokenizer then keeps the closing special tokens a plain cut would drop."""
    long = [i for i, seq in enumerate(ids) if len(seq) > max_length]
    if not long:
        return ids
    cut = encode(tokenizer, [texts[i] for i in long], truncation=True, max_length=max_length)
    ids = list(ids)
    for i, seq in zip(long, cut):
        ids[i] = seq
    return ids


def tokenize_texts(tokenizer, texts, max_length):
    """(token ids cut to max_length, full lengths) for a list of texts, in one batched call."""
    full = encode(tokenizer, texts, verbose=False)  # verbose=False: no warning for >512 tokens
    return truncate(tokenizer, texts, full, max_length), [len(ids) for ids in full]


def auto_max_length(lengths, percentile, limit):
    """The `percentile` of the token lengths, rounded up to a multiple of 8 (tensor cores and
    vector units work in multiples of 8), at most `limit` (the model's longest input)."""
    value = float(np.percentile(lengths, percentile))
    return int(min(8 * math.ceil(value / 8), limit))


def model_limit(tokenizer, config):
    """The longest input the model takes. A tokenizer without a limit reports a huge sentinel."""
    return min(tokenizer.model_max_length, getattr(config, "max_position_embeddings", float("inf")))


def length_stats(lengths, max_length):
    lengths = np.asarray(lengths)
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"p50": round(p50, 1), "p90": round(p90, 1), "p99": round(p99, 1), "max": int(lengths.max()),
            "truncated_fraction": round(float((lengths > max_length).mean()), 4)}


def label_ids(labels, label_list):
    """Label names to indices; an empty label (unlabelled test row) becomes -1."""
    index = {name: i for i, name in enumerate(label_list)}
    return [index[name] if name != "" else -1 for name in labels]


def main():
    model = model_params()
    model_name, remote_code = model["name"], model["trust_remote_code"]
    params = load_params("tokenize", TOKENIZE_PARAMS)
    max_length, percentile = params["max_length"], params["length_percentile"]
    if max_length != "auto" and max_length < 2:
        raise PipelineError(f"tokenize.max_length must be auto or at least 2 ([CLS], [SEP]), not {max_length}")
    if not 0 < percentile <= 100:
        raise PipelineError(f"tokenize.length_percentile must be above 0 and at most 100, not {percentile}")
    label_list = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))
    model_source = resolve_model(model_name)  # once: for a hub id it asks the hub
    tokenizer = AutoTokenizer.from_pretrained(model_source, trust_remote_code=remote_code)
    if not tokenizer.is_fast:
        raise PipelineError(f"model.name {model_name!r} has no fast tokenizer; pick a model that has one")

    frames = {s: read_csv(PROCESSED / f"{s}.csv") for s in SPLITS if (PROCESSED / f"{s}.csv").exists()}
    texts = {s: df["text"].tolist() for s, df in frames.items()}
    full = {s: encode(tokenizer, t, verbose=False) for s, t in texts.items()}
    lengths = {s: [len(ids) for ids in seqs] for s, seqs in full.items()}
    if max_length == "auto":
        limit = model_limit(tokenizer, AutoConfig.from_pretrained(model_source, trust_remote_code=remote_code))
        max_length = auto_max_length(lengths["train"], percentile, limit)
        print(f"max_length auto: {max_length} (p{percentile} of the train texts' token lengths, "
              f"rounded up to a multiple of 8, at most the model's {limit})")
    else:
        percentile = None  # not used: the metrics say so
    stats = {"max_length": max_length, "max_length_percentile": percentile}

    with atomic_dir(OUT) as tmp:
        for split, df in frames.items():
            ids = truncate(tokenizer, texts[split], full[split], max_length)
            save_file(pack_sequences(ids, label_ids(df["label"], label_list)), tmp / f"{split}.safetensors")
            stats[split] = length_stats(lengths[split], max_length)
            print(f"{split}: {len(ids)} texts, token length {stats[split]}")
    write_json(METRICS, stats)


if __name__ == "__main__":
    run_main(main)
