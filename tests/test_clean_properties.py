"""Property tests of the cleaning steps: any unicode string in, a string out, no exception, and cleaning
a cleaned text changes nothing, for each step in STEPS alone (a step added there is checked too), for
the default list of params.yaml and for every step together."""
import html.entities
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reading.cleaning import STEPS, clean_text

DEFAULT_STEPS = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())["preprocess"]["steps"]


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


@pytest.mark.parametrize("name", STEPS)
@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_each_step_alone_returns_a_string_and_is_idempotent(name, text):
    once = STEPS[name](text)
    assert isinstance(once, str)
    assert STEPS[name](once) == once


@pytest.mark.parametrize("steps", [DEFAULT_STEPS, list(STEPS), list(reversed(STEPS))],
                         ids=["default", "all", "all-reversed"])
@settings(max_examples=300, deadline=None)
@given(text=texts)
@example(text="&AEliG")  # lowercasing makes an entity (&aelig, "\u00e6")
@example(text="&amp;Hellip;")  # unescaping, then lowercasing, makes one (&hellip;)
@example(text="&#38;AELIG")  # unescaping makes "&AELIG", which lowercasing makes an entity
def test_cleaning_returns_a_string_and_is_idempotent(steps, text):
    once = clean_text(text, steps)
    assert isinstance(once, str)
    assert clean_text(once, steps) == once


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_normalized_text_has_no_edge_or_double_whitespace(text):
    out = clean_text(text, ["normalize_whitespace"])
    assert out == out.strip() and "  " not in out
    assert not any(c.isspace() and c != " " for c in out)


@settings(max_examples=150, deadline=None)
@given(text=texts)
def test_no_steps_change_nothing(text):
    assert clean_text(text, []) == text
