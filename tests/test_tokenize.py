import pytest

from bench.common import tokenize_texts
from reading.tokens import pack_sequences, unpack_sequences
from stages.tokenize import label_ids, length_stats


def test_pack_unpack_round_trip():
    sequences, labels = [[101, 7, 102], [101, 102], [101, 5, 6, 7, 102]], [0, 2, -1]
    assert unpack_sequences(pack_sequences(sequences, labels)) == (sequences, labels)


def test_tokenize_truncates_but_reports_full_length(tokenizer):
    long_text = "word " * 50
    ids, lengths = tokenize_texts(tokenizer, ["hello world", long_text], max_length=16)
    assert len(ids[0]) == 4 and lengths[0] == 4  # [CLS] hello world [SEP]
    assert len(ids[1]) == 16 and ids[1][-1] == tokenizer.sep_token_id
    assert lengths[1] == 52


def test_length_stats():
    stats = length_stats(list(range(1, 101)), max_length=90)
    assert stats["p50"] == pytest.approx(50.5) and stats["max"] == 100
    assert stats["truncated_fraction"] == 0.1


def test_label_ids_marks_missing_labels():
    assert label_ids(["b", "", "a"], ["a", "b"]) == [1, -1, 0]


def test_chunked_flat_tokenizing_writes_the_bytes_of_one_list_per_text(tokenizer):
    # the stage tokenizes CHUNK texts at a time into flat arrays; the file must not depend on it
    from safetensors.torch import save

    from reading.tokens import chunks, encode_flat, packed, truncate_flat

    texts = [" ".join(["word"] * (i % 23)) + f" text {i}" for i in range(50)] + ["", "long " * 40]
    labels = [i % 3 for i in range(len(texts))]
    ids = tokenizer(texts, truncation=True, max_length=12)["input_ids"]  # the reference: one list per text
    assert sum(len(x) > 12 for x in tokenizer(texts)["input_ids"]) >= 10  # texts truncate_flat must cut
    for chunk, block in ((1, 1), (7, 5), (50, 64), (1000, 1 << 20)):  # texts per tokenizer call, ids per move
        capacity = 10 if chunk == 1 else 10**6  # too small: it grows; big enough: a view of it is returned
        flat, lengths = encode_flat(tokenizer, chunks(texts, chunk), capacity)
        cut, cut_lengths = truncate_flat(tokenizer, flat, lengths, 12, lambda rows: [texts[i] for i in rows],
                                         block=block)
        assert save(packed(cut, cut_lengths, labels)) == save(pack_sequences(ids, labels)), (chunk, block)


def test_a_processed_csv_is_tokenized_in_chunks_as_a_list_would_be(tokenizer, tmp_path, monkeypatch):
    import pandas as pd

    from reading import splits
    from reading.csvfiles import write_csv
    from reading.tokens import packed, truncate_flat
    from tasks.shapes import SHAPES

    texts = ["a, \"quoted\" text", "two\nlines", "long " * 30, "", "NA"] * 7
    labels = ["b", "a", "b", "a", "a"] * 7
    write_csv(pd.DataFrame({"text": texts, "label": labels}), tmp_path / "train.csv")
    monkeypatch.setattr(splits, "CHUNK", 4)  # rows read and tokenized at a time
    flat, lengths, label_list = splits.encode_csv(tokenizer, tmp_path / "train.csv", ["a", "b"], SHAPES["classification"])
    cut, cut_lengths = truncate_flat(tokenizer, flat, lengths, 16, lambda rows: splits.texts_at(tmp_path / "train.csv", rows))
    ids, full = tokenize_texts(tokenizer, texts, 16)
    assert lengths.tolist() == full and label_list == [["a", "b"].index(y) for y in labels]
    assert unpack_sequences(packed(cut, cut_lengths, label_list))[0] == ids
