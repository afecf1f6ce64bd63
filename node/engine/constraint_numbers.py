"""JSON numbers a double can hold, as regexes: the number terminal of the constraint's JSON (node.engine.constraint_json).

llguidance's own JSON schema compiler writes an unbounded number as
`-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?` and has no option to bound its digits; under a
response_format SmolLM2 sometimes wrote digits inside a number until the token limit. The bound here:

- At most 17 significant digits: those of a nonzero integer part and every fraction digit after
  them; after "0." at most 16 zeros, then at most 17 digits. So every digit a looping model may
  write is bounded (zeros too: it writes them as readily as any other). 17 is what a double holds:
  every double has a decimal form of at most 17 significant digits that parses back to it (IEEE
  754's max_digits10; Python's repr never writes more, and writes at most 4 zeros after "0."), so
  no double is lost, while an 18th digit is one float() rounds away. 15 (DBL_DIG) would make every
  accepted decimal survive the trip back to text, but would refuse doubles a client may send and
  expect back verbatim (0.30000000000000004).
- The exponent keeps the value in [1e-307, 1e308), or 0: finite, and normal, so float() neither
  overflows to inf nor falls into subnormals (fewer digits held) or to 0. With d digits before the
  point the exponent is in [-306-d, 308-d]; with "0." and z zeros after the point, in [z-306, z+308];
  an exponent has at most one leading zero (Python and C write "1e-05"; more zeros would be digits
  without end again). The cost: a value from 1e308 to the largest double (1.8e308) cannot be written.
- A number with minimum/maximum is also matched against the range, its fixed-point digits compared
  as strings (no exponent: llguidance's range regexes have none either).

Integers (`type: integer`) stay llguidance's, their open sides bounded at 2**53 by the schema
(node.engine.constraint_json.exact_integers): every integer up to 2**53 in magnitude is exactly a
double (2**53 + 1 is the first that is not), so int(s) == int(float(s)).
tests/engine/test_constraint_numbers.py checks these claims with hypothesis against float().
"""

from __future__ import annotations

import functools
import math
from decimal import Decimal, InvalidOperation
from typing import Any, TypeGuard

MAX_DIGITS = 17
EXACT_INT = 2**53
_FRAC = "(\\.[0-9]+)?"
_ANY_UNSIGNED = "(0|[1-9][0-9]*)" + _FRAC


