"""Two steps of a rank that touch the same memory must be ordered whatever the timing.

:func:`unordered` finds two steps of one rank that touch overlapping memory, one
of them writing, with nothing that makes one finish before the other starts;
:func:`plait.schedule.verify.check_static` raises it as a ScheduleError.

Note [local order]
~~~~~~~~~~~~~~~~~~
The executor starts every step whose ``deps`` are done, so two steps of a rank
that nothing orders may run in either order, or at once, while
:func:`plait.schedule.verify.run_joint` runs them in the one order its queue
gives: a schedule it proves could give other results on a real transport.
Every two steps of a rank that touch overlapping memory, one of them writing,
must therefore be ordered by *happens-before*, a chain of

* dependencies: ``d`` in ``x.deps`` finishes before ``x`` starts;
* messages: a send starts before its receive finishes, and has read all its
  data by then (the receiver has it); what the receive writes comes from that
  send, so after the send started;
* phases: a ``GET``, ``GET_REDUCE`` or ``WAIT`` on (``q``, ``k``) starts after
  ``q``'s first post of a phase ``>= k`` finished.

Then every timing gives the values of the joint run, which follows
happens-before too. A rank's own ``deps`` alone would ask too much: an
in-place binomial allreduce sends its ``IN`` and receives the result into
``OUT``, the same memory, with no dependency between the two, and is right,
because the result it receives was made from what it sent. A chain from ``x``
to ``y`` puts every access of ``x`` before every access of ``y``: each link
starts after the one before it finished, or, for a message, its receive
finishes after the send started (and the receive writes only from then on).

A step reads its ``src`` (``SEND``, ``COPY``, ``REDUCE``) and writes its
``dst`` (``RECV``, ``RECV_REDUCE``, ``COPY``, ``REDUCE``, ``GET``,
``GET_REDUCE``; a ``RECV_REDUCE`` receives into staging memory and writes ``dst``
as it combines, after its ``deps``). A get's ``src`` is the peer's window,
which the race check covers (Note [one-sided races] in
:mod:`plait.schedule.verify`). In place, ``IN`` and ``OUT`` are one memory, and
a copy between equal regions of the two touches nothing (the executor skips
it). A one-sided schedule is not swept: its steps run in step order
(``check_static`` makes each follow the one before).

Comparing every pair of steps would be quadratic. As the builder derives
``deps``, the check sweeps a rank's steps keeping, per buffer, disjoint pieces
with the last step that wrote each and the steps that read it since: a step
must come after the last writer of every piece it touches and, if it writes,
after the readers since. Swept in an order that extends happens-before, that
covers every pair: an earlier step that touches the piece is one of those, or
precedes its last writer ``w`` in the sweep and is then, by the same rule at
``w``'s turn, ordered before ``w``. First each rank is swept in step order,
asking only for direct dependencies: the builder derives ``deps`` the same
way, so what it built passes at a lookup per access (except in place, where
the builder saw ``IN`` and ``OUT`` as two buffers). A rank that fails this is
swept again in an order of all participants' steps that extends
happens-before (Kahn's), collecting the pairs that must be ordered; what each
step happens after is then carried along that order as a bitset (a Python
int) over the earlier steps of those pairs only, so its size is what the
check needs, not the square of the steps. A step on a cycle of happens-before
never runs (a deadlock, which the joint run reports) and is left out.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from plait.schedule.ir import IN, OUT, Buf, Region, Schedule, Step, StepKind

__all__ = ["unordered"]

#: Kinds that read their ``src`` in this rank's memory (a get reads the peer's window).
_READS_SRC = frozenset((StepKind.SEND, StepKind.COPY, StepKind.REDUCE))
_RECEIVES = frozenset((StepKind.RECV, StepKind.RECV_REDUCE))
_READERS = frozenset((StepKind.GET, StepKind.GET_REDUCE, StepKind.WAIT))

#: (buffer, start, end, writes) of one access to a rank's memory.
_Access = tuple[int, int, int, bool]


def unordered(schedules: Sequence[Schedule], aliased: Sequence[bool] | None = None) -> str | None:
    """Two steps of a rank that touch overlapping memory, one writing, and that
    happens-before does not order, described; None if there are none (Note [local order]).

    ``aliased[r]``: rank ``r``'s ``IN`` and ``OUT`` are one memory (an in-place call).
    The schedules have passed the rest of ``check_static``.
    """
    alias = [bool(aliased is not None and aliased[r]) for r in range(len(schedules))]
    again = [
        r for r, s in enumerate(schedules) if not s.one_sided and not _ordered_by_deps(s, alias[r])
    ]
    if not again:
        return None
    order, preds = _causal_order(schedules)
    # Steps to sweep, per rank, in the causal order; then the pairs the sweep asks for.
    sweep: dict[int, list[int]] = {r: [] for r in again}
    for r, i in order:
        if r in sweep:
            sweep[r].append(i)
    pairs: list[tuple[int, int, int, _Access]] = []  # (rank, earlier step, later step, access)
    for r in again:
        steps = schedules[r].steps
        pieces = [_Pieces() for _ in Buf]
        for i in sweep[r]:
            touched = _accesses(steps[i], alias[r])
            for access in touched:
                buf, lo, hi, write = access
                pairs += [(r, j, i, access) for j in set(pieces[buf].before(lo, hi, write))]
            for buf, lo, hi, write in touched:
                pieces[buf].record(lo, hi, i, write)
    pairs = [p for p in pairs if p[1] not in schedules[p[0]].steps[p[2]].deps]
    bit = {(r, j): k for k, (r, j) in enumerate(dict.fromkeys((r, j) for r, j, _, _ in pairs))}
    after: dict[tuple[int, int], int] = {}  # step -> bitset of the pairs' steps before it
    for node in order:
        mask = 1 << bit[node] if node in bit else 0
        for p in preds[node[0]][node[1]]:
            mask |= after[p]
        after[node] = mask
    for r, j, i, access in pairs:
        if not after[(r, i)] >> bit[(r, j)] & 1:
            return _describe(r, schedules[r].steps, j, i, access, alias[r])
    return None


def _ordered_by_deps(sched: Schedule, aliased: bool) -> bool:
    """Whether every step has as a direct dependency each earlier step of its rank that it
    must come after (the sweep of Note [local order] in step order)."""
    pieces = [_Pieces() for _ in Buf]
    for i, step in enumerate(sched.steps):
        touched = _accesses(step, aliased)
        for buf, lo, hi, write in touched:
            if not pieces[buf].follows(lo, hi, write, step.deps):
                return False
        for buf, lo, hi, write in touched:
            pieces[buf].record(lo, hi, i, write)
    return True


def _accesses(step: Step, aliased: bool) -> list[_Access]:
    """What ``step`` reads and writes of its rank's memory (Note [local order])."""
    src, dst = step.src, step.dst
    out: list[_Access] = []
    if aliased and step.kind is StepKind.COPY and src is not None and dst is not None:
        onto_itself = src.offset == dst.offset and src.buf + dst.buf == IN + OUT
        if onto_itself:  # the executor skips it in place
            return out
    if src is not None and step.kind in _READS_SRC:
        out.append((OUT if aliased and src.buf == IN else src.buf, src.offset, src.end, False))
    if dst is not None:
        out.append((OUT if aliased and dst.buf == IN else dst.buf, dst.offset, dst.end, True))
    return out


