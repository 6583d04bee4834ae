"""The schedule IR: the per-rank list of steps that every algorithm produces.

A schedule names memory only through :class:`Region` (a buffer, an element offset
and an element count), never through raw pointers, so the same schedule can be
run by the executor on a real transport, proven correct on provenance sets by
:mod:`plait.schedule.symbolic`, checked statically by :mod:`plait.schedule.verify`
and later timed by the simulator.

Buffers
-------
``IN``   the caller's input. Steps may read it, never write it.
``OUT``  the caller's output (for in-place calls the same memory as ``IN``).
``TMP``  scratch owned by the executor, sized by ``Schedule.tmp_count``.
``SHARED`` this rank's window: memory its peers on the host can read, sized by
         ``Schedule.shared_count`` (see "One-sided steps" below).

Steps
-----
``SEND``         send ``src`` to ``peer``.
``RECV``         receive from ``peer`` into ``dst``.
``RECV_REDUCE``  receive from ``peer`` and combine into ``dst``:
                 ``dst = recv ∘ dst`` if ``first`` else ``dst ∘ recv``.
``COPY``         ``dst = src``.
``REDUCE``       ``dst = src ∘ dst`` if ``first`` else ``dst ∘ src``.

One-sided steps (ranks of one host sharing an arena, :mod:`plait.transport.shm.window`):
``POST``         publish phase ``tag``: every earlier write of this rank to ``SHARED``
                 becomes visible to peers that wait for this phase or a later one.
                 Phases are numbered from 1 and increase along a schedule.
``GET``          ``dst = peer's SHARED[src]``, once ``peer`` has posted phase ``tag``.
``GET_REDUCE``   the same, combining: ``dst = peer ∘ dst`` if ``first`` else
                 ``dst ∘ peer``.
``WAIT``         wait until ``peer`` has posted phase ``tag`` (it has finished reading
                 what this rank published before, so the region may be reused).

A schedule with one-sided steps and no messages is *one-sided*: it runs in step
order (the builder makes every step depend on the one before), so a phase a rank
posts covers everything it did before. A schedule with both is *mixed* (the
intra-host stages of a host-aware algorithm, Note [mixed schedules]). A rank may
overwrite a region of its ``SHARED`` only once every peer that reads it has
finished reading (it knows through a ``GET`` or ``WAIT`` on a phase the reader
posts afterwards); :func:`plait.schedule.verify.run_joint` checks this for every
interleaving. Between calls the executor alternates two halves of the window
(Note [window reuse] in :mod:`plait.transport.shm.window`).

Note [mixed schedules]
~~~~~~~~~~~~~~~~~~~~~~
Ranks on several hosts can share a window per host: a schedule then exchanges
messages with other hosts and reads the windows of its own host's ranks. Its
steps that use the window (the one-sided kinds, and any step with a ``SHARED``
region) form a chain: the builder makes each depend on the one before it, so
the window part of the call runs in step order, as a one-sided schedule does.
Messages run beside that chain, ordered with its steps only by the data they
share (the builder's hazards: a copy into the window of a region a message
writes follows that message). So a piece's messages across hosts can overlap
the window stages of the next piece. A phase says what the rank did on the
window before it; a message orders nothing on the window (the race check does
not count it). A one-sided step names its peer by rank, as a message does; the
peer must be on the same host (its window is the host's: ``verify.check_hosts``,
which the prover runs on every host layout). Messages never name ``SHARED``: a
copy moves data between the window and a buffer. The call takes the host
window's next epoch, as a one-sided call does. A rank of such a call that sends
no message (one that only contributes to its host's leaders) has a one-sided
schedule; across hosts the executor runs it on its host's window too.

Messages between an ordered pair of ranks match in order: the k-th send from
a to b (``tag == k``) meets the k-th receive at b from a. ``deps`` lists the
indices of earlier steps of the same rank that must finish first; the builder
derives them from data hazards, so independent steps overlap (pipelining falls
out of the data flow).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = [
    "IN",
    "ONE_SIDED",
    "OUT",
    "SHARED",
    "TMP",
    "Buf",
    "Region",
    "Schedule",
    "Step",
    "StepKind",
    "uses_window",
]


class Buf(enum.IntEnum):
    """The three buffers a schedule can name."""

    IN = 0
    OUT = 1
    TMP = 2
    SHARED = 3


IN = Buf.IN
OUT = Buf.OUT
TMP = Buf.TMP
SHARED = Buf.SHARED


class StepKind(enum.IntEnum):
    """What a step does."""

    SEND = 0
    RECV = 1
    RECV_REDUCE = 2
    COPY = 3
    REDUCE = 4
    POST = 5
    GET = 6
    GET_REDUCE = 7
    WAIT = 8


#: The one-sided step kinds (they name a peer but exchange no message).
ONE_SIDED = frozenset((StepKind.POST, StepKind.GET, StepKind.GET_REDUCE, StepKind.WAIT))


@dataclass(frozen=True, slots=True, init=False)
class Region:
    """``count`` elements of ``buf`` starting at element ``offset``.

    Note [frozen fields set directly]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    :class:`Region` and :class:`Step` are frozen dataclasses whose ``__init__``
    is written out: it stores each field through its slot's descriptor, which
    is what the generated one does through ``object.__setattr__`` by name, at
    two thirds of the cost. A thousand-rank schedule makes millions of them.
    The classes are otherwise the generated ones (equality, hash, repr,
    frozen), and immutable, so one region may serve many steps and ranks.
    """

    buf: Buf
    offset: int
    count: int

    def __init__(self, buf: Buf, offset: int, count: int) -> None:
        _set_buf(self, buf)
        _set_offset(self, offset)
        _set_count(self, count)

    @property
    def end(self) -> int:
        """One past the last element."""
        return self.offset + self.count

    def sub(self, offset: int, count: int) -> Region:
        """The region ``count`` elements long at ``offset`` relative to this one."""
        if offset < 0 or count < 0 or offset + count > self.count:
            raise IndexError(f"sub-region [{offset}, {offset + count}) outside {self}")
        region = _new(Region)  # Region(...) without the call through the type
        _set_buf(region, self.buf)
        _set_offset(region, self.offset + offset)
        _set_count(region, count)
        return region

    def __repr__(self) -> str:
        return f"{self.buf.name}[{self.offset}:{self.offset + self.count}]"


@dataclass(frozen=True, slots=True, init=False)
class Step:
    """One step of one rank's schedule (see the module docstring)."""

    kind: StepKind
    peer: int = -1
    src: Region | None = None
    dst: Region | None = None
    first: bool = False
    tag: int = -1
    deps: tuple[int, ...] = ()

    def __init__(
        self,
        kind: StepKind,
        peer: int = -1,
        src: Region | None = None,
        dst: Region | None = None,
        first: bool = False,
        tag: int = -1,
        deps: tuple[int, ...] = (),
    ) -> None:  # Note [frozen fields set directly]
        _set_kind(self, kind)
        _set_peer(self, peer)
        _set_src(self, src)
        _set_dst(self, dst)
        _set_first(self, first)
        _set_tag(self, tag)
        _set_deps(self, deps)

    @property
    def count(self) -> int:
        """Number of elements the step moves or combines (0 for ``POST`` and ``WAIT``)."""
        region = self.src if self.src is not None else self.dst
        return 0 if region is None else region.count

    def __repr__(self) -> str:
        k = self.kind
        if k is StepKind.SEND:
            body = f"send {self.src} -> r{self.peer} #{self.tag}"
        elif k is StepKind.RECV:
            body = f"recv {self.dst} <- r{self.peer} #{self.tag}"
        elif k is StepKind.RECV_REDUCE:
            order = "recv∘dst" if self.first else "dst∘recv"
            body = f"recv_reduce {self.dst} <- r{self.peer} #{self.tag} ({order})"
        elif k is StepKind.COPY:
            body = f"copy {self.src} -> {self.dst}"
        elif k is StepKind.POST:
            body = f"post phase {self.tag}"
        elif k is StepKind.WAIT:
            body = f"wait r{self.peer} phase {self.tag}"
        elif k is StepKind.GET:
            body = f"get r{self.peer}.{self.src} -> {self.dst} @{self.tag}"
        elif k is StepKind.GET_REDUCE:
            order = "get∘dst" if self.first else "dst∘get"
            body = f"get_reduce r{self.peer}.{self.src} -> {self.dst} @{self.tag} ({order})"
        else:
            order = "src∘dst" if self.first else "dst∘src"
            body = f"reduce {self.src} -> {self.dst} ({order})"
        return f"<{body} deps={list(self.deps)}>"


