"""tokenize: turn the processed CSVs into token ids with the model's fast tokenizer.

Reads data/processed/; writes data/tokenized/{train,test}.safetensors (unpadded: padding happens
per batch at training time; labels encoded as the task shape trains on them), data/tokenized/settings.json
(the max_length used, which the train stage keeps beside each model) and reports/tokenize/lengths.json,
the token-length statistics and the max_length (chosen from the train lengths when tokenize.max_length
is auto), under "tokens". The train stage reads only train.safetensors: a new test file retrains nothing.

Text pairs go to the tokenizer as pairs ([CLS] a [SEP] b [SEP]); their segment ids (token_type_ids) are
stored beside the token ids when the model takes them. Several text columns joined by preprocess get
the tokenizer's separator token between them.

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
import pandas as pd
import torch
from safetensors.torch import save_file
import transformers
from transformers import AutoConfig, AutoTokenizer

from stages.common import PipelineError, Range, atomic_dir, interactive, load_params, run_main, write_json
from stages.csvfiles import COLUMN_JOIN, read_csv_chunks
from stages.models import model_params, resolve_model
from stages.tasks import SHAPES

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


def encode(tokenizer, texts, types=False, **options):
    """Token ids of each text (texts: a list, or a tuple of two lists for text pairs), from one batched
    call to the fast (Rust) tokenizer; with types, (ids, segment ids). Nothing else is asked for:
    building attention masks for every text costs about a tenth more."""
    texts, pairs = texts if isinstance(texts, tuple) else (texts, None)
    with gc_paused():
        encoded = tokenizer(texts, pairs, return_attention_mask=False, return_token_type_ids=types, **options)
    return (encoded["input_ids"], encoded["token_type_ids"]) if types else encoded["input_ids"]


def uses_types(tokenizer, pair):
    """Whether to keep segment ids: for text pairs, where the model takes them (BERT does, RoBERTa not)."""
    return pair and "token_type_ids" in tokenizer.model_input_names


def joined(texts, tokenizer):
    """Texts of several columns (csvfiles.COLUMN_JOIN between them) with the tokenizer's separator token."""
    separator = f" {tokenizer.sep_token or chr(10)} "
    return [text.replace(COLUMN_JOIN, separator) for text in texts]


def model_inputs(frame, tokenizer):
    """What encode takes for the rows of a processed frame: the texts, or (texts, second texts) for pairs."""
    texts = joined(frame["text"].tolist(), tokenizer)
    return (texts, joined(frame["text_pair"].tolist(), tokenizer)) if "text_pair" in frame else texts


def chunks(items, size=CHUNK):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def encode_flat(tokenizer, text_chunks, capacity, types=False):
    """(flat int32 token ids of every text, uncut, one after the other; int64 length of each), from
    texts given a list (or a pair of lists) at a time. With types, flat is (2, tokens): ids, then
    segment ids. The ids go straight into one array of `capacity` ids, an upper bound on what the
    texts make: memory it never fills is never touched, so it costs nothing, and no second copy is
    made by joining chunks (a tokenizer that beats the bound is met with a bigger array, a copy,
    rather than a failure)."""
    rows = (2,) if types else ()
    flat, lengths, filled = np.empty((*rows, capacity), dtype=np.int32), [], 0
    for texts in text_chunks:
        encoded = encode(tokenizer, texts, types, verbose=False)  # verbose=False: no warning for >512 tokens
        parts = encoded if types else (encoded,)
        lengths.append(np.fromiter(map(len, parts[0]), dtype=np.int64, count=len(parts[0])))
        total = int(lengths[-1].sum())
        if filled + total > flat.shape[-1]:
            flat = np.concatenate([flat[..., :filled], np.empty((*rows, 2 * (filled + total) - filled), np.int32)], axis=-1)
        for row, part in enumerate(parts):
            flat[(row,) * bool(rows) + (slice(filled, filled + total),)] = np.fromiter(
                itertools.chain.from_iterable(part), dtype=np.int32, count=total)
        filled += total
    return flat[..., :filled], (np.concatenate(lengths) if lengths else np.empty(0, dtype=np.int64))


def truncate_flat(tokenizer, flat, lengths, max_length, texts_at, block=1 << 20):
    """(flat ids, lengths) with every text cut to max_length. In place: cut texts only get shorter,
    so flat is compacted leftwards, `block` ids at a time, and no second copy of the ids is ever
    held; the ids returned are a view of flat. Only the few texts that are too long are tokenized
    again, with truncation=True (the tokenizer then keeps the closing special tokens a plain cut
    would drop); texts_at(rows) gives their texts. flat may be (2, tokens) (encode_flat's with types)."""
    long = np.flatnonzero(lengths > max_length)
    if not len(long):
        return flat, lengths
    types = flat.ndim == 2
    cut = encode(tokenizer, texts_at(long.tolist()), types, truncation=True, max_length=max_length)
    cut = [np.array(row) for row in zip(*cut)] if types else cut  # each text's ids (and segment ids)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    write = int(offsets[long[0]])  # everything before the first long text stays where it is
    for k, (i, ids) in enumerate(zip(long, cut)):
        n = np.shape(ids)[-1]
        flat[..., write:write + n] = ids  # fits in text i's old place: write <= its start, ids shorter
        write += n
        start, stop = int(offsets[i + 1]), int(offsets[long[k + 1]] if k + 1 < len(long) else offsets[-1])
        for a in range(start, stop, block):  # the texts up to the next long one, moved left, left to right
            b = min(a + block, stop)
            flat[..., write:write + b - a] = flat[..., a:b]
            write += b - a
    lengths = lengths.copy()
    lengths[long] = [np.shape(ids)[-1] for ids in cut]
    return flat[..., :write], lengths


