"""Read the flight-recorder dumps of every rank and say what went wrong first.

Examples:
  plait analyze /tmp/plait-dumps/JOB          every dump of a job (a folder is searched)
  plait analyze dumps/rank*.json --json       machine-readable, one object per communicator
  plait analyze DIR --late 0.1                call a rank late from a 100 ms median on

Each communicator's dumps are read together and checked, in this order:

- the first call number at which ranks made different calls (another
  collective, count, dtype, op, root or algorithm), with each rank's source
  line, and whether a rank seems to have skipped a call or made an extra one
  (not where ranks without a dump could be on either side);
- the ranks that left no dump (probably dead; how they ended where plait run's
  note says, lost where the others' errors say, or stuck in or gone on to
  another communicator) and the ranks that never reached the call the others
  wait in, with their last call and when it ended (before ranks without a dump
  that no rank waits for: one killed while the others waited is not the cause);
- ranks that dumped on an error or a stall while no collective of theirs was in
  flight or failed: the point-to-point call (send, recv, sendrecv) the reason
  names, with its peer and tag, the line the rank's thread was at, and where the
  peer was as its dump says;
- where every rank is: waiting in which call for which peers since when, or
  idle after which call and where the thread that makes its calls is; failed
  calls and their errors;
- how late each rank arrived at the calls every rank completed (median and
  max); a rank late by at least ``--late`` seconds is named a straggler.

The exit status is 0 when nothing is wrong, 1 when a problem was found or a
file given could not be read as a dump, and 2 when no dump could be read.
Dumps are written on a timeout, a lost peer or a mismatch, on SIGUSR1, and by
``plait run --stall-timeout``; see docs/debugging.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import textwrap
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from plait.diagnostics._elsewhere import lost_ranks, whereabouts
from plait.diagnostics._mismatch import NOT_PROBLEMS, Finding, first_mismatch
from plait.diagnostics._where import outside_finding, stall_call
from plait.diagnostics._where import where as _where
from plait.diagnostics._words import clock as _clock
from plait.diagnostics._words import died as _died
from plait.diagnostics._words import dumps_of as _dumps_of
from plait.diagnostics._words import dur as _dur
from plait.diagnostics._words import plural as _plural
from plait.diagnostics._words import ranks as _ranks
from plait.diagnostics.places import dumped_as
from plait.diagnostics.schema import (
    CallRecord,
    Dump,
    LauncherNote,
    find_dumps,
    launcher_notes,
    load_all,
)
from plait.diagnostics.stragglers import Lateness, format_lateness, measure, stragglers

__all__ = [
    "Diagnosis",
    "Finding",
    "add_arguments",
    "diagnose",
    "diagnose_group",
    "format_report",
    "main",
]

#: Columns of the report's lines.
WIDTH = 100
#: A launcher's note (launcher.json) further than this (seconds) from a dump is another run's.
NOTE_SPREAD = 60.0
#: Dumps of one communicator written further apart than this (seconds) may be from two runs.
STALE_SPREAD = 600.0


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What the dumps of one communicator say.

    ``findings`` come most telling first: ``findings[0]`` is what went wrong
    first. ``where`` has one line per rank (where it is), ``lateness`` one
    entry per rank with a dump.
    """

    job: str
    comm: int
    size: int
    ranks: tuple[int, ...]
    reasons: tuple[str, ...]
    findings: tuple[Finding, ...]
    where: tuple[str, ...]
    lateness: tuple[Lateness, ...]
    compared: tuple[int, int] | None  # the first and last call numbers lateness was measured on
    job_ranks: tuple[int | None, ...] = ()  # each rank's job rank, as its dump says (None: ?)

    @property
    def ok(self) -> bool:
        """Whether nothing was found wrong (findings of :data:`NOT_PROBLEMS` aside)."""
        return all(f.kind in NOT_PROBLEMS for f in self.findings)


# -- diagnosis ---------------------------------------------------------------------------


