"""Kubernetes resource quantities, read as the whole numbers Neuron resources are. Pure.

The grammar is apimachinery's (`resource.Quantity`): an optionally signed decimal number of ASCII
digits, then one suffix: a binary SI one (Ki Mi Gi Ti Pi Ei), a decimal SI one (m k M G T P E or
none), or a decimal exponent (e3, E-2). The API server only admits whole numbers for extended
resources, but these values also come from kube-scheduler's request bodies and from any Node, so
they are read as untrusted text: a magnitude beyond `MAX_QUANTITY` is refused before any
arithmetic is done with it, and so is anything that is not a whole number.
"""

from __future__ import annotations

import re

from neuron_scheduler.core.resources import RequestError

# Far beyond any node's Neuron devices or cores, far below where arithmetic gets expensive.
MAX_QUANTITY = 1_000_000

_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
# [0-9], never \d: str.isdigit() and \d accept Unicode digits that int() then refuses (or reads).
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[mkMGTPE]|[eE][+-]?[0-9]+)?",
    re.ASCII,
)
_MAX_DIGITS = 40  # a quantity's number part; longer text is refused before it is looked at


class QuantityError(RequestError):
    """A quantity that is not a whole number within bounds; the message quotes it."""


def whole_quantity(value: str | int, what: str) -> int:
    """The whole number a quantity stands for; QuantityError names `what` and the value."""
    if isinstance(value, bool):  # JSON true/false decode as ints in some readers
        raise QuantityError(f"{what}: {value!r} is not a quantity")
    if isinstance(value, int):
        if not 0 <= value <= MAX_QUANTITY:
            raise QuantityError(f"{what}: {_shown(value)} is out of range (0-{MAX_QUANTITY})")
        return value
    text = value.strip()
    match = _QUANTITY.fullmatch(text) if len(text) <= _MAX_DIGITS + 8 else None
    if match is None or not (match["whole"] or match["fraction"]):
        raise QuantityError(f"{what}: cannot read quantity {_shown(value)} as a whole number")
    whole, fraction = match["whole"], match["fraction"] or ""
    if len(whole) + len(fraction) > _MAX_DIGITS:
        raise QuantityError(f"{what}: quantity {_shown(value)} has too many digits")
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        base, exponent = 2, _BINARY[suffix]
    elif suffix in _DECIMAL:
        base, exponent = 10, _DECIMAL[suffix]
    else:
        base, exponent = 10, int(suffix[1:])
    if abs(exponent) > _MAX_DIGITS + 20:
        raise QuantityError(f"{what}: {_shown(value)} is out of range (0-{MAX_QUANTITY})")
    # Every part is bounded now (at most 40 digits, an exponent of at most 60): exact
    # arithmetic is cheap. value = digits * base**exponent / 10**len(fraction)
    numerator: int = int(whole + fraction or "0") * base ** max(exponent, 0)
    denominator: int = 10 ** len(fraction) * base ** max(-exponent, 0)
    if numerator % denominator:
        raise QuantityError(f"{what}: {_shown(value)} is not a whole number")
    result = numerator // denominator
    if match["sign"] == "-" and result:
        raise QuantityError(f"{what}: {_shown(value)} is negative")
    if result > MAX_QUANTITY:
        raise QuantityError(f"{what}: {_shown(value)} is out of range (0-{MAX_QUANTITY})")
    return result


def _shown(value: str | int) -> str:
    """A value for a message: quoted, and cut so a huge value cannot make a huge message."""
    if isinstance(value, int):
        # str() of an int of thousands of digits is slow, and refused past 4,300 digits.
        return str(value) if abs(value) < 10**30 else f"a {value.bit_length()}-bit number"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
