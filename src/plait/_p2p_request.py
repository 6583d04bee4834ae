"""Requests of point to point: what ``isend``/``irecv`` return, and waits on several.

:class:`Request` (``wait``, ``test``, ``cancel``), :func:`wait_all` and
:func:`wait_any`; :class:`Status`, the constants ``ANY_SOURCE``, ``ANY_TAG`` and
``PROC_NULL`` and the check word of a message are :mod:`plait._p2p_status`'s,
named here too. The calls that make requests are
:class:`plait._p2p.PointToPointMethods`; the Notes there say how the pieces fit,
and docs/mpi.md, "Point to point", is the user's account.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, NoReturn, TypeVar

import numpy as np

from plait._arrays import DeviceTarget
from plait._checks import check_timeout
from plait._fork import not_forked
from plait._p2p_status import ANY_SOURCE, ANY_TAG, PROC_NULL, Status, _dtype_of, check_word
from plait.errors import AbortedError, CommError, CommTimeout, MismatchError, PeerLostError
from plait.group import GroupTransport, user_tag
from plait.runtime import stall
from plait.runtime.crossing import Crossing, p2p_number
from plait.transport.base import Handle, Matching, Transport, renumbered

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "ARRIVING_GRACE",
    "PROC_NULL",
    "Request",
    "Status",
    "check_word",
    "wait_all",
    "wait_any",
    "wait_crossing",
]

#: Seconds at least that a blocking receive whose message has begun to arrive when its
#: deadline passes has to finish (Note [a message arriving at the deadline]).
ARRIVING_GRACE = 10.0

#: The locks that settling requests hold, each request's chosen by its hash (Note [settling
#: a request]); a power of two.
_LOCKS = tuple(threading.Lock() for _ in range(64))

#: What a request's ``wait`` returns: ``buf`` for a receive, None for a send.
R = TypeVar("R")


class _Outgoing(NamedTuple):
    """A send, checked: the bytes to send (kept alive by the request) and their dtype."""

    dst: int
    tag: int
    data: np.ndarray  # uint8, contiguous
    dtype: np.dtype


class _Incoming(NamedTuple):
    """A receive, checked: the caller's array and the flat native array the bytes land in."""

    src: int
    tag: int
    array: np.ndarray | DeviceTarget  # DeviceTarget: the caller's array in device memory
    target: np.ndarray
    copy_back: bool  # target is a copy (``array`` is not contiguous, not native or on a device)


