"""Checked settings: one section of params.yaml at a time, each key checked against the kinds and
Range it allows, and PipelineError, the one-line error a user can fix."""
import math
from dataclasses import dataclass

import yaml

PARAMS_FILE = "params.yaml"


class PipelineError(Exception):
    """A problem the user can fix; the stage prints its message on one line and exits 1."""


KIND_NAMES = {int: "a whole number", float: "a number", str: "a string", bool: "true or false",
              dict: "a mapping", list: "a list", None: "null"}


@dataclass(frozen=True)
class Range:
    """The numbers a setting allows, for load_params: e.g. Range(0, 1, low_open=True, high_open=True)
    is above 0 and below 1; Range(1) is at least 1."""
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x):
        return ((x > self.low if self.low_open else x >= self.low)
                and (x < self.high if self.high_open else x <= self.high))

    def __str__(self):
        low = f"{'above' if self.low_open else 'at least'} {self.low:g}" if self.low > -math.inf else ""
        high = f"{'below' if self.high_open else 'at most'} {self.high:g}" if self.high < math.inf else ""
        return " and ".join(filter(None, [low, high]))


SEEDS = Range(0, 2**32 - 1)  # what numpy and scikit-learn take as a seed


def load_params(section, expected=None, path=PARAMS_FILE):
    """Return one section of params.yaml as a dict, checked against `expected` when given.

    `expected` maps each key to the kinds it accepts, e.g. {"epochs": (float, Range(0, low_open=True)),
    "batch_size": (int, "auto", Range(1)), "test_file": (str, None)}: a type, None, a literal
    string, and for numbers a Range. An unknown, missing, mistyped or out-of-range key is a
    one-line error naming it and what was expected.
    """
    with open(path, encoding="utf-8") as f:
        params = yaml.safe_load(f) or {}
    if section not in params:
        raise PipelineError(f"{path}: missing section {section!r}")
    values = dict(params[section] or {})
    if expected is None:
        return values
    unknown = [k for k in values if k not in expected]
    if unknown:
        raise PipelineError(f"{path}: unknown key {section}.{unknown[0]}; "
                            f"{section} takes {', '.join(expected)}")
    for key, kinds in expected.items():
        if key not in values:
            raise PipelineError(f"{path}: {section}.{key} is missing; expected {describe(kinds)}")
        values[key] = check_kind(values[key], kinds, f"{path}: {section}.{key}")
    return values


def describe(kinds):
    """What a params spec allows, in words: "a whole number at least 1 or 'auto'"."""
    limits = " ".join(str(k) for k in kinds if isinstance(k, Range))
    return " or ".join(repr(k) if isinstance(k, str) else KIND_NAMES[k] + (f" {limits}" if limits and k in (int, float) else "")
                       for k in kinds if not isinstance(k, Range))


def check_kind(value, kinds, name):
    """`value` if it is one of `kinds` (and inside their Range, if a number); numbers written as
    strings (YAML reads `1e-4` as a string) become floats where a number is expected."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    allowed = next((k for k in kinds if isinstance(k, Range)), Range())
    for kind in kinds:
        if (kind is None and value is None) or (isinstance(kind, str) and value == kind):
            return value
        number = None
        if kind is int and is_number and float(value).is_integer():
            number = int(value)
        elif kind is float and is_number:
            number = float(value)
        elif kind is float and isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if math.isfinite(number) and number in allowed:
                return number
            break  # a number out of range: say what the range is
        if kind in (str, bool, dict, list) and isinstance(value, kind):
            return value
    raise PipelineError(f"{name} must be {describe(kinds)}, not {value!r}")


























