"""The tokenizer's fit to the texts (reading/tokenfit.py), on Korean texts made here: the embedded
MiniLM's uncased WordPiece, which decomposes every Hangul syllable into jamo, against a WordPiece
vocabulary of whole Korean words built here, which does not; and the unknown-token share on a script
(Thai) that vocabulary lacks. Expected values are counted by hand from the texts (jamo are what the
canonical decomposition NFD gives), not taken from the module."""
import random
import unicodedata

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from reading.tokenfit import fit_measures, fit_problems, fit_warnings

# Korean words whose every jamo the embedded MiniLM's vocabulary has (none becomes its unknown token)
WORDS = "오늘 날씨 정말 영화 대응 음식 사람 시간 학교 친구 노래 바다 하늘 마음".split()
THAI = ["ภาษา", "ไทย"]  # a script neither vocabulary holds


def korean_texts(n=200, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.sample(WORDS, 4)) for _ in range(n)]


@pytest.fixture(scope="module")
def whole_words():
    """A cased WordPiece tokenizer whose vocabulary holds each Korean word whole; accents kept."""
    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=False, strip_accents=False)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    assert tokenizer.tokenize("오늘 날씨") == ["오늘", "날씨"]  # the vocabulary is used, not all [UNK]
    return tokenizer


def test_an_uncased_vocabulary_is_seen_splitting_hangul_into_jamo(tokenizer):
    texts = korean_texts()
    assert "ᄋ" in tokenizer.tokenize("오늘")  # the embedded MiniLM decomposes (U+110B, a conjoining jamo)
    fit = fit_measures(tokenizer, texts)
    assert fit["script"] == "Hangul" and fit["script_fraction"] == 1.0
    assert fit["decomposes"] == "jamo" and fit["decomposed_fraction"] == 1.0
    assert fit["unknown_fraction"] == 0.0
    # every jamo a token: a word's tokens are its canonical decomposition's characters
    words = [w for t in texts for w in t.split()]
    per_syllable = sum(len(unicodedata.normalize("NFD", w)) for w in words) / sum(map(len, words))
    assert fit["script_tokens_per_char"] == pytest.approx(per_syllable, abs=0.01)
    assert fit["chars_per_token"] == pytest.approx(1 / per_syllable, abs=0.01)
    lines = fit_warnings(fit, 0.0, 64, "minilm")
    assert lines == [f"warning: 100% of the train texts hold Hangul and minilm's tokenizer splits each syllable into "
                     f"jamo ({per_syllable:.1f} tokens per syllable): a Korean model such as klue/bert-base reads them "
                     "whole (model.name)"]


def test_a_vocabulary_of_whole_korean_words_fits_and_says_nothing(whole_words):
    fit = fit_measures(whole_words, korean_texts())
    assert fit["script"] == "Hangul" and fit["decomposes"] is None and fit["decomposed_fraction"] == 0.0
    assert fit["unknown_fraction"] == 0.0 and fit["script_tokens_per_char"] == 0.5  # two syllables a token
    assert fit["chars_per_token"] == 2.0
    assert fit_warnings(fit, 0.0, 64, "whole") == []


def test_the_unknown_share_of_a_script_the_vocabulary_lacks(whole_words):
    # each text: two Korean words the vocabulary holds, one Thai word it does not (one unknown token)
    texts = [f"{a} {THAI[i % 2]} {b}" for i, (a, b) in enumerate(zip(WORDS, WORDS[1:]))]
    fit = fit_measures(whole_words, texts)
    assert fit["unknown_fraction"] == pytest.approx(1 / 3, abs=1e-4)
    assert list(fit_problems(fit, 0.0, 64)) == ["unknown"]
    assert fit_warnings(fit, 0.0, 64, "whole")[0].startswith(
        "warning: 33% of the train texts' tokens are unknown to whole's tokenizer")


def test_accents_stripped_by_an_uncased_vocabulary(tokenizer, whole_words):
    texts = ["le café est très élégant", "une école près du marché"] * 20
    fit = fit_measures(tokenizer, texts)  # MiniLM lowercases and strips accents: é becomes e
    assert fit["script"] == "Latin" and fit["decomposes"] == "marks" and fit["decomposed_fraction"] == 1.0
    assert "strips the accents" in fit_warnings(fit, 0.0, 64, "minilm")[0]


def test_a_few_accented_words_in_english_warn_of_nothing(tokenizer):
    # the embedded English tweets: MiniLM strips every accent it meets, but one word in a hundred has one
    texts = ["the coffee at this small cafe is good and the staff are nice"] * 5 + ["we met at the café"]
    fit = fit_measures(tokenizer, texts)
    assert fit["decomposes"] == "marks" and fit["decomposed_fraction"] == 1.0
    assert fit["broken_word_fraction"] < 0.05 and fit_warnings(fit, 0.0, 64, "minilm") == []


def test_texts_cut_at_max_length_are_named_with_the_key_to_change(whole_words):
    fit = fit_measures(whole_words, korean_texts())
    assert fit_warnings(fit, 0.12, 64, "whole") == [
        "warning: 12% of the train texts are longer than max_length 64 and are cut: a larger tokenize.max_length "
        "keeps more of them"]


def test_korean_tagged_with_latin_parts_of_speech_is_judged_as_korean(tokenizer, whole_words):
    # what POS-tagging preprocessing makes (morpheme/TAG): more Latin letters than Hangul in every text,
    # yet every Hangul word is still split into jamo by MiniLM's vocabulary
    tags = ["NNG", "JX", "MAG", "VV", "EP", "EF", "JKS", "XSV"]
    rng = random.Random(3)
    texts = [";".join(f"{w}/{rng.choice(tags)}" for w in rng.sample(WORDS, 4)) for _ in range(100)]
    latin = sum(c.isascii() and c.isalpha() for t in texts for c in t)
    hangul = sum("\uac00" <= c <= "\ud7a3" for t in texts for c in t)
    assert latin > hangul  # the majority script is Latin
    fit = fit_measures(tokenizer, texts)
    assert fit["script"] == "Hangul" and fit["script_fraction"] == 1.0 and fit["decomposes"] == "jamo"
    lines = fit_warnings(fit, 0.0, 64, "minilm")
    assert len(lines) == 1 and "splits each syllable into jamo" in lines[0] and "klue/bert-base" in lines[0]
    # with a vocabulary of the whole words, the Latin tags (unknown to it) are what it lacks, not Hangul
    assert "decomposed" not in fit_problems(fit_measures(whole_words, texts), 0.0, 64)