def _causal_order(
    schedules: Sequence[Schedule],
) -> tuple[list[tuple[int, int]], list[list[list[tuple[int, int]]]]]:
    """Every step ``(rank, index)`` in an order that extends happens-before (Kahn's), and
    per step the steps it directly happens after (Note [local order])."""
    sends: dict[tuple[int, int, int], int] = {}
    posts: list[tuple[list[int], list[int]]] = []  # per rank: phases posted, at which steps
    for r, s in enumerate(schedules):
        phases: list[int] = []
        at: list[int] = []
        for i, st in enumerate(s.steps):
            if st.kind is StepKind.SEND:
                sends[(r, st.peer, st.tag)] = i
            elif st.kind is StepKind.POST:
                phases.append(st.tag)
                at.append(i)
        posts.append((phases, at))
    preds: list[list[list[tuple[int, int]]]] = []
    for r, s in enumerate(schedules):
        mine: list[list[tuple[int, int]]] = []
        for st in s.steps:
            p = [(r, d) for d in st.deps]
            if st.kind in _RECEIVES and (st.peer, r, st.tag) in sends:
                p.append((st.peer, sends[(st.peer, r, st.tag)]))
            elif st.kind in _READERS and 0 <= st.peer < len(posts):
                phases, at = posts[st.peer]
                k = bisect.bisect_left(phases, st.tag)
                if k < len(at):
                    p.append((st.peer, at[k]))
            mine.append(p)
        preds.append(mine)
    waiting = [[len(p) for p in mine] for mine in preds]
    succ: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, mine in enumerate(preds):
        for i, p in enumerate(mine):
            for q in p:
                succ.setdefault(q, []).append((r, i))
    ready = deque((r, i) for r, w in enumerate(waiting) for i, n in enumerate(w) if n == 0)
    order: list[tuple[int, int]] = []
    while ready:
        node = ready.popleft()
        order.append(node)
        for r, i in succ.get(node, ()):
            waiting[r][i] -= 1
            if waiting[r][i] == 0:
                ready.append((r, i))
    return order, preds


