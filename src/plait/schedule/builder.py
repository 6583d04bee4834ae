"""The recording builder that algorithms call imperatively, and the build context.

An algorithm reads like MPI code (``b.send(peer, region)``, ``b.recv_reduce(...)``)
but only records steps. The builder:

* numbers messages per ordered pair of ranks, so matching needs no global view;
* derives each step's dependencies from data hazards on the regions it touches
  (read-after-write, write-after-read, write-after-write), so steps that touch
  disjoint data may overlap and segmented pipelines need no extra bookkeeping;
* drops empty steps (zero elements, or a copy onto itself), which both ends of
  a message agree on because they compute the same counts;
* hands out scratch regions (``b.scratch(n)``) and sizes ``TMP`` accordingly;
* likewise hands out window regions (``b.shared(n)``) for one-sided steps
  (``b.post``, ``b.get``, ``b.get_reduce``, ``b.wait``), sizes ``SHARED`` and
  chains the steps of a one-sided schedule in order (see :mod:`plait.schedule.ir`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from plait.collectives import get as _collective
from plait.schedule.cuts import MOST_SEGMENTS, blocks, segments
from plait.schedule.hazards import Hazards
from plait.schedule.ir import (
    IN,
    OUT,
    SHARED,
    TMP,
    Buf,
    Region,
    Schedule,
    Step,
    StepKind,
)

__all__ = ["Builder", "Context", "Fabric", "HostLayout"]


class HostLayout:
    """Which host each rank runs on, as host indices numbered by first appearance.

    Hashable with a precomputed hash, so contexts that carry it stay cheap
    cache keys however many ranks there are.

    >>> HostLayout.from_names(["a", "b", "a"]).members(0)
    (0, 2)
    """

    __slots__ = ("_hash", "_members", "hosts")

    def __init__(self, hosts: Sequence[int]) -> None:
        self.hosts = tuple(hosts)
        self._hash = hash(self.hosts)
        members: dict[int, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            members.setdefault(host, []).append(rank)
        self._members = tuple(tuple(m) for _, m in sorted(members.items()))

    @classmethod
    def from_names(cls, names: Sequence[str]) -> HostLayout:
        """The layout of ranks whose host names are ``names``."""
        index: dict[str, int] = {}
        return cls([index.setdefault(n, len(index)) for n in names])

    @property
    def n_hosts(self) -> int:
        """Number of hosts."""
        return len(self._members)

    def members(self, host: int) -> tuple[int, ...]:
        """Ranks on ``host``, in rank order."""
        return self._members[host]

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostLayout) and other.hosts == self.hosts

    def __repr__(self) -> str:
        return f"HostLayout({list(self.hosts)})"


class Fabric:
    """Switches that reduce data in flight (in-network aggregation), as schedules see them.

    SHARP and SwitchML put small reduction engines in the switches: each
    switch sums what its children send it and passes one stream up a tree, and
    the root's result flows back down. To an algorithm, each such switch is one
    more participant with a schedule of its own: switch ``s`` is participant
    ``size + s`` (ranks are ``0 .. size-1``). ``attach[r]`` is the switch rank
    ``r`` sends to, ``parent[s]`` the switch above ``s`` (-1 for the root), and
    ``memory`` the aggregation memory of the smallest switch, in bytes: the
    most that may be in flight through any switch at once.

    Only the simulator provides one (:meth:`plait.sim.Network.aggregation_fabric`);
    plait's transports connect ranks only.
    """

    __slots__ = ("_hash", "attach", "memory", "parent")

    def __init__(self, attach: Sequence[int], parent: Sequence[int], memory: int) -> None:
        self.attach = tuple(attach)
        self.parent = tuple(parent)
        self.memory = int(memory)
        n = len(self.parent)
        if any(not 0 <= s < n for s in self.attach):
            raise ValueError(f"Fabric: every rank must attach to one of the {n} switches")
        if any(not -1 <= q < n or q == s for s, q in enumerate(self.parent)):
            raise ValueError("Fabric: a switch's parent must be another switch or -1")
        if self.parent.count(-1) != 1:
            raise ValueError("Fabric: exactly one switch must be the root (parent -1)")
        for s in range(n):  # every switch reaches the root without a cycle
            seen, q = 0, s
            while q != -1:
                q, seen = self.parent[q], seen + 1
                if seen > n:
                    raise ValueError("Fabric: the parents form a cycle")
        fed = set(self.attach) | {q for q in self.parent if q >= 0}
        if len(fed) != n:
            empty = min(set(range(n)) - fed)
            raise ValueError(f"Fabric: switch {empty} has no child (no rank, no switch below it)")
        if self.memory < 1:
            raise ValueError(f"Fabric: aggregation memory must be >= 1 byte; got {memory}")
        self._hash = hash((self.attach, self.parent, self.memory))

    @property
    def n_switches(self) -> int:
        """Number of aggregating switches (extra participants)."""
        return len(self.parent)

    def children(self, switch: int) -> tuple[list[int], list[int]]:
        """(ranks, switches) directly below ``switch``, each in increasing order."""
        ranks = [r for r, s in enumerate(self.attach) if s == switch]
        below = [q for q, s in enumerate(self.parent) if s == switch]
        return ranks, below

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Fabric)
            and other.attach == self.attach
            and other.parent == self.parent
            and other.memory == self.memory
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (Fabric, (self.attach, self.parent, self.memory))

    def __repr__(self) -> str:
        return f"Fabric({self.n_switches} switches, {self.memory} B each)"


@dataclass(frozen=True, slots=True)
class Context:
    """Everything a schedule builder may depend on. Identical on all ranks but ``rank``.

    ``count`` means, per collective: the vector length (allreduce, reduce,
    broadcast); the per-rank block length (reduce_scatter, allgather, gather,
    scatter); the per-destination block length (alltoall); 0 (barrier).

    ``counts`` is for the uneven collectives only (:class:`plait.collectives.Uneven`):
    one element count per rank (allgatherv, gatherv, scatterv: the block rank r
    contributes or receives; reduce_scatterv: the recvcounts), or for alltoallv
    the size×size matrix, row-major, entry ``i * size + j`` what rank i sends
    rank j. Every rank's context carries all of it, since a rank lays out its
    receives by what the others send. A tuple, so contexts stay hashable cache
    keys; ``count`` is not read when it is given (0 by convention). None: every
    count is ``count`` (the even collectives always; an uneven one then builds
    what its even twin would).

    ``window`` is the bytes of its window (``SHARED``) each rank may use in one
    call, where the ranks share an arena (one host); 0 where they do not. The
    one-sided algorithms cut larger calls into pieces that fit it.
    """

    collective: str
    rank: int
    size: int
    count: int
    itemsize: int = 1
    commutative: bool = True
    root: int = 0
    segment: int = 0  # elements per pipelined message; 0 means unsegmented
    hosts: HostLayout | None = None  # None: all ranks on one host
    fabric: Fabric | None = None  # switches that reduce in flight (simulator only)
    counts: tuple[int, ...] | None = None  # per-rank counts of an uneven collective
    window: int = 0  # bytes of SHARED per rank and call; 0: no shared arena

    @property
    def participants(self) -> int:
        """Ranks plus the fabric's switches: every schedule this call has."""
        return self.size + (self.fabric.n_switches if self.fabric is not None else 0)

    def with_rank(self, rank: int) -> Context:
        """The same call as seen by another rank."""
        return Context(
            self.collective,
            rank,
            self.size,
            self.count,
            self.itemsize,
            self.commutative,
            self.root,
            self.segment,
            self.hosts,
            self.fabric,
            self.counts,
            self.window,
        )

    def block_counts(self) -> tuple[int, ...]:
        """An uneven call's per-rank counts: ``counts``, or ``count`` for every entry."""
        if self.counts is not None:
            return self.counts
        return _collective(self.collective).even_counts(self.size, self.count)


