"""tokenize: turn the processed CSVs into token ids with the model's fast tokenizer.

Reads data/processed/; writes data/tokenized/{train,test}.safetensors (unpadded: padding happens
per batch at training time) and reports/tokenize/lengths.json, the token-length statistics and the
max_length used (chosen from the train lengths when tokenize.max_length is auto), under "tokens".

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
from stages.csvfiles import read_csv_chunks
from stages.models import model_params, resolve_model

PROCESSED = Path("data/processed")
OUT = Path("data/tokenized")
METRICS = Path("reports/tokenize/lengths.json")
SPLITS = ("train", "test")
CHUNK = 2048  # texts per tokenizer call: enough for its threads, few enough that its lists stay small
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


def chunks(items, size=CHUNK):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def encode_flat(tokenizer, text_chunks, capacity):
    """(flat int32 token ids of every text, uncut, one after the other; int64 length of each), from
    texts given a list at a time. The ids go straight into one array of `capacity` ids, an upper
    bound on what the texts make: memory it never fills is never touched, so it costs nothing,
    and no second copy is made by joining chunks (a tokenizer that beats the bound is met with a
    bigger array, a copy, rather than a failure)."""
    flat, lengths, filled = np.empty(capacity, dtype=np.int32), [], 0
    for texts in text_chunks:
        ids = encode(tokenizer, texts, verbose=False)  # verbose=False: no warning for >512 tokens
        lengths.append(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)))
        total = int(lengths[-1].sum())
        if filled + total > len(flat):
            flat = np.resize(flat, 2 * (filled + total))
        flat[filled:filled + total] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
        filled += total
    return flat[:filled], (np.concatenate(lengths) if lengths else np.empty(0, dtype=np.int64))


def truncate_flat(tokenizer, flat, lengths, max_length, texts_at, block=1 << 20):
    """(flat ids, lengths) with every text cut to max_length. In place: cut texts only get shorter,
    so flat is compacted leftwards, `block` ids at a time, and no second copy of the ids is ever
    held; the ids returned are a view of flat. Only the few texts that are too long are tokenized
    again, with truncation=True (the tokenizer then keeps the closing special tokens a plain cut
    would drop); texts_at(rows) gives their texts."""
    long = np.flatnonzero(lengths > max_length)
    if not len(long):
        return flat, lengths
    cut = encode(tokenizer, texts_at(long.tolist()), truncation=True, max_length=max_length)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    write = int(offsets[long[0]])  # everything before the first long text stays where it is
    for k, (i, ids) in enumerate(zip(long, cut)):
        flat[write:write + len(ids)] = ids  # fits in text i's old place: write <= its start, ids shorter
        write += len(ids)
        start, stop = int(offsets[i + 1]), int(offsets[long[k + 1]] if k + 1 < len(long) else offsets[-1])
        for a in range(start, stop, block):  # the texts up to the next long one, moved left, left to right
            b = min(a + block, stop)
            flat[write:write + b - a] = flat[a:b]
            write += b - a
    lengths = lengths.copy()
    lengths[long] = [len(ids) for ids in cut]
    return flat[:write], lengths


def tokenize_texts(tokenizer, texts, max_length):
    """(token id lists cut to max_length, full lengths) of a list of texts, as the stage makes them."""
    capacity = sum(len(text.encode("utf-8")) + 8 for text in texts)  # a token holds at least one byte
    flat, full = encode_flat(tokenizer, chunks(texts), capacity)
    flat, lengths = truncate_flat(tokenizer, flat, full, max_length, lambda rows: [texts[i] for i in rows])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    ids = flat.tolist()
    return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])], full.tolist()


def encode_csv(tokenizer, path, label_list):
    """(flat token ids, lengths, label ids) of a processed CSV, read and tokenized CHUNK rows at a time:
    neither the file nor its texts are ever in memory at once."""
    labels = []

    def texts():
        for frame in read_csv_chunks(path, CHUNK):
            labels.extend(label_ids(frame["label"], label_list))
            yield frame["text"].tolist()

    # each text's tokens are at most its bytes plus a few special tokens; a row is 6 bytes or more
    flat, lengths = encode_flat(tokenizer, texts(), capacity=3 * path.stat().st_size + 1024)
    return flat, lengths, labels


def texts_at(path, rows):
    """The texts of some rows of a processed CSV (positions, ascending), read CHUNK rows at a time."""
    wanted, found = set(rows), {}
    for frame in read_csv_chunks(path, CHUNK):
        found.update((i, text) for i, text in zip(frame.index, frame["text"]) if i in wanted)
    return [found[i] for i in rows]


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

    paths = [PROCESSED / f"{split}.csv" for split in SPLITS if (PROCESSED / f"{split}.csv").exists()]
    encoded = {path.stem: encode_csv(tokenizer, path, label_list) for path in paths}  # (flat ids, lengths, labels)
    if max_length == "auto":
        max_length = auto_max_length(encoded["train"][1], percentile, limit)
        print(f"max_length auto: {max_length} (p{percentile:g} of the train texts' token lengths, "
              f"rounded up to a multiple of 8, at most the model's {limit})")
    else:
        percentile = None  # not used: the metrics say so
    stats = {"max_length": max_length, "max_length_percentile": percentile}

    with atomic_dir(OUT) as tmp:
        for path in paths:
            flat, lengths, labels = encoded.pop(path.stem)
            cut, cut_lengths = truncate_flat(tokenizer, flat, lengths, max_length, lambda rows: texts_at(path, rows))
            save_file(packed(cut, cut_lengths, labels), tmp / f"{path.stem}.safetensors")
            stats[path.stem] = split = length_stats(lengths, max_length)
            print(f"{path.stem}: {len(lengths):,} texts, token length p50 {split['p50']:g}, p99 {split['p99']:g}, "
                  f"max {split['max']}; {split['truncated_fraction']:.2%} cut at {max_length}")
    # under one name, so that `dvc metrics show` reads tokens.test.max, not a test.max beside evaluate's test.accuracy
    write_json(METRICS, {"tokens": stats})
    return [OUT, METRICS]


if __name__ == "__main__":
    run_main(main)