def diagnose(
    dumps: Sequence[Dump],
    *,
    late: float = 0.01,
    notes: Mapping[Path, LauncherNote] | None = None,
    unreadable: Collection[Path] = (),
) -> list[Diagnosis]:
    """One :class:`Diagnosis` per (job, communicator) among ``dumps``.

    ``late``: the median lateness, in seconds, from which a rank is a straggler. Of a job's
    dumps from several runs (Note [runs of a job]), those of its newest run are diagnosed.
    ``notes``: ``plait run``'s notes of how a job's failed ranks ended, by the folder of
    its dumps (:func:`~plait.diagnostics.schema.launcher_notes`). ``unreadable``: files
    found that could not be read as dumps: a rank whose file is one is said to be so.
    """
    dumps, older = _newest_runs(dumps)
    groups: dict[tuple[str, int], list[Dump]] = {}
    jobs: dict[str, list[Dump]] = {}
    for d in dumps:
        groups.setdefault((d.job, d.comm), []).append(d)
        jobs.setdefault(d.job, []).append(d)
    ended: dict[str, dict[int, str]] = {}  # job -> how its failed ranks ended
    for d in dumps:
        seen = (notes or {}).get(Path(d.path).parent.resolve()) if d.path else None
        # A note of another run of a job id used again is written apart from this one's
        # dumps (a note of this run, just before the dumps it asks for).
        if seen and abs(seen.time - d.time) <= NOTE_SPREAD:
            ended.setdefault(d.job, {}).update(seen.ended)
    # A stall dumps every communicator of its process: its call may be another one's.
    procs: dict[tuple[str, str, int, str], set[int]] = {}
    for d in dumps:
        if d.reason.startswith("stall: "):
            procs.setdefault((d.job, d.host, d.pid, d.reason), set()).add(d.comm)
    result = []
    for key in sorted(groups):
        # Note [dumps of other communicators]
        elsewhere, moved = whereabouts(jobs[key[0]], key[1])
        result.append(
            diagnose_group(
                groups[key],
                late=late,
                elsewhere=elsewhere,
                ended=ended.get(key[0]),
                unread=_unread(groups[key], unreadable),
                moved=moved,
                shared={
                    d.rank
                    for d in groups[key]
                    if len(procs.get((d.job, d.host, d.pid, d.reason), ())) > 1
                },
            )
        )
    for job, left in older.items():
        i = next(i for i, d in enumerate(result) if d.job == job)
        ranks = tuple(sorted({d.rank for d in left}))
        note = Finding(
            "older_run",
            None,
            ranks,
            f"left out {_plural(len(left), 'dump')} of an earlier run of job {job} "
            f"({', '.join(sorted({os.path.basename(d.path) or d.host for d in left}))}, "
            f"written by {_clock(max(d.time for d in left))}): the job id was used again "
            "(PLAIT_JOB_ID), so its folder holds both runs' dumps",
        )
        result[i] = dataclasses.replace(result[i], findings=(*result[i].findings, note))
    return result


# Note [runs of a job]
#     A rank's dump goes to <folder>/<job>/rank<r>.json and replaces that rank's earlier
#     one. A job id used again (PLAIT_JOB_ID set by hand, torchrun's run id "none") thus
#     leaves, beside the new run's dumps, those of earlier runs' ranks that did not dump
#     this time; read together, a rank's old calls look like a mismatch or a skipped call.
#     plait.init draws a run token on rank 0 and hands it to every rank through the store
#     it meets at; each dump carries it (``run``). Of one job's dumps, only those of the run
#     whose newest dump is newest are diagnosed, and the report says what it left out.
#     Dumps without a token (written by an older plait, or by a communicator not made by
#     plait.init) are read with every run's.


def _unread(dumps: Sequence[Dump], unreadable: Collection[Path]) -> set[int]:
    """The ranks of the communicator of ``dumps`` whose files beside theirs are among
    ``unreadable`` (``rank<r>.json``, or ``comm<id>.rank<r>.json`` of a group)."""
    folders = {Path(d.path).parent.resolve() for d in dumps if d.path}
    comm = dumps[0].comm
    out = set()
    for p in unreadable:
        named = dumped_as(p.name)
        if named is not None and named[0] == comm and p.parent.resolve() in folders:
            out.add(named[1])
    return out


