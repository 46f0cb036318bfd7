"""tokenize: turn the processed CSVs into token ids with the model's fast tokenizer.

Reads data/processed/; writes data/tokenized/{train,test}.safetensors (unpadded: padding happens
per batch at training time) and reports/tokenize/lengths.json, the token-length statistics and the
max_length used (chosen from the train lengths when tokenize.max_length is auto).

Texts are tokenized CHUNK at a time into flat int32 arrays, so memory grows by 4 bytes per token
with the data, not by the ~6 KB per text that the tokenizer's Python lists take.
"""
import gc
import itertools
import json
import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
import transformers
from transformers import AutoConfig, AutoTokenizer

from stages.common import PipelineError, Range, atomic_dir, interactive, load_params, run_main, write_json
from stages.csvfiles import read_csv
from stages.models import model_params, resolve_model

PROCESSED = Path("data/processed")
OUT = Path("data/tokenized")
METRICS = Path("reports/tokenize/lengths.json")
SPLITS = ("train", "test")
CHUNK = 8192  # texts per tokenizer call: big enough for its threads, small enough that its lists stay small
# what each tokenize.* key accepts; load_params turns anything else into a one-line error
TOKENIZE_PARAMS = {"max_length": (int, "auto", Range(2)),  # room for [CLS] and [SEP]
                   "length_percentile": (float, Range(0, 100, low_open=True))}


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


def encode_flat(tokenizer, texts, chunk=CHUNK):
    """(flat int32 token ids of every text, uncut, one after the other; int64 length of each)."""
    flats, lengths = [], []
    for start in range(0, len(texts), chunk):
        ids = encode(tokenizer, texts[start:start + chunk], verbose=False)  # verbose: no >512 warning
        lengths.append(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)))
        flats.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths[-1].sum())))
    return (np.concatenate(flats) if flats else np.empty(0, np.int32),
            np.concatenate(lengths) if lengths else np.empty(0, np.int64))


def truncate_flat(tokenizer, texts, flat, lengths, max_length):
    """(flat ids, lengths) with every text cut to max_length. Only the few texts that are too long
    are tokenized again, with truncation=True: the tokenizer then keeps the closing special tokens
    that a plain cut would drop."""
    long = np.flatnonzero(lengths > max_length)
    if not len(long):
        return flat, lengths
    cut = encode(tokenizer, [texts[i] for i in long], truncation=True, max_length=max_length)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    pieces, kept = [], 0  # kept: the first text not yet copied
    for i, ids in zip(long, cut):
        pieces += [flat[offsets[kept]:offsets[i]], np.asarray(ids, dtype=np.int32)]
        kept = i + 1
    pieces.append(flat[offsets[kept]:])
    lengths = lengths.copy()
    lengths[long] = [len(ids) for ids in cut]
    return np.concatenate(pieces), lengths


def tokenize_texts(tokenizer, texts, max_length):
    """(token id lists cut to max_length, full lengths): encode_flat and truncate_flat as lists."""
    flat, full = encode_flat(tokenizer, texts)
    flat, lengths = truncate_flat(tokenizer, texts, flat, full, max_length)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    ids = flat.tolist()
    return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])], full.tolist()


def packed(flat, lengths, labels):
    """The tensors of a tokenized split, as common.pack_sequences makes them from lists."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return {"input_ids": torch.from_numpy(flat), "offsets": torch.from_numpy(offsets),
            "labels": torch.tensor(labels, dtype=torch.int64)}


def auto_max_length(lengths, percentile, limit):
    """The `percentile` of the token lengths, rounded up to a multiple of 8 (tensor cores and
    vector units work in multiples of 8), at most `limit` (the model's longest input)."""
    value = float(np.percentile(lengths, percentile))
    return int(min(8 * math.ceil(value / 8), limit))


def model_limit(tokenizer, config):
    """The longest input the model takes. A tokenizer without a limit reports a huge sentinel."""
    return min(tokenizer.model_max_length, getattr(config, "max_position_embeddings", float("inf")))


def length_stats(lengths, max_length):
    """Percentiles of the token lengths and the share max_length cuts, as plain Python numbers."""
    lengths = np.asarray(lengths)
    p50, p90, p99 = (round(float(p), 1) for p in np.percentile(lengths, [50, 90, 99]))
    return {"p50": p50, "p90": p90, "p99": p99, "max": int(lengths.max()),
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
    if not interactive():  # a download's progress bar: one endless line in a log
        transformers.utils.logging.disable_progress_bar()
    model_source = resolve_model(model_name)  # once: for a hub id it asks the hub
    tokenizer = AutoTokenizer.from_pretrained(model_source, trust_remote_code=remote_code)
    if not tokenizer.is_fast:
        raise PipelineError(f"model.name {model_name!r} has no fast tokenizer; pick a model that has one")
    limit = model_limit(tokenizer, AutoConfig.from_pretrained(model_source, trust_remote_code=remote_code))
    if max_length != "auto" and max_length > limit:  # the model would fail on its first long batch
        raise PipelineError(f"params.yaml: tokenize.max_length {max_length} is more than model.name "
                            f"{model_name!r} takes ({limit} tokens): set it to at most {limit}, or auto")
    label_list = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))

    splits = [s for s in SPLITS if (PROCESSED / f"{s}.csv").exists()]
    frames = {s: read_csv(PROCESSED / f"{s}.csv") for s in splits}
    full = {s: encode_flat(tokenizer, frames[s]["text"].tolist()) for s in splits}  # (flat ids, lengths)
    if max_length == "auto":
        max_length = auto_max_length(full["train"][1], percentile, limit)
        print(f"max_length auto: {max_length} (p{percentile:g} of the train texts' token lengths, "
              f"rounded up to a multiple of 8, at most the model's {limit})")
    else:
        percentile = None  # not used: the metrics say so
    stats = {"max_length": max_length, "max_length_percentile": percentile}

    with atomic_dir(OUT) as tmp:
        for split in splits:
            texts, (flat, lengths) = frames[split]["text"].tolist(), full.pop(split)
            cut, cut_lengths = truncate_flat(tokenizer, texts, flat, lengths, max_length)
            labels = label_ids(frames[split]["label"], label_list)
            save_file(packed(cut, cut_lengths, labels), tmp / f"{split}.safetensors")
            stats[split] = length_stats(lengths, max_length)
            print(f"{split}: {len(lengths):,} texts, token length p50 {stats[split]['p50']:g}, p99 "
                  f"{stats[split]['p99']:g}, max {stats[split]['max']}; {stats[split]['truncated_fraction']:.2%} "
                  f"cut at {max_length}")
    write_json(METRICS, stats)
    return [OUT, METRICS]


if __name__ == "__main__":
    run_main(main)
