"""A one-sided call's turn: waiting for it, and a call that does not get it.

Note [a turn given up]
    A communicator's one-sided calls run one at a time, in the order of their numbers
    among them (``CallRunner.epoch``): ``turn`` is the one that may run now, and a call that
    got it passes it on (``epoch + 1``) as it ends, however it ends. A call queued behind an
    asynchronous one that is still running (it waits for a late peer) waits for its turn
    for at most its timeout. One whose wait runs out has taken its numbers all the same,
    and its peers will make that call under them: this rank never will, so the ranks are
    out of step, as after any call that failed midway. So the call breaks the communicator
    (every later call refuses at once, naming it, and the calls that wait for their turns
    behind it stop waiting) and tells every peer that it gave up on the call, an
    ``ABANDONED`` notice on the stall probes' tag as after an error of a rank's own (Note
    [errors of a rank's own] in :mod:`plait._failures`), so that a peer stalled in that
    call or a later one raises within a probe period instead of its timeout. It posts
    nothing in the window, which the call before it may still be using. Nor does it pass
    the turn on: only a call that had its turn does, so the turn never goes backwards and
    nothing runs beside the call still running, which may yet finish (its result is good).

    Such a call used to pass the turn on and leave the communicator usable: the next
    one-sided call ran beside the one still running, and once that one ended it handed
    the turn back to an epoch already past, so that a later call waited its whole timeout
    behind nothing; a message call was let through, to wait out its timeout on peers
    that had the number for another call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.diagnostics.triggers import stuck_behind
from plait.errors import CommError
from plait.runtime.executor import Call
from plait.runtime.notices import abandon

if TYPE_CHECKING:
    from plait._request import Request
    from plait._runner import CallRunner
    from plait.diagnostics.recorder import Slot

__all__ = ["wait_turn"]

#: What a dump's path follows in an error's message (plait.diagnostics.triggers).
_DUMP = "; flight recorder dump: "


def wait_turn(
    runner: CallRunner,
    epoch: int,
    seconds: float,
    label: tuple[str, str, int],
    req: Request,
    slot: Slot | None,
    wire: int,
) -> None:
    """Wait until one-sided call ``epoch`` (``label``, ``wire`` in its tags) of ``runner``
    may run: the one before it has finished. One that does not get its turn within
    ``seconds`` ends its recorder ``slot`` and raises here, passing no turn on (Note [a turn
    given up]). A part of the call runner, kept here with the Note."""
    gate = runner._gate
    try:
        with gate:
            runner._gate_waiters += 1
            try:  # a communicator broken meanwhile ends the wait too
                gate.wait_for(lambda: runner.turn == epoch or runner.broken is not None, seconds)
            finally:
                runner._gate_waiters -= 1
        if runner.turn != epoch:
            raise _turn_lost(runner, req, label, wire, seconds)
    except BaseException as exc:
        runner._left(exc, req, label, slot)
        with gate:
            gate.notify_all()  # the calls waiting behind it get no turn either
        raise


def _turn_lost(
    runner: CallRunner, req: Request, label: tuple[str, str, int], wire: int, seconds: float
) -> CommError:
    """The error of one-sided call ``label`` (``wire`` in its tags), whose wait of ``seconds``
    for its turn ended without it: the error that made the communicator unusable meanwhile
    is raised as every later call raises it; else the call breaks it and tells its peers
    (Note [a turn given up]), and this is that error, noted so."""
    if runner.broken is not None or runner.closed:
        runner.check_usable(label[0])  # raises
    rank, plan = runner._rank, req.plan
    call = Call(label, 0, plan.check, plan.ufunc, None, seq=wire, probe_tag=runner._probe_tag)
    exc = stuck_behind(runner.recorder, rank, call.describe, label[2], seconds)
    abandon(runner._transport, call, rank, runner._size, exc)
    said, dump, path = str(exc).partition(_DUMP)  # the dump's path stays last, as elsewhere
    note = "its peers were told, and this communicator is unusable now"
    runner.broken = exc  # as CallRunner._failed: later calls name the error, not the note
    return type(exc)(f"{said}; this rank gave up on the call; {note}{dump}{path}")
