"""Run all ranks' schedules together, without I/O, and check them.

:func:`run_joint` is a reference interpreter of the executor's semantics over
all ranks at once:

* a rank's step may start when all its ``deps`` have finished;
* a ``RECV_REDUCE`` stages its message, so its receive is posted at once and
  only the combine waits for ``deps`` (as in the executor);
* a send finishes only when the matching receive is posted (zero buffering,
  the strictest transport), so a schedule that passes cannot deadlock on any
  transport that buffers more;
* a ``GET``, ``GET_REDUCE`` or ``WAIT`` on (peer ``q``, phase ``k``) runs once
  its ``deps`` are done and ``q`` has posted a phase ``>= k``; a ``GET`` reads
  ``q``'s ``SHARED`` as it is at that moment.

It checks that regions are in bounds, ``IN`` is never written, every message
has a partner of the same length, two steps of a rank that touch the same
memory are ordered whatever the timing (Note [local order] in
:mod:`plait.schedule.order`), and every step finishes (else it reports the
deadlock). Values are whatever the caller's ``combine`` works on: provenance
tuples in :mod:`plait.schedule.symbolic`, or ``None`` to check structure only.

Note [one-sided races]
~~~~~~~~~~~~~~~~~~~~~~
A one-sided schedule runs in step order, so happens-before among its steps is
captured by vector clocks: rank ``r``'s own component counts its finished
steps, a ``POST`` snapshots the poster's clock, and a ``GET``/``WAIT`` on
(``q``, ``k``) merges the snapshot of ``q``'s *first* post of a phase ``>= k``
(the one it is sure to have seen, whatever the timing). The clocks therefore
do not depend on the order the interpreter happens to pick. Every read of a
peer's window and every write of a rank to its own is recorded; a write ``i``
of ``q`` overlapping a read (``r``, step ``j``, phase ``k``) of ``q``'s window
is legal only if it precedes that publishing post in ``q``'s program order (the
reader sees it), or if the reader's step ``j`` happens-before it (the write's
clock shows ``r`` past ``j``). Anything else is a race on some interleaving
and raises :class:`ScheduleError`; with no race, the values a ``GET`` reads
here are the ones it reads on every interleaving.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from plait.schedule.ir import IN, SHARED, Region, Schedule, Step, StepKind, uses_window
from plait.schedule.order import unordered

__all__ = ["ScheduleError", "check_hosts", "check_order", "check_static", "run_joint"]

Combine = Callable[[Any, Any], Any]

_MESSAGES = frozenset((StepKind.SEND, StepKind.RECV, StepKind.RECV_REDUCE))
_READERS = frozenset((StepKind.GET, StepKind.GET_REDUCE, StepKind.WAIT))


class ScheduleError(AssertionError):
    """A schedule breaks a structural rule (bounds, matching, deadlock, a race)."""


def _posts(sched: Schedule) -> tuple[list[int], list[int]]:
    """(phases, step indices) of the schedule's POSTs, in step order."""
    phases: list[int] = []
    where: list[int] = []
    for i, step in enumerate(sched.steps):
        if step.kind is StepKind.POST:
            phases.append(step.tag)
            where.append(i)
    return phases, where