def finite_number(v: Any) -> TypeGuard[int | float]:
    """A JSON number (not a bool) with a finite value."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _alts(parts: list[str]) -> str | None:
    return "(" + "|".join(parts) + ")" if parts else None


def _same_length(a: str, *, below: bool, strict: bool, first: bool = True) -> str | None:
    """Digit strings as long as `a` below it (or above), no leading zero where longer than one; None: there are none."""
    if not a:
        return None if strict else ""
    d, rest = int(a[0]), a[1:]
    low = 1 if first and len(a) > 1 else 0
    parts = []
    if below and d > low:
        parts.append(f"[{low}-{d - 1}][0-9]{{{len(rest)}}}")
    if not below and d < 9:
        parts.append(f"[{d + 1}-9][0-9]{{{len(rest)}}}")
    tail = _same_length(rest, below=below, strict=strict, first=False)
    if tail is not None:
        parts.append(a[0] + tail)
    return _alts(parts)


def _upto(n: int) -> str:
    """The integers 0..n, without leading zeros."""
    s = str(n)
    parts = ["0"] if n > 0 else []
    if len(s) > 1:
        parts.append(f"[1-9][0-9]{{0,{len(s) - 2}}}")
    same = _same_length(s, below=True, strict=False)
    if same:
        parts.append(same)
    return _alts(parts) or "0"


def _exponent(low: int, high: int) -> str:
    # One leading zero, as C's printf and Python's repr write "1e-05"; more would be digits without end again.
    return f"([eE](\\+?0?{_upto(high)}|-0?{_upto(-low)}))?"


@functools.cache
def number_regex() -> str:
    """A JSON number of at most 17 significant digits whose value is 0 or in [1e-307, 1e308) (module docstring)."""
    alts = [f"0(\\.0{{1,{MAX_DIGITS}}})?{_exponent(-307, 307)}"]
    for d in range(1, MAX_DIGITS + 1):
        frac = f"(\\.[0-9]{{1,{MAX_DIGITS - d}}})?" if d < MAX_DIGITS else ""
        alts.append(f"[1-9][0-9]{{{d - 1}}}{frac}{_exponent(-306 - d, 308 - d)}")
    for z in range(MAX_DIGITS):
        alts.append(f"0\\.0{{{z}}}[1-9][0-9]{{0,{MAX_DIGITS - 1}}}{_exponent(z - 306, z + 308)}")
    return "-?(" + "|".join(alts) + ")"


# ---- a range, as fixed-point digit strings ------------------------------------------------

def _frac(b: str, *, below: bool, strict: bool) -> str:
    """Non-empty fraction digits F with 0.F below 0.b (or above), b non-empty without trailing zeros."""
    d, rest = int(b[0]), b[1:]
    parts = []
    if below and d > 0:
        parts.append(f"[0-{d - 1}][0-9]*")
    if not below and d < 9:
        parts.append(f"[{d + 1}-9][0-9]*")
    if rest:
        inner = _frac(rest, below=below, strict=strict)
        parts.append(f"{d}({inner})?" if below else f"{d}{inner}")  # "d" alone is below 0.b, never above
    elif below and not strict:
        parts.append(f"{d}0*")
    elif not below:
        parts.append(f"{d}[0-9]*[1-9][0-9]*" if strict else f"{d}[0-9]*")
    return _alts(parts) or ""  # never empty: b's last digit is not 0


def _unsigned(v: Decimal, *, below: bool, strict: bool) -> str:
    """Unsigned fixed-point numbers below v >= 0 (or above), strictly or not."""
    whole, _, frac = format(v, "f").partition(".")
    frac = frac.rstrip("0")
    parts = []
    if below and len(whole) > 1:
        parts.append(f"(0|[1-9][0-9]{{0,{len(whole) - 2}}}){_FRAC}")
    if not below:
        parts.append(f"[1-9][0-9]{{{len(whole)},}}{_FRAC}")
    same = _same_length(whole, below=below, strict=True)
    if same is not None:
        parts.append(same + _FRAC)
    if not frac and below and not strict:
        parts.append(f"{whole}(\\.0+)?")
    elif not frac and not below:
        parts.append(f"{whole}\\.[0-9]*[1-9][0-9]*" if strict else f"{whole}{_FRAC}")
    elif frac and below:
        parts.append(f"{whole}(\\.{_frac(frac, below=True, strict=strict)})?")
    elif frac:
        parts.append(f"{whole}\\.{_frac(frac, below=False, strict=strict)}")
    return _alts(parts) or "()"  # below 0 strictly: no unsigned number (the empty text, which is none)


def _at_least(lo: Decimal, strict: bool) -> str:
    if lo > 0 or (lo == 0 and strict):
        return _unsigned(lo, below=False, strict=strict)
    if lo == 0:
        return f"({_ANY_UNSIGNED}|-0(\\.0+)?)"
    return f"({_ANY_UNSIGNED}|-{_unsigned(-lo, below=True, strict=strict)})"


def _at_most(hi: Decimal, strict: bool) -> str:
    if hi < 0 or (hi == 0 and strict):
        return "-" + _unsigned(-hi, below=False, strict=strict)
    if hi == 0:
        return f"(-{_ANY_UNSIGNED}|-?0(\\.0+)?)"
    return f"(-{_ANY_UNSIGNED}|{_unsigned(hi, below=True, strict=strict)})"


def _decimal(v: Any) -> Decimal | None:
    """A bound as an exact decimal; None where it is none a fixed-point comparison takes (not a number, huge, tiny)."""
    if not finite_number(v):
        return None
    try:
        d = Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
    except InvalidOperation:
        return None
    return d if len(format(abs(d), "f")) <= 2 * MAX_DIGITS + 8 else None


def _bound(s: dict[str, Any], inclusive: str, exclusive: str, lower: bool) -> tuple[Decimal, bool] | None | bool:
    """(value, strict) of one side of a number's range; None: no bound; False: a bound no regex here compares."""
    given = [(_decimal(s[k]), k == exclusive) for k in (inclusive, exclusive) if k in s]
    if not given:
        return None
    if any(d is None for d, _ in given):
        return False
    values = [d for d, _ in given if d is not None]
    value = max(values) if lower else min(values)  # the tighter bound wins; at equal values, the exclusive one
    return value, any(strict for d, strict in given if d == value)


def range_regexes(s: dict[str, Any]) -> list[str] | None:
    """The regexes a number's text must also match for its schema's minimum/maximum (exclusive or not);
    None where a bound is not a plain finite number a fixed-point comparison can take, or where the range
    is empty (llguidance's own compiler then names the unsatisfiable schema)."""
    low, high = _bound(s, "minimum", "exclusiveMinimum", True), _bound(s, "maximum", "exclusiveMaximum", False)
    if low is False or high is False:
        return None
    if isinstance(low, tuple) and isinstance(high, tuple):
        if low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1])):
            return None
    return ([_at_least(*low)] if isinstance(low, tuple) else []) + ([_at_most(*high)] if isinstance(high, tuple) else [])
