"""Run all ranks' schedules together, without I/O, and check them.

:func:`run_joint` is a reference interpreter of the executor's semantics over
all ranks at once:

* a rank's step may start when all its ``deps`` have finished;
* a ``RECV_REDUCE`` stages its message, so its receive is posted at once and
  only the combine waits for ``deps`` (as in the executor);
* a send finishes only when the matching receive is posted (zero buffering,
  the strictest transport), so a schedule that passes cannot deadlock on any
  transport that buffers more.

It checks that regions are in bounds, ``IN`` is never written, every message
has a partner of the same length, and every step finishes (else it reports the
deadlock). Values are whatever the caller's ``combine`` works on: provenance
tuples in :mod:`plait.schedule.symbolic`, or ``None`` to check structure only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from plait.schedule.ir import IN, Region, Schedule, StepKind

__all__ = ["ScheduleError", "check_static", "run_joint"]

Combine = Callable[[Any, Any], Any]


class ScheduleError(AssertionError):
    """A schedule breaks a structural rule (bounds, matching, deadlock)."""


def check_static(schedules: Sequence[Schedule]) -> None:
    """Bounds, no writes to IN, deps point backwards, and send/recv pairs agree."""
    size = len(schedules)
    ranks = schedules[0].size if schedules else 0
    if ranks > size:
        raise ScheduleError(f"{size} schedules for {ranks} ranks")
    sends: dict[tuple[int, int, int], int] = {}
    recvs: dict[tuple[int, int, int], int] = {}
    for rank, sched in enumerate(schedules):
        # A fabric's switches follow the ranks (rank >= size): all claim the ranks' size.
        if sched.rank != rank or sched.size != ranks:
            raise ScheduleError(f"schedule {rank} claims rank {sched.rank} of {sched.size}")
        limits = (sched.in_count, sched.out_count, sched.tmp_count)
        for i, step in enumerate(sched.steps):
            if step.deps and (step.deps[-1] >= i or step.deps[0] < 0):
                raise ScheduleError(
                    f"rank {rank} step {i} {step!r}: dependency not on an earlier step"
                )
            for region in (step.src, step.dst):
                if region is None:
                    continue
                limit = limits[region.buf]
                if region.offset < 0 or region.count <= 0 or region.end > limit:
                    raise ScheduleError(
                        f"rank {rank} step {i} {step!r}: {region} outside buffer of {limit}"
                    )
            if step.dst is not None and step.dst.buf == IN:
                raise ScheduleError(f"rank {rank} step {i} {step!r}: writes the input buffer")
            if step.kind is StepKind.SEND:
                sends[(rank, step.peer, step.tag)] = step.count
            elif step.kind in (StepKind.RECV, StepKind.RECV_REDUCE):
                recvs[(step.peer, rank, step.tag)] = step.count
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


def run_joint(
    schedules: Sequence[Schedule],
    buffers: Sequence[list[list[Any]]] | None = None,
    combine: Combine | None = None,
) -> list[set[int]]:
    """Interpret all schedules together (see the module docstring).

    Args:
        schedules: one per rank, rank order.
        buffers: per rank, the lists [IN, OUT, TMP] of element values, mutated in place;
            None to check structure only. ``OUT`` may be the same list as ``IN``.
        combine: ``combine(a, b)`` returns ``a ∘ b``; required with ``buffers``.

    Returns:
        Per rank, the set of ranks whose start happens-before that rank's end
        (the barrier property).

    Raises:
        ScheduleError: on a structural fault or a deadlock.
    """
    check_static(schedules)
    size = len(schedules)
    with_data = buffers is not None
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

    def read(rank: int, region: Region) -> list[Any]:
        assert buffers is not None
        return buffers[rank][region.buf][region.offset : region.end]

    def write(rank: int, region: Region, values: list[Any]) -> None:
        assert buffers is not None
        buffers[rank][region.buf][region.offset : region.end] = values

    def combine_lists(first: list[Any], second: list[Any], where: str) -> list[Any]:
        assert combine is not None
        if any(v is None for v in first) or any(v is None for v in second):
            raise ScheduleError(f"{where}: reduces an element that was never written")
        return [combine(a, b) for a, b in zip(first, second, strict=True)]

    def finish(rank: int, i: int) -> None:
        nonlocal n_left
        finished[rank][i] = True
        n_left -= 1
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
            where = f"rank {rank} step {i} {step!r}"
            res = combine_lists(data, cur, where) if step.first else combine_lists(cur, data, where)
            write(rank, step.dst, res)
        finish(rank, i)

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
        else:
            if with_data:
                assert step.src is not None
                assert step.dst is not None
                src = read(rank, step.src)
                if kind is StepKind.COPY:
                    write(rank, step.dst, src)
                else:
                    cur = read(rank, step.dst)
                    where = f"rank {rank} step {i} {step!r}"
                    res = (
                        combine_lists(src, cur, where)
                        if step.first
                        else combine_lists(cur, src, where)
                    )
                    write(rank, step.dst, res)
            finish(rank, i)

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

    seen: list[set[int]] = []
    for rank in range(size):
        mask = 1 << rank
        for k in known[rank]:
            mask |= k
        seen.append({r for r in range(size) if mask >> r & 1})
    return seen
