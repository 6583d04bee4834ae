"""Sub-communicators: a group of ranks sharing the parent's transport, and the tag layout.

Note [wire tags]
    Every message carries a tag below 2**63 (transports may store it signed).
    Communicators that share a transport
    (a parent and the groups split from it) are kept apart by a communicator
    id in the tag, calls by their sequence number, and the messages of one
    call by the per-pair index the schedule builder assigns::

        bit 62      61 ........ 44   43 ........ 24   23 ........ 0
        p2p = 0     comm id (18)     call seq (20)    message index (24)
        p2p = 1     comm id (18)     user tag (31, bits 0..30)
        p2p = 1     comm id (18)     bit 32 set: the set-up of that group's window
        p2p = 1     0                bit 33 set: whereabouts of stalled calls

    Sequence numbers wrap after 2**20 calls, which is safe because the calls
    of one communicator complete in order on each rank long before that.
    A point-to-point receive with ``ANY_TAG`` is a pattern (Note [patterns] in
    :mod:`plait.transport.patterns`) that fixes every bit but the user tag's
    (:func:`p2p_pattern`), so it matches its communicator's user messages and
    never a collective's, nor another communicator's.

    A new group's ranks set up its window (:meth:`plait.transport.window.Window.split`)
    with messages in the point-to-point space of the group's own communicator id
    with bit 32 set (:func:`setup_tag`), which no user tag, stall probe or pattern
    of any communicator has: ``ANY_TAG`` fixes bits 31 and up. The id is new for
    every split (one that none of its ranks has used on the transport or takes in
    another split under way, Note [communicator ids]), so two groups of the same
    ranks set up at once (by two threads, or by two splits in a row) never take
    each other's messages, and
    the messages a failed set-up leaves behind (one small message per peer that
    gave up) stay unread instead of being taken by the next one.

    A stalled call tells the ranks it waits on where it waits on one tag that
    every communicator sharing the transport shares (:func:`whereabouts_tag`,
    Note [crossed calls] in :mod:`plait.runtime.crossing`), so that calls of
    different communicators that wait on each other are found out.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
import zlib
from collections.abc import Callable, Sequence

from plait.diagnostics.places import COMM_ID_BITS, shrunk_comm_id
from plait.errors import ClosedError, UnsupportedError
from plait.runtime.crossing import Numbered, register
from plait.transport.base import Handle, Matching, Transport
from plait.transport.window import Window

__all__ = [
    "COMM_ID_BITS",
    "GroupTransport",
    "Reservation",
    "child_comm_id",
    "claim_comm_id",
    "collective_tag",
    "crossings",
    "free_candidate",
    "own_comm_id",
    "p2p_pattern",
    "p2p_tag",
    "probe_tag",
    "reserve_ids",
    "setup_tag",
    "shrunk_comm_id",
    "user_tag",
    "whereabouts_tag",
]

SEQ_BITS = 20
INDEX_BITS = 24
_P2P = 1 << 62
_COMM_SHIFT = SEQ_BITS + INDEX_BITS
_SEQ_MASK = (1 << SEQ_BITS) - 1
_COMM_MASK = (1 << COMM_ID_BITS) - 1
_USER_TAG_MASK = (1 << 31) - 1
_SETUP = 1 << 32
_WHEREABOUTS = 1 << 33
#: Seconds a new group's ranks may take to set up its window.
SETUP_TIMEOUT = 300.0


#: A rank named in a transport's message (:meth:`GroupTransport.renumber`).
_RANK = re.compile(r"\brank (\d+)\b")


def collective_tag(comm_id: int, seq: int) -> int:
    """The tag of message index 0 of call ``seq``; add the message index to it."""
    return (comm_id << _COMM_SHIFT) | ((seq & _SEQ_MASK) << INDEX_BITS)


def p2p_tag(comm_id: int, tag: int) -> int:
    """The wire tag of a user's point-to-point ``tag`` (0 <= tag < 2**31)."""
    return _P2P | (comm_id << _COMM_SHIFT) | tag


def probe_tag(comm_id: int) -> int:
    """The wire tag of ``comm_id``'s stall probes (Note [stall probes] in plait.runtime.stall).

    In the point-to-point space with bit 31 set: above every user tag, so no user
    receive (``ANY_TAG`` included) ever takes a probe.
    """
    return _P2P | (comm_id << _COMM_SHIFT) | (1 << 31)


