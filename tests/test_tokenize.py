import pytest

from stages.common import pack_sequences, unpack_sequences
from stages.tokenize import label_ids, length_stats, tokenize_texts


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
