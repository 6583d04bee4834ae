"""The inbox of pickled messages: plait.mpi's object receives, matched in MPI's order.

Note [object messages]
    The lowercase ``send``/``isend`` pickle an object (protocol 5, in band: the bytes
    mpi4py sends) and send them as one message of bytes with the user's tag. A receive of
    an object cannot be posted before its size is known, so :class:`Inbox` matches object
    receives itself: every ``recv``/``irecv`` is queued in the order it was posted, and a
    message found by ``probe`` goes to the *earliest posted* queued receive that matches
    its source and tag, which then takes it with a receive of exactly its size from that
    source and tag (non-overtaking per sender and tag makes that the probed message).
    That is MPI's matching rule; the only difference is that a queued ``irecv`` takes its
    message when the program waits on or tests a request of the inbox, not in the
    background, so a large object sent to it waits until then (mpi4py's ``irecv`` refuses
    large objects anyway: it receives into a fixed 32 KiB buffer by default).

    The rule holds across kinds: a message goes to the earliest posted receive that
    matches it, object or buffer. The transport knows nothing of the queued receives, so
    while any are queued the buffer calls defer to them where their patterns overlap (the
    same source or ANY_SOURCE on either side, and the same for tags):

    - ``Recv``, ``Sendrecv``, ``probe`` and ``iprobe`` first let the queued receives that
      overlap their pattern take, in posting order, what has arrived for them
      (:meth:`Inbox.look`), then look; a message found that a queued receive matches
      (it came meanwhile) goes to that receive, and they look again. A blocking one waits
      for a message of its own pattern only, so a queued receive whose message never
      comes holds up no other receive.
    - An ``Irecv`` that overlaps a queued receive is queued too, behind it
      (:meth:`Inbox.defer`). A probed message whose earliest matching queued receive is
      such an Irecv is bound to it: the Irecv is posted to the transport from the
      message's source with its tag, which takes exactly that message. Once no earlier
      queued receive overlaps it, it is posted with its own pattern. Its request's
      ``Wait``/``Test`` progress the inbox until it is posted, then the transport's
      request (a plain request from then on).

    With nothing queued (no object receive pending) the buffer calls go straight to the
    transport, as before: one test of a list.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

import plait
from plait._p2p import _check_rank, _check_tag
from plait.mpi._requests import _SLICE, Status, as_call

__all__ = ["Inbox"]


class _Pending:
    """One receive queued in an :class:`Inbox`: an object receive, or a buffer ``Irecv``
    (``into``) queued behind earlier ones that overlap it (Note [object messages])."""

    __slots__ = ("call", "done", "into", "req", "source", "status", "tag", "value")

    def __init__(self, source: int, tag: int, call: str, into: np.ndarray | None = None) -> None:
        self.source = source
        self.tag = tag
        self.call = call  # the user's call (recv, irecv, Irecv), for its timeout's message
        self.done = False  # matched, cancelled, or (an Irecv) posted to the transport
        self.value: Any = None
        self.status = Status()
        self.into = into  # an Irecv's bytes; None for an object receive
        self.req: plait.Request[Any] | None = None  # an Irecv's, once posted

    def matches(self, st: plait.Status) -> bool:
        return self.source in (plait.ANY_SOURCE, st.source) and self.tag in (plait.ANY_TAG, st.tag)

    def overlaps(self, source: int, tag: int) -> bool:
        """Whether a message could match both this receive and a pattern of ``source`` and
        ``tag`` (wildcards on either side)."""
        return (self.source == source or plait.ANY_SOURCE in (self.source, source)) and (
            self.tag == tag or plait.ANY_TAG in (self.tag, tag)
        )


class Inbox:
    """The object receives of one communicator, matched in MPI's order (Note [object messages])."""

    def __init__(self, comm: plait.Communicator) -> None:
        self._comm = comm
        self._queue: list[_Pending] = []
        self._deferred = 0  # Irecvs in the queue
        self.lock = threading.RLock()

    def busy(self) -> bool:
        """Whether receives are queued: buffer calls must defer to them (without: none)."""
        return bool(self._queue)

    def defer(self, into: np.ndarray, source: int, tag: int) -> _Pending | None:
        """Queue an Irecv into ``into`` behind the queued receives it overlaps; None (post it
        now) if it overlaps none (Note [object messages]).

        Raises:
            TypeError, ValueError: as :meth:`post`.
        """
        comm = self._comm
        source = _check_rank(source, comm.rank, comm.size, "Irecv", "source", True)
        tag = _check_tag(tag, comm.rank, "Irecv", "tag", True)
        with self.lock:
            if source == plait.PROC_NULL or not any(q.overlaps(source, tag) for q in self._queue):
                return None
            p = _Pending(source, tag, "Irecv", into)
            self._queue.append(p)
            self._deferred += 1
            return p

    def look(self, source: int, tag: int) -> plait.Status | None:
        """What ``iprobe(source, tag)`` finds once the queued receives have taken what is
        theirs (Note [object messages]); the caller holds :attr:`lock` to receive it."""
        with self.lock:
            while True:
                self._settle(source, tag)
                st = self._comm.iprobe(source, tag)
                if st is None or not any(q.matches(st) for q in self._queue):
                    return st

    def _settle(self, source: int, tag: int) -> None:
        """Let each queued receive that overlaps ``source`` and ``tag`` take, in posting
        order, the messages that have arrived for it."""
        for p in [q for q in self._queue if q.overlaps(source, tag)]:
            self._take_arrived(p, None)

    def _take_arrived(self, p: _Pending, deadline: float | None) -> None:
        """Deliver the messages of ``p``'s pattern that have arrived, until ``p`` is done or
        none is left (each to the earliest queued receive it matches: ``p``, or one before);
        the caller holds :attr:`lock`."""
        while not p.done:
            st = self._comm.iprobe(p.source, p.tag)
            if st is None:
                return
            self._deliver(st, deadline)

    def _release(self) -> None:
        """Post each queued Irecv that no earlier queued receive overlaps any more."""
        if not self._deferred:
            return
        kept: list[_Pending] = []
        for p in self._queue:
            if p.into is not None and not any(q.overlaps(p.source, p.tag) for q in kept):
                self._post(p, p.source, p.tag)
            else:
                kept.append(p)
        self._queue[:] = kept

    def _post(self, p: _Pending, source: int, tag: int) -> None:
        """Post the queued Irecv ``p`` to the transport, from ``source`` with ``tag``."""
        assert p.into is not None
        self._deferred -= 1
        p.req = self._comm.irecv(p.into, source, tag)
        p.done = True

    def post(self, source: int, tag: int, c: str) -> _Pending:
        """Queue a receive from ``source`` with ``tag`` (wildcards allowed) for the call
        ``c``, checking both first.

        Raises:
            TypeError, ValueError: ``source`` or ``tag`` is no rank or tag of this
                communicator (MPI_ERR_RANK, MPI_ERR_TAG), before anything is queued.
        """
        comm = self._comm
        source = _check_rank(source, comm.rank, comm.size, c, "source", True)
        tag = _check_tag(tag, comm.rank, c, "tag", True)
        p = _Pending(source, tag, c)
        if source == plait.PROC_NULL:
            p.done = True
            p.status._fill(plait.PROC_NULL, plait.ANY_TAG, 0)
            return p
        with self.lock:
            self._queue.append(p)
        return p

    def complete(self, p: _Pending, deadline: float | None) -> bool:
        """Make ``p`` done, waiting until ``deadline`` (monotonic), or once without it.

        The wait holds no lock (Note [waiting without the inbox's lock]): it is a probe
        of ``p``'s pattern, and what it finds is delivered under the lock.

        Raises:
            CommTimeout: nothing for ``p`` arrived before the deadline (``p`` stays queued:
                a blocking receive withdraws it, :meth:`cancel`).
        """
        while True:
            with self.lock:
                self._take_arrived(p, deadline)
                if p.done:
                    return True
            if deadline is None:
                return False
            self._probe(p.source, p.tag, deadline, p.call)  # raises at the deadline

    # Note [waiting without the inbox's lock]
    #     A blocking object recv used to hold the inbox's lock while it waited, and every
    #     other thread's Irecv, iprobe and Recv on the communicator then waited for it while
    #     anything was queued, even for messages of other patterns: a program whose other
    #     thread received what let the object's sender go on deadlocked. So waits hold no
    #     lock: a probe of the pattern waits, and the lock is taken to deliver what it
    #     found (to the earliest queued receive it matches, which may be another thread's).

    def complete_any(self, ps: Sequence[_Pending], deadline: float) -> int:
        """Wait until one of ``ps`` is done; its index (the first done, in list order).

        Each round delivers, under the lock, whatever has arrived for any of ``ps``, then
        waits a slice (:data:`_SLICE`) without it on the first one not done (Note [waiting
        without the inbox's lock]).
        """
        while True:
            with self.lock:
                for p in ps:
                    self._take_arrived(p, deadline)
                for i, p in enumerate(ps):
                    if p.done:
                        return i
            left = deadline - time.monotonic()
            if left <= 0:
                raise plait.CommTimeout(
                    f"waitany: no message for any of {len(ps)} receives within "
                    f"{self._comm.timeout:g} s"
                )
            first = next(p for p in ps if not p.done)
            self._try_probe(first, min(left, _SLICE))

    def _try_probe(self, p: _Pending, seconds: float) -> plait.Status | None:
        """A probe for ``p`` that waits at most ``seconds``; None if nothing came."""
        try:
            return self._comm.probe(p.source, p.tag, timeout=seconds)
        except plait.CommTimeout:
            return None

    def cancel(self, p: _Pending) -> None:
        """Withdraw ``p`` if it has not matched."""
        with self.lock:
            if not p.done and p in self._queue:
                self._queue.remove(p)
                p.done = True
                p.status.cancelled = True
                if p.into is not None:
                    self._deferred -= 1
                self._release()

    def _probe(
        self, source: int, tag: int, deadline: float | None, call: str
    ) -> plait.Status | None:
        """A probe until ``deadline`` (None: one look) for the user's ``call``, whose name
        its errors give."""
        if deadline is None:
            return self._comm.iprobe(source, tag)
        left = max(deadline - time.monotonic(), 1e-3)
        try:
            return self._comm.probe(source, tag, timeout=left)
        except plait.CommError as exc:
            raise as_call(exc, call, self._comm.timeout) from exc.__cause__

    def _deliver(self, st: plait.Status, deadline: float | None) -> bool:
        """Receive the probed message into the earliest queued receive it matches, if any."""
        owner = next((q for q in self._queue if q.matches(st)), None)
        if owner is None:
            return False
        if owner.into is not None:  # an Irecv: posted for exactly this message
            self._queue.remove(owner)
            self._post(owner, st.source, st.tag)
            self._release()
            return True
        left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
        buf = np.empty(st.nbytes, np.uint8)
        self._comm.recv(buf, st.source, st.tag, timeout=left)
        self._queue.remove(owner)
        owner.status._fill(st.source, st.tag, st.nbytes)
        owner.done = True
        self._release()
        try:
            owner.value = pickle.loads(buf.data)
        except Exception as exc:
            exc.add_note(
                f"plait.mpi: the message from rank {st.source} with tag {st.tag} "
                f"({st.nbytes} bytes) is not a pickled object: was it sent with Send "
                f"(a buffer) rather than send?"
            )
            raise
        return True