_new = object.__new__
_set_buf, _set_offset, _set_count = (
    vars(Region)[name].__set__ for name in ("buf", "offset", "count")
)
_set_kind, _set_peer, _set_src, _set_dst, _set_first, _set_tag, _set_deps = (
    vars(Step)[name].__set__ for name in ("kind", "peer", "src", "dst", "first", "tag", "deps")
)


@dataclass(frozen=True, slots=True)
class Schedule:
    """All steps of one rank for one call, with the buffer sizes they assume."""

    rank: int
    size: int
    steps: tuple[Step, ...]
    in_count: int
    out_count: int
    tmp_count: int
    # dependents[i]: steps that list i in their deps; derived once for executors.
    dependents: tuple[tuple[int, ...], ...] = field(repr=False, default=())
    n_deps: tuple[int, ...] = field(repr=False, default=())
    # Total elements of RECV_REDUCE steps: the staging memory an executor needs.
    staged_count: int = 0
    # Steps without dependencies (ready at the start), derived once for executors.
    roots: tuple[int, ...] = field(repr=False, default=())
    # Elements of this rank's window (SHARED) the schedule uses; one-sided schedules only.
    shared_count: int = 0
    # Whether the schedule has one-sided steps (and so runs in step order, without messages).
    one_sided: bool = False
    # Whether it has one-sided steps and messages both (Note [mixed schedules]).
    mixed: bool = False
    # The last phase this rank posts (0: none).
    last_phase: int = 0

    def buffer_count(self, buf: Buf) -> int:
        """Number of elements ``buf`` must hold."""
        return (self.in_count, self.out_count, self.tmp_count, self.shared_count)[buf]

    @property
    def peers(self) -> frozenset[int]:
        """Ranks this rank exchanges messages with."""
        return frozenset(s.peer for s in self.steps if s.peer >= 0)


def uses_window(step: Step) -> bool:
    """Whether ``step`` is one-sided or names a region of the window (``SHARED``)."""
    return step.kind >= StepKind.POST or any(
        r is not None and r.buf is SHARED for r in (step.src, step.dst)
    )