#: One recorded step, as :class:`Step`'s fields in order: (kind, peer, src, dst, first,
#: tag, deps). The builder keeps these and makes the :class:`Step` objects once, in
#: :meth:`Builder.build` (Note [recorded rows]).
Row = tuple[StepKind, int, "Region | None", "Region | None", bool, int, tuple[int, ...]]


class Builder:
    """Records one rank's steps; see the module docstring.

    Note [recorded rows]
    ~~~~~~~~~~~~~~~~~~~~
    A step is recorded as a plain tuple of :class:`Step`'s fields (a :data:`Row`),
    with its dependencies already derived, and becomes a :class:`Step` only in
    :meth:`build`: a frozen dataclass costs about a microsecond to make, more
    than the tuple and its hazards together, and the simulator, which builds
    every rank's schedule of a thousand-rank call, reads the same rows as flat
    columns (:meth:`columns`) without making the objects at all. The rows are
    the schedule: :meth:`build` turns exactly them into its steps, and
    :meth:`columns` is what :mod:`plait.sim.program` would read off those steps
    (``tests/unit/test_schedule_scale.py`` holds the two to each other).
    """

    def __init__(self, ctx: Context, in_count: int, out_count: int) -> None:
        self.ctx = ctx
        self.rank = ctx.rank
        self.size = ctx.size
        self._participants = ctx.participants
        self._in_count = in_count
        self._out_count = out_count
        self._inp = Region(IN, 0, in_count)
        self._out = Region(OUT, 0, out_count)
        self._tmp_count = 0
        self._shared_count = 0
        self._phase = 0  # the last phase posted
        self._rows: list[Row] = []
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._hazards = (Hazards(), Hazards(), Hazards(), Hazards())
        self._one_sided_steps = False  # whether a POST, GET, GET_REDUCE or WAIT was recorded
        self._messages = False  # whether a SEND, RECV or RECV_REDUCE was recorded

    @property
    def recorded(self) -> int:
        """How many steps have been recorded so far."""
        return len(self._rows)

    # -- regions ---------------------------------------------------------------
    @property
    def inp(self) -> Region:
        """The whole input buffer (one region, made once: regions are immutable)."""
        return self._inp

    @property
    def out(self) -> Region:
        """The whole output buffer (one region, made once)."""
        return self._out

    def scratch(self, count: int) -> Region:
        """A fresh scratch region of ``count`` elements, disjoint from all others."""
        region = Region(TMP, self._tmp_count, count)
        self._tmp_count += count
        return region

    def shared(self, count: int) -> Region:
        """A fresh region of ``count`` elements of this rank's window (``SHARED``).

        Regions are handed out in order, so ranks that ask for the same sizes in
        the same order find each other's regions at the same offsets.

        Raises:
            ValueError: the window (``ctx.window`` bytes) cannot hold it.
        """
        region = Region(SHARED, self._shared_count, count)
        self._shared_count += count
        if self._shared_count * self.ctx.itemsize > self.ctx.window:
            raise ValueError(
                f"rank {self.rank}: {self._shared_count} elements of {self.ctx.itemsize} bytes "
                f"do not fit the window of {self.ctx.window} bytes"
            )
        return region

    # -- steps -----------------------------------------------------------------
    def send(self, peer: int, src: Region, *, after: Sequence[int] = ()) -> int:
        """Send ``src`` to ``peer``; returns the step index (-1 if empty).

        ``after``: earlier steps that must finish first although no data links
        them (flow control, e.g. a window of messages in flight); -1s are ignored.
        """
        if src.count == 0:
            return -1
        index, tag, deps = self._message(peer, src, after, self._sent)
        rows = self._rows
        start = src.offset
        end = start + src.count
        hazards = self._hazards[src.buf]
        one = hazards.piece.get(start)
        if one is not None and one[0] == end and not after:  # Note [hazard pieces]
            one[2].append(index)
            rows.append((_SEND, peer, src, None, False, tag, (one[1],) if one[1] >= 0 else ()))
            return index
        hazards.read(start, end, index, deps)
        rows.append((_SEND, peer, src, None, False, tag, _sorted(deps)))
        return index

    def messages(self) -> list[int]:
        """The indices of the sends and receives recorded so far (for an ``after``)."""
        return [i for i, row in enumerate(self._rows) if row[0] in _MESSAGES]

    def recv(self, peer: int, dst: Region, *, after: Sequence[int] = ()) -> int:
        """Receive from ``peer`` into ``dst``; ``after`` as for :meth:`send`."""
        return self._recv(_RECV, peer, dst, first=False, after=after)

    def recv_reduce(self, peer: int, dst: Region, *, recv_first: bool) -> int:
        """Receive from ``peer`` and combine: ``recv ∘ dst`` if ``recv_first`` else ``dst ∘ recv``.

        Put the operand that holds contributions of lower ranks first: that keeps
        non-commutative ops in rank order and makes both partners of an exchange
        compute bit-identical results.
        """
        return self._recv(_RECV_REDUCE, peer, dst, first=recv_first)

    def copy(self, src: Region, dst: Region) -> int:
        """``dst = src``."""
        if src.count != dst.count:
            raise ValueError(f"copy of {src} into {dst}: lengths differ")
        if src.count == 0 or src == dst:
            return -1
        return self._add(StepKind.COPY, -1, src, dst, False, -1, src, dst)

    def reduce(self, src: Region, dst: Region, *, src_first: bool) -> int:
        """``dst = src ∘ dst`` if ``src_first`` else ``dst ∘ src``."""
        if src.count != dst.count:
            raise ValueError(f"reduce of {src} into {dst}: lengths differ")
        if src.count == 0:
            return -1
        return self._add(StepKind.REDUCE, -1, src, dst, src_first, -1, src, dst)

    # -- one-sided steps (ranks sharing an arena; see plait.schedule.ir) -----------
    def post(self, phase: int) -> int:
        """Publish ``phase``: peers waiting for it see every earlier write to ``SHARED``.

        Raises:
            ValueError: ``phase`` is not above the last phase posted.
        """
        if phase <= self._phase:
            raise ValueError(
                f"rank {self.rank}: phase {phase} posted after phase {self._phase}; "
                "phases must increase"
            )
        self._phase = phase
        self._one_sided_steps = True
        # It reads the whole window: it follows every write to it, and writes wait for it.
        return self._add(StepKind.POST, -1, None, None, False, phase, _WHOLE_WINDOW, None)

    def get(self, peer: int, src: Region, dst: Region, phase: int) -> int:
        """``dst = peer's SHARED[src]`` once ``peer`` has posted ``phase`` (-1 if empty)."""
        return self._get(StepKind.GET, peer, src, dst, phase, first=False)

    def get_reduce(
        self, peer: int, src: Region, dst: Region, phase: int, *, get_first: bool
    ) -> int:
        """``dst = peer's SHARED[src] ∘ dst`` if ``get_first`` else ``dst ∘ peer's SHARED[src]``."""
        return self._get(StepKind.GET_REDUCE, peer, src, dst, phase, first=get_first)

    def wait(self, peer: int, phase: int) -> int:
        """Wait until ``peer`` has posted ``phase`` (it has read what it needed of ours)."""
        self._check_peer(peer)
        if phase < 1:
            raise ValueError(f"rank {self.rank}: phases start at 1, got {phase}")
        self._one_sided_steps = True
        # It reads nothing locally but orders what follows: writes to SHARED come after it.
        return self._add(StepKind.WAIT, peer, None, None, False, phase, _WHOLE_WINDOW, None)

    def build(self) -> Schedule:
        """Freeze the recorded steps into a :class:`Schedule`."""
        rows = self._freeze()
        steps = tuple([Step(*row) for row in rows])
        dependents: list[list[int]] = [[] for _ in rows]
        for i, row in enumerate(rows):
            for d in row[6]:
                dependents[d].append(i)
        return Schedule(
            rank=self.rank,
            size=self.size,
            steps=steps,
            in_count=self._in_count,
            out_count=self._out_count,
            tmp_count=self._tmp_count,
            dependents=tuple(tuple(d) for d in dependents),
            n_deps=tuple(len(row[6]) for row in rows),
            staged_count=sum(s.count for s in steps if s.kind is StepKind.RECV_REDUCE),
            roots=tuple(i for i, row in enumerate(rows) if not row[6]),
            shared_count=self._shared_count,
            one_sided=self._windowed() and not self._mixed(),
            mixed=self._mixed(),
            last_phase=self._phase,
        )

    def columns(self) -> tuple[Sequence[Any], ...]:
        """The recorded steps as columns: (kind, peer, tag, count, deps), one entry per step.

        What :meth:`build`'s steps say, read without making them (Note [recorded
        rows]): ``kind[i]`` is step i's :class:`StepKind`, ``count[i]`` its
        :attr:`Step.count` and ``deps[i]`` its ``deps``. Ends the recording, as
        :meth:`build` does.
        """
        rows = self._freeze()
        if not rows:
            return (), (), (), (), ()
        kind, peer, src, dst, _, tag, deps = zip(*rows, strict=True)
        count = [
            (s if s is not None else d or _NOTHING).count for s, d in zip(src, dst, strict=True)
        ]
        return kind, peer, tag, count, deps

    # -- internals -------------------------------------------------------------
    def _windowed(self) -> bool:
        return self._shared_count > 0 or self._one_sided_steps

    def _mixed(self) -> bool:
        return self._windowed() and self._messages

    def _freeze(self) -> list[Row]:
        """The rows, with a one-sided or mixed schedule's window steps chained (again, if
        called again: the chains are idempotent)."""
        if self._mixed():
            self._chain_windows()
        elif self._windowed():
            self._chain()
        return self._rows

    def _get(
        self, kind: StepKind, peer: int, src: Region, dst: Region, phase: int, *, first: bool
    ) -> int:
        if src.buf != SHARED:
            raise ValueError(f"rank {self.rank}: a get reads a peer's window, not {src}")
        if src.count != dst.count:
            raise ValueError(f"get of r{peer}.{src} into {dst}: lengths differ")
        if dst.buf == IN:
            raise ValueError(f"rank {self.rank}: a get cannot write the input ({dst})")
        if src.count == 0:
            return -1
        self._check_peer(peer)
        if phase < 1:
            raise ValueError(f"rank {self.rank}: phases start at 1, got {phase}")
        reads = dst if kind is StepKind.GET_REDUCE else None
        self._one_sided_steps = True
        return self._add(kind, peer, src, dst, first, phase, reads, dst)

    def _chain(self) -> None:
        """Make every step depend on the one before: a one-sided schedule runs in order."""
        rows = self._rows
        for i, row in enumerate(rows):
            deps = row[6]
            if i and (not deps or deps[-1] != i - 1):
                rows[i] = (*row[:6], tuple(sorted({*deps, i - 1})))

    def _chain_windows(self) -> None:
        """Make each step that uses the window follow the one before it (Note [mixed schedules]).

        The window part of the call then runs in step order, as a one-sided schedule
        does; messages run beside it, ordered only by the data they share with it.
        """
        rows = self._rows
        last = -1
        for i, row in enumerate(rows):
            src, dst = row[2], row[3]
            if not (
                row[0] >= StepKind.POST
                or (src is not None and src.buf == SHARED)
                or (dst is not None and dst.buf == SHARED)
            ):
                continue
            if last >= 0 and last not in row[6]:
                rows[i] = (*row[:6], tuple(sorted({*row[6], last})))
            last = i

    def _recv(
        self, kind: StepKind, peer: int, dst: Region, *, first: bool, after: Sequence[int] = ()
    ) -> int:
        if dst.count == 0:
            return -1
        index, tag, found = self._message(peer, dst, after, self._received)
        rows = self._rows
        start = dst.offset
        end = start + dst.count
        hazards = self._hazards[dst.buf]
        one = hazards.piece.get(start)
        if one is not None and one[0] == end and not after:  # Note [hazard pieces]
            # The writer, then its readers since, in the order they came: sorted already.
            deps = (one[1], *one[2]) if one[1] >= 0 else tuple(one[2])
            one[1] = index
            one[2] = []
            rows.append((kind, peer, None, dst, first, tag, deps))
            return index
        hazards.write(start, end, index, found)
        rows.append((kind, peer, None, dst, first, tag, _sorted(found)))
        return index

    def _message(
        self, peer: int, region: Region, after: Sequence[int], numbered: dict[int, int]
    ) -> tuple[int, int, list[int]]:
        """Check a send or receive of ``region`` with ``peer``, then number it among the
        messages ``numbered`` counts (sent or received, per peer); its index, its tag and
        the steps of ``after``. Everything is checked before anything changes."""
        if not 0 <= peer < self._participants or peer == self.rank:
            self._check_peer(peer)
        if region.buf == SHARED:
            _no_window(self.rank, region)
        index = len(self._rows)
        deps = self._after(after, index) if after else []
        tag = numbered.get(peer, 0)
        numbered[peer] = tag + 1
        self._messages = True
        return index, tag, deps

    def _after(self, after: Sequence[int], index: int) -> list[int]:
        """The steps of ``after`` (-1s left out), all before step ``index``."""
        deps = [i for i in after if i >= 0]
        if any(i >= index for i in deps):
            raise ValueError(f"rank {self.rank}: a step can only wait for earlier steps")
        return deps

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self._participants or peer == self.rank:
            raise ValueError(f"rank {self.rank}: invalid peer {peer} (size {self.size})")

    def _add(
        self,
        kind: StepKind,
        peer: int,
        src: Region | None,
        dst: Region | None,
        first: bool,
        tag: int,
        read: Region | None,
        write: Region | None,
        after: Sequence[int] = (),
    ) -> int:
        """Record a step that reads ``read`` and writes ``write`` (either may be None), with
        the dependencies its data hazards give it; returns its index. (A send and a
        receive, which touch one region and may have an ``after``, record themselves.)"""
        index = len(self._rows)
        deps: list[int] = []
        hazards = self._hazards
        if write is None or read is None or read.buf != write.buf:
            # Separate tables: each access is looked up and recorded on its own.
            if read is not None:
                hazards[read.buf].read(read.offset, read.offset + read.count, index, deps)
            if write is not None:
                hazards[write.buf].write(write.offset, write.offset + write.count, index, deps)
            self._rows.append((kind, peer, src, dst, first, tag, _sorted(deps)))
            return index
        # One buffer: both looked up before either is recorded.
        table = hazards[read.buf]
        r0, r1, w0, w1 = (
            read.offset,
            read.offset + read.count,
            write.offset,
            write.offset + write.count,
        )
        table.deps(r0, r1, False, deps)
        table.deps(w0, w1, True, deps)
        if not w0 <= r0 <= r1 <= w1:  # a read within the write leaves no reader behind
            table.record(r0, r1, index, False)
        table.record(w0, w1, index, True)
        self._rows.append((kind, peer, src, dst, first, tag, _sorted(deps)))
        return index


