"""Where each rank is, as ``plait analyze`` lists it: in which call, since when, or past
its last call and where the thread that makes its communicator's calls is; and what a
rank's dump says it was doing when it dumped on an error or a stall outside every call
its communicator's recorder keeps (a point-to-point call)."""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Mapping
from typing import NamedTuple

from plait.diagnostics._mismatch import Finding
from plait.diagnostics._words import clock as _clock
from plait.diagnostics._words import dur as _dur
from plait.diagnostics._words import plural as _plural
from plait.diagnostics._words import ranks as _ranks
from plait.diagnostics.schema import CallRecord, Dump

__all__ = [
    "ERROR_CHARS",
    "At",
    "Outside",
    "outside",
    "outside_finding",
    "stall_call",
    "thread_at",
    "where",
]

#: An error message in the list of where each rank is is cut to this length.
ERROR_CHARS = 160

#: A point-to-point call as plait's errors and stall dumps name it:
#: ``recv from rank 1 (tag 0)``, ``send to rank 2 (any tag)``.
_P2P = re.compile(r"\b([a-z_]+) (from|to) (rank (\d+)|any rank|PROC_NULL) \((tag -?\d+|any tag)\)")
#: The reason of a stall dump: ``stall: recv from rank 1 (tag 0) in flight for 4 s``.
_STALL = re.compile(r"stall: (.*) in flight for (.*)")


def where(rank: int, d: Dump | None) -> str:
    """Where rank ``rank`` is, as its dump ``d`` says (None: it left none)."""
    if d is None:
        return f"rank {rank}: no dump"
    last = d.stuck or d.last
    if last is None:
        return f"rank {rank}: no call recorded"
    peers = f" for {_ranks(last.waiting_on)}" if last.waiting_on else ""
    if last.in_flight:
        since = last.start or last.queued
        waited = f" ({_dur(d.time - since)} before its dump)" if since else ""
        verb = "queued behind" if last.state == "queued" else "waiting in"
        queue = [c for c in d.calls if c.seq > last.seq and c.state == "queued"]
        behind = (
            f"; {_plural(len(queue), 'call')} queued behind it (#{queue[0].seq}"
            + (f" to #{queue[-1].seq})" if len(queue) > 1 else ")")
            if queue
            else ""
        )
        return f"rank {rank}: {verb} {last.describe()}{peers} since {_clock(since)}{waited}{behind}"
    if last.state == "failed":
        error = last.error or "?"
        if len(error) > ERROR_CHARS:
            error = error[: ERROR_CHARS - 3] + "..."
        return f"rank {rank}: failed in {last.describe()}{peers} at {_clock(last.end)}: {error}"
    at = thread_at(d, last, _plait_call(d))
    return f"rank {rank}: done with {last.describe()} at {_clock(last.end)}; no call since" + (
        f"; {at.who} is at {at.text}" if at is not None else ""
    )


class At(NamedTuple):
    """Where a thread of a dump is: ``name``; ``line``, the program's innermost line
    (``train.py:13``; "" where no frame is the program's); ``inside``, the plait function
    the program called, where the thread is in plait ("" if not); ``library``, the
    innermost frame of Python's own library out from plait's, if any
    (``threading.py:1139 (_wait_for_tstate_lock)``)."""

    name: str
    line: str
    inside: str
    library: str

    @property
    def who(self) -> str:
        """``its main thread``, or ``its thread "loader"``."""
        return "its main thread" if self.name == "MainThread" else f'its thread "{self.name}"'

    @property
    def text(self) -> str:
        """``train.py:13, in plait's recv``; ``train.py:9, in threading.py:1139 (...)``."""
        if not self.line:
            return self.library
        said = f", in plait's {self.inside}" if self.inside else ""
        return self.line + (said or (f", in {self.library}" if self.library else ""))


def thread_at(d: Dump, call: CallRecord | None = None, plait_call: str = "") -> At | None:
    """Where the thread of ``d`` that makes its communicator's calls is (None: the dump
    has no thread that says): of the program's threads (plait's own, named ``plait-...``,
    left out), the one in the plait call ``plait_call`` (``recv``) if one is, else the one
    in the function that made ``call`` (its line's file and function), else one in a plait
    call, else the main thread. Calls keep no thread id: the thread is told by its frames
    (a thread of the program may drive a communicator of its own)."""
    mine = {(f[0], f[2]) for f in (call.stack[:1] if call is not None else ()) if f}
    if call is not None and call.site is not None:
        mine.add((call.site[0], call.site[2]))
    best: tuple[tuple[bool, bool, bool, bool], At] | None = None
    for name, stack in d.threads:
        at = _read(name, stack)
        if at is None or (name.startswith("plait-") and name != "MainThread"):
            continue
        users = [(p, fn) for p, _, fn in stack if not _ours(p) and not _in_library(p)]
        key = (
            bool(plait_call) and at.inside == plait_call,
            any(u in mine for u in users),
            bool(at.inside),
            name == "MainThread",
        )
        if (at.line or name == "MainThread") and (best is None or key > best[0]):
            best = (key, at)
    return None if best is None else best[1]


