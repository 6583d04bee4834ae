"""PLAIT_ALGO: the user's own choice of algorithm per collective and size range.

Grammar (whitespace ignored)::

    PLAIT_ALGO = entry ("," entry)*
    entry      = [collective ":"] algorithm [":" range]
    range      = [size] "-" [size]      half-open: lo <= bytes < hi; an open end is unbounded
    size       = integer with an optional K, M or G suffix (powers of 1024)

An entry without a collective continues the previous entry's collective, so::

    PLAIT_ALGO="allreduce:recursive_doubling:0-8K,ring:8K-,broadcast:binomial"

runs recursive doubling for allreduce calls below 8 KiB, ring from 8 KiB on,
and binomial for every broadcast. Bytes are counted as ``auto`` counts them
(the whole vector for allreduce/reduce/broadcast, one rank's block for the
block collectives). The first entry whose range holds the call and whose
algorithm allows the call's op wins; calls no entry covers fall back to the
built-in rules. Every rank must see the same PLAIT_ALGO (as with any setting
that changes schedules, a mismatch fails with MismatchError).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from plait.algos._registry import COLLECTIVES, get

__all__ = ["Override", "overrides", "parse"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Override:
    """Use ``algorithm`` for ``collective`` calls of ``lo <= bytes < hi``."""

    collective: str
    algorithm: str
    lo: int = 0
    hi: float = float("inf")

    def covers(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` is in this entry's range."""
        return self.lo <= nbytes < self.hi


def _size(text: str, where: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = int(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"PLAIT_ALGO: {where}: {text!r} is not a size like 8K or 4096") from None
    if value < 0:
        raise ValueError(f"PLAIT_ALGO: {where}: size {text!r} is negative")
    return value


def parse(text: str) -> tuple[Override, ...]:
    """The entries of a PLAIT_ALGO value.

    Raises:
        ValueError: a syntax error, an unknown collective or algorithm, or an
            empty range; the message quotes the entry.
    """
    entries: list[Override] = []
    collective = None
    for raw in text.replace(" ", "").split(","):
        if not raw:
            continue
        parts = raw.split(":")
        if parts[0] in COLLECTIVES:
            collective, parts = parts[0], parts[1:]
        if collective is None:
            raise ValueError(
                f"PLAIT_ALGO: {raw!r} names no collective; start with one of "
                + ", ".join(COLLECTIVES)
            )
        if not parts or len(parts) > 2 or not parts[0]:
            raise ValueError(
                f"PLAIT_ALGO: {raw!r}: expected [collective:]algorithm[:lo-hi], "
                "e.g. allreduce:ring:8K-"
            )
        algorithm = parts[0]
        try:
            get(collective, algorithm)
        except ValueError as exc:
            raise ValueError(f"PLAIT_ALGO: {raw!r}: {exc}") from None
        lo, hi = 0, float("inf")
        if len(parts) == 2:
            if "-" not in parts[1]:
                raise ValueError(f"PLAIT_ALGO: {raw!r}: a range is lo-hi, e.g. 0-8K or 8K-")
            a, b = parts[1].split("-", 1)
            lo = _size(a, raw) if a else 0
            hi = _size(b, raw) if b else float("inf")
            if not lo < hi:
                raise ValueError(f"PLAIT_ALGO: {raw!r}: the range {parts[1]!r} is empty")
        entries.append(Override(collective, algorithm, lo, hi))
    return tuple(entries)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> tuple[Override, ...]:
    return parse(text)


def overrides() -> tuple[Override, ...]:
    """The entries of the current PLAIT_ALGO (parsed once per distinct value)."""
    text = os.environ.get("PLAIT_ALGO", "")
    return _parsed(text) if text.strip() else ()