def _newest_runs(dumps: Sequence[Dump]) -> tuple[list[Dump], dict[str, list[Dump]]]:
    """``dumps`` less those of a job's earlier runs, and those, by job."""
    newest: dict[str, tuple[float, str]] = {}
    for d in dumps:
        if d.run is not None and (d.job not in newest or d.time > newest[d.job][0]):
            newest[d.job] = (d.time, d.run)
    kept: list[Dump] = []
    older: dict[str, list[Dump]] = {}
    for d in dumps:
        if d.run is None or d.run == newest[d.job][1]:
            kept.append(d)
        else:
            older.setdefault(d.job, []).append(d)
    return kept, older


def diagnose_group(
    dumps: Sequence[Dump],
    *,
    late: float = 0.01,
    elsewhere: set[int] | None = None,
    ended: Mapping[int, str] | None = None,
    unread: Collection[int] = (),
    moved: Mapping[int, tuple[int, int]] | None = None,
    shared: Collection[int] = (),
) -> Diagnosis:
    """The :class:`Diagnosis` of the dumps of one communicator (one job, one comm id).

    ``elsewhere``: the job ranks whose dump of another communicator of the job says where
    they are; a rank without a dump here but among them (by its job rank: the world
    communicator's ranks are the job's, a group's dumps list theirs) is stuck or failed in
    another communicator, not dead. ``ended``: how ranks that failed ended, by job rank, as
    ``plait run`` saw (its dumps of the others were asked for after that failure: no
    snapshot of a busy rank). ``unread``: ranks whose dump file could not be read.
    ``moved``: job ranks that went on to a communicator shrunk from this one, with its id
    and the number of shrinks from this one (Note [dumps of other communicators]).
    ``shared``: ranks whose stall dump other communicators of their process share.
    """
    if not dumps:
        raise ValueError("no dumps to diagnose")
    findings: list[Finding] = []
    by_rank: dict[int, Dump] = {}
    for d in sorted(dumps, key=lambda d: d.time):
        by_rank[d.rank] = d  # a later dump of a rank replaces an earlier one
    sizes = sorted({d.size for d in dumps})
    size = sizes[-1]
    if len(sizes) > 1:
        findings.append(
            Finding("size", None, (), f"the dumps disagree on the communicator's size: {sizes}")
        )
    times = [d.time for d in by_rank.values()]
    if max(times) - min(times) > STALE_SPREAD:
        findings.append(
            Finding(
                "stale",
                None,
                (),
                f"the dumps were written {(max(times) - min(times)) / 60:.0f} minutes apart: "
                "are they all from the same run?",
            )
        )
    ranks = tuple(sorted(by_rank))
    missing = tuple(r for r in range(size) if r not in by_rank)
    calls = {r: {c.seq: c for c in by_rank[r].calls} for r in ranks}
    mismatch = first_mismatch(calls, missing)
    job_ranks = tuple(_job_rank(by_rank, r) for r in range(size))
    if dumps[0].comm == 0:
        job_ranks = tuple(r if g is None else g for r, g in enumerate(job_ranks))
    away = {r for r in missing if job_ranks[r] in (elsewhere or ())}
    saw = {r: ended[g] for r, g in enumerate(job_ranks) if ended and g is not None and g in ended}
    went = {
        r: f"communicator {moved[g][0]:x}, "
        + ("shrunk from this one" if moved[g][1] == 1 else "shrunk from one that replaced this one")
        for r, g in enumerate(job_ranks)
        if moved and g is not None and g in moved
    }
    why = functools.partial(_died, away=away, saw=saw, unread=unread, moved=went)
    stuck = _stuck(by_rank, calls, missing, why, bool(saw))
    if mismatch is not None and (
        not stuck
        or mismatch[0].seq is None
        or stuck[0].seq is None
        or mismatch[0].seq <= stuck[0].seq
    ):
        head = [*mismatch, *stuck]
    else:
        head = [*stuck, *(mismatch or ())]
    # Dumps on an error or a stall outside every recorded call: a point-to-point call.
    p2p = (outside_finding(r, d, by_rank, r in shared) for r, d in sorted(by_rank.items()))
    findings[:0] = [*head, *(f for f in p2p if f is not None)]
    explained = {f.seq for f in stuck if f.kind in ("never_arrived", "missing")}
    findings.extend(f for f in _failures(by_rank) if f.seq not in explained)
    limit = mismatch[0].seq if mismatch is not None else None
    lateness, compared = _lateness(by_rank, calls, limit)
    for x in stragglers(lateness, late):
        rec = calls[x.rank].get(x.worst_seq) if x.worst_seq is not None else None
        where = f", {rec.where}" if rec is not None else ""
        findings.append(
            Finding(
                "late",
                x.worst_seq,
                (x.rank,),
                f"rank {x.rank} arrives late: {_dur(x.median)} after the first rank (median) "
                f"over {x.calls} calls, at worst {_dur(x.max)} at #{x.worst_seq}{where}",
            )
        )
    return Diagnosis(
        job=dumps[0].job,
        comm=dumps[0].comm,
        size=size,
        ranks=ranks,
        reasons=_reasons(by_rank),
        findings=tuple(findings),
        where=tuple(_where(r, by_rank.get(r)) for r in range(size)),
        lateness=tuple(lateness),
        compared=compared,
        job_ranks=job_ranks,
    )