def p2p_pattern(comm_id: int, tag: int | None) -> tuple[int, int]:
    """``(tag, mask)`` of a pattern receiving user ``tag`` (None: any) of ``comm_id``."""
    if tag is None:
        return p2p_tag(comm_id, 0), ~_USER_TAG_MASK
    return p2p_tag(comm_id, tag), -1


def user_tag(wire_tag: int) -> int:
    """The user's tag in the wire tag of a point-to-point message."""
    return wire_tag & _USER_TAG_MASK


def setup_tag(comm_id: int) -> int:
    """The tag of the messages that set up the window of group ``comm_id`` (Note [wire tags])."""
    return _P2P | (comm_id << _COMM_SHIFT) | _SETUP


def whereabouts_tag() -> int:
    """The tag of stalled calls' whereabouts notices, one for every communicator of a
    transport (Note [crossed calls] in :mod:`plait.runtime.crossing`)."""
    return _P2P | _WHEREABOUTS


def crossings(owner: Numbered, transport: Transport, comm_id: int) -> None:
    """Register the call runner ``owner`` of communicator ``comm_id`` over ``transport`` (a
    group's view, or the transport its groups share) for Note [crossed calls]."""
    ranks = tuple(range(transport.size))
    root = transport
    while isinstance(root, GroupTransport):
        ranks = tuple(root.ranks[r] for r in ranks)
        root = root.parent
    register(owner, transport, probe_tag(comm_id), comm_id, root, ranks, whereabouts_tag())


# Note [communicator ids]
#     Communicators that share a transport are kept apart on the wire by their id alone
#     (Note [wire tags]), so two of them with one id and two ranks in common take each
#     other's messages: a send on one matches a receive on the other, silently. An id
#     hashed from the split (its parent, call number and color) into 18 bits repeats
#     within a few hundred splits (the 137th and 338th calls of a world, color 0), so the
#     ranks of a new group choose among ID_TRIES hashed candidates the first that none
#     of them holds: each rank marks, in the word it sends in the split's allgather,
#     which of its color's candidates it holds, and every member of the group ORs its
#     members' words and takes the same first free candidate. The choice comes out of
#     the exchange alone, so the ranks agree on it whatever else each of them is doing.
#
#     A rank holds an id it has made a communicator with on the transport (claimed, for
#     good: a closed one's unread messages stay queued), and every candidate of a split of
#     its own that is under way (reserved). reserve_ids, under one lock per process, marks
#     the candidates claimed or reserved and reserves the rest, before the word is sent;
#     Reservation.take claims the id the group chose and releases the others at once (a
#     split that fails before it chose releases them all). It claims it before the group's
#     window is set up, so a set-up that fails keeps its id, with the messages it left
#     behind (Note [wire tags]). So two communicators that a rank belongs to never get one
#     id, even where threads split at once (the README gives each thread a communicator of
#     its own) and the ranks start those splits in different orders: on a rank of both, one
#     split reserved its candidates first, and the other's word marks each of them (or the
#     id the first has claimed since), while the first can only take one free on that rank,
#     which it reserved there. Two communicators without a rank in common may share an id;
#     no message passes between them. A split's candidates are reserved only while it runs,
#     so they cost others a candidate rarely (ID_TRIES of 2**18 ids), and an ordinary call
#     nothing.

#: Candidate ids a split tries (the bits of the word each rank sends; below 63).
ID_TRIES = 62
#: The ids made on each transport (by its root), as seen by this rank.
_CLAIMED: weakref.WeakKeyDictionary[object, set[int]] = weakref.WeakKeyDictionary()
#: The candidates of this rank's splits under way on each transport (by its root).
_RESERVED: weakref.WeakKeyDictionary[object, set[int]] = weakref.WeakKeyDictionary()
#: Guards _CLAIMED and _RESERVED: threads of a rank split their communicators at once.
_IDS = threading.Lock()


def child_comm_id(parent_id: int, seq: int, color: int, attempt: int = 0) -> int:
    """Candidate ``attempt`` for the id of the group of ``color`` split from ``parent_id``
    by its call ``seq`` (never 0; Note [communicator ids])."""
    tail = f"/{attempt}" if attempt else ""
    digest = zlib.crc32(f"{parent_id}/{seq}/{color}{tail}".encode())
    return digest % ((1 << COMM_ID_BITS) - 1) + 1


def _root(transport: object) -> object:
    """The transport at the bottom of ``transport``'s chain of group views."""
    while isinstance(transport, GroupTransport):
        transport = transport.parent
    return transport


