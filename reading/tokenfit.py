"""How well a tokenizer fits the texts, measured on a sample of them: the share of unknown tokens, the
characters per token, the script the texts are written in, and whether the tokenizer breaks that script
apart: Hangul syllables decomposed into jamo (what an uncased BERT vocabulary does to Korean: `대응`
becomes `ᄃ ##ᅢ ##ᄋ ##ᅳ ##ᆼ`), accents and other marks stripped (what uncasing does to French, Vietnamese
or Hindi), or words cut into more tokens than they have characters (a vocabulary without the script).
Pure functions over a tokenizer and texts; the tokenize stage writes fit_measures' result to tokens.fit
and prints fit_warnings' lines, which never stop a run.

A script is the first word of a letter's Unicode name (HANGUL SYLLABLE GA: Hangul; LATIN SMALL LETTER E:
Latin; CJK UNIFIED IDEOGRAPH: Han), enough to tell the scripts a tokenizer treats differently apart."""
import re
import unicodedata
from collections import Counter
from functools import lru_cache

from reading.csvfiles import COLUMN_JOIN

SAMPLE = 5000  # texts measured, spread evenly over the file: seconds of tokenizing, a stable share
WORDS = 5000  # the most frequent words of the main script that are tokenized one by one
SYLLABLE = re.compile("[\uac00-\ud7a3]")  # precomposed Hangul syllables
JAMO = re.compile("[\u1100-\u11ff\u3130-\u318f\ua960-\ua97f\ud7b0-\ud7ff]")  # conjoining and compatibility jamo
WORD = re.compile(r"\w+")
# past these, a line in tokenize's log (thresholds of advice, not of correctness)
MAIN_SCRIPT = 0.2  # share of the texts holding a script for it to be judged
DECOMPOSED = 0.5  # share of the script's words with syllables or marks that the tokenizer breaks
# and the share of all its words that the tokenizer breaks: English has a few accented words (café), all
# stripped by an uncased vocabulary, which costs it nothing; French has one in about six, Korean every one
BROKEN_WORDS = 0.05
PIECES = 1.0  # tokens per character of the script's words: more tokens than characters
UNKNOWN = 0.02  # share of tokens that are the unknown token
TRUNCATED = 0.05  # share of train texts cut at max_length
MODELS_FOR = {"Hangul": "a Korean model such as klue/bert-base"}  # what reads a script whole, where one is well known
NAMES = {"CJK": "Han"}


@lru_cache(maxsize=None)
def script_of(char):
    """The script of a letter (Hangul, Latin, Han, Cyrillic, ...), None for anything else."""
    if not char.isalpha():
        return None
    first = unicodedata.name(char, "").split(" ")[0]
    return NAMES.get(first, first.title()) or None


def marks(text):
    """The number of combining marks (accents, vowel signs) in the canonical decomposition of a text,
    Hangul's jamo not counted (they are letters)."""
    return sum(unicodedata.category(c) in ("Mn", "Mc") for c in unicodedata.normalize("NFD", text))


def broken(word, decoded):
    """Whether the tokenizer's reading of a word (its tokens decoded) breaks its script: syllables now in
    jamo, or marks lost."""
    return bool(SYLLABLE.search(word) and JAMO.search(decoded)) or marks(decoded) < marks(word)


def structured(word):
    """Whether a word has what a tokenizer can break: Hangul syllables or marks."""
    return bool(SYLLABLE.search(word)) or marks(word) > 0


