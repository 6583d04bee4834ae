"""``plait.mpi.Comm``: mpi4py's communicator over a :class:`plait.Communicator`.

The lowercase methods move Python objects with plait's object collectives (pickle protocol
5, arrays out of band) and, point to point, as pickled bytes matched by an
:class:`~plait.mpi._inbox.Inbox` (Note [object messages]); the capitalised ones move
buffers (:mod:`plait.mpi._collectives` for the collectives, here for point to point).

Note [the world communicator]
    ``MPI.COMM_WORLD`` exists from import on, but joins the job (``plait.init()``, which
    reads the launcher's environment) only when first used, as mpi4py initialises MPI on
    import: a script that imports ``MPI`` and never communicates needs no job. Joining
    also installs an exception hook: a rank whose script raises prints its traceback,
    then aborts the job's communicator (``Communicator.abort``), so that the other ranks'
    calls fail at once with ``AbortedError`` instead of waiting for their deadline,
    whatever launched them (``plait run`` stops them anyway).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NoReturn

import numpy as np

import plait
from plait._p2p import _check_rank as check_rank
from plait._p2p import _check_tag as check_tag
from plait.mpi._collectives import BufferCollectives
from plait.mpi._datatypes import DATATYPES, Message, message
from plait.mpi._errors import MPIValueError, mpi_error, raising_mpi_errors
from plait.mpi._identity import CommIdentity
from plait.mpi._inbox import Inbox
from plait.mpi._ops import OPS, as_function
from plait.mpi._requests import UNDEFINED, Request, Status, as_call
from plait.mpi._unsupported import Unlisted, unsupported

__all__ = ["Comm", "Intracomm", "world"]

_SUM = OPS["SUM"]
_ANY_SOURCE = plait.ANY_SOURCE
_ANY_TAG = plait.ANY_TAG


def _truncated(call: str, st: plait.Status, m: Message) -> MPIValueError:
    """MPI's truncation error, in elements of the buffer's datatype: the message ``st``
    describes is longer than the buffer of ``m``, and stays unreceived."""
    e, name = m.extent, m.datatype.name
    sent = f"{st.nbytes // e} {name}" if st.nbytes % e == 0 else f"{st.nbytes} bytes"
    return mpi_error(
        "ERR_TRUNCATE",
        f"{call}: message truncated (MPI_ERR_TRUNCATE): rank {st.source} sent {sent} "
        f"({st.nbytes} bytes) with tag {st.tag}, but the buffer holds {m.count} {name} "
        f"({m.count * e} bytes); the message is left unreceived",
    )


def _p2p(buf: Any, peer: Any, call: str, writes: bool = False) -> Message:
    """The message of a point-to-point call (a receive ``writes`` into it: it must be
    writable); with ``PROC_NULL`` a None buffer is an empty one, as mpi4py does not read the
    buffer of a message to or from no process."""
    if buf is None and isinstance(peer, int) and peer == plait.PROC_NULL:
        buf = [None, 0, DATATYPES["BYTE"]]
    return message(buf, call, what="buf", writes=writes)


def _pickled(obj: Any) -> np.ndarray:
    """``obj`` as the bytes mpi4py sends for it (pickle protocol 5, in band)."""
    return np.frombuffer(pickle.dumps(obj, protocol=5), np.uint8)


def c_int(value: Any) -> int:
    """``value`` as mpi4py reads an argument that is a C int: anything with ``__index__``
    or ``__int__`` (a float or numpy float is truncated), else TypeError; OverflowError
    outside a 32-bit int, as mpi4py's messages say."""
    kind = type(value)
    if hasattr(kind, "__index__"):
        n = operator.index(value)
    elif hasattr(kind, "__int__"):
        n = int(value)  # ValueError for NaN, as mpi4py
    else:
        raise TypeError("an integer is required")
    if not -(1 << 31) <= n < 1 << 31:
        raise OverflowError("value too large to convert to int")
    return n


