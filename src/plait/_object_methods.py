"""The object collectives of :class:`plait.Communicator`: any picklable Python object.

mpi4py's lower-case API (docs/mpi.md, "Object collectives"): ``bcast_object``,
``allgather_object``, ``gather_object``, ``scatter_object``,
``alltoall_object``, ``allreduce_object``, ``send_object`` and
``recv_object``. Each pickles with protocol 5 into the frames of
:mod:`plait.objects` and moves them with the communicator's own collectives:
first the lengths (one 64-bit word per object, PICKLE_FAILED for an object
that could not be pickled, so every rank learns of a failure and raises alike
after the same calls, leaving the communicator usable), then the messages.
scatter_object and alltoall_object, whose lengths every rank already has
after the first call, start their scatterv and alltoallv through
``_uneven`` directly rather than exchange the counts a second time.

:class:`ObjectMethods` is a mixin on top of the even and uneven collectives;
point to point (``send``, ``recv``) comes from :class:`plait.Communicator`.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from plait import objects
from plait._checks import check_peer, check_root, check_user_tag
from plait._p2p_status import check_word
from plait._uneven_edge import UnevenMethods
from plait.collectives import displacements
from plait.collectives import get as collective
from plait.errors import CommError, CommTimeout, MismatchError

__all__ = ["ObjectMethods"]

#: What recv fills and returns: ``buf`` itself.
_B = TypeVar("_B")
#: An object ``allreduce_object`` combines.
_O = TypeVar("_O")

_BYTE = np.dtype(np.uint8)
_FAILED = objects.PICKLE_FAILED
#: The length word of a rank whose call was malformed (objs not one object per rank): it
#: raises ValueError itself, and the others learn that from this word, not a pickling failure.
_MISUSED = np.uint64(objects.PICKLE_FAILED - 1)
_SEP = objects.SEPARATE_MIN
_SCATTERV = collective("scatterv")
_ALLGATHERV = collective("allgatherv")
_GATHERV = collective("gatherv")
_ALLTOALLV = collective("alltoallv")
_ALLGATHER = collective("allgather")
_BROADCAST = collective("broadcast")


class Lanes:
    """One lock per (way, peer, tag) while some thread sends or receives objects on it.

    Note [one object at a time on a lane]
        An object goes as several messages on one tag (its length, its first message,
        its large buffers), and a receive takes them in that order. Two threads that
        sent to one peer with one tag at once interleaved their messages, and the
        receiver took one object's length for another's message (MismatchError, or the
        wrong object); two threads receiving from one peer with one tag split one
        object's messages between them alike. mpi4py's ``send`` of an object is one
        message, so threads that share a communicator never see this there. So
        ``send_object`` and ``recv_object`` hold their lane, (way, peer, tag), for
        the whole object: threads on one lane take turns, whole objects at a time, in
        no promised order (as messages of different threads have none); threads on
        different lanes do not wait for each other. A lane's lock lives while some
        thread holds or waits for it, so tags used once leave nothing behind.

    Note [an object cut short]
        A ``send_object`` that fails after its first message was posted (a timeout over
        TCP, where part of a message may have left and the rest still goes; Ctrl-C)
        leaves its receiver with part of an object: the receiver takes the next
        object's length for the rest (MismatchError), or the rest of the next object
        for this one. Nothing on the tag can put that right, so the lane is *spoiled*
        on the side that failed: every later ``send_object`` (or ``recv_object``, for
        a receive that failed after it took the length) on that peer and tag raises
        CommError naming the first failure, and a receive whose message does not fit
        the object it reads says that its sender's earlier object may have been cut
        short. A failure before anything moved (a receive that timed out waiting for
        the length) and a pickling failure (told in the length word) spoil nothing.
        The lanes spoiled stay listed while the communicator lives, one entry each.

        A sender that spoils its lane then tells its receiver: it sends an empty
        message of its own dtype (int8, :data:`_CUT_DTYPE`; an object's messages are
        uint64 and uint8) on the tag, behind whatever of the object still goes, and
        does not wait for it (an ``isend`` let go of still goes). Over
        TCP a timed-out large message is withdrawn and never arrives, and the
        receiver waited out its whole timeout for it, then blamed a dead or absent
        peer; now the receive that meets the notice fails at once, saying the sender
        cut its object short, and spoils the receiver's lane alike.
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._lanes: dict[tuple[str, int, int], list[Any]] = {}  # [lock, threads on it]
        self._spoiled: dict[tuple[str, int, int], str] = {}  # lane -> why

    def spoil(self, key: tuple[str, int, int], why: str) -> None:
        """Refuse lane ``key`` from now on, saying ``why`` (Note [an object cut short])."""
        with self._mu:
            self._spoiled.setdefault(key, why)

    @contextmanager
    def hold(self, key: tuple[str, int, int], seconds: float, what: str) -> Iterator[None]:
        """Hold lane ``key`` for one object; CommTimeout if it stays taken for ``seconds``
        (``what``: the call, as its message names it); CommError if it was spoiled."""
        with self._mu:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = [threading.Lock(), 0]
            lane[1] += 1
        try:
            if not lane[0].acquire(timeout=min(seconds, threading.TIMEOUT_MAX)):
                raise CommTimeout(
                    f"{what}: another thread's {key[0]}_object on the same peer and tag "
                    f"held it for {seconds:g} s (objects on one peer and tag go one at a "
                    "time); nothing was sent or received"
                )
            try:
                with self._mu:  # read once its turn came: the thread before may have spoiled it
                    why = self._spoiled.get(key)
                if why is not None:
                    raise CommError(f"{what}: {why}; use another tag for the objects that follow")
                yield
            finally:
                lane[0].release()
        finally:
            with self._mu:
                lane[1] -= 1
                if lane[1] == 0:
                    del self._lanes[key]