#: The length of a region that stands for the whole window in the hazard tables.
_ALL = 1 << 61
_WHOLE_WINDOW = Region(SHARED, 0, _ALL)
_NOTHING = Region(IN, 0, 0)  # the "region" of a POST or WAIT: no elements
_SEND, _RECV, _RECV_REDUCE = StepKind.SEND, StepKind.RECV, StepKind.RECV_REDUCE
_MESSAGES = (_SEND, _RECV, _RECV_REDUCE)


def _sorted(deps: list[int]) -> tuple[int, ...]:
    """``deps`` without repeats, in increasing order."""
    return tuple(sorted(set(deps))) if len(deps) > 1 else tuple(deps)


def _no_window(rank: int, region: Region) -> None:
    """Messages move the caller's buffers and scratch, not the window (a copy does)."""
    if region.buf == SHARED:
        raise ValueError(
            f"rank {rank}: a message cannot send from or receive into the window ({region}); "
            "copy between the window and a buffer instead"
        )


def exchange(
    b: Builder,
    peer: int,
    give: Region,
    take: Region,
    segment: int,
    *,
    reduce: bool,
    recv_first: bool = False,
) -> None:
    """Send ``give`` to ``peer`` while receiving (``reduce``: receive-reducing) ``take``.

    Both are cut into segments of ``segment`` elements, interleaved send and
    receive, so each segment of the exchange can overlap the next.
    """
    gives, takes = segments(give, segment), segments(take, segment)
    for i in range(max(len(gives), len(takes))):
        if i < len(gives):
            b.send(peer, gives[i])
        if i < len(takes):
            if reduce:
                b.recv_reduce(peer, takes[i], recv_first=recv_first)
            else:
                b.recv(peer, takes[i])


