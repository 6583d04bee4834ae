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
    *,
    moved: Mapping[int, str] | None = None,
    lost: Collection[int] = (),
    idle: Collection[int] = (),
) -> str:
    """Why ranks ``rs`` left no dump; ``away``: those that dumped for another communicator;
    ``saw``: how some ended, as the launcher saw ("was killed by SIGKILL"); ``unread``:
    those whose dump file is there but could not be read; ``moved``: those that went on
    to a communicator that replaced this one, and which ("communicator 1337c, shrunk from
    this one"); ``lost``: those the others' errors say were lost; ``idle``: those that no
    rank with a dump waited for."""
    bad = sorted(r for r in rs if r in unread)
    went = {r: moved[r] for r in rs if moved and r in moved and r not in bad}
    there = sorted(r for r in rs if r in away and r not in bad and r not in went)
    seen = {
        r: saw[r]
        for r in rs
        if saw and r in saw and r not in away and r not in bad and r not in went
    }
    told = set(bad) | set(went) | set(there) | set(seen)
    gone = sorted(r for r in rs if r in lost and r not in told)
    quiet = sorted(r for r in rs if r in idle and r not in told and r not in gone)
    rest = [r for r in rs if r not in told and r not in gone and r not in quiet]
    said = []
    finished = sorted(r for r, how in seen.items() if how == "exited with code 0")
    if finished:
        it, its = ("it", "its") if len(finished) == 1 else ("they", "their")
        said.append(
            f"{ranks(finished)} exited with code 0, as plait run saw: {it} finished {its} "
            "calls (a rank that ends well writes no dump)"
        )
    said.extend(
        f"rank {r} {how}, as plait run saw" + (" (no rank here waited for it)" if r in idle else "")
        for r, how in sorted(seen.items())
        if r not in finished
    )
    if bad:
        said.append(f"the dump file of {ranks(bad)} could not be read (see the skipped line above)")
    for where in sorted(set(went.values())):
        rs_there = sorted(r for r, w in went.items() if w == where)
        said.append(f"{ranks(rs_there)} went on to {where} (see its report)")
    if there:
        said.append(
            f"{ranks(there)} dumped for another communicator of the job (see its report): "
            f"stuck or failed there"
        )
    if gone:
        was, its = ("was", "its process") if len(gone) == 1 else ("were", "their processes")
        said.append(
            f"{ranks(gone)} {was} lost, as the others' PeerLostError says: {its} exited or "
            f"{was} killed (see plait run's output for how)"
        )
    # Those waited for first: what the others are blocked on.
    for group in (rest, quiet):
        if not group:
            continue
        if len(group) == 1:
            it, was, its, them = "it", "was", "its", "it"
        else:
            it, was, its, them = "they", "were", "their", "them"
        # Named where other ranks were named before them ("rank 1 probably died") or are
        # named after them, else "it", after "rank 1 left no dump: " ("they" of a part of
        # "ranks 1, 2, 3" named ranks 1 and 3 as all three).
        who = ranks(group) if said or len(group) < len(rs) else it
        if group is quiet:  # nothing says they were needed: a rank that ends well dumps none
            said.append(
                f"{who} probably finished, or died (no rank here waited for {them}; see {its} "
                f"exit status in plait run's output), or {it} wrote to another folder or host"
            )
            continue
        said.append(
            f"{who} probably died or {was} killed (see {its} exit status in plait run's "
            f"output), or {it} wrote to another folder or host"
        )
    return "; ".join(said)


def call_text(c: CallRecord, ref: CallRecord | None) -> str:
    """``allreduce #17 (train.py:42)``, plus the fields that differ from ``ref``'s call."""
    if ref is None or ref.name != c.name:
        return c.describe()
    diff = [
        f"{name}={getattr(c, name)}"
        for name in ("algorithm", "count", "dtype", "op", "root")
        if getattr(c, name) != getattr(ref, name)
    ]
    return f"{c.name} #{c.seq} with {', '.join(diff)} ({c.where})"


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