def _describe(
    rank: int, steps: Sequence[Step], j: int, i: int, access: _Access, aliased: bool
) -> str:
    """Step ``j`` (swept first) and step ``i``, whose ``access`` overlaps it, unordered."""
    buf, lo, hi, write = access
    _, s, e, w = next(  # what of j's overlaps it: a write, or a read if i writes
        a
        for a in _accesses(steps[j], aliased)
        if a[0] == buf and a[1] < hi and lo < a[2] and (a[3] or write)
    )
    region = Region(Buf(buf), max(s, lo), min(e, hi) - max(s, lo))
    place = " (IN and OUT are one memory in place)" if aliased and buf == OUT else ""
    who = "both write it" if w and write else f"step {j if w else i} writes it"
    a, z = sorted((j, i))
    return (
        f"rank {rank}: step {a} {steps[a]!r} and step {z} {steps[z]!r} both touch "
        f"{region!r}{place} and {who}, but nothing orders them (no chain of deps, messages "
        "or phases): the executor may run them in either order, or at once, and the result "
        "would depend on the timing"
    )


class _Pieces:
    """One buffer's disjoint pieces, each with its last writer and the readers since
    (Note [local order]); kept sorted, so an access costs a bisection and the pieces it
    touches."""

    __slots__ = ("readers", "starts", "writer")

    def __init__(self) -> None:
        self.starts: list[int] = [0]  # piece k is [starts[k], starts[k + 1]), the last unbounded
        self.writer: list[int] = [-1]
        self.readers: list[list[int]] = [[]]

    def _split(self, x: int) -> int:
        """Make a piece start at ``x``; its index."""
        k = bisect.bisect_right(self.starts, x) - 1
        if self.starts[k] == x:
            return k
        self.starts.insert(k + 1, x)
        self.writer.insert(k + 1, self.writer[k])
        self.readers.insert(k + 1, list(self.readers[k]))
        return k + 1

    def before(self, lo: int, hi: int, write: bool) -> list[int]:
        """The steps an access to ``[lo, hi)`` must come after: the last writer of every
        piece it touches and, if it writes, the readers since."""
        a, b = self._split(lo), self._split(hi)
        out = [w for w in self.writer[a:b] if w >= 0]
        if write:
            for readers in self.readers[a:b]:
                out += readers
        return out

    def follows(self, lo: int, hi: int, write: bool, deps: tuple[int, ...]) -> bool:
        """Whether ``deps`` hold every step :meth:`before` names."""
        a, b = self._split(lo), self._split(hi)
        for w in self.writer[a:b]:
            if w >= 0 and w not in deps:
                return False
        if write:
            for readers in self.readers[a:b]:
                for r in readers:
                    if r not in deps:
                        return False
        return True

    def record(self, lo: int, hi: int, i: int, write: bool) -> None:
        """Step ``i`` reads or writes ``[lo, hi)`` (pieces start at both ends: ``before``)."""
        a = bisect.bisect_left(self.starts, lo)
        b = bisect.bisect_left(self.starts, hi)
        if write:
            self.starts[a:b] = [lo]
            self.writer[a:b] = [i]
            self.readers[a:b] = [[]]
        else:
            for readers in self.readers[a:b]:
                readers.append(i)
