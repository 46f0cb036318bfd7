"""Long texts (tokenize.truncation): head, tail, head+tail and windows with exact token ids from a tiny
WordPiece vocabulary, checked against hand-written ids and against the tokenizer's own truncation and
overflowing windows; window outputs averaged back to their texts against a hand computation."""
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from reading.tokens import tokenize_rows
from reading.windows import Cutting, kept_positions, mean_by_text, text_of_row
from tasks.shapes import SHAPES
from training.trainer import ValidationScores

CLS, SEP = 2, 3
WORD = 4  # w0 has id 4, w1 id 5, ...


@pytest.fixture(scope="module")
def tiny():
    """A WordPiece tokenizer of [PAD] [UNK] [CLS] [SEP] w0 ... w39, with BERT's templates."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": CLS, "[SEP]": SEP, **{f"w{i}": WORD + i for i in range(40)}}
    core = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                        sep_token="[SEP]", model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    assert tokenizer("w0 w1")["input_ids"] == [CLS, WORD, WORD + 1, SEP]  # real ids, not [UNK]
    return tokenizer


def words(start, stop):
    return " ".join(f"w{i}" for i in range(start, stop))


def ids(start, stop):
    return list(range(WORD + start, WORD + stop))


def test_kept_positions_by_hand():
    assert [p.tolist() for p in kept_positions(10, 4, Cutting("head"))] == [[0, 1, 2, 3]]
    assert [p.tolist() for p in kept_positions(10, 4, Cutting("tail"))] == [[6, 7, 8, 9]]
    assert [p.tolist() for p in kept_positions(10, 4, Cutting("head_tail", head_tokens=1))] == [[0, 7, 8, 9]]
    # windows of 4 moving on by 4 - 1: the last one reaches the end
    assert [p.tolist() for p in kept_positions(10, 4, Cutting("windows", stride=1))] == [
        [0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert [p.tolist() for p in kept_positions(11, 4, Cutting("windows", stride=2))] == [
        [0, 1, 2, 3], [2, 3, 4, 5], [4, 5, 6, 7], [6, 7, 8, 9], [8, 9, 10]]
    for how in ("head", "tail", "head_tail", "windows"):  # a text that fits is kept whole
        assert [p.tolist() for p in kept_positions(3, 4, Cutting(how, head_tokens=1, stride=1))] == [[0, 1, 2]]


def test_each_cut_keeps_the_special_tokens_and_the_right_ids(tiny):
    texts = [words(0, 12), words(30, 33)]  # 14 tokens with [CLS] and [SEP]: cut at 8; 5 tokens: kept
    expected = {
        "head": [[CLS, *ids(0, 6), SEP]],
        "tail": [[CLS, *ids(6, 12), SEP]],
        "head_tail": [[CLS, *ids(0, 2), *ids(8, 12), SEP]],
        "windows": [[CLS, *ids(0, 6), SEP], [CLS, *ids(4, 10), SEP], [CLS, *ids(8, 12), SEP]],
    }
    for how, rows in expected.items():
        sequences, types, texts_of, full = tokenize_rows(tiny, texts, 8, cutting=Cutting(how, head_tokens=2, stride=2))
        assert sequences == [*rows, [CLS, *ids(30, 33), SEP]], how
        assert texts_of == [0] * len(rows) + [1] and full == [14, 5] and types is None


def test_pairs_cut_the_first_text_and_keep_the_second_whole(tiny):
    second = [SEP, *ids(20, 22), SEP]  # and its segment ids: 1
    for how, rows in {"tail": [ids(7, 12)], "head_tail": [ids(0, 1) + ids(8, 12)],
                      "windows": [ids(0, 5), ids(3, 8), ids(6, 11), ids(9, 12)]}.items():
        sequences, types, texts_of, _ = tokenize_rows(tiny, [words(0, 12), "w30"], 10, pairs=[words(20, 22), "w31"],
                                                      types=True, cutting=Cutting(how, head_tokens=1, stride=2))
        assert sequences[:-1] == [[CLS, *row, *second] for row in rows], how
        assert types[:-1] == [[0] * (len(row) + 2) + [1] * 3 for row in rows], how
        assert sequences[-1] == [CLS, WORD + 30, SEP, WORD + 31, SEP] and texts_of == [0] * len(rows) + [1]


@pytest.mark.parametrize("max_length", [9, 16, 33])
def test_windows_tail_and_head_are_the_tokenizers_own(tokenizer, max_length):
    # a second implementation: the fast tokenizer's overflowing tokens (stride = overlap) and left truncation
    texts = [" ".join(["alpha beta", "gamma delta epsilon"][i % 2] for _ in range(i)) + f" end {i}" for i in range(40)]
    pairs = [f"second text {i}" for i in range(40)]
    stride = max_length // 4
    for second in (None, pairs):
        reference = tokenizer(texts, second, truncation="only_first" if second else True, max_length=max_length,
                              stride=stride, return_overflowing_tokens=True)
        sequences, _, texts_of, _ = tokenize_rows(tokenizer, texts, max_length, second, cutting=Cutting("windows", stride=stride))
        assert sequences == reference["input_ids"] and texts_of == list(reference["overflow_to_sample_mapping"])
        tokenizer.truncation_side = "left"
        try:
            tail = tokenizer(texts, second, truncation="only_first" if second else True, max_length=max_length)["input_ids"]
        finally:
            tokenizer.truncation_side = "right"
        assert tokenize_rows(tokenizer, texts, max_length, second, cutting=Cutting("tail"))[0] == tail
    head = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    assert tokenize_rows(tokenizer, texts, max_length, cutting=Cutting("head"))[0] == head


def test_a_cut_that_cannot_be_made_names_the_row(tiny):
    with pytest.raises(ValueError, match=r"row 1: tokenize.head_tokens 6 leaves no tail"):
        tokenize_rows(tiny, ["w0", words(0, 12)], 8, cutting=Cutting("head_tail", head_tokens=6))
    with pytest.raises(ValueError, match=r"row 0: tokenize.stride 6: windows must move on"):
        tokenize_rows(tiny, [words(0, 12)], 8, cutting=Cutting("windows", stride=6))
    with pytest.raises(ValueError, match=r"row 0: no token of the text fits"):  # the second text fills max_length
        tokenize_rows(tiny, ["w0"], 8, pairs=[words(0, 12)], cutting=Cutting("tail"))


def test_window_outputs_are_averaged_back_to_their_texts():
    outputs = [[0.9, 0.1], [0.5, 0.5], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]]
    texts, means = mean_by_text(outputs, [2, 0, 2, 2, 1])  # rows of text 2: 0, 2, 3
    assert texts.tolist() == [0, 1, 2]
    np.testing.assert_allclose(means, [[0.5, 0.5], [0.3, 0.7], [(0.9 + 0.2 + 0.6) / 3, (0.1 + 0.8 + 0.4) / 3]])
    single = np.float32([[0.123456789, 0.876543211]])
    assert mean_by_text(single, [0])[1].tolist() == single.astype(np.float64).tolist()  # one row: its own, exactly
    assert text_of_row({"offsets": np.arange(4)}).tolist() == [0, 1, 2]  # a file without windows: a row per text


def test_validation_scores_score_each_text_once():
    # text 0: windows whose mean logit says class 1 (right) although one window says class 0
    logits = np.array([[2.0, 0.0], [0.0, 5.0], [1.0, 0.0], [0.0, 1.0]])
    labels = np.array([1, 1, 0, 1])  # text 0, text 0, text 1, text 2
    scores = ValidationScores(SHAPES["classification"], texts=np.array([0, 0, 1, 2]))((logits, labels))
    assert scores["accuracy"] == 1.0  # 3 texts of 3, where windows scored one by one would be 3 of 4
    assert ValidationScores(SHAPES["classification"])((logits, labels))["accuracy"] == 0.75


def test_the_settings_can_be_searched_by_tune():
    import yaml

    from pipeline.settings import PipelineError
    from tests.test_params import REPO
    from tune.settings import parse_dimension

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    assert parse_dimension("tokenize.truncation", {"choices": ["head", "head_tail", "windows"]}, params).choices == (
        "head", "head_tail", "windows")
    assert parse_dimension("tokenize.stride", {"low": 0, "high": 64}, params).integer
    with pytest.raises(PipelineError, match="tokenize.truncation: choice must be 'head' or 'tail'"):
        parse_dimension("tokenize.truncation", {"choices": ["head", "middle"]}, params)