class Request(Generic[R]):
    """A send or receive in flight, from ``isend`` or ``irecv``.

    ``wait()`` blocks until it completes and returns ``buf`` (a receive) or
    None (a send); ``test()`` says whether it has, without blocking;
    ``cancel()`` withdraws a receive that has not matched a message yet.
    :func:`wait_all` and :func:`wait_any` wait for several. Until a request
    is done, its buffer belongs to it: do not read a receive's ``buf`` or
    change a send's ``x``. A failed request raises its error from ``wait``
    and ``test`` (PeerLostError, MismatchError, ...); it never breaks the
    communicator.
    """

    __slots__ = (
        "_c",
        "_cancelled",
        "_error",
        "_explained",
        "_handle",
        "_incoming",
        "_outgoing",
        "_peer",
        "_rank",
        "_runner",
        "_settled",
        "_status",
        "_tag",
        "_timeout",
        "_transport",
        "_value",
    )

    def __init__(
        self,
        c: str,
        transport: Transport,
        handle: Handle | None,
        rank: int,
        peer: int,
        tag: int,
        timeout: float,
        value: Any,
        incoming: _Incoming | None,
        outgoing: _Outgoing | None = None,
    ) -> None:
        self._c = c
        self._transport = transport
        self._handle = handle
        self._rank = rank
        self._peer = peer
        self._tag = tag
        self._timeout = timeout
        self._value = value
        self._incoming = incoming
        self._outgoing = outgoing  # what a send reads until it is done
        self._status = Status()
        self._error: BaseException | None = None
        self._cancelled = False
        self._settled = False  # set once settled: status, error and buf are final
        self._runner: Any = None  # the communicator's call runner: its abort, its recorder
        if handle is None:  # PROC_NULL: done at once
            self._settle()

    # -- the user's side -----------------------------------------------------------------
    def done(self) -> bool:
        """Whether the request has completed, failed or been cancelled (no progress, no raise).

        Once it says so, a receive's ``buf`` holds the message, strided and byte-swapped
        ones too (Note [settling a request]).
        """
        if self._settled:
            return True
        h = self._handle
        if h is not None and not h.done:
            return False
        self._settle()
        return True

    def test(self, status: Status | None = None) -> bool:
        """Make progress once, without blocking; whether the request is done.

        ``status`` is filled when it is (see :class:`Status`).

        Raises:
            CommError: the request failed (its error, naming the peer and the tag).
        """
        _check_status(status, self._rank, f"{self._c}: test")
        h = self._handle
        if h is not None and not h.done:
            not_forked(self._runner, f"{self._c}: test")  # the parent's messages
            self._transport.wait_any([h], 0.0)
            if not h.done:
                return False
        return self._finish(status)

    def wait(self, timeout: float | None = None, status: Status | None = None) -> R:
        """Block until the request is done; return ``buf`` for a receive, None for a send.

        Args:
            timeout: seconds to wait at most (0 only looks); default the communicator's
                timeout.
            status: filled with the message's envelope (see :class:`Status`).

        Raises:
            CommTimeout: ``timeout`` passed first; the request stays pending
                (wait again, or cancel it).
            CommError: the request failed.
        """
        where = f"rank {self._rank}: {self._c}: wait"
        seconds = self._timeout if timeout is None else check_timeout(timeout, where, poll=True)
        _check_status(status, self._rank, f"{self._c}: wait")
        cross = timeout is None and self._incoming is not None
        try:
            if not self._wait_until(time.monotonic() + seconds, cross):
                raise self._timed_out(seconds)
            self._finish(status)
        except CommError as exc:
            raise_dumped(self._runner, exc, chosen=timeout is not None)
        value: R = self._value
        return value

    def cancel(self) -> None:
        """Withdraw the request if it can still be withdrawn; then it is done and ``cancelled``.

        A receive is withdrawn only if no message has matched it yet (MPI's
        rule); one that has completes normally and is not cancelled. A send
        stops reading ``x`` at once, but the message may still arrive: part of
        it may have left (MPI-4 deprecates cancelling sends). Cancelling a done
        request does nothing.
        """
        h = self._handle
        if h is None or h.done:
            return
        not_forked(self._runner, f"{self._c}: cancel")
        t = self._transport
        # Under the settling lock: a thread settling the request sees it cancelled, or not at all.
        with _LOCKS[hash(self) & 63]:
            if h.done:
                return
            if self._incoming is not None and isinstance(t, Matching):
                self._cancelled = t.withdraw(h)
                return
            t.cancel(h)
            self._cancelled = True

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` withdrew the request."""
        return self._cancelled

    @property
    def status(self) -> Status | None:
        """The message's envelope once the request is done (see :class:`Status`), else None."""
        if not self.done():
            return None
        self._settle()
        return self._status

    def exception(self) -> BaseException | None:
        """The error the request failed with, or None (None too while it is pending)."""
        if not self.done():
            return None
        self._settle()
        return self._error

    def __repr__(self) -> str:
        if self._cancelled:
            state = "cancelled"
        elif not self.done():
            state = "pending"
        else:
            state = "failed" if self.exception() is not None else "done"
        return f"<plait.Request {self._c} {self._describe()} {state}>"

    # -- inside -----------------------------------------------------------------------------
    def _describe(self) -> str:
        return _describe(self._incoming is not None, self._peer, self._tag)

    def label(self) -> str:
        """What the request is, for a stall line: ``recv from rank 1 (tag 0)``."""
        return f"{self._c} {self._describe()}"

    def _wait_until(self, deadline: float, cross: bool = False) -> bool:
        """Wait for the request until ``deadline`` (time.monotonic); whether it is done.

        ``cross``: a blocking wait on this receive alone, with the communicator's own
        timeout: where it receives from one rank and stalls, it takes part in crossed calls
        (:meth:`_wait_crossing`).
        """
        h = self._handle
        if h is None:
            return True
        if not h.done:
            not_forked(self._runner, f"{self._c}: wait")
        t = self._transport
        looked = False
        while not h.done:
            left = deadline - time.monotonic()
            if left <= 0:
                if looked:
                    return h.done
                left = 0.0  # a wait of 0 (or one whose deadline passed) looks once, as test()
            looked = True
            if not cross:
                if not t.wait_any([h], left):
                    self._closed_meanwhile(h)
                    return h.done
                continue
            probe = stall.PROBE_SECONDS
            if not t.wait_any([h], probe if left > probe else left) and not h.done:
                self._closed_meanwhile(h)
                if left <= probe or self._peer < 0:
                    continue  # the deadline, or a wait on any rank: as without cross
                return self._wait_crossing(deadline)  # a probe period without the message
        return True

    def _closed_meanwhile(self, h: Any) -> None:
        """ClosedError (or AbortedError) where the communicator was closed (aborted) while
        this request waited: its wait woke short of the deadline, and a send, whose handle
        the close had not failed yet, read the wake-up as its timeout."""
        runner = self._runner
        if not h.done and (runner.closed or runner.aborted is not None):
            runner.check_usable(self._c)

    def _wait_crossing(self, deadline: float) -> bool:
        """:meth:`_wait_until` of a receive from one rank stalled for a probe period: tell
        the rank where this one waits, and raise MismatchError (the request withdrawn) where
        the two wait for each other for sure (Note [crossed calls] in
        :mod:`plait.runtime.crossing`)."""
        h = self._handle
        assert h is not None
        done, self._explained = wait_crossing(
            self._transport, h, self._rank, self._peer, self.label(), deadline, self._abandon
        )
        return done

    def _finish(self, status: Status | None) -> bool:
        """The request is done: raise its error, or fill ``status`` and return True."""
        self._settle()
        if self._error is not None:
            raise self._error
        self._status._copy_to(status)
        return True

    def _abandon(self, grace: float = 0.0) -> bool:
        """A blocking call's deadline passed: make sure the request never touches its buffer.

        With ``grace``, a receive whose message has begun to arrive (it can no longer be
        withdrawn) has that many seconds more to finish (Note [a message arriving at the
        deadline]). Whether the request ended after all (then it completes as it would have).
        """
        h = self._handle
        if h is None or h.done:
            return True
        t = self._transport
        if self._incoming is not None and isinstance(t, Matching):
            with _LOCKS[hash(self) & 63]:  # as in cancel()
                if h.done:  # another thread drove it to its end meanwhile
                    return True
                if t.withdraw(h):  # matched nothing yet: a message that comes later stays queued
                    self._cancelled = True
                    return False
            if grace > 0:
                if t.wait_any([h], grace) or h.done:
                    return True
                self._explained = (
                    f"; its message had begun to arrive and did not finish within {grace:g} s "
                    "more: the rest of it was dropped, and the receive buffer's contents are "
                    "undefined"
                )
        with _LOCKS[hash(self) & 63]:
            if h.done:  # it ended meanwhile: it completes as it would have
                return True
            self._cancelled = True
            t.cancel(h)  # a receive whose bytes are arriving drops the rest
        return False

    # Note [a message arriving at the deadline]
    #     A blocking receive whose deadline passes withdraws its receive, so that a message
    #     that comes later is left for the next one. One whose message has begun to arrive
    #     cannot be withdrawn (MPI's rule: a matched receive completes), and cancelling it
    #     dropped the rest of the message, which was then lost to every later receive while
    #     its sender was told it had succeeded (a 256 MiB message over TCP, its receive
    #     posted with a short timeout). The sender made the matching send, which is what the
    #     timeout waits for; so such a receive has ARRIVING_GRACE seconds more (or its
    #     timeout, where that is longer) to finish, and completes as it would have: a large
    #     message takes that long only on a slow link, and a short timeout must not make its
    #     receive lose it. Only a message that stalls midway for so long is dropped, and the
    #     timeout then says so and that the buffer's contents are undefined.

    def _timed_out(self, seconds: float) -> CommTimeout:
        sending = self._incoming is None
        # A send is not undone: what of it has left is sent to its end (cancel()).
        after = "; its message may still arrive, where part of it had left" if sending else ""
        return CommTimeout(
            f"rank {self._rank}: {self._c} {self._describe()} did not complete within "
            f"{seconds:g} s; the peer may have died or not made the matching "
            f"{'recv' if sending else 'send'}{after}"
            + getattr(self, "_explained", "")  # set only where a stalled wait heard of it
        )

    def _settle(self) -> None:
        """Once done: fill the status, take the error, copy a receive back where needed;
        once, every other caller waiting until it is (Note [settling a request])."""
        if self._settled:
            return
        with _LOCKS[hash(self) & 63]:
            if not self._settled:
                self._fill()
                self._settled = True

    # Note [settling a request]
    #     A done handle is not yet a done request: a strided, byte-swapped or device buf
    #     receives into a copy, written back as the request settles, and the status and the
    #     error are filled then. So done() settles a request whose handle is done before it
    #     says so (a flag read once settled: it stays cheap), and a thread that finds another
    #     settling the request waits on its lock until the buf, the status and the error are
    #     final. The flag was set before the work, unlocked: a second thread's wait() (test(),
    #     status, wait_all) returned while the first was still writing buf back, and done()
    #     said True before anything was written back. The lock is one of _LOCKS, by the
    #     request's hash: a lock of its own cost each request 0.8 µs to make (a blocking recv
    #     of a small message takes about 15), where one taken from a few shared ones costs
    #     nothing measurable; two requests sharing one settle one after the other, and
    #     nothing holding one waits for anything else. cancel() and a deadline's withdrawal
    #     set ``_cancelled`` under the lock too, so that settling sees a cancelled request
    #     as cancelled.

    def _fill(self) -> None:
        """:meth:`_settle`'s work, the lock held."""
        h = self._handle
        inc = self._incoming
        st = self._status
        out = self._outgoing
        self._outgoing = None  # the send's memory is free again
        if self._cancelled:
            st.cancelled = True
        elif h is not None and h.error is not None:
            mine = ""
            if isinstance(h.error, MismatchError) and inc is not None:
                mine = f"; this rank's {self._c}: {inc.target.size} elements of "
                mine += inc.target.dtype.name
                sent = h.error.sent
                theirs = _dtype_of(sent[0]) if sent is not None else None
                if sent is not None and theirs is not None and theirs.itemsize:
                    mine += f"; the message: {sent[1] // theirs.itemsize} elements of {theirs.name}"
            err = renumbered(self._transport, h.error)
            self._error = _reword(err, f"rank {self._rank}: {self._c} {self._describe()}", mine)
            if isinstance(self._error, PeerLostError):
                self._error.lost_rank = self._lost_rank(h)
            if isinstance(h.error, MismatchError) and isinstance(self._error, MismatchError):
                self._error.sent = h.error.sent
        elif inc is None:
            nbytes, dtype = (out.data.nbytes, out.dtype) if out is not None else (0, None)
            st._set(self._rank, self._tag, nbytes, dtype)
        elif h is None:
            st._set(PROC_NULL, ANY_TAG, 0, inc.target.dtype)
        else:
            if inc.src >= 0 and inc.tag >= 0:
                source, tag = inc.src, inc.tag
            else:
                t = self._transport
                assert isinstance(t, Matching)
                source, wire, _, _ = t.envelope(h)
                tag = user_tag(wire)
            st._set(source, tag, inc.target.nbytes, inc.target.dtype)
            if inc.copy_back:
                inc.array[...] = inc.target.reshape(inc.array.shape)

    def _lost_rank(self, h: Handle) -> int | None:
        """The rank whose loss failed ``h``: the one it sends to or receives from, or the
        sender of the message a receive from several ranks had matched (Note [p2p
        failures] in :mod:`plait._p2p`); None where every rank it could match is lost."""
        if self._peer >= 0:
            return self._peer
        t = self._transport
        if self._incoming is None or not isinstance(t, Matching):
            return None
        peer = t.envelope(h)[0]
        return peer if peer >= 0 else None


def _reword(err: BaseException, where: str, mine: str = "") -> BaseException:
    """``err`` with ``where`` (this rank, the call, the peer and the tag) in front; the
    rank is said once where ``err`` starts with it too (an abort's error does)."""
    said = str(err)
    head = where.partition(": ")[0] + ": "
    text = f"{where}: {said.removeprefix(head)}{mine}"
    try:
        new = type(err)(text)
    except Exception:
        new = CommError(text)
    new.__cause__ = err
    return new


def _describe(receiving: bool, peer: int, tag: int) -> str:
    """``from rank 2 (tag 5)``, ``from any rank (any tag)``, ``to rank 1 (tag 0)``."""
    if peer == ANY_SOURCE:
        who = "any rank"
    elif peer == PROC_NULL:
        who = "PROC_NULL"
    else:
        who = f"rank {peer}"
    what = "any tag" if tag == ANY_TAG else f"tag {tag}"
    return f"{'from' if receiving else 'to'} {who} ({what})"


def _check_status(status: Any, rank: int, c: str) -> None:
    if status is not None and not isinstance(status, Status):
        raise TypeError(
            f"rank {rank}: {c}: status must be a plait.Status or None; got {type(status).__name__}"
        )


def _root(t: Transport) -> Transport:
    """The transport under a chain of sub-communicators' views."""
    while isinstance(t, GroupTransport):
        t = t.parent
    return t


def _check_requests(requests: Any, c: str) -> list[Request[Any]]:
    try:
        reqs = list(requests)
    except TypeError:
        raise TypeError(
            f"{c}: requests must be a sequence of plait.Request; got {type(requests).__name__}"
        ) from None
    for i, r in enumerate(reqs):
        if not isinstance(r, Request):
            raise TypeError(f"{c}: requests[{i}] is a {type(r).__name__}, not a plait.Request")
    return reqs


def wait_all(requests: Sequence[Request[Any]], *, timeout: float | None = None) -> list[Any]:
    """Wait for every request; their results in order (``buf`` for receives, None for sends).

    Args:
        requests: requests from ``isend``/``irecv``, of any communicators.
        timeout: seconds for all of them together; default the largest of
            their communicators' timeouts.

    Raises:
        CommTimeout: some were not done in time (named; they stay pending).
        CommError: the error of the first request (in order) that failed,
            once every request is done; the others' outcomes stay on them.
    """
    c = "wait_all"
    reqs = _check_requests(requests, c)
    if not reqs:
        return []
    seconds = (
        max(r._timeout for r in reqs) if timeout is None else check_timeout(timeout, c, poll=True)
    )
    deadline = time.monotonic() + seconds
    for r in reqs:
        r._wait_until(deadline)
    late = [r for r in reqs if not r.done()]
    if late:
        names = ", ".join(f"{r._c} {r._describe()}" for r in late[:4])
        more = f" and {len(late) - 4} more" if len(late) > 4 else ""
        raise CommTimeout(
            f"rank {late[0]._rank}: {c}: {len(late)} of {len(reqs)} requests did not complete "
            f"within {seconds:g} s ({names}{more}); they stay pending"
        )
    for r in reqs:
        r._settle()
    for r in reqs:
        if r._error is not None:
            raise r._error
    return [r._value for r in reqs]


def wait_any(requests: Sequence[Request[Any]], *, timeout: float | None = None) -> int:
    """Wait until one of ``requests`` is done; the index of the first that is.

    Its outcome is then ``requests[i].wait()`` (at once: the result, or its
    error). The requests must come from communicators over one transport (a
    communicator and the groups split from it), whose progress one wait drives.

    Raises:
        ValueError: no requests, or requests over different transports.
        CommTimeout: none was done within ``timeout`` (default: the largest of
            their communicators' timeouts).
    """
    c = "wait_any"
    reqs = _check_requests(requests, c)
    if not reqs:
        raise ValueError(f"{c}: no requests to wait for")
    seconds = (
        max(r._timeout for r in reqs) if timeout is None else check_timeout(timeout, c, poll=True)
    )
    for i, r in enumerate(reqs):
        if r.done():
            return i
    roots = {id(_root(r._transport)) for r in reqs}
    if len(roots) > 1:
        raise ValueError(
            f"{c}: the requests belong to communicators over {len(roots)} different transports; "
            "wait_any waits on one (a communicator and its splits); use wait_all or test()"
        )
    for r in reqs:
        not_forked(r._runner, c)
    t = reqs[0]._transport
    handles = [r._handle for r in reqs if r._handle is not None]
    deadline = time.monotonic() + seconds
    looked = False
    while True:
        for i, r in enumerate(reqs):
            if r.done():
                return i
        left = deadline - time.monotonic()
        if left <= 0 and not looked:
            left = 0.0  # a wait of 0 (or one whose deadline passed) looks once, as test()
        looked = True
        if left < 0 or not t.wait_any(handles, left) or left == 0:
            for i, r in enumerate(reqs):
                if r.done():
                    return i
            names = ", ".join(f"{r._c} {r._describe()}" for r in reqs[:4])
            raise CommTimeout(
                f"rank {reqs[0]._rank}: {c}: none of {len(reqs)} requests completed within "
                f"{seconds:g} s ({names}{'...' if len(reqs) > 4 else ''})"
            )


def raise_dumped(runner: Any, exc: CommError, *, chosen: bool) -> NoReturn:
    """Raise ``exc`` of a point-to-point call of ``runner``'s communicator (its call
    runner, or None), with the flight recorder's dump named in it once dumped (its
    ``threads`` say where the rank waits: plait analyze reads it), as a failed
    collective's is. A timeout the caller chose (``chosen``) is a receive that may come
    later, not a hang: no dump. A peer lost because the communicator was aborted is the
    abort (AbortedError), as a collective's is: the aborted ranks leave, and a receive from
    one of them named it "lost: its process exited or was killed"."""
    if runner is not None and isinstance(exc, PeerLostError):
        if runner.aborted is None and runner.hear is not None:
            runner.hear()  # the abort, if one waits in the store for this rank
        if runner.aborted is not None:
            where = ": ".join(str(exc).split(": ", 2)[:2])  # rank 1: recv from rank 0 (tag 0)
            aborted = AbortedError(f"{where}: {runner.aborted}")
            aborted.__cause__ = exc
            exc = aborted
    recorder = None if runner is None else runner.recorder
    if recorder is None or (chosen and type(exc) is CommTimeout):
        raise exc
    from plait.diagnostics.triggers import dump_on_error  # the diagnostics load on failure

    path = dump_on_error(recorder, exc)
    if path is None:
        raise exc
    noted = type(exc)(f"{exc}; flight recorder dump: {path}")
    noted.__dict__.update(exc.__dict__)  # PeerLostError.lost_rank
    raise noted from exc


def wait_crossing(
    t: Transport,
    h: Handle,
    rank: int,
    peer: int,
    label: str,
    deadline: float,
    abandon: Callable[[], object],
) -> tuple[bool, str]:
    """Wait until ``deadline`` for ``h``, a blocking wait (``label``: "recv from rank 1
    (tag 0)", "probe ...") for a message of rank ``peer`` that stalled for a probe period,
    taking part in crossed calls (Note [crossed calls] in :mod:`plait.runtime.crossing`):
    tell ``peer`` where this rank waits and, where the two wait for each other for sure,
    call ``abandon`` (which withdraws the wait) and raise MismatchError.

    Returns whether ``h`` is done, and what the peers said of where they wait ("" once
    done), for a timeout's message.
    """
    crossing = Crossing(t, None, p2p_number(), label)
    crossing.start([peer])
    try:
        while not h.done:
            left = deadline - time.monotonic()
            if left <= 0:
                return h.done, crossing.explain([peer])
            t.wait_any([h, *crossing.handles], left)
            if not h.done and (err := crossing.check(rank, [peer])):
                abandon()
                raise err
        return True, ""
    finally:
        crossing.close()
