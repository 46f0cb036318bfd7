"""Tokenizing texts as the tokenize stage does (one batched call to the fast tokenizer per chunk,
ids written straight into one flat array, long texts cut again with truncation), and the format of
a tokenized split: variable-length token ids as flat tensors, no padding stored and no pickle needed."""
import gc
import itertools
import math
from contextlib import contextmanager

import numpy as np
import torch

from reading.csvfiles import COLUMN_JOIN
from reading.windows import Cutting, row_positions


def pack_sequences(sequences, labels, token_types=None):
    """Variable-length token ids as flat tensors: no padding stored, no pickle needed to load. Labels are
    class ids (int64), or floats (multi-label rows, regression targets); token_types, segment ids of
    text pairs, are stored the same way as the ids."""
    import torch  # here, not at the top: fetch and preprocess need no torch

    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat = [token for s in sequences for token in s]
    floats = any(isinstance(y, (float, list)) for y in labels)
    tensors = {"input_ids": torch.tensor(flat, dtype=torch.int32), "offsets": offsets,
               "labels": torch.tensor(labels, dtype=torch.float32 if floats else torch.int64)}
    if token_types is not None:
        tensors["token_type_ids"] = torch.tensor([t for s in token_types for t in s], dtype=torch.int32)
    return tensors


def unpack_sequences(tensors):
    """Inverse of pack_sequences: (list of token id lists, list of labels; -1 or NaN = no label)."""
    return unpack_flat(tensors, "input_ids"), tensors["labels"].tolist()


def unpack_flat(tensors, name):
    """The lists of one flat tensor of pack_sequences (input_ids, token_type_ids); None when absent."""
    if name not in tensors:
        return None
    ids, offsets = tensors[name].tolist(), tensors["offsets"].tolist()
    return [ids[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


CHUNK = 2048  # texts per tokenizer call: enough for its threads, few enough that its lists stay small


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


def cut_flat(tokenizer, flat, lengths, max_length, texts_at, cutting):
    """(flat ids, lengths, text of each row) with every text longer than max_length cut as `cutting` says
    (reading/windows.py): into one row (tail, head_tail) or several (windows). The long texts are tokenized
    again, whole, for the tokenizer's sequence ids (where the first text's tokens are); texts_at(rows)
    gives them. Not in place: windows may hold more ids than their text, so one new array is made.
    flat may be (2, tokens) (encode_flat's with types). A text that cannot be cut (a second text that
    fills max_length alone, a head_tokens or stride too large) raises ValueError naming its row."""
    long = np.flatnonzero(lengths > max_length)
    rows = np.arange(len(lengths))
    if not len(long):
        return flat, lengths, rows
    texts = texts_at(long.tolist())
    texts, pairs = texts if isinstance(texts, tuple) else (texts, None)
    types = flat.ndim == 2
    with gc_paused():
        encoded = tokenizer(texts, pairs, return_attention_mask=False, return_token_type_ids=types, verbose=False)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    parts, part_lengths, owners, done = [], [], [], 0
    for k, i in enumerate(long):
        kept = row_positions(encoded.sequence_ids(k), max_length, cutting)
        if isinstance(kept, str):
            raise ValueError(f"row {i}: {kept}")
        ids = np.array([encoded["input_ids"][k], encoded["token_type_ids"][k]] if types else encoded["input_ids"][k],
                       dtype=np.int32)
        parts += [flat[..., offsets[done]:offsets[i]], *(ids[..., at] for at in kept)]
        part_lengths += [lengths[done:i], [len(at) for at in kept]]
        owners += [rows[done:i], np.full(len(kept), i)]
        done = i + 1
    parts.append(flat[..., offsets[done]:])
    part_lengths.append(lengths[done:])
    owners.append(rows[done:])
    return (np.concatenate(parts, axis=-1), np.concatenate(part_lengths).astype(np.int64),
            np.concatenate(owners).astype(np.int64))


def tokenize_rows(tokenizer, texts, max_length, pairs=None, types=False, cutting=None):
    """(token id lists, segment id lists or None, text of each row, full lengths) of a list of texts (and
    of their second texts: pairs), as the stage makes them: long texts cut as `cutting` says (windows:
    several rows of one text; None: the head)."""
    cutting = cutting or Cutting()
    capacity = sum(len(text.encode("utf-8")) + 8 for text in texts + (pairs or []))  # a token holds a byte or more
    pick = (lambda rows: [texts[i] for i in rows]) if pairs is None else \
        (lambda rows: ([texts[i] for i in rows], [pairs[i] for i in rows]))
    flat, full = encode_flat(tokenizer, (pick(rows) for rows in chunks(range(len(texts)))), capacity, types)
    if cutting.how == "head":
        (flat, lengths), owners = truncate_flat(tokenizer, flat, full, max_length, pick), np.arange(len(texts))
    else:
        flat, lengths, owners = cut_flat(tokenizer, flat, full, max_length, pick, cutting)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    rows = [[part[a:b] for a, b in zip(offsets[:-1], offsets[1:])] for part in np.atleast_2d(flat).tolist()]
    return rows[0], (rows[1] if types else None), owners.tolist(), full.tolist()


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