def sample_rows(rows, n=SAMPLE):
    """Up to n row positions of `rows` rows, spread evenly over them."""
    return list(range(0, rows, max(1, rows // n)))[:n]


def plain(texts):
    """Several columns' texts (joined by COLUMN_JOIN) as one text each."""
    return [t.replace(COLUMN_JOIN, " ") for t in texts]


def script_words(tokenizer, texts, script):
    """The tokenizer's reading of a script's words, the WORDS most frequent tokenized one by one: {letters,
    pieces (tokens), counted (words), with_structure (words with syllables or marks), breaks (those it
    breaks), jamo (those broken into jamo)}, each word weighted by how often it occurs. Words with an
    unknown token are left out (the unknown share counts them)."""
    words = Counter(w for t in texts for w in WORD.findall(t) if {script_of(c) for c in w} == {script})
    top = [w for w, _ in words.most_common(WORDS)]
    word_ids = tokenizer(top, add_special_tokens=False, return_attention_mask=False)["input_ids"] if top else []
    decoded = tokenizer.batch_decode(word_ids) if top else []
    counts = Counter()
    for word, word_tokens, reading in zip(top, word_ids, decoded):
        n = words[word]
        if tokenizer.unk_token_id in word_tokens:
            continue
        counts.update(letters=n * len(word), pieces=n * len(word_tokens), counted=n)
        if structured(word):
            counts["with_structure"] += n
            if broken(word, reading):
                counts.update(breaks=n, jamo=n * bool(JAMO.search(reading)))
    return counts


def worst_fit(readings):
    """Of {script: script_words' counts}, the script the tokenizer fits worst: the most broken words (jamo,
    marks), else the most tokens per character; the first (the most common) when all fit."""
    def badness(item):
        counts = item[1]
        broken_share = counts["breaks"] / counts["with_structure"] if counts["with_structure"] else 0.0
        per_char = counts["pieces"] / counts["letters"] if counts["letters"] else 0.0
        return (broken_share >= DECOMPOSED and counts["breaks"] / max(counts["counted"], 1) >= BROKEN_WORDS,
                per_char > PIECES and per_char)
    return max(readings.items(), key=badness)[0] if readings else None


def fit_measures(tokenizer, texts):
    """How the tokenizer fits the texts (a sample of them: sample_rows), as metrics: `unknown_fraction` of
    the tokens (special tokens left out), `chars_per_token` (characters but whitespace). Every script held
    by at least MAIN_SCRIPT of the texts is judged, not only the majority's (Korean words tagged with Latin
    part-of-speech tags, 대응/NNG, have more Latin letters than Hangul), and the one fitted worst reported:
    `script`, the `script_fraction` of texts holding it, `script_tokens_per_char` of its words tokenized
    one by one (below 1 where the vocabulary holds whole words; Hangul split into jamo, 2 to 3), and
    `decomposed_fraction`: of those words with syllables or marks, the share whose tokens lose them
    (`decomposes` says how: jamo, marks, or null)."""
    texts = plain(texts)
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"] if texts else []
    tokens = sum(map(len, ids))
    unknown = tokenizer.unk_token_id
    unknowns = sum(row.count(unknown) for row in ids) if unknown is not None else 0
    characters = sum(len(t) - sum(c.isspace() for c in t) for t in texts)
    held = Counter(script for t in texts for script in set(filter(None, map(script_of, t))))
    judged = [s for s, n in held.most_common() if n >= MAIN_SCRIPT * len(texts)] or [s for s, _ in held.most_common(1)]
    readings = {script: script_words(tokenizer, texts, script) for script in judged}
    script = worst_fit(readings)
    counts = readings.get(script, Counter())
    breaks, with_structure = counts["breaks"], counts["with_structure"]
    return {
        "sample_texts": len(texts),
        "unknown_fraction": round(unknowns / tokens, 4) if tokens else 0.0,
        "chars_per_token": round(characters / tokens, 2) if tokens else None,
        "script": script,
        "script_fraction": round(held[script] / len(texts), 4) if script else 0.0,
        "script_tokens_per_char": round(counts["pieces"] / counts["letters"], 2) if counts["letters"] else None,
        "decomposed_fraction": round(breaks / with_structure, 4) if with_structure else 0.0,
        "broken_word_fraction": round(breaks / counts["counted"], 4) if counts["counted"] else 0.0,
        "decomposes": ("jamo" if counts["jamo"] * 2 >= breaks else "marks") if breaks else None,
    }


def percent(share):
    return f"{share:.0%}" if share >= 0.01 else f"{share:.1%}"


def fit_problems(fit, truncated_fraction, max_length):
    """{problem: (what was found, what to try)} past the thresholds, for the log and for evaluate's
    likely causes: decomposed (syllables into jamo, marks stripped), pieces (more tokens than
    characters), unknown (unknown tokens), truncated (texts cut at max_length)."""
    found = {}
    script, share = fit.get("script"), fit.get("script_fraction") or 0.0
    per_char = fit.get("script_tokens_per_char")
    reader = MODELS_FOR.get(script, f"a model pretrained on {script} text or a multilingual one (xlm-roberta-base)")
    if (share >= MAIN_SCRIPT and (fit.get("decomposed_fraction") or 0.0) >= DECOMPOSED
            and fit.get("broken_word_fraction", 1.0) >= BROKEN_WORDS):
        if fit.get("decomposes") == "jamo":
            found["decomposed"] = (f"{percent(share)} of the train texts hold Hangul and the tokenizer splits each "
                                   f"syllable into jamo ({per_char:.1f} tokens per syllable)",
                                   f"{reader} reads them whole (model.name)")
        else:
            found["decomposed"] = (f"{percent(share)} of the train texts hold {script} and the tokenizer strips the "
                                   f"accents or marks from {percent(fit['decomposed_fraction'])} of the words that have "
                                   "them (an uncased vocabulary)", "a cased or multilingual model keeps them (model.name)")
    elif share >= MAIN_SCRIPT and per_char is not None and per_char > PIECES:
        found["pieces"] = (f"{percent(share)} of the train texts hold {script} and the tokenizer cuts its words into "
                           f"{per_char:.1f} tokens per character (its vocabulary lacks them)",
                           f"{reader} reads them whole (model.name)")
    if (fit.get("unknown_fraction") or 0.0) >= UNKNOWN:
        found["unknown"] = (f"{percent(fit['unknown_fraction'])} of the train texts' tokens are unknown to the tokenizer "
                            "(the model sees nothing of them)",
                            "a model whose vocabulary covers the texts' characters (model.name)")
    if truncated_fraction >= TRUNCATED:
        found["truncated"] = (f"{percent(truncated_fraction)} of the train texts are longer than max_length "
                              f"{max_length} and are cut", "a larger tokenize.max_length keeps more of them")
    return found


def fit_warnings(fit, truncated_fraction, max_length, model_name):
    """One line per problem fit_problems finds, naming the model, what was found and what to try."""
    return [f"warning: {found.replace('the tokenizer', f'{model_name}' + chr(39) + 's tokenizer', 1)}: {remedy}"
            for found, remedy in fit_problems(fit, truncated_fraction, max_length).values()]
