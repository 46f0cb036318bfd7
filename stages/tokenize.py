"""tokenize: turn the processed CSVs into token ids with the model's fast tokenizer.

Reads data/processed/; writes data/tokenized/{train,test}.safetensors (unpadded: padding happens
per batch at training time; labels encoded as the task shape trains on them), data/tokenized/settings.json
(the max_length used, which the train stage keeps beside each model) and reports/tokenize/lengths.json,
the token-length statistics and the max_length (chosen from the train lengths when tokenize.max_length
is auto), under "tokens", and under tokens.fit how well the tokenizer fits the train texts (reading/
tokenfit.py, on up to 5,000 of them spread over the file, first texts of pairs): unknown tokens,
characters per token, the texts' script and whether the tokenizer breaks it apart (Hangul syllables into
jamo, accents stripped). Past a threshold it prints a warning line saying what it found and what to
try (model.name, tokenize.max_length); the run goes on. The train stage reads only train.safetensors: a new test file retrains nothing.

A text longer than max_length keeps its head, its tail, its head and tail, or becomes overlapping windows,
each a row of its own (tokenize.truncation; reading/windows.py; windows add `text_of_row` to the file);
the metrics count the texts cut (cut_texts), the rows they became (windows) and all rows (rows).

Text pairs go to the tokenizer as pairs ([CLS] a [SEP] b [SEP]); their segment ids (token_type_ids) are
stored beside the token ids when the model takes them. Several text columns joined by preprocess get
the tokenizer's separator token between them.

Texts are tokenized CHUNK at a time into flat int32 arrays, so memory grows by 4 bytes per token
with the data, not by the ~6 KB per text that the tokenizer's Python lists take.
"""
import json
from pathlib import Path

import numpy as np
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from modeling.families import takes_segment_ids
from modeling.models import model_params, remote_code_named, resolve_model
from pipeline.command import interactive, run_main
from pipeline.outputs import atomic_dir, write_json
from pipeline.settings import PipelineError, Range, load_params
from reading.splits import cut_split, encode_csv, texts_at
from reading.tokenfit import fit_measures, fit_warnings, sample_rows
from reading.tokens import auto_max_length, model_limit
from reading.windows import TRUNCATIONS, Cutting
from tasks.shapes import SHAPES

PROCESSED = Path("data/processed")
OUT = Path("data/tokenized")
METRICS = Path("reports/tokenize/lengths.json")
SPLITS = ("train", "test")
# what each tokenize.* key accepts; load_params turns anything else into a one-line error
TOKENIZE_PARAMS = {"max_length": (int, "auto", Range(2)),  # room for [CLS] and [SEP]
                   "length_percentile": (float, Range(0, 100, low_open=True)),
                   "truncation": TRUNCATIONS, "head_tokens": (int, Range(1)), "stride": (int, Range(0))}


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
    with remote_code_named(model_name):
        tokenizer = AutoTokenizer.from_pretrained(model_source, trust_remote_code=remote_code)
        config = AutoConfig.from_pretrained(model_source, trust_remote_code=remote_code)
    if not tokenizer.is_fast:
        raise PipelineError(f"model.name {model_name!r} has no fast tokenizer; pick a model that has one")
    limit = model_limit(tokenizer, config)
    if max_length != "auto" and max_length > limit:  # the model would fail on its first long batch
        raise PipelineError(f"params.yaml: tokenize.max_length {max_length} is more than model.name "
                            f"{model_name!r} takes ({limit} tokens): set it to at most {limit}, or auto")
    label_list = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))
    shape = json.loads((PROCESSED / "shape.json").read_text(encoding="utf-8"))
    types = takes_segment_ids(tokenizer, config, bool(shape["pair_columns"]))

    paths = [PROCESSED / f"{split}.csv" for split in SPLITS if (PROCESSED / f"{split}.csv").exists()]
    # (flat ids, lengths, labels) of each split
    encoded = {path.stem: encode_csv(tokenizer, path, label_list, SHAPES[shape["kind"]], types) for path in paths}
    train_rows = len(encoded["train"][1])
    if max_length == "auto":
        max_length = auto_max_length(encoded["train"][1], percentile, limit)
        print(f"max_length auto: {max_length} (p{percentile:g} of the train texts' token lengths, "
              f"rounded up to a multiple of 8, at most the model's {limit})")
    else:
        percentile = None  # not used: the metrics say so
    cutting = Cutting(params["truncation"], params["head_tokens"], params["stride"])
    print(f"tokenize.truncation {cutting.describe()}: what is kept of a text longer than {max_length} tokens")
    stats = {"max_length": max_length, "max_length_percentile": percentile, "truncation": cutting.how}

    with atomic_dir(OUT) as tmp:
        for path in paths:
            flat, lengths, labels = encoded.pop(path.stem)
            tensors, rows = cut_split(tokenizer, flat, lengths, labels, max_length, cutting,
                                      lambda rows: texts_at(path, rows, tokenizer), path)
            save_file(tensors, tmp / f"{path.stem}.safetensors")
            stats[path.stem] = split = {**length_stats(lengths, max_length), **rows}
            print(f"{path.stem}: {len(lengths):,} texts, token length p50 {split['p50']:g}, p99 {split['p99']:g}, "
                  f"max {split['max']}; {split['cut_texts']:,} ({split['truncated_fraction']:.2%}) cut at {max_length}" +
                  (f", into {split['windows']:,} windows: {split['rows']:,} rows"
                   if cutting.how == "windows" else ""))
        write_json(tmp / "settings.json", {"max_length": max_length, "truncation": cutting.how,
                                           "head_tokens": cutting.head_tokens, "stride": cutting.stride})
    stats["fit"] = fit = fit_measures(tokenizer, texts_at(PROCESSED / "train.csv", sample_rows(train_rows)))
    print(f"tokenizer fit ({fit['sample_texts']:,} train texts): {fit['unknown_fraction']:.2%} unknown tokens, "
          f"{fit['chars_per_token']} characters per token; {fit['script_fraction']:.0%} of the texts hold "
          f"{fit['script']}, {fit['script_tokens_per_char']} tokens per character of its words")
    for line in fit_warnings(fit, stats["train"]["truncated_fraction"], max_length, model_name):
        print(line)
    # under one name, so that `dvc metrics show` reads tokens.test.max, not a test.max beside evaluate's test.accuracy
    write_json(METRICS, {"tokens": stats})
    return [OUT, METRICS]


if __name__ == "__main__":
    run_main(main)
