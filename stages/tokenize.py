"""tokenize: turn the processed CSVs into token ids with the model's fast tokenizer.

Reads data/processed/; writes data/tokenized/{train,val,test}.safetensors (unpadded: padding
happens per batch at training time) and reports/tokenize/lengths.json, the token-length
statistics to choose tokenize.max_length from.
"""
import json
from pathlib import Path

import numpy as np
from safetensors.torch import save_file
from transformers import AutoTokenizer

from stages.common import (PipelineError, atomic_dir, load_params, pack_sequences, read_csv,
                           resolve_model, run_main, write_json)

PROCESSED = Path("data/processed")
OUT = Path("data/tokenized")
METRICS = Path("reports/tokenize/lengths.json")


def tokenize_texts(tokenizer, texts, max_length):
    """(truncated token ids, full lengths) for a list of texts, tokenized in one batched call."""
    truncated = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    # a second, untruncated pass gives the true lengths; verbose=False silences the >512 warning
    full = tokenizer(texts, verbose=False)["input_ids"]
    return truncated, [len(ids) for ids in full]


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
    model_name = load_params("model")["name"]
    max_length = load_params("tokenize")["max_length"]
    label_list = json.loads((PROCESSED / "labels.json").read_text(encoding="utf-8"))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model_name))
    if not tokenizer.is_fast:
        raise PipelineError(f"model.name {model_name!r} has no fast tokenizer; pick a model that has one")

    stats = {"max_length": max_length}
    with atomic_dir(OUT) as tmp:
        for split in ("train", "val", "test"):
            path = PROCESSED / f"{split}.csv"
            if not path.exists():
                continue
            df = read_csv(path)
            ids, lengths = tokenize_texts(tokenizer, df["text"].tolist(), max_length)
            save_file(pack_sequences(ids, label_ids(df["label"], label_list)), tmp / f"{split}.safetensors")
            stats[split] = length_stats(lengths, max_length)
            print(f"{split}: {len(ids)} texts, token length {stats[split]}")
    write_json(METRICS, stats)


if __name__ == "__main__":
    run_main(main)