def _stuck(
    by_rank: dict[int, Dump],
    calls: dict[int, dict[int, CallRecord]],
    missing: tuple[int, ...],
    why: Callable[..., str],
    saw: bool,
) -> list[Finding]:
    """Ranks that left no dump, and ranks that never reached the call the others block in;
    ``why``: :func:`~plait.diagnostics._words.died` with what is known of the ranks that
    left none; ``saw``: whether ``plait run`` saw ranks fail before the dumps."""
    out: list[Finding] = []
    lost = lost_ranks(by_rank.values())
    # A rank blocks in its oldest call not done: in flight, or failed (a timeout dumps it).
    blocked = {r: c for r, d in by_rank.items() if (c := _blocked_in(d, saw)) is not None}
    if not blocked:
        asked = not saw and all(d.reason.startswith("signal ") for d in by_rank.values())
        if (
            missing
            and asked
            and not any(c.state == "failed" for d in by_rank.values() for c in d.calls)
        ):
            # Dumps a user asked one rank for: nothing says the others are in trouble.
            them, they = ("it", "it") if len(missing) == 1 else ("them", "they")
            out.append(
                Finding(
                    "undumped",
                    None,
                    missing,
                    f"{_ranks(missing)} left no dump, so {_ranks(sorted(by_rank))} could not be "
                    f"compared with {them}: dump {them} too (kill -USR1), or see plait run's "
                    f"output if {they} ended",
                )
            )
        elif missing:
            out.append(
                Finding(
                    "missing",
                    None,
                    missing,
                    f"{_ranks(missing)} left no dump: {why(missing, lost=lost)}",
                )
            )
        return out
    # The oldest call anyone blocks in: every rank has to pass it.
    seq = min(c.seq for c in blocked.values())
    in_it = sorted(r for r, c in blocked.items() if c.seq == seq)
    ref = blocked[in_it[0]]
    when = min((c.start or c.queued or 0.0) for c in (blocked[r] for r in in_it))
    waited_for = sorted({p for r in in_it for p in blocked[r].waiting_on} - set(in_it))
    wait_text = f" for {_ranks(waited_for)}" if waited_for else ""
    verb = "wait" if any(blocked[r].in_flight for r in in_it) else "waited"
    if len(in_it) == 1:
        verb += "s" if verb == "wait" else ""
    idle: list[int] = []
    if missing:
        waited = {p for c in blocked.values() for p in c.waiting_on}
        idle = [r for r in missing if r not in waited] if waited else []
        out.append(
            Finding(
                "missing",
                seq,
                missing,
                f"{_ranks(missing)} left no dump: {why(missing, lost=lost, idle=idle)}; "
                + _waiting(in_it, blocked, verb.rstrip("s")),
            )
        )
    out.extend(_too_late(blocked, in_it, seq))  # after the missing: a likelier cause
    behind = sorted(
        r for r, d in by_rank.items() if r not in blocked and (d.last is None or d.last.seq < seq)
    )
    if behind:
        parts = []
        for r in behind:
            last = by_rank[r].last
            if last is None:
                parts.append(f"rank {r} made no call at all")
                continue
            if last.in_flight:  # a snapshot of a busy rank, taken before (_blocked_in)
                since = last.start or last.queued or 0.0
                before = (
                    f", {_dur(when - d_time)} before" if when > (d_time := by_rank[r].time) else ""
                )
                parts.append(
                    f"rank {r}'s dump ({by_rank[r].reason}, at {_clock(by_rank[r].time)}"
                    f"{before} the first rank began #{seq}) found it in {last.describe()}, "
                    f"{_dur(by_rank[r].time - since)} after it began: a rank at work then"
                )
                continue
            ended = last.end or last.start
            gap = (
                f", {_dur(when - ended)} before the first rank began #{seq}"
                if ended and when and when > ended
                else ""
            )
            parts.append(f"rank {r}'s last call, {last.describe()}, ended at {_clock(ended)}{gap}")
        # The ranks waited for come before those without a dump that no rank waits for: a
        # rank killed while the others waited, its part of the call sent, is not what
        # blocks them.
        out.insert(
            0 if missing and len(idle) == len(missing) else len(out),
            Finding(
                "never_arrived",
                seq,
                tuple(behind),
                f"{_ranks(behind)} never reached call #{seq} ({ref.name} at {ref.where}), "
                f"where {_ranks(in_it)} {verb}{wait_text} from {_clock(when)} on: "
                + "; ".join(parts),
            ),
        )
    return out


