"""A processed CSV (data/processed/{train,test}.csv) as the tokenize stage stores it: token ids read and
tokenized CHUNK rows at a time into flat arrays (encode_csv), its long texts cut as tokenize.truncation says
(cut_split). The tokenize stage writes these for the model; the distill stage makes them for a student
whose tokenizer has another vocabulary than its teachers'."""
import numpy as np
import pandas as pd
import torch

from pipeline.settings import PipelineError
from reading.csvfiles import read_csv_chunks
from reading.tokens import CHUNK, cut_flat, encode_flat, model_inputs, packed, truncate_flat


def encode_csv(tokenizer, path, label_list, shape, types=False):
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


def cut_split(tokenizer, flat, lengths, labels, max_length, cutting, texts_at, path):
    """(the tensors of a tokenized split, its row counts) with its long texts cut as `cutting` says: the
    head in place (truncate_flat), anything else into new rows (cut_flat; windows add text_of_row)."""
    if cutting.how == "head":
        cut, cut_lengths = truncate_flat(tokenizer, flat, lengths, max_length, texts_at)
        return packed(cut, cut_lengths, labels), row_counts(lengths, max_length, len(lengths))
    try:
        cut, cut_lengths, text_of_row = cut_flat(tokenizer, flat, lengths, max_length, texts_at, cutting)
    except ValueError as error:
        raise PipelineError(f"{path} {error} (tokenize.truncation {cutting.how}, max_length {max_length})") from None
    tensors = packed(cut, cut_lengths, np.asarray(labels)[text_of_row] if len(labels) else labels)
    if cutting.how == "windows":  # several rows of a text: which text each is (reading/windows.py)
        tensors["text_of_row"] = torch.from_numpy(text_of_row)
    return tensors, row_counts(lengths, max_length, len(cut_lengths))


def row_counts(lengths, max_length, rows):
    """The tokens.* counts of a split: texts cut, the rows (windows) those became, the rows in all."""
    cut = int((np.asarray(lengths) > max_length).sum())
    return {"cut_texts": cut, "windows": rows - len(lengths) + cut, "rows": rows}