def check_static(schedules: Sequence[Schedule], aliased: Sequence[bool] | None = None) -> None:
    """Bounds, no writes to IN, deps point backwards, send/recv pairs agree, one-sided rules,
    steps that touch the same memory ordered (:func:`check_order`, given ``aliased``).

    One-sided rules: a schedule with one-sided steps or ``SHARED`` regions is
    marked ``one_sided`` (no message steps; chained: each step depends on the
    one before) or ``mixed`` (each of its steps that use the window depends on
    the last one before it; Note [mixed schedules] in :mod:`plait.schedule.ir`); ``SHARED``
    regions fit the owner's ``shared_count`` (a ``GET``'s ``src`` the *peer's*);
    a rank's phases are >= 1 and strictly increasing; a ``GET``/``WAIT`` on phase ``k`` of ``q``
    needs ``q`` to post some phase ``>= k`` (else it would wait forever).
    """
    size = len(schedules)
    ranks = schedules[0].size if schedules else 0
    if ranks > size:
        raise ScheduleError(f"{size} schedules for {ranks} ranks")
    last_phase = [
        max((st.tag for st in s.steps if st.kind is StepKind.POST), default=0) for s in schedules
    ]
    sends: dict[tuple[int, int, int], int] = {}
    recvs: dict[tuple[int, int, int], int] = {}
    for rank, sched in enumerate(schedules):
        # A fabric's switches follow the ranks (rank >= size): all claim the ranks' size.
        if sched.rank != rank or sched.size != ranks:
            raise ScheduleError(f"schedule {rank} claims rank {sched.rank} of {sched.size}")
        limits = (sched.in_count, sched.out_count, sched.tmp_count, sched.shared_count)
        phase = 0
        last = -1
        for i, step in enumerate(sched.steps):
            where = _Where(rank, i, step)
            if step.deps and (step.deps[-1] >= i or step.deps[0] < 0):
                raise ScheduleError(f"{where}: dependency not on an earlier step")
            kind = step.kind
            _check_one_sided(sched, i, where)
            if sched.mixed:
                last = _check_window_chain(sched, i, last, where)
            if kind in _READERS and (not 0 <= step.peer < size or step.peer == rank):
                raise ScheduleError(f"{where}: invalid peer {step.peer}")
            for region, limit in (
                (step.src, _src_limit(schedules, step, limits, where)),
                (step.dst, limits[step.dst.buf] if step.dst is not None else 0),
            ):
                if region is None:
                    continue
                if region.offset < 0 or region.count <= 0 or region.end > limit:
                    raise ScheduleError(f"{where}: {region} outside buffer of {limit}")
            if step.dst is not None and step.dst.buf == IN:
                raise ScheduleError(f"{where}: writes the input buffer")
            if kind is StepKind.SEND:
                sends[(rank, step.peer, step.tag)] = step.count
            elif kind in (StepKind.RECV, StepKind.RECV_REDUCE):
                recvs[(step.peer, rank, step.tag)] = step.count
            elif kind is StepKind.POST:
                if step.tag < 1 or step.tag <= phase:
                    raise ScheduleError(
                        f"{where}: phase {step.tag} after phase {phase}; phases start at 1 "
                        "and increase"
                    )
                phase = step.tag
            elif kind in _READERS:
                if step.tag < 1:
                    raise ScheduleError(f"{where}: phases start at 1, got {step.tag}")
                if last_phase[step.peer] < step.tag:
                    raise ScheduleError(
                        f"deadlock: {where}: rank {step.peer} never posts phase {step.tag} "
                        "or later; it would wait forever"
                    )
    for key, n in sends.items():
        if key not in recvs:
            raise ScheduleError(f"send {key[0]}->{key[1]} #{key[2]} ({n} elements) has no receive")
        if recvs[key] != n:
            raise ScheduleError(
                f"message {key[0]}->{key[1]} #{key[2]}: sends {n} elements, receives {recvs[key]}"
            )
    for key in recvs:
        if key not in sends:
            raise ScheduleError(f"receive {key[1]}<-{key[0]} #{key[2]} has no send")
    check_order(schedules, aliased)


def check_order(schedules: Sequence[Schedule], aliased: Sequence[bool] | None = None) -> None:
    """Two steps of a rank that touch overlapping memory, one writing, are ordered whatever
    the timing (Note [local order] in :mod:`plait.schedule.order`); each schedule's
    ``dependents``, ``n_deps`` and ``roots``, which the executor follows, agree with its
    ``deps``. ``aliased[r]``: rank ``r``'s ``IN`` and ``OUT`` are one memory (in place).

    Raises:
        ScheduleError: naming the two steps and the region they share, or the field
            that disagrees.
    """
    for rank, sched in enumerate(schedules):
        _check_derived(rank, sched)
    problem = unordered(schedules, aliased)
    if problem is not None:
        raise ScheduleError(problem)


