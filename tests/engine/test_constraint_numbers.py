"""The number bound of constrained JSON (node.engine.constraint_numbers), checked against float() with hypothesis.

What the number terminal accepts parses to a finite, normal double (or 0) from at most 17 digits, and every
double in [1e-307, 1e308) is accepted as Python writes it; a range's regexes agree with Decimal comparisons.
Python's `re` reads these regexes as llguidance does (classes, counted repeats, alternation only); the
matcher-level tests in test_constraint_json.py drive llguidance itself.
"""

from __future__ import annotations

import json
import math
import re
import sys
from decimal import Decimal

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.node.engine.constraint_numbers import EXACT_INT, MAX_DIGITS, number_regex, range_regexes

NUMBER = re.compile(number_regex())
# JSON's number syntax with room past every bound: long mantissas, leading zeros, 4-digit exponents.
JSON_NUMBER = r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,4})?"


def significant(text: str) -> int:
    """The significant digits a number's mantissa writes: from its first nonzero digit on (trailing zeros too)."""
    mantissa = re.split("[eE]", text.lstrip("-"))[0].replace(".", "")
    return len(mantissa.lstrip("0"))


@settings(max_examples=1000, deadline=None, database=None)
@given(st.one_of(st.from_regex(number_regex(), fullmatch=True), st.from_regex(JSON_NUMBER, fullmatch=True)))
def test_an_accepted_number_is_a_finite_normal_double_of_at_most_17_digits(text: str) -> None:
    """Any JSON number the terminal accepts has <= 17 significant digits (and a bounded length) and float() reads
    it as 0 or a normal finite double."""
    if NUMBER.fullmatch(text) is None:
        return
    value = float(text)
    assert math.isfinite(value) and significant(text) <= MAX_DIGITS and len(text) <= 45, text
    assert value == 0 or abs(value) >= sys.float_info.min, text  # no underflow into subnormals or to 0
    assert value == 0 or Decimal(text) != 0


@settings(max_examples=1000, deadline=None, database=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_double_in_range_is_accepted_as_python_writes_it(x: float) -> None:
    """repr/json.dumps of a double in [1e-307, 1e308) or 0 is accepted: the bound loses no value a client sends."""
    if x != 0 and not 1e-307 <= abs(x) < 1e308:
        return
    assert NUMBER.fullmatch(json.dumps(x)), json.dumps(x)
    assert float(json.dumps(x)) == x


def test_a_long_mantissa_a_long_fraction_and_a_huge_exponent_are_refused() -> None:
    """An 18th digit, a fraction's 18th digit, a value past 1e308 or under 1e-307, two leading zeros in an exponent:
    refused; what Python and C write (one leading zero) passes."""
    for text in ("1" * 18, "0." + "0" * 17 + "1", "1." + "2" * 17, "0.0" + "3" * 18, "1e308", "99e307", "1e-308", "0.01e-306", "1e007",
                 "00", "-", "1.", ".5"):
        assert NUMBER.fullmatch(text) is None, text
    for text in ("0", "-0", "42", "-3.25", "1" * 17, "0.30000000000000004", "0.031725642227913436", "1.7976931348623157e307", "1e-307",
                 "5E+10", "0.5e-306", "9007199254740993", "1e-05", "2.5e+16", "99e306"):
        assert NUMBER.fullmatch(text), text


@settings(max_examples=500, deadline=None, database=None)
@given(st.from_regex(r"-?(0|[1-9][0-9]{0,3})(\.[0-9]{1,4})?", fullmatch=True),
       st.sampled_from(["0", "1", "-1", "0.5", "-2.25", "10", "3.14159", "100", "-0.001", "7"]),
       st.booleans(), st.booleans())
def test_a_range_regex_agrees_with_decimal_comparison(text: str, bound: str, lower: bool, exclusive: bool) -> None:
    """minimum / maximum, inclusive or exclusive: the range regex matches exactly the numbers Decimal puts inside."""
    value = Decimal(bound)
    key = ("exclusiveMinimum" if exclusive else "minimum") if lower else ("exclusiveMaximum" if exclusive else "maximum")
    (rx,) = range_regexes({"type": "number", key: float(bound) if "." in bound else int(bound)}) or []
    x = Decimal(text)
    inside = (x > value if exclusive else x >= value) if lower else (x < value if exclusive else x <= value)
    assert bool(re.fullmatch(rx, text)) == inside, (text, key, bound, rx)


def test_an_integer_bound_of_two_to_the_53_is_exact() -> None:
    """Every integer up to 2**53 in magnitude is exactly a double; 2**53 + 1 is the first that is not."""
    for n in (EXACT_INT, -EXACT_INT, EXACT_INT - 1, 10**15 + 7):
        assert int(float(str(n))) == n
    assert int(float(str(EXACT_INT + 1))) != EXACT_INT + 1