def record(build: Callable[[Builder], None], ctx: Context) -> Schedule:
    """Run the builder function ``build`` for ``ctx`` and return the schedule it recorded.

    ``IN`` and ``OUT`` are sized by the collective's table entry
    (:meth:`plait.collectives.Collective.buffer_counts`, which also refuses
    ``ctx.counts`` of the wrong length; their values are checked where they
    enter, by :meth:`~plait.collectives.Collective.check_counts`); the registry
    caches the result per (algorithm, context), :func:`plait.schedule.symbolic.prove`
    calls this directly.
    """
    return _recorded(build, ctx).build()


def record_columns(build: Callable[[Builder], None], ctx: Context) -> tuple[Sequence[Any], ...]:
    """What :func:`record` records, as :meth:`Builder.columns` (no ``Step`` objects made)."""
    return _recorded(build, ctx).columns()


def _recorded(build: Callable[[Builder], None], ctx: Context) -> Builder:
    in_count, out_count = _collective(ctx.collective).buffer_counts(
        ctx.size, ctx.count, ctx.rank, ctx.root, ctx.counts
    )
    builder = Builder(ctx, in_count, out_count)
    build(builder)
    return builder


__all__ += ["MOST_SEGMENTS", "blocks", "exchange", "record", "record_columns", "segments"]
_ = Buf  # re-exported for builders that annotate buffers