def _check_derived(rank: int, sched: Schedule) -> None:
    """``dependents``, ``n_deps`` and ``roots`` say what ``deps`` says: the order checked
    is the order run."""
    steps, dependents, n_deps = sched.steps, sched.dependents, sched.n_deps
    if len(dependents) != len(steps) or len(n_deps) != len(steps):
        raise ScheduleError(
            f"rank {rank}: {len(steps)} steps, but dependents and n_deps for "
            f"{len(dependents)} and {len(n_deps)}"
        )
    if n_deps != tuple(len(step.deps) for step in steps):
        raise ScheduleError(f"rank {rank}: n_deps disagree with the steps' deps")
    for i, step in enumerate(steps):
        for d in step.deps:
            if i not in dependents[d]:
                raise ScheduleError(f"{_Where(rank, i, step)}: dependents[{d}] does not list it")
    if sum(n_deps) != sum(map(len, dependents)):
        raise ScheduleError(f"rank {rank}: dependents name a step whose deps do not list it")
    if sched.roots and sched.roots != tuple(i for i, n in enumerate(n_deps) if n == 0):
        raise ScheduleError(f"rank {rank}: roots are not the steps without deps")


def check_hosts(schedules: Sequence[Schedule], hosts: Sequence[int]) -> None:
    """Every one-sided step reads a window of its own host: ``hosts[r]`` is rank ``r``'s host.

    A window is shared by the ranks of one host only (Note [mixed schedules] in
    :mod:`plait.schedule.ir`), so a ``GET``, ``GET_REDUCE`` or ``WAIT`` naming a rank
    on another host could never run; the transports refuse such a call, and this
    check lets the prover refuse the schedule first.
    """
    for rank, sched in enumerate(schedules):
        if not (sched.one_sided or sched.mixed) or rank >= len(hosts):
            continue
        for i, step in enumerate(sched.steps):
            q = step.peer
            if step.kind in _READERS and 0 <= q < len(hosts) and hosts[q] != hosts[rank]:
                raise ScheduleError(
                    f"{_Where(rank, i, step)}: reads the window of rank {q} on host "
                    f"{hosts[q]}, but rank {rank} is on host {hosts[rank]}; a window is "
                    "shared by the ranks of one host only"
                )


class _Where:
    """``rank R step I <step>`` for a message, formatted only when one is raised.

    The checks run over every step of every rank; formatting the step each
    time would cost more than the checks themselves.
    """

    __slots__ = ("i", "rank", "step")

    def __init__(self, rank: int, i: int, step: Step) -> None:
        self.rank, self.i, self.step = rank, i, step

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __str__(self) -> str:
        return f"rank {self.rank} step {self.i} {self.step!r}"


def _check_window_chain(sched: Schedule, i: int, last: int, where: _Where) -> int:
    """Step ``i`` of a mixed schedule keeps the window's order: a step that uses the window
    depends on the last one before it. Returns the last step that uses the window."""
    step = sched.steps[i]
    if not uses_window(step):
        return last
    if last >= 0 and last not in step.deps:
        raise ScheduleError(
            f"{where}: a step of a mixed schedule that uses the window must follow the last "
            f"one before it (step {last})"
        )
    return i


def _check_one_sided(sched: Schedule, i: int, where: _Where) -> None:
    step = sched.steps[i]
    kind = step.kind
    uses = uses_window(step)
    if uses and not (sched.one_sided or sched.mixed):
        raise ScheduleError(f"{where}: a one-sided step in a schedule not marked one_sided")
    if sched.one_sided and sched.mixed:
        raise ScheduleError(f"{where}: a schedule is one-sided or mixed, not both")
    if sched.mixed:
        if kind in _MESSAGES and uses:
            raise ScheduleError(f"{where}: a message cannot move the window's memory")
        _check_data(step, where)
        return
    if not sched.one_sided:
        return
    if kind in _MESSAGES:
        raise ScheduleError(f"{where}: a one-sided schedule cannot exchange messages")
    if i and (not step.deps or step.deps[-1] != i - 1):
        raise ScheduleError(
            f"{where}: a one-sided schedule runs in order; it must follow step {i - 1}"
        )
    _check_data(step, where)