#: The arguments of Comm's methods that mpi4py reads as a C int (Note [C int arguments]).
_C_INTS = frozenset({"dest", "source", "tag", "sendtag", "recvtag", "root", "errorcode"})


def reading_c_ints(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, its arguments named in :data:`_C_INTS` read with :func:`c_int` first,
    whether passed by position or by name; ``method`` itself where it has none.

    Note [C int arguments]
        mpi4py reads a rank, a tag, a root and an error code as a C int: a float, a numpy
        float or a bool is truncated (``size / 2`` is a float in Python 3, and scripts pass
        it as a root or a destination), a value outside 32 bits raises OverflowError, a
        string or None TypeError. plait's own calls take ints only, so every public
        method of Comm reads these arguments so before its body runs: one wrapper, from
        the method's signature, so that no method (upper or lower case, an alias such as
        ``Probe`` included) is left out. Split's color and key are C ints too; Split reads
        them itself.
    """
    names = list(inspect.signature(method).parameters)
    at = frozenset(i for i, name in enumerate(names) if name in _C_INTS)
    if not at:
        return method
    first = min(at)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if len(args) > first:
            args = tuple(c_int(a) if i in at else a for i, a in enumerate(args))
        for name in kwargs:
            if name in _C_INTS:
                kwargs[name] = c_int(kwargs[name])
        return method(*args, **kwargs)

    return call


class Comm(BufferCollectives, CommIdentity, metaclass=Unlisted):
    """An mpi4py communicator: the base class of :class:`Intracomm`, which ``COMM_WORLD``,
    ``COMM_SELF`` and what ``Split`` and ``Dup`` make of them are, as in mpi4py.

    A name mpi4py's has and this lacks raises Unsupported naming it, on an instance
    (``comm.Compare``) and on the class (``MPI.Comm.Get_parent``, ``MPI.Intracomm``'s) alike.

    ``COMM_NULL`` (what ``Split`` gives a rank with ``MPI.UNDEFINED``, and what ``Free``
    leaves of the handle it was called on) is false in a boolean context and compares
    equal to every handle that ``Free`` left so; ``MPI.Comm()`` is one. ``MPI.Comm(comm)``
    (``MPI.Intracomm(comm)``) is a second handle to ``comm``'s communicator (Note
    [communicator handles]).

    Note [communicator handles]
        An mpi4py ``Comm`` is a handle: ``MPI.Intracomm(MPI.COMM_WORLD)`` is another Python
        object for the same communicator, equal to it, and freeing either frees the
        communicator. plait.mpi keeps what it knows of a communicator in the Comm itself:
        the plait communicator, or how the world joins the job on first use; the inbox of
        queued object receives and the lock buffer receives take messages under (Note
        [threads receiving buffers]); the name. Two objects with copies of these would join
        the world twice, and match object receives in two inboxes out of MPI's order. So a
        second handle shares the first one's instance ``__dict__``: every attribute is the
        communicator's, whichever handle sets it (a join, a ``Free``), with nothing to
        forward. (plait.mpi's own calls pass a plait communicator, or None for COMM_NULL.)

        What is the handle's alone is a slot, ``_handle_freed``: MPI_Comm_free sets the
        handle it is given to MPI_COMM_NULL, and no other. After ``h.Free()`` ``h`` is
        COMM_NULL (false, equal to COMM_NULL), while ``a``, a handle to the same
        communicator, is true and unequal to COMM_NULL, as mpi4py's, but its communicator
        is freed (``_freed``, shared): a call on it raises MPI_ERR_COMM, as a call on a freed
        communicator does, and so does its ``Free`` (MPI calls the use of such a handle
        erroneous; plait.mpi refuses it rather than free the communicator twice).
    """

    __slots__ = ("_handle_freed",)

    def __init__(
        self,
        comm: plait.Communicator | Comm | None = None,
        name: str = "",
        *,
        join: Callable[[], plait.Communicator] | None = None,
        origin: str = "",
        number: int = -1,
    ) -> None:
        self._handle_freed = False  # Note [communicator handles]
        if isinstance(comm, Comm):  # a second handle (Note [communicator handles])
            self.__dict__ = comm.__dict__
            self._handle_freed = comm._handle_freed
            return
        if comm is None and join is None and not name:
            name = "MPI_COMM_NULL"  # MPI.Comm(), as mpi4py's: COMM_NULL
        self._comm = comm
        self._name = name
        self._origin = origin  # how an unnamed one was made ("SPLIT FROM MPI_COMM_WORLD")
        self._number = number  # Open MPI's for it (Note [communicator numbers]); -1: none
        self._join = join
        self._has_attrs = number == 0  # the world's TAG_UB (Note [communicator attributes])
        self._freed = False  # by Free, through any handle (Note [communicator handles])
        self._lock = threading.Lock()
        # Buffer receives take a probed message under it (Note [threads receiving buffers]).
        self._taking = threading.Lock()
        self._inbox: Inbox | None = None

    @property
    def _c(self) -> plait.Communicator:
        """The plait communicator, joining the job on first use (Note [the world communicator])."""
        comm = self._comm
        if comm is not None:
            return comm
        with self._lock:
            if self._comm is None and self._join is not None:
                self._comm = self._join()
                self._join = None
        if self._comm is None:
            raise mpi_error(
                "ERR_COMM", "plait.mpi: COMM_NULL (or a freed communicator) cannot communicate"
            )
        return self._comm

    def _box(self) -> Inbox:
        if self._inbox is None:
            self._inbox = Inbox(self._c)
        return self._inbox

    # -- identity ---------------------------------------------------------------------------
    def Get_rank(self) -> int:
        """This process's rank in the communicator."""
        return self._c.rank

    def Get_size(self) -> int:
        """The number of ranks."""
        return self._c.size

    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._c.rank

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._c.size

    def __bool__(self) -> bool:
        if self._handle_freed:  # Note [communicator handles]
            return False
        return self._comm is not None or self._join is not None or self._freed

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Comm):
            return NotImplemented
        if not self or not other:
            return not self and not other
        if self.__dict__ is other.__dict__:  # handles of one (Note [communicator handles])
            return True
        return self._comm is not None and self._comm is other._comm

    def __hash__(self) -> int:
        return id(self._comm) if self else 0

    def __repr__(self) -> str:
        return f"<plait.mpi.{type(self).__name__} {self._name or hex(id(self))}>"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported("Comm", name, (n for n in dir(type(self)) if not n.startswith("_")))

    # -- groups -----------------------------------------------------------------------------
    def Split(self, color: int = 0, key: int = 0) -> Comm:
        """Sub-communicators by ``color``, ordered by ``key``; COMM_NULL for MPI.UNDEFINED.
        Of this handle's class, as mpi4py's: an Intracomm's are Intracomms.

        ``color`` and ``key`` are read as mpi4py reads a C int (:func:`c_int`).

        Raises:
            ValueError: ``color`` is negative but not MPI.UNDEFINED (MPI_ERR_ARG).
            TypeError, OverflowError: ``color`` or ``key`` is not a number or is outside a
                C int, as mpi4py raises.
        """
        color, key = c_int(color), c_int(key)
        if color < 0 and color != UNDEFINED:
            raise mpi_error(
                "ERR_ARG",
                f"Split: color={color} is invalid (MPI_ERR_ARG); expected a color >= 0, or "
                f"MPI.UNDEFINED ({UNDEFINED}) to join no group",
            )
        group = self._c.split(None if color == UNDEFINED else color, key)
        if group is None:
            return type(self)(None, "MPI_COMM_NULL")
        n = next(_NUMBERS)  # as Dup's (Note [communicator numbers])
        return type(self)(group, origin=f"{n} SPLIT FROM {self._number}", number=n)

    def _label(self) -> str:
        """The communicator as MPI's messages name it: its name, or, for one Split or Dup
        made with none, where it came from (as Open MPI's: SPLIT FROM, DUP FROM)."""
        return self._name or f"MPI COMMUNICATOR {self._origin or 'made by plait.mpi'}"

    def Dup(self, info: Any = None) -> Comm:
        """A new communicator of the same ranks whose messages never meet this one's.

        It has no name (``Get_name()`` is ``''``, as mpi4py's); MPI's messages call it as
        Open MPI does, "MPI COMMUNICATOR 3 DUP FROM 0" (Note [communicator numbers]). It is
        of this handle's class and has its attributes, as mpi4py's (Note [communicator
        attributes]).
        """
        group = self._c.split(0, self._c.rank)
        n = next(_NUMBERS)
        dup = type(self)(group, origin=f"{n} DUP FROM {self._number}", number=n)
        dup._has_attrs = self._has_attrs
        return dup

    Clone = Dup

    def Free(self) -> None:
        """Release the communicator; this handle then compares equal to COMM_NULL, and
        another handle to it stays as it was, its communicator freed (Note [communicator
        handles]).

        Raises:
            ValueError: it is COMM_WORLD, COMM_SELF or COMM_NULL (a freed communicator
                included: a second Free, through this handle or another), which MPI does
                not let a program free (MPI_ERR_COMM); :func:`plait.mpi.Finalize`
                releases the world.
        """
        if self._mpis_own() or not self or self._freed:
            which, again = self._name, ""
            if not self._mpis_own() and not self:
                which, again = "MPI_COMM_NULL", " (this one was freed already)"
            elif not self._mpis_own():  # Note [communicator handles]
                which = "this communicator"
                again = " (it was freed already, through another handle to it)"
            raise mpi_error(
                "ERR_COMM",
                f"Free: {which} cannot be freed (MPI_ERR_COMM: invalid communicator){again}; "
                "free the communicators made by Split or Dup, once each, and call "
                "MPI.Finalize() to release the world",
            )
        self._release()
        self._freed = True
        self._handle_freed = True

    def _mpis_own(self) -> bool:
        """Whether this is COMM_WORLD, COMM_SELF or a COMM_NULL that MPI made (not one
        ``Free`` left), which a program may not free, whatever ``Set_name`` called them."""
        return self._number in (0, 1) or (self._name == "MPI_COMM_NULL" and not self._freed)

    def _release(self) -> None:
        """:meth:`Free`, for any communicator (:func:`plait.mpi.Finalize`'s world too)."""
        if self._comm is not None:
            self._comm.close()
        self._comm = None
        self._join = None

    def Abort(self, errorcode: int = 0) -> NoReturn:
        """End the job: the other ranks' calls fail, and this process exits with ``errorcode``.

        Before ``COMM_WORLD`` has joined the job it does not join it (the others may never
        come): the rank printed is the launcher's (``PLAIT_RANK``, ``RANK``, ...), as the
        join would read it, and the launcher ends the job.
        """
        comm = self._comm
        rank = comm.rank if comm is not None else self._rank_before_joining()
        sys.stdout.flush()
        where = self._label()
        print(
            f"MPI_ABORT was invoked on rank {rank} in communicator {where} "
            f"with errorcode {errorcode}",
            file=sys.stderr,
            flush=True,
        )
        if comm is not None:
            comm.abort(f"MPI_ABORT on rank {rank} with errorcode {errorcode}")
        os._exit(errorcode)

    def _rank_before_joining(self) -> int:
        """This process's rank in a communicator not joined yet: the world's from the
        launcher's environment, as ``plait.init`` reads it; 0 for COMM_SELF or none."""
        if self._join is None or self._number != 0:
            return 0
        from plait._init import detect_launch

        try:
            return detect_launch().rank
        except ValueError:  # an environment the join would refuse too
            return 0

    # -- lowercase collectives: Python objects ---------------------------------------------
    def barrier(self) -> None:
        """Wait until every rank has entered the barrier."""
        self._c.barrier()

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Root's ``obj`` on every rank, root included, as a copy (unpickled, as mpi4py's
        root gets it), so that changing the result leaves root's ``obj`` as it was."""
        got = self._c.bcast_object(obj, root)
        if self._c.rank == root:  # plait's root gets obj itself
            return pickle.loads(pickle.dumps(got, protocol=5))
        return got

    def scatter(self, sendobj: Sequence[Any] | None, root: int = 0) -> Any:
        """Root's ``sendobj[r]`` on rank r (``sendobj`` has ``size`` items at root)."""
        return self._c.scatter_object(sendobj, root)

    def gather(self, sendobj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's object in a list, in rank order, at root; None elsewhere."""
        return self._c.gather_object(sendobj, root)

    def allgather(self, sendobj: Any) -> list[Any]:
        """Every rank's object in a list, in rank order, on every rank."""
        return self._c.allgather_object(sendobj)

    def alltoall(self, sendobj: Sequence[Any]) -> list[Any]:
        """``sendobj[j]`` to rank j; the objects received, in rank order."""
        return self._c.alltoall_object(sendobj)

    def reduce(self, sendobj: Any, op: Any = _SUM, root: int = 0) -> Any:
        """Every rank's object combined with ``op`` in rank order, at root; None elsewhere."""
        f = as_function(op, "reduce")
        objs = self._c.gather_object(sendobj, root)
        return None if objs is None else functools.reduce(f, objs)

    def allreduce(self, sendobj: Any, op: Any = _SUM) -> Any:
        """Every rank's object combined with ``op`` in rank order, on every rank."""
        return self._c.allreduce_object(sendobj, as_function(op, "allreduce"))

    # -- lowercase point to point: Python objects (Note [object messages]) ----------------
    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Send ``obj`` to ``dest``; returns once it is on its way."""
        self._c.send(_pickled(obj), dest, tag)

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``obj``; a request whose ``wait()`` returns None."""
        data = _pickled(obj)
        return Request(self._c.isend(data, dest, tag), inbox=self._box(), keep=data, sends=True)

    def recv(
        self,
        buf: Any = None,
        source: int = _ANY_SOURCE,
        tag: int = _ANY_TAG,
        status: Status | None = None,
    ) -> Any:
        """The next object from ``source`` with ``tag`` (wildcards by default); ``buf`` unused."""
        box = self._box()
        pending = box.post(source, tag, "recv")
        try:
            box.complete(pending, time.monotonic() + self._c.timeout)
        except BaseException:
            box.cancel(pending)  # a message that comes later is the next receive's
            raise
        pending.status._copy_to(status)
        return pending.value

    def irecv(self, buf: Any = None, source: int = _ANY_SOURCE, tag: int = _ANY_TAG) -> Request:
        """Start receiving an object; a request whose ``wait()`` returns it."""
        box = self._box()
        return Request(inbox=box, pending=box.post(source, tag, "irecv"))

    def sendrecv(
        self,
        sendobj: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = _ANY_SOURCE,
        recvtag: int = _ANY_TAG,
        status: Status | None = None,
    ) -> Any:
        """Send ``sendobj`` to ``dest`` and receive an object from ``source``, together."""
        req = self.isend(sendobj, dest, sendtag)
        got = self.recv(recvbuf, source, recvtag, status)
        req.wait()
        return got

    def probe(
        self, source: int = _ANY_SOURCE, tag: int = _ANY_TAG, status: Status | None = None
    ) -> bool:
        """Wait until a message from ``source`` with ``tag`` can be received; True.

        A message that a queued receive (posted earlier) matches is that receive's, not
        the probe's (Note [object messages]).
        """
        c = self._c
        seconds = c.timeout
        deadline = time.monotonic() + seconds
        found = c.probe(source, tag)
        while (box := self._inbox) is not None and box.busy():
            again = box.look(source, tag)
            if again is not None:
                found = again
                break
            try:
                found = c.probe(source, tag, timeout=max(deadline - time.monotonic(), 1e-3))
            except plait.CommError as exc:
                raise as_call(exc, "probe", seconds) from exc.__cause__
        if status is not None:
            status._from(found)
        return True

    def iprobe(
        self, source: int = _ANY_SOURCE, tag: int = _ANY_TAG, status: Status | None = None
    ) -> bool:
        """Whether a message from ``source`` with ``tag`` can be received now (one that no
        queued receive, posted earlier, matches: Note [object messages])."""
        box = self._inbox
        if box is not None and box.busy():
            found = box.look(source, tag)
        else:
            found = self._c.iprobe(source, tag)
        if found is not None and status is not None:
            status._from(found)
        return found is not None

    Probe = probe
    Iprobe = iprobe

    # -- capitalised point to point: buffers ----------------------------------------------
    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        """Send the elements of ``buf``; returns once ``buf`` may be reused."""
        self._c.send(_p2p(buf, dest, "Send").bytes(), dest, tag)

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        """Start sending ``buf`` (leave it unchanged until the request is done)."""
        data = _p2p(buf, dest, "Isend").bytes()
        return Request(self._c.isend(data, dest, tag), inbox=self._box(), keep=buf, sends=True)

    def Recv(
        self,
        buf: Any,
        source: int = _ANY_SOURCE,
        tag: int = _ANY_TAG,
        status: Status | None = None,
    ) -> None:
        """Receive the next message from ``source`` with ``tag`` into ``buf``.

        The message may be shorter than ``buf`` (its size is in ``status``), as in MPI;
        a longer one raises ValueError (MPI's truncation error) and is left unreceived.
        """
        self._recv(buf, source, tag, status, "Recv")

    def _recv(self, buf: Any, source: int, tag: int, status: Status | None, call: str) -> None:
        """:meth:`Recv`, its errors naming ``call`` (Note [threads receiving buffers])."""
        m = _p2p(buf, source, call, writes=True)
        into = m.bytes()
        if source == plait.PROC_NULL:
            if status is not None:
                status._fill(plait.PROC_NULL, _ANY_TAG, 0)
            return
        c = self._c
        seconds = c.timeout
        deadline = time.monotonic() + seconds
        first = True
        while True:
            try:
                if first:  # the communicator's own deadline: a stall takes part in crossed calls
                    c.probe(source, tag)
                else:
                    c.probe(source, tag, timeout=max(deadline - time.monotonic(), 1e-3))
            except (plait.CommError, ValueError, TypeError) as exc:  # a bad source or tag too
                raise as_call(exc, call, seconds) from exc.__cause__
            first = False
            # Queued receives, posted earlier, take theirs first (Note [object messages]).
            box = self._inbox if self._inbox is not None and self._inbox.busy() else None
            with self._taking, box.lock if box is not None else contextlib.nullcontext():
                st = c.iprobe(source, tag) if box is None else box.look(source, tag)
                if st is None:
                    continue  # another thread took it: wait for the next one
                if st.nbytes > into.size:
                    raise _truncated(call, st, m)
                done = plait.Status()
                c.recv(into[: st.nbytes], st.source, st.tag, status=done)
                break
        if status is not None:
            status._from(done)

    # Note [threads receiving buffers]
    #     Recv and Sendrecv accept a message shorter than their buffer, as MPI's do, so they
    #     probe for its size and then receive exactly that message. Two threads receiving
    #     with one pattern used to probe the same message and then each take another one
    #     (MismatchError, and a message consumed). A blocked receive must not hold a lock
    #     (a thread waiting on another tag would wait behind it), so each waits in a probe
    #     with no lock held, then under the communicator's lock (_taking) looks again
    #     (iprobe) and receives the message it finds, from its source with its tag, before
    #     letting go; finding none (another thread took it), it waits again, within the
    #     deadline the call started with. Irecv posts under the same lock (posting does not
    #     wait), so no receive posted meanwhile can match the message between the look and
    #     the receive. While object receives are queued, the look and the receive also hold
    #     the inbox's lock, so that no queued receive takes the message in between (Note
    #     [object messages]); the lock order is _taking, then the inbox's.

    def Irecv(self, buf: Any, source: int = _ANY_SOURCE, tag: int = _ANY_TAG) -> Request:
        """Start receiving into ``buf``, which must have exactly the message's size."""
        m = _p2p(buf, source, "Irecv", writes=True)
        box = self._box()
        with self._taking:  # Note [threads receiving buffers]
            if box.busy():  # behind the queued receives it overlaps (Note [object messages])
                queued = box.defer(m.bytes(), source, tag)
                if queued is not None:
                    return Request(inbox=box, pending=queued, keep=buf, into=m)
            req = self._c.irecv(m.bytes(), source, tag)
        return Request(req, inbox=box, keep=buf, into=m)

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = _ANY_SOURCE,
        recvtag: int = _ANY_TAG,
        status: Status | None = None,
    ) -> None:
        """Send ``sendbuf`` to ``dest`` and receive into ``recvbuf`` from ``source``, together.

        Its receive's arguments are refused before anything is sent, as Open MPI's are: the
        send went first, and a bad ``source`` or ``recvtag`` left its message for ``dest``
        to find in a later receive."""
        _p2p(recvbuf, source, "Sendrecv", writes=True)
        c = self._c  # plait's checks of a receive's source and tag (Note [MPI's errors])
        check_rank(source, c.rank, c.size, "Sendrecv", "source", wildcard=True)
        check_tag(recvtag, c.rank, "Sendrecv", "recvtag", wildcard=True)
        req = self.Isend(sendbuf, dest, sendtag)
        self._recv(recvbuf, source, recvtag, status, "Sendrecv")
        req.Wait()


