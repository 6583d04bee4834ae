"""A call that fails on one rank for a reason of that rank's own: the peers are told.

Note [errors of a rank's own]
    A call can fail on one rank for a reason of that rank alone, after its number was
    taken and maybe after bytes moved: the user's op raised (an :class:`~plait.Op` of a
    Python function), memory ran out, Ctrl-C landed midway. Such an error used to leave
    the communicator usable there and to tell nobody. The call's peers waited for what
    it would never send; once stalled (Note [stall probes] in
    :mod:`plait.runtime.stall`) they found it in its next call and raised a MismatchError
    that blamed different collectives, 3 s later, or, where it made none, waited for
    their timeout.

    The rank has left the call midway, so the ranks disagree about what completed, as
    after a :class:`~plait.errors.CommError`. So such an error now breaks the communicator
    the same way (every later call refuses, naming it). The rank also tells every peer
    that it gave up on the call: an ``ABANDONED`` notice on the stall probes' tag, and,
    for a one-sided call, its window post, as before. A peer stalled in that call or in
    any later one raises PeerLostError within a probe period, naming the rank and the
    type of its error. The rank's own error keeps its type (the user's ZeroDivisionError,
    Ctrl-C's KeyboardInterrupt); a note on it says what the failure left.

    An error raised before the call's number is taken moves no byte and breaks nothing:
    an argument check, or the op's probe of the dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.errors import CommError
from plait.runtime.executor import Call
from plait.runtime.notices import abandon

if TYPE_CHECKING:
    from plait._request import Request
    from plait.transport.base import Transport

__all__ = ["gave_up"]


def gave_up(
    transport: Transport,
    rank: int,
    size: int,
    probe_tag: int,
    req: Request,
    label: tuple[str, str, int],
    error: BaseException,
) -> CommError:
    """Tell the peers of call ``label`` that this rank gave up on it after ``error``, note
    on ``error`` what that left, and return the error that breaks the communicator (Note
    [errors of a rank's own])."""
    plan = req.plan
    call = Call(label, 0, plan.check, plan.ufunc, None, seq=label[2], probe_tag=probe_tag)
    abandon(transport, call, rank, size, error)
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    note = (
        f"rank {rank}: {call.describe} failed midway on this rank; its peers were told, and "
        "this communicator is unusable now"
    )
    if req.writes_caller_memory:
        note += "; the output buffer's contents are undefined"
    error.add_note(note)
    return CommError(
        f"rank {rank}: {call.describe}: this rank gave up on the call after an error of its "
        f"own, {what}"
    )