def _check_data(step: Step, where: _Where) -> None:
    kind = step.kind
    if kind in (StepKind.GET, StepKind.GET_REDUCE) and (step.src is None or step.dst is None):
        raise ScheduleError(f"{where}: a get needs a source and a destination")
    if kind in (StepKind.POST, StepKind.WAIT) and (step.src is not None or step.dst is not None):
        raise ScheduleError(f"{where}: a {kind.name.lower()} moves no data")


def _src_limit(
    schedules: Sequence[Schedule], step: Step, limits: tuple[int, ...], where: _Where
) -> int:
    """The size of the buffer ``step.src`` names: a get's is the peer's window."""
    if step.src is None:
        return 0
    if step.kind not in _READERS:
        return limits[step.src.buf]
    if step.src.buf != SHARED:
        raise ScheduleError(f"{where}: a get reads a peer's window, not {step.src}")
    return schedules[step.peer].shared_count


class _Windows:
    """The one-sided part of a joint run (Note [one-sided races])."""

    def __init__(self, schedules: Sequence[Schedule]) -> None:
        n = len(schedules)
        self.schedules = schedules
        self.on = [s.one_sided or s.mixed for s in schedules]
        self.uses = [[uses_window(st) for st in s.steps] for s in schedules]
        self.clock = [[0] * n for _ in range(n)]
        self.posts = [_posts(s) for s in schedules]
        self.snap: dict[tuple[int, int], list[int]] = {}  # (rank, POST step) -> its clock
        # (q, POST step) -> (rank, step) of the steps waiting for that post
        self.waiting: dict[tuple[int, int], list[tuple[int, int]]] = {}
        # Per owner: reads of its window (reader, step, lo, hi, phase, publishing POST step)
        # and its writes to it, in program order (step, lo, hi, clock).
        self.reads: list[list[tuple[int, int, int, int, int, int]]] = [[] for _ in range(n)]
        self.writes: list[list[tuple[int, int, int, list[int]]]] = [[] for _ in range(n)]

    def publisher(self, q: int, phase: int) -> int:
        """The step of ``q``'s first POST of a phase ``>= phase`` (check_static made sure)."""
        phases, where = self.posts[q]
        return where[bisect.bisect_left(phases, phase)]

    def finished(self, rank: int, i: int) -> None:
        # A rank's own entry counts its steps that use the window: they run in step order
        # (chained), while a mixed schedule's messages may finish in any order beside them
        # and order nothing on the window (Note [mixed schedules]).
        if self.on[rank] and self.clock[rank][rank] <= i and self.uses[rank][i]:
            self.clock[rank][rank] = i + 1

    def acquire(self, rank: int, q: int, post: int) -> None:
        """``rank`` has seen ``q``'s POST at step ``post``: merge its clock."""
        mine = self.clock[rank]
        for r, c in enumerate(self.snap[(q, post)]):
            if c > mine[r]:
                mine[r] = c

    def wrote(self, rank: int, i: int, region: Region) -> None:
        if region.buf == SHARED:
            self.writes[rank].append((i, region.offset, region.end, list(self.clock[rank])))

    def check_races(self) -> None:
        """Raise ScheduleError for a write that may overlap a read (Note [one-sided races])."""
        for q, reads in enumerate(self.reads):
            writes = self.writes[q]
            if not reads or not writes:
                continue
            index = [w[0] for w in writes]
            for r, j, lo, hi, phase, post in reads:
                # Writes before the publishing post are seen; from the first write that
                # knows the read is done on, all are ordered after it (clocks only grow).
                for i, wlo, whi, clock in writes[bisect.bisect_right(index, post) :]:
                    if clock[r] > j:
                        break
                    if wlo < hi and lo < whi:
                        a, b = max(lo, wlo), min(hi, whi)
                        raise ScheduleError(
                            f"race: rank {q} step {i} {self.schedules[q].steps[i]!r} "
                            f"overwrites SHARED[{a}:{b}] while rank {r} may still read it "
                            f"(step {j} {self.schedules[r].steps[j]!r}, phase {phase})"
                        )


