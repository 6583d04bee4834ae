"""The words of ``plait analyze``'s findings: ranks, counts, times and calls as text."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence

from plait.diagnostics.schema import CallRecord

__all__ = ["call_text", "clock", "died", "dumps_of", "dur", "is_are", "plural", "ranks"]


def ranks(rs: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 0, 1, 3``."""
    rs = sorted(rs)
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return "ranks " + ", ".join(map(str, rs))


def is_are(rs: Sequence[int]) -> str:
    """The verb for ``rs``."""
    return "is" if len(rs) == 1 else "are"


def plural(n: int, word: str) -> str:
    """``a call`` or ``3 calls``."""
    return f"{'a' if n == 1 else n} {word}{'' if n == 1 else 's'}"


def dumps_of(rs: Sequence[int]) -> str:
    """``rank 0's dump`` or ``the dumps of ranks 0, 2``."""
    return f"rank {rs[0]}'s dump" if len(rs) == 1 else f"the dumps of {ranks(rs)}"


def died(
    rs: Sequence[int],
    away: Collection[int] = (),
    saw: Mapping[int, str] | None = None,
    unread: Collection[int] = (),
) -> str:
    """Why ranks ``rs`` left no dump; ``away``: those that dumped for another communicator;
    ``saw``: how some ended, as the launcher saw ("was killed by SIGKILL"); ``unread``:
    those whose dump file is there but could not be read."""
    bad = sorted(r for r in rs if r in unread)
    seen = {r: saw[r] for r in rs if saw and r in saw and r not in away and r not in bad}
    there = sorted(r for r in rs if r in away and r not in bad)
    rest = [r for r in rs if r not in away and r not in seen and r not in bad]
    said = [f"rank {r} {how}, as plait run saw" for r, how in sorted(seen.items())]
    if bad:
        said.append(f"the dump file of {ranks(bad)} could not be read (see the skipped line above)")
    if there:
        said.append(
            f"{ranks(there)} dumped for another communicator of the job (see its report): "
            f"stuck or failed there"
        )
    if rest:
        if len(rest) == 1:
            it, was, its = "it", "was", "its"
        else:
            it, was, its = "they", "were", "their"
        # Named where other ranks were named before them ("rank 1 probably died"), else
        # "it", after "rank 1 left no dump: ".
        who = ranks(rest) if said else it
        said.append(
            f"{who} probably died or {was} killed (see {its} exit status in plait run's "
            f"output), or {it} wrote to another folder or host"
        )
    return "; ".join(said)


def call_text(c: CallRecord, ref: CallRecord | None) -> str:
    """``allreduce #17 (train.py:42)``, plus the fields that differ from ``ref``'s call."""
    if ref is None or ref.collective != c.collective:
        return c.describe()
    diff = [
        f"{name}={getattr(c, name)}"
        for name in ("algorithm", "count", "dtype", "op", "root")
        if getattr(c, name) != getattr(ref, name)
    ]
    return f"{c.collective} #{c.seq} with {', '.join(diff)} ({c.where})"


def clock(t: float | None) -> str:
    """A wall-clock time of day, to the millisecond, in UTC; ``?`` if unknown."""
    if not t:
        return "?"
    try:
        return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d} UTC"
    except (OverflowError, ValueError, OSError):  # no time a dump of a real run holds
        return "?"


def dur(t: float, places: int = 1) -> str:
    """A duration in s (``places`` decimals), ms or µs."""
    if t >= 1:
        return f"{t:.{places}f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} µs"
