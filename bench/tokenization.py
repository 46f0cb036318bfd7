"""Rows 1 and 2: the tokenize stage's batched tokenizer against one padded call per row, and its peak
memory on the embedded corpus copied 10 times against on the corpus (bench/tokenize_memory.py)."""
import time

from bench.common import BASELINE_MAX_LENGTH, GOALS, tokenize_texts, verdict


def per_row_seconds(tokenizer, texts):
    start = time.perf_counter()
    for text in texts:
        tokenizer(text, padding="max_length", truncation=True, max_length=BASELINE_MAX_LENGTH,
                  return_tensors="pt")
    return time.perf_counter() - start


def bench_tokenization(tokenizer, texts, max_length):
    """(seconds of the tokenize stage's function, seconds of one padded call per row) over all
    texts. The per-row baseline runs half before the stage's function and half after, so a change
    in the machine's load affects both alike."""
    half = len(texts) // 2
    per_row = per_row_seconds(tokenizer, texts[:half])
    start = time.perf_counter()
    tokenize_texts(tokenizer, texts, max_length)
    stage = time.perf_counter() - start
    return stage, per_row + per_row_seconds(tokenizer, texts[half:])


def report_tokenization(tokenizer, texts, max_length):
    stage_s, per_row_s = bench_tokenization(tokenizer, texts, max_length)
    ratio = per_row_s / stage_s
    print(f"1. tokenization of {len(texts)} texts: tokenize stage {stage_s:.2f} s vs one padded call per "
          f"row {per_row_s:.2f} s: {ratio:.1f}x (goal >= {GOALS['tokenize']:.0f}x: "
          f"{verdict(ratio, GOALS['tokenize'])})")


def report_tokenize_memory(found):
    (n1, gb1, s1), (n10, gb10, s10) = found[1], found[10]
    ratio = gb10 / gb1
    print(f"2. tokenize stage peak memory: {gb10:.2f} GB for {n10:,} texts (the corpus x10, {s10:.0f} s) vs "
          f"{gb1:.2f} GB for {n1:,} ({s1:.0f} s): {ratio:.2f}x (goal <= {GOALS['memory']}x: "
          f"{verdict(ratio, GOALS['memory'], at_least=False)})")
