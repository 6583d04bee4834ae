"""mpi4py's ``Status`` and ``Request`` for plait.mpi.

Object receives are queued in an :class:`~plait.mpi._inbox.Inbox` (Note [object messages]);
a request of one waits on or tests the inbox.
"""

from __future__ import annotations

import contextlib
import operator
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import plait
from plait.mpi._datatypes import DATATYPES, Datatype, Message
from plait.mpi._errors import TruncatedError, mpi_error
from plait.mpi._unsupported import Unlisted, lacking

if TYPE_CHECKING:
    from plait.mpi._inbox import Inbox, _Pending

__all__ = ["REQUEST_NULL", "UNDEFINED", "Request", "Status", "as_call", "read_count"]

#: mpi4py's ``MPI.UNDEFINED`` (Open MPI's value): a count that is not whole, a split color.
UNDEFINED = -32766
#: Seconds a wait on several kinds of request blocks on one before it looks at the others.
_SLICE = 0.01
_E = TypeVar("_E", bound=Exception)


def as_call(exc: _E, call: str, seconds: float | None = None) -> _E:
    """``exc``, a probe's error, naming the call the user made (``Recv``, ``recv``,
    ``irecv``, ``waitany``): plait.mpi receives by probing first, and plait's probe names
    itself ("probe from rank 0 (tag 5) found no message within 3 s"). ``seconds``: the
    deadline the user's call had, for the probe's remainder of it."""
    said = str(exc)
    text = re.sub(r"^(rank \d+: )?probe\b", lambda g: f"{g.group(1) or ''}{call}", said, count=1)
    if seconds is not None:
        text = re.sub(r"within [0-9.e+-]+ s\b", f"within {seconds:g} s", text, count=1)
    if text == said:
        return exc
    err = type(exc)(text)
    err.__dict__.update(exc.__dict__)  # PeerLostError.lost_rank
    return err


def read_count(value: Any) -> int:
    """``value`` as mpi4py reads a count or an error code: an integer, a float truncated;
    TypeError for anything else (a string, None)."""
    kind = type(value)
    if hasattr(kind, "__index__"):
        return operator.index(value)
    if hasattr(kind, "__int__"):
        return int(value)
    raise TypeError("an integer is required")