class ObjectMethods(UnevenMethods):
    """The object collectives, built on the collectives below and on point to point."""

    #: send_object's and recv_object's lanes (Note [one object at a time on a lane]).
    _lanes: Lanes

    if TYPE_CHECKING:
        # Point to point is the communicator's own (plait.communicator): declared here for
        # the type checker only, so that at run time this mixin has no send or recv at all.
        def send(
            self, x: object, dst: int, tag: int = 0, *, timeout: float | None = None
        ) -> None: ...

        def recv(self, buf: _B, src: int, tag: int = 0, *, timeout: float | None = None) -> _B: ...

        def isend(self, x: object, dst: int, tag: int = 0) -> Any: ...

    def bcast_object(self, obj: Any = None, root: int = 0, *, timeout: float | None = None) -> Any:
        """Root's ``obj`` on every rank (mpi4py's ``bcast``); other ranks' ``obj`` is ignored.

        One broadcast of the first message's length, one of the first message,
        one per buffer of :data:`plait.objects.SEPARATE_MIN` bytes or more
        (sent from the object's memory, received into the new array's). Root
        gets its own ``obj`` back, not a copy.

        Raises:
            pickle.PicklingError: on every rank, when root's object cannot be pickled.
        """
        c = "bcast_object"
        r = self._rank
        root = check_root(root, r, self._size, c)
        word = np.zeros(1, np.uint64)
        messages: list[memoryview] = []
        err: BaseException | None = None
        if r == root:
            try:
                messages = objects.pack(objects.dumps(obj), separate_min=_SEP)
                word[0] = messages[0].nbytes
            except Exception as exc:
                err, word[0] = exc, _FAILED
        self._within(_BROADCAST, word, c, timeout, root=root)
        self._raise_if_failed(c, word, err, [root])
        if r == root:
            for m in messages:
                self._within(_BROADCAST, np.frombuffer(m, np.uint8), c, timeout, root=root)
            return obj
        first = objects.empty(int(word[0]))
        self._within(_BROADCAST, np.frombuffer(first, np.uint8), c, timeout, root=root)
        layout = objects.Layout.read(first, separate_min=_SEP)
        rest = [objects.empty(n) for n in layout.message_lens[1:]]
        for m in rest:
            self._within(_BROADCAST, np.frombuffer(m, np.uint8), c, timeout, root=root)
        return _unpickled([first, *rest], f"rank {r}: {c}: the object of rank {root}", _SEP)

    def allgather_object(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every rank's ``obj`` on every rank, in rank order (mpi4py's ``allgather``).

        Two collectives: an allgather of each rank's message length (one
        64-bit word), then an allgatherv of the messages, each one pickle
        with its arrays inline (see :mod:`plait.objects`).

        Raises:
            pickle.PicklingError: on every rank, naming the ranks whose object
                could not be pickled.
        """
        return self._allgather_object(obj, timeout, "allgather_object")

    def _allgather_object(self, obj: Any, timeout: float | None, c: str) -> list[Any]:
        """:meth:`allgather_object` as part of call ``c`` (its own, or allreduce_object's):
        its exchange of lengths carries ``c``, so that it matches only the same call on the
        other ranks (Note [calls within calls] in :mod:`plait._request`)."""
        first, err = _first_message(obj)
        sizes = self._within(_ALLGATHER, _word(first), c, timeout)
        counts = self._raise_if_failed(c, sizes, err)
        out = np.frombuffer(objects.empty(sum(counts)), np.uint8)
        mine = _as_bytes(first)
        self._uneven(
            _ALLGATHERV, mine, _BYTE, (), counts, sum(counts), None, 0, mine, out,
            "auto", timeout, False, c,
        )  # fmt: skip
        return _load_all(out, counts, f"rank {self._rank}: {c}")

    def gather_object(
        self, obj: Any, root: int = 0, *, timeout: float | None = None
    ) -> list[Any] | None:
        """Every rank's ``obj`` on root, in rank order; None elsewhere (mpi4py's ``gather``).

        Two collectives: an allgather of the lengths (every rank's schedule
        needs them all), then a gatherv of the messages.
        """
        c = "gather_object"
        root = check_root(root, self._rank, self._size, c)
        first, err = _first_message(obj)
        sizes = self._within(_ALLGATHER, _word(first), c, timeout)
        counts = self._raise_if_failed(c, sizes, err)
        out = None
        if self._rank == root:
            out = np.frombuffer(objects.empty(sum(counts)), np.uint8)
        mine = _as_bytes(first)
        self._uneven(
            _GATHERV, mine, _BYTE, (), counts, len(out) if out is not None else None, None,
            root, mine, out, "auto", timeout, False, c,
        )  # fmt: skip
        return _load_all(out, counts, f"rank {self._rank}: {c}") if out is not None else None

    def scatter_object(
        self, objs: Sequence[Any] | None = None, root: int = 0, *, timeout: float | None = None
    ) -> Any:
        """Root's ``objs[r]`` on rank r (mpi4py's ``scatter``); ``objs`` is read on root only:
        a list, or anything of ``size`` items indexed by position (a numpy array's rows).

        Two collectives: a broadcast of the ``size`` lengths from root, then a
        scatterv of the messages, laid end to end on root.

        Raises:
            ValueError: on root, ``objs`` is not a sequence of ``size`` objects
                (the other ranks raise ValueError too, naming root).
            pickle.PicklingError: on every rank, naming the ranks whose object
                could not be pickled.
        """
        c = "scatter_object"
        r, size = self._rank, self._size
        root = check_root(root, r, size, c)
        table = np.zeros(size, np.uint64)
        frames: list[objects.Frames | None] = []
        err: BaseException | None = None
        usage: ValueError | None = None  # raised here after the others learn of it
        if r == root:
            items = _items(objs, size)
            if items is None:
                usage = ValueError(
                    f"rank {r}: {c}: root must pass a sequence of {size} objects, one per rank; "
                    f"got {_what(objs)}"
                )
                table[:] = _MISUSED
            else:
                frames, err = _pickle_each(items, table)
        self._within(_BROADCAST, table, c, timeout, root=root)
        if usage is not None:
            raise usage
        if table[0] == _MISUSED:
            raise self._misused(c, f"root (rank {root})")
        counts = self._raise_if_failed(c, table, err, "the objects root gave to ranks")
        send = None
        if r == root:
            send = np.frombuffer(objects.empty(sum(counts)), np.uint8)
            _pack_all(frames, send, counts)
        out = np.frombuffer(objects.empty(counts[r]), np.uint8)
        self._uneven(
            _SCATTERV, send, _BYTE, (), counts, counts[r], None, root, send, out,
            "auto", timeout, False, c,
        )  # fmt: skip
        return _unpickled([out], f"rank {r}: {c}: the object root (rank {root}) gave this rank")

    def alltoall_object(self, objs: Sequence[Any], *, timeout: float | None = None) -> list[Any]:
        """``objs[j]`` goes to rank j; returns what every rank sent here, in rank order
        (``objs``: a list, or anything of ``size`` items indexed by position).

        mpi4py's ``alltoall``. Two collectives: an allgather of each rank's
        ``size`` lengths (the whole matrix, which every schedule needs), then
        an alltoallv of the messages.

        Raises:
            ValueError: ``objs`` is not a sequence of ``size`` objects (the
                other ranks raise ValueError too, naming the ranks that did so).
            pickle.PicklingError: on every rank, naming the ranks with an object
                that could not be pickled.
        """
        c = "alltoall_object"
        r, size = self._rank, self._size
        row = np.zeros(size, np.uint64)
        frames: list[objects.Frames | None] = []
        err: BaseException | None = None
        usage: ValueError | None = None  # raised here after the others learn of it
        items = _items(objs, size)
        if items is None:
            usage = ValueError(
                f"rank {r}: {c}: objs must be a sequence of {size} objects, one per rank; "
                f"got {_what(objs)}"
            )
            row[:] = _MISUSED
        else:
            frames, err = _pickle_each(items, row)
        matrix = self._within(_ALLGATHER, row, c, timeout)
        if usage is not None:
            raise usage
        # a rank with any object that failed fails as a whole
        by_rank = np.where((matrix == _FAILED).any(axis=1), np.uint64(_FAILED), np.uint64(0))
        misused = [q for q in range(size) if (matrix[q] == _MISUSED).any()]
        if misused:
            raise self._misused(c, "rank " + ", ".join(map(str, misused)))
        self._raise_if_failed(c, by_rank, err)
        m = [int(k) for k in matrix.reshape(-1)]
        mine = m[r * size : (r + 1) * size]
        col = m[r::size]
        send = np.frombuffer(objects.empty(sum(mine)), np.uint8)
        _pack_all(frames, send, mine)
        out = np.frombuffer(objects.empty(sum(col)), np.uint8)
        self._uneven(
            _ALLTOALLV, send, _BYTE, (), tuple(m), sum(col), None, 0, send, out,
            "auto", timeout, False, c,
        )  # fmt: skip
        return _load_all(out, col, f"rank {self._rank}: {c}")

    def allreduce_object(
        self, obj: _O, op: Callable[[_O, _O], _O], *, timeout: float | None = None
    ) -> _O:
        """``op`` over every rank's ``obj``, in rank order, on every rank (mpi4py's ``allreduce``).

        ``op(op(o0, o1), o2) ...``: any function of two objects, commutative or
        not (string concatenation gives ``o0 + o1 + ...``); every rank gets an
        equal result when ``op`` is deterministic. An allgather_object, then
        the fold on every rank (:func:`plait.objects.reduce_in_rank_order`).

        Raises:
            TypeError: ``op`` is not callable (before any byte moves).
            Whatever ``op`` raises, on every rank, with a note naming the ranks.
        """
        if not callable(op):
            raise TypeError(f"rank {self._rank}: allreduce_object: op must be callable; got {op!r}")
        objs: list[_O] = self._allgather_object(obj, timeout, "allreduce_object")
        return objects.reduce_in_rank_order(objs, op)

    def send_object(
        self, obj: Any, dst: int, tag: int = 0, *, timeout: float | None = None
    ) -> None:
        """Send ``obj`` to rank ``dst``, matched by ``recv_object`` there (mpi4py's ``send``).

        Messages on ``tag``: the first message's length (one word), the first
        message, then each buffer of :data:`plait.objects.SEPARATE_MIN` bytes
        or more straight from the object's memory. Threads sending to one peer
        with one tag take turns, an object at a time (Note [one object at a
        time on a lane]).

        Raises:
            pickle.PicklingError: ``obj`` cannot be pickled (``dst`` raises too).
        """
        c = "send_object"
        check_peer(dst, self._rank, self._size, c, "dst")
        check_user_tag(tag, self._rank, c)
        messages: list[memoryview] = []
        err: BaseException | None = None
        try:
            messages = objects.pack(objects.dumps(obj), separate_min=_SEP)
        except Exception as exc:
            err = exc
        word = np.array([messages[0].nbytes if messages else _FAILED], np.uint64)
        seconds = self._runner.seconds(timeout, c)
        lane = ("send", dst, tag)
        end = time.monotonic() + seconds  # one deadline for the whole object, its turn included
        what = f"rank {self._rank}: {c} to rank {dst} (tag {tag})"
        with (
            self._lanes.hold(lane, seconds, f"rank {self._rank}: {c} to {dst}"),
            _one_call(what, seconds),
        ):
            try:
                self.send(word, dst, tag, timeout=_left(end))
                if err is None:
                    for m in messages:
                        self.send(np.frombuffer(m, np.uint8), dst, tag, timeout=_left(end))
            except BaseException as exc:  # Note [an object cut short]
                self._lanes.spoil(lane, f"an earlier {c} to rank {dst} with tag {tag} failed "
                                  f"partway ({type(exc).__name__}): its receiver may hold part "
                                  "of that object")  # fmt: skip
                with suppress(CommError, OSError):  # the receiver is told, where it can be,
                    self.isend(np.zeros(0, _CUT_DTYPE), dst, tag)  # behind what still goes
                raise
            self._raise_if_failed(c, word, err, [self._rank])

    def recv_object(self, src: int, tag: int = 0, *, timeout: float | None = None) -> Any:
        """The next object ``send_object`` sent from ``src`` with ``tag`` (mpi4py's ``recv``).

        Each message is received once, at its exact size, into memory that the
        object's arrays then use. Threads receiving from one peer with one tag
        take turns, an object at a time.

        Raises:
            pickle.PicklingError: ``src``'s object could not be pickled.
        """
        c = "recv_object"
        check_peer(src, self._rank, self._size, c, "src")
        check_user_tag(tag, self._rank, c)
        seconds = self._runner.seconds(timeout, c)
        lane = ("recv", src, tag)
        end = time.monotonic() + seconds  # one deadline for the whole object, its turn included
        what = f"rank {self._rank}: {c} from rank {src} (tag {tag})"
        with (
            self._lanes.hold(lane, seconds, f"rank {self._rank}: {c} from {src}"),
            _one_call(what, seconds),
        ):
            try:
                word = self.recv(np.zeros(1, np.uint64), src, tag, timeout=_left(end))
            except MismatchError as exc:  # not a length: the rest of a cut object
                if _told_cut(exc):
                    self._lanes.spoil(lane, f"rank {src}'s {_TOLD_CUT}")
                    raise CommError(f"{what}: rank {src}'s {_TOLD_CUT}") from exc
                exc.add_note(_CUT.format(src=src))
                raise
            self._raise_if_failed(c, word, None, [src])
            try:
                first = objects.empty(int(word[0]))
                self.recv(np.frombuffer(first, np.uint8), src, tag, timeout=_left(end))
                layout = objects.Layout.read(first, separate_min=_SEP)
                rest = [objects.empty(n) for n in layout.message_lens[1:]]
                for m in rest:
                    self.recv(np.frombuffer(m, np.uint8), src, tag, timeout=_left(end))
            except BaseException as exc:  # Note [an object cut short]
                told = isinstance(exc, MismatchError) and _told_cut(exc)
                if isinstance(exc, MismatchError) and not told:
                    exc.add_note(_CUT.format(src=src))
                self._lanes.spoil(lane, f"an earlier {c} from rank {src} with tag {tag} "
                                  f"failed partway ({type(exc).__name__}): it took part of an "
                                  "object")  # fmt: skip
                if told:
                    raise CommError(
                        f"{what}: rank {src}'s {_TOLD_CUT}; this object was not received"
                    ) from exc
                raise
        where = f"rank {self._rank}: {c}: the object of rank {src}"
        return _unpickled([first, *rest], where, _SEP)

    def _misused(self, c: str, who: str) -> ValueError:
        """The error of the ranks whose peer ``who`` passed objs not one per rank."""
        return ValueError(
            f"rank {self._rank}: {c}: {who} did not pass a sequence of {self._size} objects, "
            "one per rank (its own error says what it passed); nothing was delivered"
        )

    def _raise_if_failed(
        self,
        c: str,
        sizes: np.ndarray,
        err: BaseException | None,
        ranks: Sequence[int] | str = "ranks",
    ) -> tuple[int, ...]:
        """The lengths in ``sizes``, or PicklingError if any is PICKLE_FAILED.

        ``sizes[q]`` is rank q's length (``ranks`` names whose each entry is:
        a list of ranks, or a phrase); ``err`` is this rank's own pickling
        error, chained. Every rank sees the same ``sizes``, so all raise
        alike, and all after the same collectives: the communicator stays usable.
        """
        words = [int(k) for k in sizes.reshape(-1)]
        failed = [q for q, k in enumerate(words) if k == _FAILED]
        if not failed:
            return tuple(words)
        if isinstance(ranks, str):
            who = f"{ranks} {failed}"
        else:
            who = "rank " + ", ".join(str(ranks[q]) for q in failed)
        mine = f" (here: {type(err).__name__}: {err})" if err is not None else ""
        raise pickle.PicklingError(
            f"rank {self._rank}: {c}: the object of {who} could not be pickled{mine}; "
            "nothing was delivered"
        ) from err


#: The note on a receive whose message does not fit the object it reads.
#: The dtype of the empty message that tells a receiver its sender cut an object short (Note
#: [an object cut short]).
_CUT_DTYPE = np.dtype(np.int8)
_TOLD_CUT = (
    "send_object on this tag failed partway (it said so) and sends no more objects on it; "
    "use another tag for the objects that follow"
)


def _told_cut(exc: MismatchError) -> bool:
    """Whether ``exc`` met the notice of a sender that cut its object short."""
    return exc.sent == (check_word(_CUT_DTYPE), 0)


_CUT = (
    "rank {src}'s earlier send_object on this tag may have failed partway (a timeout): the "
    "objects on this peer and tag are undefined from here"
)


@contextmanager
def _one_call(what: str, seconds: float) -> Iterator[None]:
    """A timeout of one of an object's messages, said as the object's call (``what``) and its
    whole ``seconds``: the messages share one deadline, and a message's own timeout named a
    plain send or recv and what was left of the deadline."""
    try:
        yield
    except CommTimeout as exc:
        _, found, rest = str(exc).partition(" did not complete within ")
        if not found:  # the lane's turn: it names the object's call already
            raise
        error = type(exc)(f"{what} did not complete within {seconds:g} s{rest.partition(' s')[2]}")
        for note in getattr(exc, "__notes__", ()):
            error.add_note(note)
        raise error from None


def _left(end: float) -> float:
    """Seconds left until ``end`` for one message of an object (at least a microsecond: a
    timeout must be positive)."""
    return max(end - time.monotonic(), 1e-6)


def _items(objs: Any, size: int) -> list[Any] | None:
    """The ``size`` objects of ``objs`` in order, or None where it is not ``size`` objects.

    As mpi4py's ``scatter`` and ``alltoall``, anything with a length that indexes by
    position serves: a list or tuple, and a numpy array or torch tensor too (its rows).
    """
    if isinstance(objs, Sequence):
        return list(objs) if len(objs) == size else None
    try:
        if len(objs) != size:
            return None
        return [objs[i] for i in range(size)]
    except (TypeError, KeyError, IndexError):  # no length, or not indexed by position
        return None


def _what(objs: Any) -> str:
    """How a message names a wrong ``objs``: its type, and its length where it has one."""
    try:
        return f"a {type(objs).__name__} of {len(objs)}"
    except TypeError:
        return type(objs).__name__


def _first_message(obj: Any) -> tuple[memoryview | None, BaseException | None]:
    """``obj`` packed as one message (arrays inline), or None and the error pickling raised."""
    try:
        return objects.pack(objects.dumps(obj))[0], None
    except Exception as exc:
        return None, exc


def _word(first: memoryview | None) -> np.ndarray:
    """The length word a rank sends first: the message's length, or PICKLE_FAILED."""
    return np.array(first.nbytes if first is not None else _FAILED, np.uint64)


def _as_bytes(first: memoryview | None) -> np.ndarray:
    """The message as the bytes a rank contributes: none where its object failed to pickle."""
    return np.frombuffer(first, np.uint8) if first is not None else np.empty(0, np.uint8)


def _pickle_each(
    objs: Sequence[Any], lengths: np.ndarray
) -> tuple[list[objects.Frames | None], BaseException | None]:
    """Pickle every object; ``lengths[j]``: the first message's length or PICKLE_FAILED."""
    frames: list[objects.Frames | None] = []
    err: BaseException | None = None
    for j, o in enumerate(objs):
        try:
            f = objects.dumps(o)
        except Exception as exc:
            err, lengths[j] = exc, _FAILED
            frames.append(None)
            continue
        frames.append(f)
        lengths[j] = objects.Layout.of(len(f.header), f.buffer_lens).first_nbytes
    return frames, err


def _pack_all(
    frames: Sequence[objects.Frames | None], out: np.ndarray, counts: Sequence[int]
) -> None:
    """Each object's first message into ``out``, end to end, at ``counts``' displacements."""
    for f, d, n in zip(frames, displacements(counts), counts, strict=True):
        assert f is not None
        objects.pack_into(f, out[d : d + n].data)


def _load_all(buf: np.ndarray, counts: Sequence[int], where: str) -> list[Any]:
    """The objects whose messages lie end to end in ``buf``, ``counts`` bytes each (rank q's
    q-th; ``where``: the rank and call, for :func:`_unpickled`)."""
    return [
        _unpickled([buf[d : d + n]], f"{where}: the object of rank {q}")
        for q, (d, n) in enumerate(zip(displacements(counts), counts, strict=True))
    ]


def _unpickled(messages: Sequence[Any], what: str, separate_min: int | None = None) -> Any:
    """The object ``messages`` hold; where unpickling it raises (the object's own
    ``__setstate__``, say), the error is the object's, with a note of ``what`` it was: it
    named no call and no rank."""
    try:
        return objects.loads(*objects.unpack(messages, separate_min=separate_min))
    except Exception as exc:
        exc.add_note(f"{what} could not be unpickled here")
        raise
