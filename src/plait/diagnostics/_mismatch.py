"""What ``plait analyze`` finds, and the first call at which ranks made different calls."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from plait.diagnostics._words import call_text
from plait.diagnostics._words import is_are as _is
from plait.diagnostics._words import plural as _plural
from plait.diagnostics._words import ranks as _ranks
from plait.diagnostics.schema import CallRecord

__all__ = ["NOT_PROBLEMS", "Finding", "first_mismatch", "skip_hint"]

#: Kinds of findings that say what the dumps cannot tell, not that anything went wrong:
#: ``undumped``, ranks without a dump beside dumps asked for by a signal that show nothing
#: blocked (``kill -USR1`` of one rank, to see where it is); ``older_run``, dumps of an
#: earlier run of the job left out (Note [runs of a job]).
NOT_PROBLEMS = frozenset({"undumped", "older_run"})


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing found wrong, in plain words.

    ``kind``: ``mismatch``, ``skipped``, ``extra``, ``missing``,
    ``never_arrived``, ``too_late``, ``failed``, ``late``, ``size`` or ``stale``; or
    ``undumped`` or ``older_run``, which are not problems (:data:`NOT_PROBLEMS`); ``seq``
    the call number it concerns (None if none); ``ranks`` the ranks at fault.
    """

    kind: str
    seq: int | None
    ranks: tuple[int, ...]
    message: str


def first_mismatch(
    calls: dict[int, dict[int, CallRecord]], missing: Sequence[int] = ()
) -> list[Finding] | None:
    """Findings about the first call number at which ranks' calls differ, or None.

    ``missing``: the ranks of the communicator without a dump. Their calls are not known,
    so the ranks of one call are "the others" only where they outnumber those of every
    other call even if every missing rank made that one (Note [the others]).
    """
    seqs = sorted({s for per in calls.values() for s in per})
    for seq in seqs:
        here = {r: per[seq] for r, per in calls.items() if seq in per}
        groups: dict[tuple[object, ...], list[int]] = {}
        for r, c in here.items():
            groups.setdefault((c.signature, c.within), []).append(r)
        if len(groups) < 2:
            continue
        ordered = sorted(groups.values(), key=lambda g: (-len(g), g[0]))
        if missing and len(ordered[0]) <= len(ordered[1]) + len(missing):
            return [_undecided(seq, ordered, here, missing)]
        major = ordered[0]
        ref = here[major[0]]
        parts = []
        odd: list[int] = []
        for g in ordered[1:]:
            c = here[g[0]]
            parts.append(f"{_ranks(g)} {_is(g)} in {_call_text(c, ref)}")
            odd.extend(g)
        message = (
            f"{'; '.join(parts)} while {_ranks(major)} {_is(major)} in {_call_text(ref, None)}"
        )
        out = [Finding("mismatch", seq, tuple(sorted(odd)), message)]
        for g in ordered[1:]:
            hint = skip_hint(g, major, seq, calls)
            if hint is not None:
                out.append(hint)
        return out
    return None


def _call_text(c: CallRecord, ref: CallRecord | None) -> str:
    """``allreduce #17 (train.py:42)``, plus the fields that differ from ``ref``'s call; a
    call within another (``split (its allgather) #1``) by its name where the two differ in
    that, whatever else differs."""
    if ref is not None and c.within != ref.within:
        return c.describe()
    return call_text(c, ref)


# Note [the others]
#     Ranks that finished their calls exit with 0 and write no dump, as do ranks that died
#     unseen: the dumps of a mismatch may be those of the odd ranks alone. Rank 2 in an
#     allreduce where ranks 0, 1, 3 were in a broadcast, ranks 0 and 1 done with theirs and
#     gone, left the dumps of ranks 2 and 3: one each, and rank 3 was named as the rank that
#     did not make "the others'" allreduce. Where the missing ranks could tip the count,
#     each rank's call is named as its dump says, and none is said to have skipped one.


def _undecided(
    seq: int, ordered: list[list[int]], here: dict[int, CallRecord], missing: Sequence[int]
) -> Finding:
    """Ranks in different calls at ``seq``, none known to be the odd one (Note [the others])."""
    by_first = sorted(ordered, key=lambda g: g[0])
    ref = here[by_first[0][0]]
    parts = [
        f"{_ranks(g)} {_is(g)} in {_call_text(here[g[0]], None if i == 0 else ref)}"
        for i, g in enumerate(by_first)
    ]
    return Finding(
        "mismatch",
        seq,
        tuple(sorted(r for g in ordered for r in g)),
        f"{'; '.join(parts)}: different calls at #{seq}, and {_ranks(missing)} left no dump, "
        "so which of these calls the rest of the ranks made, and which rank is the odd one, is "
        "not known",
    )


def skip_hint(
    odd: list[int], major: list[int], seq: int, calls: dict[int, dict[int, CallRecord]]
) -> Finding | None:
    """Whether ranks ``odd`` skipped a call (or made an extra one) at ``seq``, from evidence.

    Two kinds of evidence, both facts of the dumps: the calls after ``seq``
    line up once shifted by ``k`` (and not unshifted), or the others' call at
    ``seq`` is one that ``odd`` made before from the same line and now did not.
    """
    mine, theirs = calls[odd[0]], calls[major[0]]
    a, b = mine[seq], theirs[seq]
    them = "its" if len(odd) == 1 else "their"

    def same(x: CallRecord | None, y: CallRecord | None) -> bool | None:
        if x is None or y is None:
            return None
        return x.signature == y.signature and x.within == y.within and x.line == y.line

    unshifted = [same(mine.get(seq + i), theirs.get(seq + i)) for i in (1, 2, 3)]
    if not any(unshifted):
        for k in (1, 2, 3):
            skipped = [same(mine.get(seq + i), theirs.get(seq + i + k)) for i in range(4)]
            if skipped[0] and all(v is not False for v in skipped):
                c = theirs[seq + k]
                return Finding(
                    "skipped",
                    seq,
                    tuple(odd),
                    f"{_ranks(odd)} skipped {_plural(k, 'call')}: {them} #{seq} is the others' "
                    f"#{seq + k} ({c.name} at {c.where})",
                )
            extra = [same(mine.get(seq + i + k), theirs.get(seq + i)) for i in range(4)]
            if extra[0] and all(v is not False for v in extra):
                return Finding(
                    "extra",
                    seq,
                    tuple(odd),
                    f"{_ranks(odd)} made {_plural(k, 'extra call')} from #{seq} on "
                    f"({a.name} at {a.where}): {them} #{seq + k} is the others' #{seq}",
                )
    if a.stack and b.stack and a.stack[0][:2] == b.stack[0][:2]:
        return None  # one line, different arguments: no branch (sites differ by kind alone)
    if a.line != b.line:
        before = [c for s, c in mine.items() if s < seq and same(c, b)]
        if before:
            last = max(before, key=lambda c: c.seq)
            # Compared by sites (where a kind of call was first made), the last one is of the
            # same kind, not always from the same line: say "there" only where both lines are
            # the calls' own.
            there = bool(last.stack and b.stack) and last.stack[0][:2] == b.stack[0][:2]
            said = "one there" if there else "call of that kind"
            return Finding(
                "skipped",
                seq,
                tuple(odd),
                f"{_ranks(odd)} did not make the others' {b.name} at {b.where} this time "
                f"({them} last {said} was #{last.seq}) and went on to {a.name} at "
                f"{a.where}: a branch that only some ranks took?",
            )
    return None