def tokenize_texts(tokenizer, texts, max_length, pairs=None, types=False):
    """(token id lists cut to max_length, full lengths) of a list of texts (and of their second texts:
    pairs), as the stage makes them; with types, (token id lists, segment id lists, full lengths)."""
    capacity = sum(len(text.encode("utf-8")) + 8 for text in texts + (pairs or []))  # a token holds a byte or more
    pick = (lambda rows: [texts[i] for i in rows]) if pairs is None else \
        (lambda rows: ([texts[i] for i in rows], [pairs[i] for i in rows]))
    flat, full = encode_flat(tokenizer, (pick(rows) for rows in chunks(range(len(texts)))), capacity, types)
    flat, lengths = truncate_flat(tokenizer, flat, full, max_length, pick)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    rows = [[part[a:b] for a, b in zip(offsets[:-1], offsets[1:])] for part in np.atleast_2d(flat).tolist()]
    return (*rows, full.tolist()) if types else (rows[0], full.tolist())


def encode_csv(tokenizer, path, label_list, shape=SHAPES["classification"], types=False):
    """(flat token ids, lengths, labels as the shape encodes them) of a processed CSV, read and tokenized
    CHUNK rows at a time: neither the file nor its texts are ever in memory at once."""
    labels = []

    def texts():
        for frame in read_csv_chunks(path, CHUNK):
            labels.extend(shape.encode(frame["label"], label_list).tolist())
            yield model_inputs(frame, tokenizer)

    # each text's tokens are at most its bytes plus a few special tokens; a row is 6 bytes or more
    flat, lengths = encode_flat(tokenizer, texts(), capacity=3 * path.stat().st_size + 1024, types=types)
    return flat, lengths, labels


def texts_at(path, rows, tokenizer=None):
    """What encode takes for some rows of a processed CSV (positions, ascending), read CHUNK rows at a
    time: their texts (joined columns with the tokenizer's separator), or (texts, second texts)."""
    wanted, found = set(rows), []
    for frame in read_csv_chunks(path, CHUNK):
        found.append(frame[frame.index.isin(wanted)])
    frame = pd.concat(found).loc[rows]
    return model_inputs(frame, tokenizer) if tokenizer is not None else frame["text"].tolist()


def packed(flat, lengths, labels):
    """The tensors of a tokenized split, as common.pack_sequences makes them from lists: flat (tokens,)
    token ids, or (2, tokens) token ids and segment ids."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    labels = np.asarray(labels)
    tensors = {"input_ids": torch.from_numpy(np.ascontiguousarray(np.atleast_2d(flat)[0])),
               "offsets": torch.from_numpy(offsets),
               "labels": torch.from_numpy(labels.astype(np.int64 if labels.dtype.kind in "iu" or not labels.size
                                                        else np.float32))}
    if flat.ndim == 2:
        tensors["token_type_ids"] = torch.from_numpy(np.ascontiguousarray(flat[1]))
    return tensors


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
    return SHAPES["classification"].encode(labels, label_list).tolist()


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
    shape = json.loads((PROCESSED / "shape.json").read_text(encoding="utf-8"))
    types = uses_types(tokenizer, bool(shape["pair_columns"]))

    paths = [PROCESSED / f"{split}.csv" for split in SPLITS if (PROCESSED / f"{split}.csv").exists()]
    # (flat ids, lengths, labels) of each split
    encoded = {path.stem: encode_csv(tokenizer, path, label_list, SHAPES[shape["kind"]], types) for path in paths}
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
            cut, cut_lengths = truncate_flat(tokenizer, flat, lengths, max_length,
                                             lambda rows: texts_at(path, rows, tokenizer))
            save_file(packed(cut, cut_lengths, labels), tmp / f"{path.stem}.safetensors")
            stats[path.stem] = split = length_stats(lengths, max_length)
            print(f"{path.stem}: {len(lengths):,} texts, token length p50 {split['p50']:g}, p99 {split['p99']:g}, "
                  f"max {split['max']}; {split['truncated_fraction']:.2%} cut at {max_length}")
        write_json(tmp / "settings.json", {"max_length": max_length})
    # under one name, so that `dvc metrics show` reads tokens.test.max, not a test.max beside evaluate's test.accuracy
    write_json(METRICS, {"tokens": stats})
    return [OUT, METRICS]


if __name__ == "__main__":
    run_main(main)