def _read(name: str, stack: tuple[tuple[str, int, str], ...]) -> At | None:
    """Where a thread whose stack is ``stack`` (innermost first) is; None if it says nothing."""
    inside = ""  # the plait function the program called, where the thread is in plait
    library = ""  # the innermost frame of Python's own library, if the program's is further
    for path, line, function in stack:
        if _ours(path):
            inside = function
            continue
        here = f"{os.path.basename(path)}:{line}"
        if _in_library(path):  # threading.py of a Thread.join: the caller's line says more
            library = library or f"{here} ({function})"
            continue
        return At(name, here, inside, library)
    return At(name, "", "", library) if library else None


def _ours(path: str) -> bool:
    """Whether ``path`` is a module of plait."""
    return f"{os.sep}plait{os.sep}" in path or "/plait/" in path


def _in_library(path: str) -> bool:
    """Whether ``path`` is a module of Python's own library (not site-packages)."""
    return path.startswith(_STDLIB) and "site-packages" not in path


_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


# -- dumps written outside every recorded call -------------------------------------------


class Outside(NamedTuple):
    """What a dump written on an error or a stall says its rank was doing, where no call
    its communicator's recorder keeps was in flight or failed: ``call``, the point-to-point
    call the reason names (``recv from rank 1 (tag 0)``; "" where it names none);
    ``peer``, the rank that call names (None: any rank, or none); ``stalled``: a stall
    dump (else an error's); ``how``: the error (``CommTimeout: rank 0: ...``) or how long
    the call was in flight (``4 s``)."""

    call: str
    peer: int | None
    stalled: bool
    how: str


def outside(d: Dump) -> Outside | None:
    """What ``d`` says its rank did outside every recorded call, or None: a dump asked for
    by a signal, one whose communicator has a call in flight or failed (that call says),
    and one written on a stall of another communicator's collective (a stall dumps every
    communicator of the process) say nothing of it."""
    if d.stuck is not None or d.reason.startswith("signal "):
        return None
    stall = _STALL.fullmatch(d.reason)
    if stall is not None:
        p2p = _P2P.fullmatch(stall.group(1))
        if p2p is None:
            return None
        return Outside(p2p.group(0), _peer(p2p), True, stall.group(2))
    p2p = _P2P.search(d.reason.split("; flight recorder dump:", 1)[0])
    return Outside(p2p.group(0) if p2p else "", _peer(p2p), False, d.reason)


def stall_call(reason: str) -> str | None:
    """The call a stall dump's ``reason`` names (``recv from rank 1 (tag 0)``), or None."""
    m = _STALL.fullmatch(reason)
    return m.group(1) if m else None


def _peer(m: re.Match[str] | None) -> int | None:
    return int(m.group(4)) if m is not None and m.group(4) is not None else None


def _plait_call(d: Dump) -> str:
    """The plait function a point-to-point call ``d`` dumped on is made by (``recv``)."""
    o = outside(d)
    return o.call.split(" ", 1)[0] if o is not None and o.call else ""


def outside_finding(
    rank: int, d: Dump, by_rank: Mapping[int, Dump], shared: bool = False
) -> Finding | None:
    """The finding of rank ``rank``'s dump ``d`` written outside every recorded call (see
    :func:`outside`), or None: what the rank was doing, where, and why it dumped; and
    where the peer it names was, as the peer's dump says. ``shared``: other communicators
    of its process were dumped with the same stall, which may be theirs."""
    o = outside(d)
    if o is None:
        return None
    at = thread_at(d, d.last, o.call.split(" ", 1)[0] if o.call else "")
    line = ""
    if at is not None and at.line:
        line = f" at {at.line}" + ("" if at.name == "MainThread" else f' (thread "{at.name}")')
    last = d.last
    after = (
        f"after its last collective, {last.describe()}, ended at {_clock(last.end or last.start)}"
        if last is not None
        else "before any collective"
    )
    if o.stalled:
        where = " (this communicator's, or another's of its process)" if shared else ""
        text = (
            f"rank {rank} is stuck in {o.call}{where}, a point-to-point call,{line}: in flight "
            f"for {o.how} when the stall watchdog (--stall-timeout) dumped it, {after}"
        )
    elif o.call:
        text = f"rank {rank} failed in {o.call}, a point-to-point call,{line}, {after}: {o.how}"
    else:
        text = f"rank {rank} dumped on an error outside any collective{line}, {after}: {o.how}"
    peer = by_rank.get(o.peer) if o.peer is not None and o.peer != rank else None
    if o.peer is not None and o.peer != rank and (peer is None or outside(peer) is None):
        text += f"; {_peer_text(o.peer, peer, d)}"
    return Finding("p2p" if o.call else "error", None, (rank,), text)


def _peer_text(r: int, peer: Dump | None, d: Dump) -> str:
    """Where peer ``r`` was, as its dump ``peer`` says: ``rank 1's dump (signal SIGUSR1,
    3.0 s later) finds it past its last call, allreduce #2 (p2p.py:6), at p2p.py:17``."""
    if peer is None:
        return f"rank {r}, its peer, left no dump here"
    gap = peer.time - d.time
    later = f", {_dur(abs(gap))} {'later' if gap > 0 else 'earlier'}" if abs(gap) >= 0.5 else ""
    said = f"rank {r}'s dump ({peer.reason.split(':', 1)[0]}{later}) finds it "
    c = peer.stuck
    if c is not None:
        state = "waiting in" if c.in_flight else "failed in"
        return said + f"{state} {c.describe()}"
    last = peer.last
    past = f"past its last call, {last.describe()}" if last is not None else "before any call"
    at = thread_at(peer, last)
    return said + past + (f", at {at.text}" if at is not None and at.line else "")
