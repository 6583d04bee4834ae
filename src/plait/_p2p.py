"""Point to point of :class:`plait.Communicator`, as MPI users know it.

Blocking ``send``/``recv``, non-blocking ``isend``/``irecv`` returning a
:class:`Request` (``wait``, ``test``, ``cancel``; :func:`wait_all` and
:func:`wait_any` over several), ``probe``/``iprobe``, ``sendrecv``, the
wildcards :data:`ANY_SOURCE` and :data:`ANY_TAG`, :data:`PROC_NULL`, and a
:class:`Status` saying who sent a message, with which tag and how large it
is. docs/mpi.md, "Point to point", is the user's account; this module's
notes are the implementer's.

Note [p2p on the wire]
    A user's message travels as one transport message with the wire tag
    ``p2p_tag(comm_id, tag)`` (Note [wire tags] in :mod:`plait.group`), which
    no collective and no other communicator uses, and a check word naming
    its dtype (:func:`check_word`), so a receive into another dtype fails
    with MismatchError instead of reinterpreting bytes; the lengths must be
    equal too. A receive from one rank with one tag is a plain transport
    receive. Any other receive, and every probe, is a *pattern* of the
    transport (:class:`plait.transport.base.Matching`): ``ANY_SOURCE`` is
    every rank of the communicator (this one included; a sub-communicator's
    transport translates its ranks), ``ANY_TAG`` the mask of
    :func:`plait.group.p2p_pattern`, which fixes the communicator and the
    point-to-point bit. The endpoint keeps MPI's order across plain and
    pattern receives (Note [patterns] in :mod:`plait.transport.patterns`).

Note [p2p failures]
    Point-to-point failures are the failures of one message: they never
    break the communicator (collectives go on), unlike a collective's. A lost
    peer fails the requests that need it: a send to it, a receive or probe
    from it, and a receive or probe from ``ANY_SOURCE`` only once every
    other rank of the communicator is lost (ULFM instead interrupts every
    pending any-source receive at the first failure; here such a receive
    goes on with the live ranks, as a master whose workers die one by one
    wants, and its deadline bounds it anyway). A receive from several ranks
    that has matched a message is bound to it, as MPI's is: where its sender
    dies before all of it has arrived, the receive fails, and its
    ``lost_rank`` is that sender (``Request._lost_rank``). The transport
    fails it so; to take it back to matching would need the transport to
    re-post it, behind the receives posted since, out of MPI's order. Every blocking call has a
    deadline, the communicator's timeout unless ``timeout=`` says otherwise;
    when it passes, the call withdraws what it posted and raises CommTimeout
    naming the peer and the tag. ``Request.wait`` times out the same way but
    leaves the request pending (wait again, or cancel it), as ``Work.wait`` does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from plait._arrays import target
from plait._checks import MAX_USER_TAG, as_array, as_writable, check_own_memory
from plait._p2p_request import (
    ANY_SOURCE,
    ANY_TAG,
    ARRIVING_GRACE,
    PROC_NULL,
    Request,
    Status,
    _check_status,
    _describe,
    _Incoming,
    _Outgoing,
    _reword,
    check_word,
    raise_dumped,
    wait_all,
    wait_any,
    wait_crossing,
)
from plait._p2p_status import _dtype_of
from plait.errors import CommError, CommTimeout, PeerLostError, UnsupportedError
from plait.group import p2p_pattern, p2p_tag, user_tag
from plait.runtime import stall
from plait.runtime.crossing import sending
from plait.transport.base import Matching, Transport, renumbered

if TYPE_CHECKING:
    from plait._runner import CallRunner

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "PROC_NULL",
    "PointToPointMethods",
    "Request",
    "Status",
    "check_word",
    "wait_all",
    "wait_any",
]

#: What recv fills and returns: ``buf`` itself.
_B = TypeVar("_B")


def _check_rank(peer: Any, rank: int, size: int, c: str, what: str, wildcard: bool) -> int:
    """``dst`` or ``src``: a rank, ``PROC_NULL``, or (``wildcard``, receives) ``ANY_SOURCE``."""
    if isinstance(peer, bool) or not isinstance(peer, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: {what} must be an int (a rank); got {peer!r}")
    p = int(peer)
    if 0 <= p < size or p == PROC_NULL or (wildcard and p == ANY_SOURCE):
        return p
    allowed = f"a rank in 0..{size - 1}, plait.PROC_NULL ({PROC_NULL})"
    allowed += f" or plait.ANY_SOURCE ({ANY_SOURCE})" if wildcard else ""
    hint = "; ANY_SOURCE is for receives and probes" if p == ANY_SOURCE else ""
    raise ValueError(f"rank {rank}: {c}: {what}={p} is invalid; expected {allowed}{hint}")


def _check_tag(tag: Any, rank: int, c: str, what: str, wildcard: bool) -> int:
    """A user tag in 0..MAX_USER_TAG, or (``wildcard``, receives) ``ANY_TAG``."""
    if isinstance(tag, bool) or not isinstance(tag, int | np.integer):
        raise TypeError(f"rank {rank}: {c}: {what} must be an int; got {tag!r}")
    t = int(tag)
    if 0 <= t <= MAX_USER_TAG or (wildcard and t == ANY_TAG):
        return t
    extra = f" or plait.ANY_TAG ({ANY_TAG})" if wildcard else ""
    hint = "; ANY_TAG is for receives and probes" if t == ANY_TAG and not wildcard else ""
    raise ValueError(f"rank {rank}: {c}: {what} {t} out of range 0..{MAX_USER_TAG}{extra}{hint}")


class PointToPointMethods:
    """Point to point: a mixin of :class:`plait.Communicator` (Notes above)."""

    _rank: int
    _size: int
    _comm_id: int
    _transport: Transport
    _runner: CallRunner

    # -- blocking ----------------------------------------------------------------------------
    def send(self, x: object, dst: int, tag: int = 0, *, timeout: float | None = None) -> None:
        """Send ``x`` to rank ``dst``; matched by a receive there with the same tag (or ANY_TAG).

        Returns once ``x`` may be reused (small messages are buffered, so
        usually at once). Messages from one rank with one tag arrive in the
        order they were sent. ``dst`` may be this rank (receive it later) or
        ``PROC_NULL`` (nothing happens).

        Raises:
            TypeError, ValueError: bad ``x``, ``dst`` (not 0..size-1 or
                PROC_NULL) or ``tag`` (not 0..2**31-1), before any byte moves.
            CommTimeout: not done within ``timeout`` (default: the communicator's).
            PeerLostError: ``dst`` is gone.
        """
        c = "send"
        seconds = self._runner.seconds(timeout, c)
        req = self._post_send(self._outgoing(x, dst, tag, c), c)
        self._block([req], seconds, chosen=timeout is not None)

    def recv(
        self,
        buf: _B,
        src: int,
        tag: int = 0,
        *,
        status: Status | None = None,
        timeout: float | None = None,
    ) -> _B:
        """Receive the next message from ``src`` with ``tag`` into ``buf``; returns ``buf``.

        ``src`` may be ``ANY_SOURCE`` and ``tag`` ``ANY_TAG``; ``status``
        (a :class:`Status`) then tells who sent the message and with which tag.
        The message must have exactly ``buf``'s size and dtype (learn them
        first with :meth:`probe`).

        Raises:
            TypeError, ValueError: bad ``buf`` (not writable memory), ``src``,
                ``tag`` or ``status``, before anything is posted.
            MismatchError: the message has another size or dtype (it is consumed).
            CommTimeout: nothing arrived within ``timeout`` (the receive is withdrawn).
            PeerLostError: ``src`` is gone (for ANY_SOURCE: every other rank is).
        """
        c = "recv"
        seconds = self._runner.seconds(timeout, c)
        _check_status(status, self._rank, c)
        req = self._post_recv(buf, self._incoming_of(buf, src, tag, c), c)
        self._block([req], seconds, cross=timeout is None, chosen=timeout is not None)
        req._status._copy_to(status)
        return buf

    def sendrecv(
        self,
        x: object,
        dst: int,
        buf: _B,
        src: int,
        sendtag: int = 0,
        recvtag: int = 0,
        *,
        status: Status | None = None,
        timeout: float | None = None,
    ) -> _B:
        """Send ``x`` to ``dst`` and receive from ``src`` into ``buf`` at once; returns ``buf``.

        The receive is posted first and both run together, so a ring of
        ``sendrecv`` never deadlocks whatever the buffering. ``src`` may be
        ``ANY_SOURCE``, ``recvtag`` ``ANY_TAG``, either peer ``PROC_NULL``;
        ``status`` describes the message received. ``buf`` must not share
        memory with ``x`` (ValueError; to replace ``x``, send a copy of it).
        Every argument is checked before anything is posted; if one half
        fails, the other is withdrawn and the error raised.
        """
        c = "sendrecv"
        seconds = self._runner.seconds(timeout, c)
        _check_status(status, self._rank, c)
        out = self._outgoing(x, dst, sendtag, c, "dst", "sendtag")
        inc = self._incoming_of(buf, src, recvtag, c, "src", "recvtag")
        if _overlap(out.data, inc.target) or _overlap(out.data, inc.array):
            raise ValueError(
                f"rank {self._rank}: {c}: buf shares memory with x, so the message received "
                "would overwrite the one being sent; receive into another array (to replace x, "
                "as MPI's Sendrecv_replace: comm.sendrecv(x.copy(), dst, x, src))"
            )
        rreq = self._post_recv(buf, inc, c)
        sreq = self._post_send(out, c)
        self._block([rreq, sreq], seconds, cross=timeout is None, chosen=timeout is not None)
        rreq._status._copy_to(status)
        return buf

    def probe(
        self,
        src: int,
        tag: int = 0,
        *,
        status: Status | None = None,
        timeout: float | None = None,
    ) -> Status:
        """Wait for a message from ``src`` with ``tag`` and describe it, without receiving it.

        ``src`` may be ``ANY_SOURCE`` and ``tag`` ``ANY_TAG``. Returns a
        :class:`Status` (and fills ``status``): a receive from its ``source``
        with its ``tag`` then gets that very message, unless another thread
        takes it first. The usual way to receive a message of unknown size::

            st = comm.probe(plait.ANY_SOURCE, plait.ANY_TAG)
            buf = comm.recv(np.empty(st.count, st.dtype), st.source, st.tag)

        Raises:
            CommTimeout: no such message within ``timeout``.
            PeerLostError: as for :meth:`recv`.
        """
        c = "probe"
        seconds = self._runner.seconds(timeout, c)
        _check_status(status, self._rank, c)
        try:
            found = self._probe(
                src, tag, c, time.monotonic() + seconds, seconds, cross=timeout is None
            )
        except CommError as exc:
            raise_dumped(self._runner, exc, chosen=timeout is not None)
        assert found is not None
        found._copy_to(status)
        return found

    def iprobe(self, src: int, tag: int = 0, *, status: Status | None = None) -> Status | None:
        """:meth:`probe` without waiting: the message's :class:`Status`, or None if none is here.

        Each call makes progress once, so a loop of ``iprobe`` sees every
        message eventually (MPI's progress rule); ``status`` is filled only
        when a message is found.
        """
        c = "iprobe"
        _check_status(status, self._rank, c)
        found = self._probe(src, tag, c, None, 0.0)
        if found is not None:
            found._copy_to(status)
        return found

    # -- non-blocking ------------------------------------------------------------------------
    def isend(self, x: object, dst: int, tag: int = 0) -> Request[None]:
        """Start sending ``x`` to ``dst``; returns a :class:`Request` (``wait()`` returns None).

        ``x`` must stay unchanged until the request is done (it is sent from
        its memory when it is a contiguous array in native byte order; other
        input is copied first). Checks as :meth:`send`.
        """
        c = "isend"
        return self._post_send(self._outgoing(x, dst, tag, c), c)

    def irecv(self, buf: _B, src: int, tag: int = 0) -> Request[_B]:
        """Start receiving into ``buf``; returns a :class:`Request` (``wait()`` returns ``buf``).

        ``src`` may be ``ANY_SOURCE`` and ``tag`` ``ANY_TAG``; the request's
        ``status`` says who sent the message. Do not read ``buf`` until the
        request is done. Checks as :meth:`recv`.
        """
        c = "irecv"
        return self._post_recv(buf, self._incoming_of(buf, src, tag, c), c)

    # -- inside ------------------------------------------------------------------------------
    def _outgoing(
        self, x: object, dst: Any, tag: Any, c: str, dname: str = "dst", tname: str = "tag"
    ) -> _Outgoing:
        r = self._rank
        a = as_array(x, "x", r, c)
        d = _check_rank(dst, r, self._size, c, dname, False)
        t = _check_tag(tag, r, c, tname, False)
        if not a.dtype.isnative:  # the wire carries native order (Note [byte order])
            a = a.astype(a.dtype.newbyteorder("="))
        data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return _Outgoing(d, t, data, a.dtype)

    def _incoming_of(
        self, buf: Any, src: Any, tag: Any, c: str, sname: str = "src", tname: str = "tag"
    ) -> _Incoming:
        r = self._rank
        a = as_writable(buf, "buf", r, c, contents=False)
        if not a.flags.writeable:
            raise ValueError(f"rank {r}: {c}: buf is read-only")
        if not a.flags.c_contiguous:
            check_own_memory(a, "buf", r, c)
        s = _check_rank(src, r, self._size, c, sname, True)
        t = _check_tag(tag, r, c, tname, True)
        if type(buf) is not np.ndarray:
            # An array in device memory receives into a host buffer, copied back once the
            # message is in (Note [staging through the host] in plait._arrays).
            back = target(buf, a)
            if back is not None:
                return _Incoming(s, t, back, a.reshape(-1), True)
        # Non-contiguous or non-native memory receives into a native copy, written back.
        if a.flags.c_contiguous and a.dtype.isnative:
            return _Incoming(s, t, a, a.reshape(-1), False)
        return _Incoming(s, t, a, np.empty(a.size, a.dtype.newbyteorder("=")), True)

    def _post_send(self, out: _Outgoing, c: str) -> Request[None]:
        self._runner.check_usable(c)
        t = self._transport
        if out.dst == PROC_NULL:
            return Request(
                c, t, None, self._rank, out.dst, out.tag, self._runner.timeout, None, None
            )
        wire = p2p_tag(self._comm_id, out.tag)
        # ``.data`` is memoryview(data), typed as one (numpy's stubs give ndarray the buffer
        # protocol only from Python 3.12 on)
        h = t.isend(out.dst, wire, out.data.data, check_word(out.dtype))
        if not h.done:  # in flight: no crossing with dst's receives (Note [crossed calls])
            sending(t, out.dst, h)
        req: Request[None] = Request(
            c, t, h, self._rank, out.dst, out.tag, self._runner.timeout, None, None, out
        )
        req._runner = self._runner
        return req

    def _post_recv(self, buf: _B, inc: _Incoming, c: str) -> Request[_B]:
        self._runner.check_usable(c)
        t = self._transport
        timeout = self._runner.timeout
        if inc.src == PROC_NULL:
            return Request(c, t, None, self._rank, inc.src, inc.tag, timeout, buf, inc)
        view = inc.target.view(np.uint8).data
        check = check_word(inc.target.dtype)
        if inc.src >= 0 and inc.tag >= 0:
            h = t.irecv(inc.src, p2p_tag(self._comm_id, inc.tag), view, check)
        else:
            m = self._matching(c)
            want, mask = p2p_pattern(self._comm_id, inc.tag if inc.tag >= 0 else None)
            peers = None if inc.src == ANY_SOURCE else [inc.src]
            h = m.irecv_match(peers, want, mask, view, check)
        req: Request[_B] = Request(c, t, h, self._rank, inc.src, inc.tag, timeout, buf, inc)
        req._runner = self._runner
        return req

    def _probe(
        self,
        src: Any,
        tag: Any,
        c: str,
        deadline: float | None,
        seconds: float,
        *,
        cross: bool = False,
    ) -> Status | None:
        """A probe until ``deadline`` (None: one round of progress); its status or None.

        ``cross``: a blocking probe with the communicator's own timeout: where it waits on
        one rank and stalls, it takes part in crossed calls, as a ``recv`` does.

        Note [a probed message withdrawn]
            A send that times out withdraws its message where none of it has left: over
            TCP, its WITHDRAW follows its RTS. A probe completes as the RTS is read, and
            the WITHDRAW read in the same round of progress took the message away: the
            probe described a message that was no longer there, and the receive made for
            it took the next message, at the wrong size, and lost it. So a probe that found
            a message looks once more, which costs a look, and describes what is there
            then (waiting on where nothing is).
        """
        r = self._rank
        s = _check_rank(src, r, self._size, c, "src", True)
        t_ = _check_tag(tag, r, c, "tag", True)
        self._runner.check_usable(c)
        st = Status()
        if s == PROC_NULL:
            st._set(PROC_NULL, ANY_TAG, 0, None)
            return st
        m = self._matching(c)
        want, mask = p2p_pattern(self._comm_id, t_ if t_ >= 0 else None)
        h = m.probe(None if s == ANY_SOURCE else [s], want, mask)
        explained = ""
        if deadline is None:
            m.wait_any([h], 0.0)
        elif cross and s >= 0:
            probe = stall.PROBE_SECONDS
            left = deadline - time.monotonic()
            if not m.wait_any([h], min(probe, max(left, 0.0))) and not h.done and left > probe:
                label = f"{c} {_describe(True, s, t_)}"
                _, explained = wait_crossing(m, h, r, s, label, deadline, lambda: m.withdraw(h))
        else:
            while not h.done:
                left = deadline - time.monotonic()
                if left <= 0 or not m.wait_any([h], left):
                    break
        if not h.done and m.withdraw(h):
            if deadline is None:
                return None
            raise CommTimeout(
                f"rank {r}: {c} {_describe(True, s, t_)} found no message within {seconds:g} s; "
                "the peer may have died or not made the matching send" + explained
            )
        if h.error is None:
            # Note [a probed message withdrawn]: its sender may have withdrawn it in the round
            # of progress that brought it (a WITHDRAW behind its RTS): is it still here?
            again = m.probe(None if s == ANY_SOURCE else [s], want, mask)
            if not again.done and m.withdraw(again):
                if deadline is None:
                    return None
                if time.monotonic() < deadline:  # wait for the next one
                    return self._probe(src, tag, c, deadline, seconds, cross=cross)
                raise CommTimeout(
                    f"rank {r}: {c} {_describe(True, s, t_)} found no message within "
                    f"{seconds:g} s; the message it saw was withdrawn by its sender"
                )
            h = again
        if h.error is not None:
            err = _reword(renumbered(m, h.error), f"rank {r}: {c} {_describe(True, s, t_)}")
            if isinstance(err, PeerLostError) and s >= 0:
                err.lost_rank = s  # the rank it probes, as a recv's error says (Request._settle)
            raise err
        source, wire, nbytes, check = m.envelope(h)
        st._set(source, user_tag(wire), nbytes, _dtype_of(check))
        return st

    def _matching(self, c: str) -> Matching:
        """The transport, which must match patterns (every plait transport does)."""
        t = self._transport
        if not isinstance(t, Matching):
            raise UnsupportedError(
                f"rank {self._rank}: {c}: {type(t).__name__} cannot match ANY_SOURCE, ANY_TAG "
                "or probes; receive from one rank with one tag"
            )
        return t

    def _block(
        self,
        reqs: Sequence[Request[Any]],
        seconds: float,
        cross: bool = False,
        chosen: bool = False,
    ) -> None:
        """Wait for ``reqs`` of one blocking call; on the deadline withdraw them and raise.

        Stops at the first failure (withdrawing the rest) and raises it, the recorder
        dumped (:func:`dumped`; ``chosen``: the caller gave the timeout). ``cross``: the
        call has the communicator's timeout (``Request._wait_until``).
        """
        rec = self._runner.recorder
        me = threading.get_ident()
        if rec is not None:  # the stall watchdog sees it (the ring keeps no such call)
            rec.p2p[me] = (reqs[0], time.monotonic())  # named only if it stalls
        try:
            self._wait_all(reqs, seconds, cross)
        except CommError as exc:
            raise_dumped(self._runner, exc, chosen=chosen)
        finally:
            if rec is not None:
                rec.p2p.pop(me, None)

    def _wait_all(self, reqs: Sequence[Request[Any]], seconds: float, cross: bool) -> None:
        """:meth:`_block`'s wait."""
        deadline = time.monotonic() + seconds
        if len(reqs) == 1:  # send and recv
            req = reqs[0]
            grace = max(seconds, ARRIVING_GRACE)
            try:
                came = req._wait_until(deadline, cross)
            except BaseException:  # interrupted (Ctrl-C): withdrawn, as at its deadline
                req._abandon()
                raise
            if not came and not req._abandon(grace):
                raise req._timed_out(seconds)
            req._finish(None)
            return
        t = self._transport
        if cross:  # sendrecv: its receive takes part in crossed calls, as a recv does
            try:
                reqs[0]._wait_until(deadline, True)
            except BaseException:
                for r in reqs:
                    r._abandon()
                raise
        while True:
            pending = [r._handle for r in reqs if r._handle is not None and not r._handle.done]
            if not pending or any(r.exception() is not None for r in reqs):
                break
            left = deadline - time.monotonic()
            if (left <= 0 or not t.wait_any(pending, left)) and not all(r.done() for r in reqs):
                late = next(r for r in reqs if not r.done())
                # A receive whose message is arriving has one more timeout to finish (Note
                # [a message arriving at the deadline] in plait._p2p_request).
                ended = [r._abandon(max(seconds, ARRIVING_GRACE)) for r in reqs]
                if all(ended):
                    break
                raise late._timed_out(seconds)
        for r in reqs:
            if not r.done():
                r._abandon()
        for r in reqs:
            r._finish(None)


def _overlap(a: np.ndarray, b: object) -> bool:
    """Whether the contiguous array ``a`` and ``b`` (an array; anything else: no) share
    memory: exactly, which costs little against one contiguous range."""
    if not isinstance(b, np.ndarray) or not np.may_share_memory(a, b):
        return False
    return bool(np.shares_memory(a, b))