def run_joint(
    schedules: Sequence[Schedule],
    buffers: Sequence[list[list[Any]]] | None = None,
    combine: Combine | None = None,
) -> list[set[int]]:
    """Interpret all schedules together (see the module docstring).

    Args:
        schedules: one per rank, rank order.
        buffers: per rank, the lists [IN, OUT, TMP, SHARED] of element values, mutated
            in place; None to check structure only. ``OUT`` may be the same list as
            ``IN``. A rank given only [IN, OUT, TMP] gets a ``SHARED`` of ``None``\\ s.
        combine: ``combine(a, b)`` returns ``a ∘ b``; required with ``buffers``.

    Returns:
        Per rank, the set of ranks whose start happens-before that rank's end
        (the barrier property; a ``GET`` or ``WAIT`` learns what its poster knew).

    Raises:
        ScheduleError: on a structural fault, a deadlock or a race on a window.
    """
    # In place, the caller passes one list as IN and as OUT.
    aliased = [len(b) > 1 and b[0] is b[1] for b in buffers] if buffers is not None else None
    check_static(schedules, aliased)
    size = len(schedules)
    with_data = buffers is not None
    if buffers is not None:
        buffers = [
            b if len(b) > 3 else [*b, [None] * s.shared_count]
            for b, s in zip(buffers, schedules, strict=True)
        ]
    remaining = [list(s.n_deps) for s in schedules]
    finished = [[False] * len(s.steps) for s in schedules]
    known = [[0] * len(s.steps) for s in schedules]  # bitmask of ranks seen, per step
    # Posted, unmatched operations keyed by (src, dst, tag) -> step index.
    posted_send: dict[tuple[int, int, int], int] = {}
    posted_recv: dict[tuple[int, int, int], int] = {}
    staged: dict[tuple[int, int], tuple[list[Any] | None, int]] = {}  # RECV_REDUCE data arrived
    deps_done = [[False] * len(s.steps) for s in schedules]
    ready: deque[tuple[int, int]] = deque()
    n_left = sum(len(s.steps) for s in schedules)
    win = _Windows(schedules) if any(s.one_sided or s.mixed for s in schedules) else None

    def read(rank: int, region: Region) -> list[Any]:
        assert buffers is not None
        return buffers[rank][region.buf][region.offset : region.end]

    def write(rank: int, region: Region, values: list[Any]) -> None:
        assert buffers is not None
        buffers[rank][region.buf][region.offset : region.end] = values

    def combine_lists(first: list[Any], second: list[Any], where: _Where) -> list[Any]:
        assert combine is not None
        if None in first or None in second:
            raise ScheduleError(f"{where}: reduces an element that was never written")
        if len(first) != len(second):
            raise ScheduleError(f"{where}: reduces {len(first)} elements with {len(second)}")
        return list(map(combine, first, second))

    def finish(rank: int, i: int) -> None:
        nonlocal n_left
        finished[rank][i] = True
        n_left -= 1
        if win is not None:
            win.finished(rank, i)
        for j in schedules[rank].dependents[i]:
            known[rank][j] |= known[rank][i]
            remaining[rank][j] -= 1
            if remaining[rank][j] == 0:
                ready.append((rank, j))

    def try_match(key: tuple[int, int, int]) -> None:
        if key not in posted_send or key not in posted_recv:
            return
        src, dst, _ = key
        si = posted_send.pop(key)
        ri = posted_recv.pop(key)
        send = schedules[src].steps[si]
        recv = schedules[dst].steps[ri]
        data = read(src, send.src) if with_data else None  # type: ignore[arg-type]
        known[dst][ri] |= known[src][si]
        if recv.kind is StepKind.RECV:
            if with_data:
                write(dst, recv.dst, data)  # type: ignore[arg-type]
            finish(dst, ri)
        else:
            staged[(dst, ri)] = (data, known[src][si])
            maybe_finish_recv_reduce(dst, ri)
        finish(src, si)

    def maybe_finish_recv_reduce(rank: int, i: int) -> None:
        if not deps_done[rank][i] or (rank, i) not in staged:
            return
        data, _ = staged.pop((rank, i))
        step = schedules[rank].steps[i]
        if with_data:
            assert step.dst is not None
            assert data is not None
            cur = read(rank, step.dst)
            where = _Where(rank, i, step)
            res = combine_lists(data, cur, where) if step.first else combine_lists(cur, data, where)
            write(rank, step.dst, res)
        finish(rank, i)

    def local(rank: int, i: int, src: list[Any] | None) -> None:
        """A COPY, REDUCE, GET or GET_REDUCE with its source values ``src``."""
        step = schedules[rank].steps[i]
        assert step.dst is not None
        if with_data:
            assert src is not None
            if step.kind in (StepKind.COPY, StepKind.GET):
                write(rank, step.dst, src)
            else:
                cur = read(rank, step.dst)
                where = _Where(rank, i, step)
                first = step.first
                res = combine_lists(src, cur, where) if first else combine_lists(cur, src, where)
                write(rank, step.dst, res)
        if win is not None:
            win.wrote(rank, i, step.dst)
        finish(rank, i)

    def one_sided(rank: int, i: int) -> None:
        """A GET, GET_REDUCE or WAIT whose peer has posted the phase it waits for."""
        assert win is not None
        step = schedules[rank].steps[i]
        q = step.peer
        post = win.publisher(q, step.tag)
        win.acquire(rank, q, post)
        known[rank][i] |= known[q][post]
        if step.kind is StepKind.WAIT:
            finish(rank, i)
            return
        assert step.src is not None
        win.reads[q].append((rank, i, step.src.offset, step.src.end, step.tag, post))
        local(rank, i, read(q, step.src) if with_data else None)

    for rank, sched in enumerate(schedules):
        for i, step in enumerate(sched.steps):
            known[rank][i] = 1 << rank
            if step.kind is StepKind.RECV_REDUCE:
                key = (step.peer, rank, step.tag)
                posted_recv[key] = i
            if sched.n_deps[i] == 0:
                ready.append((rank, i))
    for key in list(posted_recv):
        try_match(key)

    while ready:
        rank, i = ready.popleft()
        deps_done[rank][i] = True
        step = schedules[rank].steps[i]
        kind = step.kind
        if kind is StepKind.SEND:
            key = (rank, step.peer, step.tag)
            posted_send[key] = i
            try_match(key)
        elif kind is StepKind.RECV:
            key = (step.peer, rank, step.tag)
            posted_recv[key] = i
            try_match(key)
        elif kind is StepKind.RECV_REDUCE:
            maybe_finish_recv_reduce(rank, i)
        elif kind is StepKind.POST:
            assert win is not None
            finish(rank, i)
            win.snap[(rank, i)] = list(win.clock[rank])
            for r, j in win.waiting.pop((rank, i), ()):
                one_sided(r, j)
        elif kind in _READERS:
            assert win is not None
            post = win.publisher(step.peer, step.tag)
            if finished[step.peer][post]:
                one_sided(rank, i)
            else:
                win.waiting.setdefault((step.peer, post), []).append((rank, i))
        else:
            assert step.src is not None
            local(rank, i, read(rank, step.src) if with_data else None)

    if n_left:
        stuck = []
        for rank, sched in enumerate(schedules):
            for i, step in enumerate(sched.steps):
                if not finished[rank][i]:
                    stuck.append(f"rank {rank} step {i} {step!r}")
                    break
        raise ScheduleError(
            f"deadlock: {n_left} steps cannot finish; first stuck: " + "; ".join(stuck[:8])
        )
    if win is not None:
        win.check_races()

    seen: list[set[int]] = []
    for rank in range(size):
        mask = 1 << rank
        for k in known[rank]:
            mask |= k
        seen.append({r for r in range(size) if mask >> r & 1})
    return seen
