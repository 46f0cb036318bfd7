"""What becomes of a text longer than tokenize.max_length (tokenize.truncation): its head (the tokenizer's
own truncation, the default), its tail, its head and tail (Sun et al. 2019, "How to Fine-Tune BERT for
Text Classification?": IMDb test error 5.63 head, 5.44 tail, 5.42 first 128 + last 382 tokens), or
overlapping windows, each a model row of its own, whose outputs are averaged back to the text.

Pure functions of token ids and positions, which reading/tokens.py applies to the tokenizer's output.
Only the first text is cut: a text is its special tokens before it (prefix), its own tokens (body) and
everything after them (suffix: the closing special tokens, and for a text pair the second text whole);
every row keeps the prefix and the suffix. A tokenized split with windows holds `text_of_row`, the text
each row (window) comes from; files without it (every other setting, and runs before windows existed)
have one row per text."""
from dataclasses import dataclass

import numpy as np

TRUNCATIONS = ("head", "tail", "head_tail", "windows")


@dataclass(frozen=True)
class Cutting:
    """How long texts are cut: tokenize.truncation, tokenize.head_tokens (head_tail: the tokens kept from
    the start, the rest from the end) and tokenize.stride (windows: the tokens each window shares with
    the one before, as the stride of transformers' return_overflowing_tokens)."""
    how: str = "head"
    head_tokens: int = 128
    stride: int = 32

    @classmethod
    def of(cls, settings):
        """From data/tokenized/settings.json or a model's pipeline.json; runs from before these settings: head."""
        default = cls()
        return cls(settings.get("truncation", default.how), settings.get("head_tokens", default.head_tokens),
                   settings.get("stride", default.stride))

    def problem(self, room):
        """Why this cutting cannot fill rows of `room` tokens besides the special tokens, or None."""
        if room < 1:
            return f"no token of the text fits ({room} left besides the special tokens and the second text)"
        if self.how == "head_tail" and self.head_tokens >= room:
            return (f"tokenize.head_tokens {self.head_tokens} leaves no tail: a row holds {room} tokens besides "
                    f"the special tokens; set it below {room}, or raise tokenize.max_length")
        if self.how == "windows" and self.stride >= room:
            return (f"tokenize.stride {self.stride}: windows must move on; a window holds {room} tokens besides "
                    f"the special tokens; set it below {room}, or raise tokenize.max_length")
        return None

    def describe(self):
        return {"head": "head (the first tokens)", "tail": "tail (the last tokens)",
                "head_tail": f"head_tail (the first {self.head_tokens} tokens and the last ones)",
                "windows": f"windows (overlapping by {self.stride} tokens, outputs averaged per text)"}[self.how]


def kept_positions(n, room, cutting):
    """The positions (0..n-1) of a body of n tokens that each of its rows keeps: one array per row, each of
    at most `room` positions. A body that fits is kept whole, in one row. Windows start every room - stride
    tokens until one reaches the end (the last may be short), as the tokenizer's overflowing tokens do."""
    if n <= room:
        return [np.arange(n)]
    if cutting.how == "head":
        return [np.arange(room)]
    if cutting.how == "tail":
        return [np.arange(n - room, n)]
    if cutting.how == "head_tail":
        return [np.concatenate([np.arange(cutting.head_tokens), np.arange(n - (room - cutting.head_tokens), n)])]
    step, starts = room - cutting.stride, [0]
    while starts[-1] + room < n:
        starts.append(starts[-1] + step)
    return [np.arange(start, min(start + room, n)) for start in starts]


def body_span(sequence_ids):
    """(start, stop) of the first text's tokens in one encoded text, from the tokenizer's sequence ids
    (None for a special token, 0 for the first text, 1 for the second): the tokens of text 0. An empty
    first text: an empty span after the leading special tokens."""
    first = [i for i, s in enumerate(sequence_ids) if s == 0]
    if first:
        return first[0], first[-1] + 1
    start = next((i for i, s in enumerate(sequence_ids) if s is not None), len(sequence_ids))
    return start, start


def row_positions(sequence_ids, max_length, cutting):
    """The positions of one encoded text (special tokens included) that each of its rows keeps: the
    prefix, the kept part of the first text, the suffix. A string (the problem) where none fits."""
    start, stop = body_span(sequence_ids)
    room = max_length - (len(sequence_ids) - (stop - start))
    problem = cutting.problem(room) if len(sequence_ids) > max_length else None
    if problem:
        return problem
    prefix, suffix = np.arange(start), np.arange(stop, len(sequence_ids))
    return [np.concatenate([prefix, start + kept, suffix]) for kept in kept_positions(stop - start, room, cutting)]


def text_of_row(tensors):
    """The text (position in the split's CSV) of each row of a tokenized split: `text_of_row` where windows
    made several rows of a text, else one row per text."""
    if "text_of_row" in tensors:
        return np.asarray(tensors["text_of_row"], dtype=np.int64)
    return np.arange(len(tensors["offsets"]) - 1)


def mean_by_text(outputs, texts):
    """(texts in ascending order, the mean of their rows' outputs): outputs (rows, k), texts (rows,) the
    text of each row. Probabilities, or values, averaged over a text's windows; a text of one row keeps
    its own outputs exactly."""
    outputs, texts = np.asarray(outputs, dtype=np.float64), np.asarray(texts)
    unique, inverse = np.unique(texts, return_inverse=True)
    sums = np.zeros((len(unique), outputs.shape[1]))
    np.add.at(sums, inverse, outputs)
    return unique, sums / np.bincount(inverse, minlength=len(unique))[:, None]