def _waiting(in_it: list[int], blocked: dict[int, CallRecord], verb: str) -> str:
    """``ranks 0, 1 wait in allreduce #3 (train.py:9) for rank 2``; each call apart where
    ``in_it`` block in different ones (a mismatch): ``rank 2 waited in allreduce #3
    (b.py:9), rank 3 in broadcast #3 (b.py:10)``."""
    calls: dict[tuple[object, ...], list[int]] = {}
    for r in in_it:
        calls.setdefault((blocked[r].signature, blocked[r].where), []).append(r)
    parts: list[str] = []
    for rs in calls.values():
        peers = sorted({p for r in rs for p in blocked[r].waiting_on} - set(in_it))
        wait = f" for {_ranks(peers)}" if peers else ""
        said = "" if parts else f"{verb}{'s' if verb == 'wait' and len(rs) == 1 else ''} "
        parts.append(f"{_ranks(rs)} {said}in {blocked[rs[0]].describe()}{wait}")
    return ", ".join(parts)


def _job_rank(by_rank: dict[int, Dump], r: int) -> int | None:
    """Rank ``r``'s job rank, as any dump of its communicator says (its own, or a member
    list: a rank without a dump is still named), or None."""
    return next((g for d in by_rank.values() if (g := d.job_rank(r)) is not None), None)


#: A call in flight for less than this (seconds) when a signal asked for the dump is a
#: busy rank's, not a blocked one's (Note [snapshots of busy ranks]).
YOUNG = 1.0

# Note [snapshots of busy ranks]
#     ``kill -USR1`` of one rank of a healthy job, busy in a loop of calls, finds it in a
#     call nearly every time, a millisecond in; read as a rank blocked there, with the
#     others left without a dump, that was "probably died". And such a dump, taken long
#     before another rank's failure, stood for where the rank blocked though it had gone
#     on for thousands of calls since. A timeout, a lost peer, a mismatch and a stall
#     dump where a call is in trouble; a signal dumps wherever the rank is. So a call in
#     flight for less than YOUNG at a signal's dump is work in progress, not a block: the
#     rank is compared by the calls before it, and said to have been at work then.


def _blocked_in(d: Dump, failed: bool = False) -> CallRecord | None:
    """The call rank ``d`` blocks in: its oldest call not done, unless a signal's dump
    found it there only just begun (Note [snapshots of busy ranks]) and no rank had
    ``failed`` before (``plait run`` asked for the dumps after one)."""
    c = d.stuck
    if c is None or not c.in_flight or failed or not d.reason.startswith("signal "):
        return c
    since = c.start or c.queued
    return c if since is None or d.time - since >= YOUNG else None