def claim_comm_id(transport: object, comm_id: int) -> None:
    """Record that this rank has made communicator ``comm_id`` over ``transport``."""
    with _IDS:
        _CLAIMED.setdefault(_root(transport), set()).add(comm_id)


class Reservation:
    """The candidate ids one split of this rank holds while it runs (:func:`reserve_ids`).

    ``word`` is what the rank sends: bit ``i`` set where candidate ``i`` is held already
    (claimed, or reserved by another split under way). Use it as a context manager: on
    exit every candidate still reserved is released, so a split that fails holds none.
    """

    def __init__(self, root: object, ids: list[int], word: int, held: set[int]) -> None:
        self.ids = ids
        self.word = word
        self._root = root
        self._held = held

    def take(self, attempt: int) -> int:
        """Claim candidate ``attempt`` (the group's choice, :func:`free_candidate`), release
        the others, and return it."""
        comm_id = self.ids[attempt]
        with _IDS:
            _CLAIMED.setdefault(self._root, set()).add(comm_id)
            self._release()
        return comm_id

    def _release(self) -> None:
        _RESERVED.get(self._root, set()).difference_update(self._held)
        self._held = set()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        with _IDS:
            self._release()


def reserve_ids(transport: object, parent_id: int, seq: int, color: int | None) -> Reservation:
    """Reserve for this rank's split of ``color`` (None: it joins no group, and reserves
    nothing) from ``parent_id`` at call ``seq`` over ``transport`` every candidate id
    (:func:`child_comm_id`) it does not hold already (Note [communicator ids])."""
    root = _root(transport)
    if color is None:
        return Reservation(root, [], 0, set())
    ids = [child_comm_id(parent_id, seq, color, i) for i in range(ID_TRIES)]
    with _IDS:
        claimed = _CLAIMED.setdefault(root, set())
        reserved = _RESERVED.setdefault(root, set())
        held = {c for c in ids if c not in claimed and c not in reserved}
        reserved |= held
    word = sum(1 << i for i, c in enumerate(ids) if c not in held)
    return Reservation(root, ids, word, held)


def free_candidate(words: Sequence[int]) -> int | None:
    """The first candidate that none of a group's words (:attr:`Reservation.word`) marks
    held, or None where all are."""
    taken = 0
    for w in words:
        taken |= w
    return next((i for i in range(ID_TRIES) if not taken >> i & 1), None)


def own_comm_id(run: str) -> int:
    """Id of a communicator that ``plait.init`` makes for ranks that are not the job's world
    (a torch sub-group, say), from the ``run`` token its ranks agree on (never 0): its
    flight recorder's dumps are not the world's ``rank<r>.json`` of the same number."""
    return zlib.crc32(f"init/{run}".encode()) % ((1 << COMM_ID_BITS) - 1) + 1


