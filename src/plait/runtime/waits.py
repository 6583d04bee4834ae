"""Waiting on the transport, and what a call that fails raises.

Both ways of running a schedule (the executor's dataflow and a straight-line
order, :mod:`plait.runtime.line`) block on the transport here, probing their
peers once the wait is long (Note [stall probes] in :mod:`plait.runtime.stall`),
withdraw what they left in flight when they fail, and word their errors alike.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from plait.errors import CollectiveTimeout, CommError, InternalError, PeerLostError
from plait.runtime.notices import OWN
from plait.runtime.stall import PROBE_SECONDS, Prober, settle
from plait.schedule.ir import Schedule, Step
from plait.transport.base import PEER_CLOSED, Handle, Transport, peer_closed

if TYPE_CHECKING:
    from plait.diagnostics.recorder import FlightRecorder
    from plait.runtime.executor import Call

__all__ = [
    "block",
    "job_rank",
    "malformed",
    "timeout_error",
    "timeout_for",
    "waiting_on",
    "withdraw",
    "wrap",
]


def withdraw(transport: Transport, call: Call, pending: dict[Handle, int], ws: Any = None) -> None:
    """A call failed: its recorder keeps whom it waited for; its window steps ``ws`` give back
    their watches, and its unfinished handles are withdrawn (nothing lands after it returns)."""
    rec, slot = call.recorder, call.slot
    if rec is not None and slot is not None:
        rec.unwatch(slot)
    if ws is not None:
        ws.drop(pending)
    for h in (h for h in pending if not h.done):
        transport.cancel(h)


def block(
    transport: Transport,
    call: Call,
    schedule: Schedule,
    pending: dict[Handle, int],
    handles: list[Handle],
    probe_at: float,
    prober: Prober | None,
) -> tuple[float, Prober | None]:
    """Wait on the transport until one of ``handles`` is done or it is time to look again.

    ``pending`` holds every unfinished handle of the call (whom it waits for, in
    messages). ``probe_at`` (when the call starts to probe its peers, 0.0 until it
    first blocks) and ``prober`` carry from one wait of the call to the next; the
    new pair is returned (Note [stall probes]). Raises the call's error once its
    deadline passes, or once the probes find a mismatch or a lost rank (settled: told to
    the call's peers, :func:`~plait.runtime.stall.settle`).
    """
    steps = schedule.steps
    tl = call.timeline
    now = time.monotonic()
    timeout = None if call.deadline is None else call.deadline - now
    expired = timeout is not None and timeout <= 0
    if tl is not None:
        blocked, waited = time.monotonic(), waiting_on(steps, pending)
    if not expired:
        # Until it probes, the call wakes up when it is time to (Note [stall probes]).
        limit = timeout
        if prober is not None:
            handles += prober.handles
            wake = prober.wake_at
            if wake is not None and (timeout is None or wake - now < timeout):
                limit = max(wake - now, 0.0)
        elif call.probe_tag >= 0:
            if not probe_at:
                probe_at = now + PROBE_SECONDS
            if timeout is None or probe_at - now < timeout:
                limit = max(probe_at - now, 0.0)
        expired = not transport.wait_any(handles, limit) and limit == timeout
    if expired:
        late = timeout_error(schedule.rank, call, steps, pending, prober)
        raise settle(transport, call, schedule, late, prober)
    if tl is not None:
        tl.wait(blocked, time.monotonic(), [job_rank(call.recorder, p) for p in waited])
    fresh = None
    try:
        if prober is None and probe_at and time.monotonic() >= probe_at:
            tags = max((st.tag for st in schedule.steps), default=-1) + 1  # Note [foreign messages]
            prober = fresh = Prober(transport, call, schedule.rank, schedule.size, tags)
            prober.start(waiting_on(steps, pending))
        if prober is not None:
            prober.check(waiting_on(steps, pending))
    except BaseException as exc:
        # A loss a peer told is passed on, as one this rank saw (Note [a loss told on] in
        # plait.runtime.stall); a mismatch the probes found they have told, and a peer that
        # gave up after an error of its own told every rank itself.
        told = isinstance(exc, PeerLostError) and not getattr(exc, OWN, False)
        found = settle(transport, call, schedule, exc, prober) if told else exc
        if fresh is not None:  # never returned, so never closed by the caller
            fresh.close()
        if found is exc:
            raise
        raise found from exc  # (as settle chains it)
    return probe_at, prober


def timeout_for(rank: int, call: Call, waiting: list[int]) -> CollectiveTimeout:
    """The timeout of ``call`` waiting for ``waiting``; a group's ranks also by the job's
    numbers, which the launcher's lines and the other ranks' messages use."""
    rec = call.recorder
    group = ""
    if rec is not None and rec.comm and rec.members is not None:
        jobs = [job_rank(rec, p) for p in sorted(waiting)]
        group = f" (job rank(s) {jobs}) of communicator {rec.comm:x}"
    return CollectiveTimeout(
        f"rank {rank}: {call.describe} timed out waiting for rank(s) {sorted(waiting)}{group}: "
        "they may have died, be stuck in other work, be slower than the timeout, or be in a "
        "different call"
    )


def waiting_on(steps: tuple[Step, ...], pending: dict[Handle, int]) -> list[int]:
    """The peers of the unfinished handles: whom the call waits for."""
    return sorted({steps[i].peer for h, i in pending.items() if not h.done})


def timeout_error(
    rank: int,
    call: Call,
    steps: tuple[Step, ...],
    pending: dict[Handle, int],
    prober: Prober | None = None,
) -> CollectiveTimeout:
    waiting = waiting_on(steps, pending)
    err = timeout_for(rank, call, waiting)
    if prober is not None:  # who the peers said they wait on (Note [stall probes])
        note = prober.explain(waiting)
        if note:
            err = CollectiveTimeout(f"{err}{note}")
    return err


def malformed(rank: int, call: Call, step: Step) -> InternalError:
    """A step without a region its kind needs (see Note [step fields])."""
    return InternalError(
        f"rank {rank}: {call.describe}: {step!r} lacks a region a {step.kind.name} step needs"
    )


def wrap(rank: int, call: Call, step: object, err: BaseException) -> BaseException:
    """``err`` of the transport at ``step``, naming this rank, the call and a lost peer."""
    if isinstance(err, CommError):
        out = type(err)(f"rank {rank}: {call.describe}: {err}")
        if isinstance(out, PeerLostError) and isinstance(err, PeerLostError):
            out.lost_rank = step.peer if isinstance(step, Step) else err.lost_rank
            if peer_closed(err):  # settle looks for what it told (Note [peers that close])
                setattr(out, PEER_CLOSED, True)
        return out
    return CommError(f"rank {rank}: {call.describe}: transport failed at {step!r}: {err}")


def job_rank(rec: FlightRecorder | None, rank: int) -> int:
    """Rank ``rank`` of the communicator ``rec`` records, by its rank in the job (as the
    timeline names ranks), where the recorder knows its members."""
    members = rec.members if rec is not None else None
    return members[rank] if members is not None and 0 <= rank < len(members) else rank