def _too_late(blocked: dict[int, CallRecord], in_it: list[int], seq: int) -> list[Finding]:
    """Ranks that began call ``seq`` only after the others had given up on it (their
    timeout ran out first): the cause, though every rank failed in the call."""
    # Only a timeout is giving up on a late rank; a lost peer ends a call at once.
    ended = [
        blocked[r].end
        for r in in_it
        if blocked[r].state == "failed"
        and blocked[r].end
        and (blocked[r].error or "").startswith("CollectiveTimeout")
    ]
    if not ended:
        return []
    gave_up = min(e for e in ended if e is not None)
    late = sorted(r for r in in_it if (blocked[r].start or 0.0) > gave_up)
    if not late:
        return []
    first = min(blocked[r].start or gave_up for r in in_it)
    early = sorted(r for r in in_it if r not in late)
    parts = [
        f"rank {r} at {_clock(blocked[r].start)}, {_dur((blocked[r].start or 0.0) - first)} "
        "after the first rank"
        for r in late
    ]
    ref = blocked[late[0]]
    return [
        Finding(
            "too_late",
            seq,
            tuple(late),
            f"{_ranks(late)} reached call #{seq} ({ref.name} at {ref.where}) only after "
            f"{_ranks(early)} had given up on it at {_clock(gave_up)}: {'; '.join(parts)}. "
            "What came before the call took longer there than the others' timeout",
        )
    ]


def _failures(by_rank: dict[int, Dump]) -> list[Finding]:
    """The first failed call of each rank, grouped by call number."""
    first: dict[int, CallRecord] = {}
    for r, d in by_rank.items():
        for c in d.calls:
            if c.state == "failed":
                first[r] = c
                break
    # Ranks that failed in one call number may have made different calls there (a mismatch):
    # each call, with its own line, gets its own finding.
    # So may ranks that failed in one call of different errors (a timeout where the others
    # lost a peer): each error kind gets its own finding too.
    calls: dict[tuple[int, str, str], list[int]] = {}
    for r, c in sorted(first.items()):
        calls.setdefault((c.seq, c.describe(), (c.error or "").split(":", 1)[0]), []).append(r)
    out = []
    for (seq, text, _), rs in sorted(calls.items(), key=lambda kv: (kv[0][0], kv[1][0])):
        c = first[rs[0]]
        out.append(Finding("failed", seq, tuple(rs), f"{_ranks(rs)}: {text} failed: {c.error}"))
    return out


def _lateness(
    by_rank: dict[int, Dump], calls: dict[int, dict[int, CallRecord]], limit: int | None
) -> tuple[list[Lateness], tuple[int, int] | None]:
    """Lateness over the calls every rank with a dump completed (before ``limit``)."""
    ranks = sorted(by_rank)
    if not ranks:
        return [], None
    common = set.intersection(*(set(calls[r]) for r in ranks))
    seqs = sorted(
        s
        for s in common
        if (limit is None or s < limit)
        and all(calls[r][s].state == "done" and calls[r][s].start is not None for r in ranks)
    )
    if not seqs:
        return [Lateness(r, 0, 0.0, 0.0, 0.0, None) for r in ranks], None
    nan = float("nan")
    starts = np.array([[calls[r][s].start or nan for r in ranks] for s in seqs])
    ends = np.array([[calls[r][s].end or nan for r in ranks] for s in seqs])
    collectives = [calls[ranks[0]][s].collective for s in seqs]
    same_clock = len({by_rank[r].host for r in ranks}) == 1
    result = measure(starts, ends, seqs, collectives, same_clock=same_clock)
    # measure numbers columns 0..n-1; give them their ranks back.
    return [dataclasses.replace(x, rank=ranks[i]) for i, x in enumerate(result)], (
        seqs[0],
        seqs[-1],
    )