class GroupTransport:
    """A view of ``parent`` in which rank ``i`` is the parent's rank ``ranks[i]``.

    It adds nothing on the wire (the communicator id in the tag keeps groups
    apart) and never closes the parent: closing a group leaves the parent usable.
    Its byte counters are the parent's: they count every group's traffic.

    Where the parent has a window (its ranks share memory on one host), the
    group gets one of its own, ``window``: new memory, counters and digests,
    so that the group's one-sided calls and the parent's, which interleave and
    number their epochs apart, never share a half or a counter. Making it is a
    collective of the group's ranks (every one of them constructs its view at
    the same point of its program, as ``Communicator.split`` does), through the
    parent's messages (:func:`setup_tag`) within ``timeout`` seconds; see
    :meth:`plait.transport.window.Window.split`. Otherwise ``window`` is None.
    ``comm_id`` is the id of the group's communicator (:func:`child_comm_id`).

    Raises:
        RendezvousError, PeerLostError, TransportError: the window could not be
            set up (a rank absent or lost, the OS refused memory or a socket).
    """

    def __init__(
        self,
        parent: Transport,
        ranks: Sequence[int],
        rank: int,
        *,
        comm_id: int,
        timeout: float = SETUP_TIMEOUT,
    ) -> None:
        self.parent = parent
        self.comm_id = comm_id
        self.ranks = tuple(ranks)
        self.rank = rank
        self.size = len(self.ranks)
        self._index = {p: i for i, p in enumerate(self.ranks)}  # parent rank -> rank here
        shared: Window | None = getattr(parent, "window", None)
        self.window = (
            None
            if shared is None
            else shared.split(self, self.ranks, setup_tag(comm_id), time.monotonic() + timeout)
        )

    def isend(self, peer: int, tag: int, data: memoryview, check: int) -> Handle:
        return self.parent.isend(self.ranks[peer], tag, data, check)

    def irecv(self, peer: int, tag: int, into: memoryview, check: int) -> Handle:
        return self.parent.irecv(self.ranks[peer], tag, into, check)

    def wait_any(self, handles: Sequence[Handle], timeout: float | None) -> bool:
        return self.parent.wait_any(handles, timeout)

    def foreign(self, lo: int, hi: int, check: int) -> int | None:
        """:meth:`plait.transport.endpoint.Endpoint.foreign`, as the group numbers ranks."""
        found = getattr(self.parent, "foreign", None)
        peer = None if found is None else found(lo, hi, check)
        return None if peer is None else self._index.get(peer)

    def cancel(self, handle: Handle) -> None:
        self.parent.cancel(handle)

    # Matching patterns (plait.transport.base.Matching), where the parent matches them:
    # the group's peers are translated, and "any rank" means any rank of the group.
    def irecv_match(
        self, peers: Sequence[int] | None, tag: int, mask: int, into: memoryview, check: int
    ) -> Handle:
        mine = self.ranks if peers is None else [self.ranks[p] for p in peers]
        return self._matching().irecv_match(mine, tag, mask, into, check)

    def probe(self, peers: Sequence[int] | None, tag: int, mask: int) -> Handle:
        mine = self.ranks if peers is None else [self.ranks[p] for p in peers]
        return self._matching().probe(mine, tag, mask)

    def withdraw(self, handle: Handle) -> bool:
        return self._matching().withdraw(handle)

    def envelope(self, handle: Handle) -> tuple[int, int, int, int]:
        peer, tag, nbytes, check = self._matching().envelope(handle)
        return self._index.get(peer, -1), tag, nbytes, check

    def name(self, rank: int) -> int:
        """The job's number of this group's ``rank``: how its transport's messages name it."""
        q = self.ranks[rank]
        parent_name = getattr(self.parent, "name", None)
        return q if parent_name is None else int(parent_name(q))

    def renumber(self, err: BaseException) -> BaseException:
        """``err``, from the parent's handles, with the job's rank numbers in its message
        given as this group numbers them (:func:`plait.transport.base.renumbered`): "rank
        3 was lost" becomes "rank 1 (job rank 3) was lost" where job rank 3 is rank 1 here.
        """
        here = {self.name(i): i for i in range(self.size)}

        def ours(m: re.Match[str]) -> str:
            job = int(m.group(1))
            mine = here.get(job)
            return m.group(0) if mine is None or mine == job else f"rank {mine} (job rank {job})"

        text = str(err)
        new = _RANK.sub(ours, text)
        if new == text:
            return err
        try:
            out = type(err)(new)
        except Exception:
            return err
        out.__cause__ = err.__cause__
        return out

    def _matching(self) -> Matching:
        parent = self.parent
        if not isinstance(parent, Matching):
            raise UnsupportedError(
                f"{type(parent).__name__} does not match patterns (any source, any tag, probe)"
            )
        return parent

    @property
    def bytes_sent(self) -> int:
        """The parent's counter (shared by the parent and all its groups)."""
        return self.parent.bytes_sent  # type: ignore[attr-defined,no-any-return]

    @property
    def bytes_received(self) -> int:
        """The parent's counter (shared by the parent and all its groups)."""
        return self.parent.bytes_received  # type: ignore[attr-defined,no-any-return]

    def fail_posted(self, owns: Callable[[int], bool], err: BaseException) -> None:
        """The parent's :meth:`~plait.transport.endpoint.Endpoint.fail_posted`, where it has one."""
        fail = getattr(self.parent, "fail_posted", None)
        if fail is not None:
            fail(owns, err)

    def close(self) -> None:
        """Release the group's window, if any, and fail the group's receives and probes still
        waiting with ClosedError, as a transport's close does (the parent owns the
        connections and stays open). Idempotent."""
        if self.window is not None:
            self.window.release()
        ours = self.comm_id

        def owns(tag: int) -> bool:
            return (tag >> _COMM_SHIFT) & _COMM_MASK == ours

        self.fail_posted(owns, ClosedError(f"rank {self.rank}: the communicator is closed"))
