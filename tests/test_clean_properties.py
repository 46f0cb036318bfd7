"""Property tests of clean_text: any unicode string in, a string out, no exception, and cleaning
a cleaned text changes nothing, under every combination of the five switches."""
import html.entities
import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reading.cleaning import CLEANING_SWITCHES, clean_text

COMBINATIONS = [dict(zip(CLEANING_SWITCHES, values))
                for values in itertools.product([False, True], repeat=len(CLEANING_SWITCHES))]


def any_case(word):
    """A strategy for `word` with each letter upper- or lowercase."""
    return st.lists(st.booleans(), min_size=len(word), max_size=len(word)).map(
        lambda upper: "".join(c.upper() if u else c for c, u in zip(word, upper)))


# Texts built from pieces the cleaning rules react to, so they hit the rules far more often than
# uniformly random characters do: every HTML entity name in any case, URL and mention starts,
# whitespace of several kinds, and characters whose case mapping is unusual.
ENTITIES = st.sampled_from(sorted(html.entities.html5)).flatmap(any_case).map(lambda n: "&" + n)
PIECES = ["&", "&amp;", "&#64;", "&#x40;", "&#10;", "&#", ";", "http://", "HTTPS://", "www.", "WWW.",
          "@", "_", " ", "  ", "\t", "\n", "\r", "\x0b", "\x1c", "\u00a0", "\u2028", "\u3000",
          "\u0130", "\u1e9e", "\u212a", "\u017f", "\u03a3", "\u0390", "a", "A", "1"]
texts = st.one_of(
    st.text(st.characters(exclude_categories=())),  # any code point, lone surrogates included
    st.lists(st.one_of(ENTITIES, st.sampled_from(PIECES), st.text(max_size=3)), max_size=12).map("".join),
)


@pytest.mark.parametrize("switches", COMBINATIONS, ids=lambda s: "-".join(k for k, v in s.items() if v) or "none")
@settings(max_examples=150, deadline=None)
@given(text=texts)
@example(text="&AEliG")  # found by this test: lowercasing made an entity (&aelig, "\u00e6")
@example(text="&amp;Hellip;")  # unescaping, then lowercasing, makes one (&hellip;)
def test_clean_text_returns_a_string_and_is_idempotent(switches, text):
    once = clean_text(text, **switches)
    assert isinstance(once, str)
    assert clean_text(once, **switches) == once


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_normalized_text_has_no_edge_or_double_whitespace(text):
    out = clean_text(text, normalize_whitespace=True)
    assert out == out.strip() and "  " not in out
    assert not any(c.isspace() and c != " " for c in out)


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_everything_off_changes_nothing(text):
    assert clean_text(text, lowercase=False, unescape_html=False, replace_urls=False,
                      replace_mentions=False, normalize_whitespace=False) == text
