"""How every number in normscope's text is written: one notation for tables, evidence and verdicts alike (a true
minus sign, exponents without padding: ``1.5e−7``, never ``1.5e-07`` beside it)."""

from __future__ import annotations

import math


def _exponent(text: str) -> str:
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


def fmt(v: float, digits: int = 4) -> str:
    """A value read as a quantity: ``digits`` decimals, −0 shown as 0, tiny or huge in e-notation."""
    if v != v:  # NaN
        return "nan"
    if v in (math.inf, -math.inf):
        return "∞" if v > 0 else "−∞"
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        mantissa, exponent = f"{v:.{digits - 1}e}".split("e")
        return _exponent(f"{mantissa.rstrip('0').rstrip('.')}e{exponent}").replace("-", "−")
    text = f"{v:.{digits}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "0") else text.replace("-", "−")


def sig(v: float, digits: int = 3) -> str:
    """A value read as a size (an error, a bound, a ratio): ``digits`` significant digits, in the notation of
    :func:`fmt`."""
    v = float(v)
    if not math.isfinite(v) or v == 0:
        return fmt(v)
    return _exponent(f"{v:.{digits}g}").replace("-", "−")