# Every public method reads its ranks, tags and roots as mpi4py does (Note [C int
# arguments]) and raises a bad one as MPI's error (Note [MPI's errors]).
for _name, _method in {**vars(BufferCollectives), **vars(CommIdentity), **vars(Comm)}.items():
    if not _name.startswith("_") and inspect.isfunction(_method):  # Comm's win
        setattr(Comm, _name, raising_mpi_errors(reading_c_ints(_method)))
del _name, _method


class Intracomm(Comm):
    """mpi4py's ``MPI.Intracomm``: the class of ``COMM_WORLD``, ``COMM_SELF`` and what
    ``Split`` and ``Dup`` make of them, as in mpi4py (and of ``MPI.Intracomm(comm)``, a
    second handle), while ``COMM_NULL``, ``MPI.Comm()`` and ``MPI.Comm(comm)`` are plain
    :class:`Comm` objects."""

    __slots__ = ()


def _join_world() -> plait.Communicator:
    """``plait.init()`` and the exception hook of Note [the world communicator]."""
    comm = plait.init()
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if not comm.closed:
            comm.abort(f"rank {comm.rank} raised {kind.__name__}: {value}")

    sys.excepthook = hook
    return comm


# Note [communicator numbers]
#     Open MPI numbers communicators (its context ids) and names an unnamed one by them in
#     MPI_ABORT's line: "MPI COMMUNICATOR 3 DUP FROM 0". COMM_WORLD is 0 and COMM_SELF 1;
#     each Split (for a rank that gets a group) and Dup takes the next, from 3, in the order
#     this process makes them, as Open MPI's do in a program whose ranks make the same
#     communicators. A Dup's or Split's label says its number and its parent's ("MPI
#     COMMUNICATOR 4 SPLIT FROM 3"), as Open MPI's does, whatever names the parent has.
_NUMBERS = itertools.count(3)


def world() -> Intracomm:
    """A new ``COMM_WORLD`` that joins the job on first use."""
    return Intracomm(None, "MPI_COMM_WORLD", join=_join_world, number=0)