class Status(metaclass=Unlisted):
    """Who sent a message, with which tag, and how many bytes: mpi4py's ``MPI.Status``.

    Two statuses are equal where every field is (source, tag, error, bytes, cancelled), as
    mpi4py's, so ``MPI.Status(st) == st``; like mpi4py's, a status is not hashable.
    """

    __slots__ = ("cancelled", "error", "nbytes", "source", "tag")
    __getattr__ = lacking  # an mpi4py name it lacks: Unsupported, naming it
    __hash__ = None  # type: ignore[assignment]  # mutable and compared by value, as mpi4py's

    def __init__(self, status: Status | None = None) -> None:
        """An empty status, or a copy of ``status`` (mpi4py's ``MPI.Status(st)``)."""
        self.source = plait.ANY_SOURCE
        self.tag = plait.ANY_TAG
        self.error = 0
        self.nbytes = 0
        self.cancelled = False
        if status is not None:
            if not isinstance(status, Status):
                raise TypeError(f"Status: expected a Status to copy; got {type(status).__name__}")
            status._copy_to(self)
            self.error = status.error

    def Get_source(self) -> int:
        """The sender's rank."""
        return self.source

    def Get_tag(self) -> int:
        """The message's tag."""
        return self.tag

    def Get_error(self) -> int:
        """0: plait raises errors instead of storing them here."""
        return self.error

    def Get_count(self, datatype: Datatype = DATATYPES["BYTE"]) -> int:
        """Elements of ``datatype`` in the message (bytes by default); UNDEFINED if not whole.

        By the datatype's extent, the bytes plait sends per element: for the MAXLOC pairs
        (``DOUBLE_INT``: 12 bytes of data in 16) that is not MPI's size (Note [datatypes]).
        """
        size = datatype.extent
        if size == 0 or self.nbytes % size:
            return UNDEFINED
        return self.nbytes // size

    def Get_elements(self, datatype: Datatype) -> int:
        """As :meth:`Get_count` (no derived datatypes)."""
        return self.Get_count(datatype)

    def Is_cancelled(self) -> bool:
        """Whether the request was cancelled before it matched."""
        return self.cancelled

    def Set_source(self, source: int) -> None:
        """Set the source (as mpi4py allows)."""
        self.source = source

    def Set_tag(self, tag: int) -> None:
        """Set the tag (as mpi4py allows)."""
        self.tag = tag

    def Set_error(self, error: int) -> None:
        """Set the error code (an integer; a float is truncated, as mpi4py's)."""
        self.error = read_count(error)

    def Set_cancelled(self, flag: Any) -> None:
        """Set whether the request counts as cancelled (any value, by its truth)."""
        self.cancelled = bool(flag)

    def Set_elements(self, datatype: Datatype, count: int) -> None:
        """Make the message ``count`` elements of ``datatype``, as MPI_Status_set_elements:
        ``Get_count(datatype)`` is then ``count`` (by the extent, as :meth:`Get_count`).

        Raises:
            TypeError: ``datatype`` is not a datatype, or ``count`` not a number.
            ValueError: ``count`` is negative: ``MPI.Exception`` of class ``ERR_COUNT``, as
                mpi4py's.
        """
        if not isinstance(datatype, Datatype):
            raise TypeError(
                f"Set_elements: datatype must be an MPI datatype (MPI.DOUBLE, ...); got "
                f"{type(datatype).__name__}"
            )
        n = read_count(count)
        if n < 0:
            raise mpi_error("ERR_COUNT", "MPI_ERR_COUNT: invalid count argument")
        self.nbytes = n * datatype.extent

    @property
    def count(self) -> int:
        """Bytes in the message (mpi4py's ``Status.count``); setting it is
        ``Set_elements(MPI.BYTE, n)``, as mpi4py's."""
        return self.nbytes

    @count.setter
    def count(self, value: int) -> None:
        self.Set_elements(DATATYPES["BYTE"], value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return self._fields() == other._fields()

    def _fields(self) -> tuple[int, int, int, int, bool]:
        return self.source, self.tag, self.error, self.nbytes, self.cancelled

    def _fill(self, source: int, tag: int, nbytes: int, cancelled: bool = False) -> None:
        self.source, self.tag, self.nbytes, self.cancelled = source, tag, nbytes, cancelled

    def _copy_to(self, other: Status | None) -> None:
        if other is not None:
            other._fill(self.source, self.tag, self.nbytes, self.cancelled)

    def _from(self, st: plait.Status | None) -> None:
        if st is not None:
            self._fill(st.source, st.tag, st.nbytes, st.cancelled)

    def __repr__(self) -> str:
        return f"<plait.mpi.Status source={self.source} tag={self.tag} bytes={self.nbytes}>"


def _empty(status: Status | None) -> None:
    """Make ``status`` MPI's empty status (any source, any tag, no error, no bytes): what a
    null request gives, and Waitany and Testany of no live request."""
    if status is not None:
        status._fill(plait.ANY_SOURCE, plait.ANY_TAG, 0)
        status.error = 0


class Request(metaclass=Unlisted):
    """A non-blocking operation in flight: mpi4py's ``MPI.Request``.

    ``Wait``/``Test`` (capitalised) return True and a flag; ``wait``/``test`` return the
    received object too (None for sends and buffer receives), as in mpi4py.

    ``MPI.Request()`` is a null request, as :data:`REQUEST_NULL`: a wait returns at once
    with an empty status, and the waits of several pass it over. A request whose
    completion was handed out is one too: it compares equal to ``REQUEST_NULL`` and is
    false, as mpi4py's (whose requests are not hashable either).
    """

    __slots__ = ("_inbox", "_into", "_keep", "_pending", "_req", "_sends", "_spent")
    __getattr__ = lacking  # an mpi4py name it lacks: Unsupported, naming it

    def __init__(
        self,
        req: plait.Request[Any] | Request | None = None,
        *,
        inbox: Inbox | None = None,
        pending: _Pending | None = None,
        keep: Any = None,
        into: Message | None = None,
        sends: bool = False,
    ) -> None:
        if isinstance(req, Request):  # MPI.Request(r): a second handle to r's request
            for name in Request.__slots__:
                setattr(self, name, getattr(req, name))
            return
        self._req = req
        self._sends = sends  # a send's: its status says no message (Note [a send's status])
        self._inbox = inbox
        self._pending = pending
        self._keep = keep  # the bytes of an isend, alive until it is done
        self._into = into  # an Irecv's buffer, for its errors in MPI's terms
        # Its completion was handed out (by a wait, a test that found it done, waitany,
        # testany, waitall or testall): mpi4py's request is then MPI.REQUEST_NULL, which a
        # later wait returns at once with an empty status, and waitany passes over. A
        # request of nothing (MPI.Request(), REQUEST_NULL) is one from the start.
        self._spent = req is None and pending is None

    def __bool__(self) -> bool:
        return not self._spent

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        if self is other or (self._spent and other._spent):
            return True
        if self._spent or other._spent:
            return False
        self._adopt()
        other._adopt()
        return self._req is other._req and self._pending is other._pending

    __hash__ = None  # type: ignore[assignment]  # equal when null: unhashable, as mpi4py's

    def _deadline(self) -> float:
        assert self._inbox is not None
        return time.monotonic() + self._inbox._comm.timeout

    def _adopt(self) -> None:
        """An Irecv that was queued behind object receives, once posted to the transport:
        a plain request from then on (Note [object messages])."""
        p = self._pending
        if p is not None and p.req is not None:
            self._req, self._pending = p.req, None

    def _finish(self, status: Status | None) -> Any:
        """The request's result, done; ``status`` filled with what it received.

        Note [a send's status]
            MPI fills a status for received messages only: a wait or test of a send
            leaves source ``PROC_NULL``, tag ``ANY_TAG`` and count 0 there, as mpi4py's
            do on Open MPI. plait's send request has a status of its own (the peer, the
            tag, the bytes), which plait.mpi handed on, so a script that waited on sends
            and receives with one list of statuses read sends as received messages.
        """
        if self._pending is not None:
            self._pending.status._copy_to(status)
            return self._pending.value
        if self._req is not None and status is not None:
            if self._sends:
                status._fill(plait.PROC_NULL, plait.ANY_TAG, 0)
                status.error = 0
            else:
                status._from(self._req.status)
        return None

    def _null(self, status: Status | None) -> None:
        """What a request whose completion was handed out gives: nothing, an empty status."""
        _empty(status)

    def wait(self, status: Status | None = None) -> Any:
        """Wait until done (within the communicator's timeout); the object received, or None.

        Once it has returned, the request is spent, as MPI's becomes MPI_REQUEST_NULL: a
        later wait returns None at once, and waitany passes it over.
        """
        if self._spent:
            self._null(status)
            return None
        value = self._wait(status)
        self._spent = True
        return value

    def _wait(self, status: Status | None) -> Any:
        """:meth:`wait`, leaving the request as it is."""
        if self._pending is not None:
            assert self._inbox is not None
            self._inbox.complete(self._pending, self._deadline())
            self._adopt()
        if self._pending is None and self._req is not None:
            try:
                self._req.wait()
            except plait.MismatchError as exc:
                raise self._in_mpi_terms(exc) from exc.__cause__
        return self._finish(status)

    def _in_mpi_terms(self, exc: plait.MismatchError) -> plait.MismatchError:
        """An Irecv's error for a message of another size, in the buffer's elements and
        MPI's words (plait's says bytes), a longer one as MPI's truncation error
        (:class:`TruncatedError`, an ``MPI.Exception`` of class ``ERR_TRUNCATE``); other
        errors as they are."""
        m, sent = self._into, exc.sent
        if m is None or sent is None or self._req is None:
            return exc
        nbytes, e, name = sent[1], m.datatype.extent, m.datatype.name
        held = m.count * e
        what = f"{nbytes // e} {name}" if e and nbytes % e == 0 else f"{nbytes} bytes"
        if nbytes > held:
            why = "message truncated (MPI_ERR_TRUNCATE): "
            tail = ""
        else:
            why = ""
            tail = " (Irecv takes a message of exactly its buffer's size; Recv, a shorter one)"
        where = self._req.label().partition(" ")[2]  # from rank 0 (tag 3)
        said = str(exc)
        rank = said.partition(": ")[0] + ": " if said.startswith("rank ") else ""
        dumped = said.partition("; flight recorder dump: ")[2]
        kind = TruncatedError if nbytes > held else plait.MismatchError
        err = kind(
            f"{rank}Irecv {where}: {why}the message holds {what} ({nbytes} bytes), but the buffer "
            f"holds {m.count} {name} ({held} bytes){tail}"
            + (f"; flight recorder dump: {dumped}" if dumped else "")
        )
        err.sent = sent
        return err

    def Wait(self, status: Status | None = None) -> bool:
        """Wait until done; True."""
        self.wait(status)
        return True

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        """Make progress once; ``(done, object or None)``. A request found done is spent
        (as :meth:`wait`); a spent one is ``(True, None)``."""
        if self._spent:
            self._null(status)
            return True, None
        done, value = self._test(status)
        self._spent = done
        return done, value

    def _test(self, status: Status | None) -> tuple[bool, Any]:
        """:meth:`test`, leaving the request as it is."""
        if self._pending is not None:
            assert self._inbox is not None
            done = self._inbox.complete(self._pending, None)
            self._adopt()
        if self._pending is None:
            try:
                done = self._req is None or self._req.test()
            except plait.MismatchError as exc:
                raise self._in_mpi_terms(exc) from exc.__cause__
        return (True, self._finish(status)) if done else (False, None)

    def Test(self, status: Status | None = None) -> bool:
        """Make progress once; whether the request is done."""
        return self.test(status)[0]

    def Get_status(self, status: Status | None = None) -> bool:
        """Make progress once, as :meth:`Test` does; whether the request is done, filling
        ``status`` if it is. Unlike Test it leaves the request as it is (MPI's
        ``MPI_Request_get_status`` does not free it): a wait still hands out its result.

        It makes progress because a loop of Get_status is a way to wait: the transport's
        progress and the inbox's matching happen only inside calls.
        """
        if self._spent:
            self._null(status)
            return True
        return self._test(status)[0]

    def Cancel(self) -> None:
        """Withdraw the request if it has not matched yet (MPI's rule)."""
        self._adopt()
        if self._pending is not None:
            assert self._inbox is not None
            self._inbox.cancel(self._pending)
        elif self._req is not None:
            self._req.cancel()

    cancel = Cancel

    def Free(self) -> None:
        """Forget the request: it still completes, and this handle is ``REQUEST_NULL``
        from now on, as mpi4py's."""
        self._spent = True

    free = Free

    @staticmethod
    def waitall(requests: Sequence[Request], statuses: list[Status] | None = None) -> list[Any]:
        """Wait for every request; their objects (None for sends and spent requests), in
        list order."""
        values: list[Any] = [None] * len(requests)
        for i in Request._order_of(requests, list(range(len(requests)))):
            values[i] = requests[i].wait(statuses[i] if statuses else None)
        return values

    @staticmethod
    def Waitall(requests: Sequence[Request], statuses: list[Status] | None = None) -> bool:
        """Wait for every request; True."""
        Request.waitall(requests, statuses)
        return True

    @staticmethod
    def testall(
        requests: Sequence[Request], statuses: list[Status] | None = None
    ) -> tuple[bool, list[Any] | None]:
        """Progress once on each; ``(True, objects)`` if all are done (then all are spent),
        else ``(False, None)``, none spent (MPI's rule)."""
        live = [i for i, r in enumerate(requests) if not r._spent]
        if not all(requests[i]._test(None)[0] for i in Request._order_of(requests, live)):
            return False, None
        values: list[Any] = [None] * len(requests)
        for i in live:
            values[i] = requests[i]._finish(statuses[i] if statuses else None)
            requests[i]._spent = True
        if statuses:
            for i, r in enumerate(requests):
                if i not in live:
                    r._null(statuses[i])
        return True, values

    @staticmethod
    def Testall(requests: Sequence[Request], statuses: list[Status] | None = None) -> bool:
        """Whether every request is done (progress once on each)."""
        return Request.testall(requests, statuses)[0]

    @staticmethod
    def waitany(requests: Sequence[Request], status: Status | None = None) -> tuple[int, Any]:
        """Wait until one request is done; ``(its index, its object)``. A request whose
        completion an earlier waitany or testany returned is passed over (mpi4py's is then
        REQUEST_NULL); ``(UNDEFINED, None)``, ``status`` emptied, when every request is,
        or there are none (MPI's rule for an empty or all-null list)."""
        live = [i for i, r in enumerate(requests) if not r._spent]
        if not live:  # none, or all spent: MPI's (MPI_UNDEFINED, an empty status), not an error
            _empty(status)
            return UNDEFINED, None
        j = Request._any([requests[i] for i in live])
        i = live[j]
        return i, requests[i].wait(status)  # done: at once, its result or its error

    @staticmethod
    def Waitany(requests: Sequence[Request], status: Status | None = None) -> int:
        """Wait until one request is done; its index."""
        return Request.waitany(requests, status)[0]

    @staticmethod
    def testany(requests: Sequence[Request], status: Status | None = None) -> tuple[int, bool, Any]:
        """Progress once on each until one is done: ``(index, True, object)``, else
        ``(UNDEFINED, False, None)``; ``(UNDEFINED, True, None)`` when every request's
        completion was returned already, or there are none (as :meth:`waitany`)."""
        live = [i for i, r in enumerate(requests) if not r._spent]
        if not live:  # none, or all spent: flag True, so a Testany loop ends (MPI's rule)
            _empty(status)
            return UNDEFINED, True, None
        for i in Request._order_of(requests, live):
            done, value = requests[i].test(status)
            if done:
                return i, True, value
        return UNDEFINED, False, None

    @staticmethod
    def Testany(requests: Sequence[Request], status: Status | None = None) -> tuple[int, bool]:
        """``(index, True)`` of a done request, else ``(UNDEFINED, False)``."""
        i, flag, _ = Request.testany(requests, status)
        return i, flag

    @staticmethod
    def _order_of(requests: Sequence[Request], live: list[int]) -> list[int]:
        """``live`` indices, object receives first: they take their messages only when
        waited on, and a send waited on before them could wait for a peer that waits for
        them."""
        return sorted(live, key=lambda i: requests[i]._pending is None)

    @staticmethod
    def _any(requests: Sequence[Request]) -> int:
        if not requests:
            raise ValueError("waitany: no requests")
        for i, r in enumerate(requests):
            if r.Get_status():
                return i
        objects = [r for r in requests if r._pending is not None]
        if not objects:  # all requests of plait's transport: its own wait drives them together
            reqs = [r._req for r in requests]
            return plait.wait_any([q for q in reqs if q is not None])
        inbox = objects[0]._inbox
        pending = [r._pending for r in objects if r._pending is not None]
        if (
            len(objects) == len(requests)
            and all(r._inbox is inbox for r in objects)
            and all(p.into is None for p in pending)
        ):
            assert inbox is not None
            return inbox.complete_any(pending, objects[0]._deadline())
        # Mixed kinds: queued receives take their messages only when tested, so test each
        # in turn, blocking a slice at a time on the transport's (Note [object messages]).
        deadline = objects[0]._deadline()
        while True:
            for i, r in enumerate(requests):
                if r._test(None)[0]:
                    return i
            if time.monotonic() > deadline:
                raise plait.CommTimeout(
                    f"waitany: none of {len(requests)} requests was done within "
                    f"{objects[0]._inbox._comm.timeout:g} s"  # type: ignore[union-attr]
                )
            plain = [r._req for r in requests if r._pending is None and r._req is not None]
            queued = [r for r in requests if r._pending is not None]
            if plain:
                with contextlib.suppress(plait.CommTimeout):
                    plait.wait_any(plain, timeout=_SLICE)
            elif queued:  # a slice's wait for the first queued one's message
                q = queued[0]
                with contextlib.suppress(plait.CommTimeout):
                    q._inbox.complete(q._pending, time.monotonic() + _SLICE)  # type: ignore
            else:  # every plain request is done already, or none is a transport's
                time.sleep(_SLICE)


#: mpi4py's ``MPI.REQUEST_NULL``: a request of nothing, done from the start; a list of
#: requests may hold it where nothing was posted.
REQUEST_NULL = Request()