def _reasons(by_rank: dict[int, Dump]) -> tuple[str, ...]:
    """Why the dumps were written, by kind: ``CollectiveTimeout (ranks 0, 1, 2)``."""
    kinds: dict[str, list[int]] = {}
    for r, d in sorted(by_rank.items()):
        stalled = stall_call(d.reason)  # which call stalled: a point-to-point one has no record
        kind = d.reason.split(":", 1)[0] if stalled is None else f"stall in {stalled}"
        kinds.setdefault(kind, []).append(r)
    return tuple(f"{kind} ({_ranks(rs)})" for kind, rs in kinds.items())


# -- report ------------------------------------------------------------------------------


def format_report(diagnoses: Sequence[Diagnosis], skipped: Sequence[str] = ()) -> str:
    """The plain-words report ``plait analyze`` prints."""
    lines: list[str] = [f"skipped {s}" for s in skipped]
    for d in diagnoses:
        comm = "the world communicator" if d.comm == 0 else f"communicator {d.comm:x}"
        lines.append(
            f"job {d.job}, {comm} of {d.size} ranks: dumps from {len(d.ranks)} of {d.size} ranks"
        )
        if d.comm != 0 and any(g is not None for g in d.job_ranks):
            known = ", ".join(
                f"{r} is job rank {'?' if g is None else g}" for r, g in enumerate(d.job_ranks)
            )
            lines.append(f"its ranks, as this report numbers them: {known}")
        lines.append(f"dumped on: {', '.join(d.reasons)}")
        problems = [f for f in d.findings if f.kind not in NOT_PROBLEMS]
        if problems:
            first, *rest = problems
            lines.append(_wrap(f"first problem: {first.message}", ""))
            lines.extend(_wrap(f"then: {f.message}", "") for f in rest)
        elif any(f.kind == "undumped" for f in d.findings):
            lines.append(f"no problem found: no call is blocked in {_dumps_of(d.ranks)}")
        else:
            span = f" (calls #{d.compared[0]} to #{d.compared[1]})" if d.compared else ""
            lines.append(f"no problem found: every rank made the same calls{span}; none is stuck")
        lines.extend(_wrap(f"note: {f.message}", "") for f in d.findings if f.kind in NOT_PROBLEMS)
        lines.append("where each rank is:")
        lines.extend(_wrap(w, "  ") for w in d.where)
        if d.compared is not None:
            lines.append(
                f"lateness at the calls every rank completed (#{d.compared[0]} to "
                f"#{d.compared[1]}), after the first rank to arrive:"
            )
            lines.extend(f"  {x}" for x in format_lateness(d.lateness))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _wrap(text: str, indent: str) -> str:
    """``text`` in lines of at most :data:`WIDTH` columns, continuations indented 4 more."""
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent + "    ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def _late(text: str) -> float:
    """``--late``: a number of seconds >= 0 (a negative one called every rank late)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, not {text!r}")
    return seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``plait analyze``."""
    parser.add_argument("dumps", nargs="+", metavar="DUMPS", help="dump files or folders")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument(
        "--late",
        type=_late,
        default=0.01,
        metavar="SECONDS",
        help="median lateness from which a rank is called a straggler (default 0.01)",
    )


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``plait analyze``: takes parsed arguments (the CLI registry) or an argv list."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(
            prog="plait analyze",
            description=__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_arguments(parser)
        args = parser.parse_args(args)
    dumps, skipped = load_all(args.dumps)
    notes = launcher_notes(args.dumps)
    read = {Path(d.path).resolve() for d in dumps if d.path}
    unreadable = [p for p in find_dumps(args.dumps) if p.resolve() not in read]
    if not dumps:
        for s in skipped:
            print(f"plait analyze: {s}", file=sys.stderr)
        print("plait analyze: no flight-recorder dump found", file=sys.stderr)
        return 2
    diagnoses = diagnose(dumps, late=args.late, notes=notes, unreadable=unreadable)
    if args.json:
        print(json.dumps([{**dataclasses.asdict(d), "ok": d.ok} for d in diagnoses], indent=1))
    else:
        sys.stdout.write(format_report(diagnoses, skipped))
    return 0 if all(d.ok for d in diagnoses) and not skipped else 1


if __name__ == "__main__":
    sys.exit(main())
