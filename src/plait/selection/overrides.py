"""PLAIT_ALGO: the user's own choice of algorithm per collective and size range.

Grammar (whitespace ignored)::

    PLAIT_ALGO = entry ("," entry)*
    entry      = [collective ":"] algorithm [":" range] ["@" segment]
    range      = [size] "-" [size]      half-open: lo <= bytes < hi; an open end is unbounded
    segment    = size                   the pipelining unit, bytes (default: SEGMENT_BYTES, 1M)
    size       = integer with an optional K, M or G suffix (powers of 1024)

An entry without a collective continues the previous entry's collective, so::

    PLAIT_ALGO="allreduce:recursive_doubling:0-8K,ring:8K-@256K,broadcast:binomial"

runs recursive doubling for allreduce calls below 8 KiB, ring cut into
256 KiB segments from 8 KiB on, and binomial for every broadcast. Bytes are
counted as ``auto`` counts them (the whole vector for allreduce/reduce/
broadcast, one rank's block for the block collectives). The first entry whose
range holds the call, whose algorithm allows the call's op and can run where
the ranks are (a one-sided algorithm such as ``arena`` needs ranks that share
a window: one host, over shared memory) wins; calls no entry covers fall back
to the rules file (:mod:`plait.selection.rules_file`), the profile and the
built-in rules, silently (``PLAIT_DEBUG=info`` logs each choice and its
source). Every rank must see the same PLAIT_ALGO (``plait.init`` refuses ranks
that differ: Note [one configuration] in plait._meeting).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from plait.algos._registry import COLLECTIVES, get

__all__ = [
    "Override",
    "format_range",
    "format_size",
    "overrides",
    "parse",
    "parse_range",
    "parse_size",
]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class Override:
    """Use ``algorithm`` for ``collective`` calls of ``lo <= bytes < hi``.

    ``segment`` is the pipelining unit in bytes; None keeps the default.
    """

    collective: str
    algorithm: str
    lo: int = 0
    hi: float = float("inf")
    segment: int | None = None

    def covers(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` is in this entry's range."""
        return self.lo <= nbytes < self.hi

    def describe(self) -> str:
        """The entry as PLAIT_ALGO writes it: ``allreduce:ring:8K-@256K``."""
        text = f"{self.collective}:{self.algorithm}"
        if self.lo or self.hi != float("inf"):
            text += ":" + format_range(self.lo, self.hi)
        if self.segment is not None:
            text += "@" + format_size(self.segment)
        return text


def format_size(n: float) -> str:
    """Bytes as the settings write them: ``256K``, ``1M``, ``100``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    return str(int(n))


def format_range(lo: float, hi: float) -> str:
    """A half-open range as the settings write it: ``0-8K`` is ``-8K``, ``8K-`` is unbounded."""
    return (format_size(lo) if lo else "") + "-" + (format_size(hi) if hi != float("inf") else "")


def parse_size(text: str) -> int:
    """Bytes in ``text``: an integer with an optional K, M or G suffix (KiB, KB, MiB... too).

    Raises:
        ValueError: not such a size, or negative (the message quotes ``text``).
    """
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    number = t[: len(t) - len(unit)]
    try:
        value = int(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 8K or 4096") from None
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return value


def parse_range(text: str) -> tuple[int, float]:
    """``(lo, hi)`` of a half-open range ``lo-hi`` of sizes; an open end is 0 or infinity.

    Raises:
        ValueError: no ``-``, a bad size, or an empty range.
    """
    if "-" not in text:
        raise ValueError("a range is lo-hi, e.g. 0-8K or 8K-")
    a, b = text.split("-", 1)
    lo = parse_size(a) if a.strip() else 0
    hi: float = parse_size(b) if b.strip() else float("inf")
    if not lo < hi:
        raise ValueError(f"the range {text!r} is empty")
    return lo, hi


def parse(text: str) -> tuple[Override, ...]:
    """The entries of a PLAIT_ALGO value.

    Raises:
        ValueError: a syntax error, an unknown collective or algorithm, an
            empty range or a zero segment; the message quotes the entry.
    """
    entries: list[Override] = []
    collective = None
    for raw in text.replace(" ", "").split(","):
        if not raw:
            continue
        body, at, seg_text = raw.partition("@")
        parts = body.split(":")
        if parts[0] in COLLECTIVES:
            collective, parts = parts[0], parts[1:]
        if collective is None:
            raise ValueError(
                f"PLAIT_ALGO: {raw!r} names no collective; start with one of "
                + ", ".join(COLLECTIVES)
            )
        if not parts or len(parts) > 2 or not parts[0] or "@" in seg_text:
            raise ValueError(
                f"PLAIT_ALGO: {raw!r}: expected [collective:]algorithm[:lo-hi][@segment], "
                "e.g. allreduce:ring:8K-@256K"
            )
        algorithm = parts[0]
        try:
            spec = get(collective, algorithm)
        except ValueError as exc:
            raise ValueError(f"PLAIT_ALGO: {raw!r}: {exc}") from None
        if not spec.supports(commutative=True):
            raise ValueError(f"PLAIT_ALGO: {raw!r}: {algorithm} runs only in the simulator")
        lo, hi = 0, float("inf")
        segment = None
        try:
            if len(parts) == 2:
                lo, hi = parse_range(parts[1])
            if at:
                segment = parse_size(seg_text)
                if segment < 1:
                    raise ValueError(f"the segment {seg_text!r} must be at least one byte")
        except ValueError as exc:
            raise ValueError(f"PLAIT_ALGO: {raw!r}: {exc}") from None
        entries.append(Override(collective, algorithm, lo, hi, segment))
    return tuple(entries)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> tuple[Override, ...]:
    return parse(text)


def overrides() -> tuple[Override, ...]:
    """The entries of the current PLAIT_ALGO (parsed once per distinct value)."""
    text = os.environ.get("PLAIT_ALGO", "")
    return _parsed(text) if text.strip() else ()
