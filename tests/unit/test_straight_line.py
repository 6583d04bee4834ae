"""Straight-line orders (plait.schedule.straight): which schedules get one, and that they
never deadlock.

Every rank of every registered message-passing algorithm runs its order here on paper,
with the strictest sends (a send completes only once its receive is posted, as over a
transport without buffering): all ranks must finish. The real runs of the same orders are
the collective tests (threads, processes, and the lockstep transport).
"""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

import plait
from plait.algos._registry import build_schedule, specs
from plait.schedule.builder import Builder, Context
from plait.schedule.ir import OUT, Region, Schedule, Step, StepKind
from plait.schedule.straight import (
    L_COMBINE,
    L_LOCAL,
    L_POST,
    L_RECV,
    L_SEND,
    L_WAIT,
    LINE_BYTES,
    LINE_STEPS,
    Line,
    straight_line,
)

MESSAGE_SPECS = [
    s for c in plait.COLLECTIVES for s in specs(c) if not s.needs_window and not s.needs_fabric
]
#: The small-message algorithms: each gets a straight line at every size.
ALWAYS = {
    ("allreduce", "recursive_doubling"),
    ("allreduce", "binomial"),
    ("allreduce", "direct"),
    ("allgather", "recursive_doubling"),
    ("allgather", "bruck"),
    ("alltoall", "pairwise"),
    ("barrier", "dissemination"),
    ("broadcast", "binomial"),
    ("gather", "binomial"),
    ("scatter", "binomial"),
    ("reduce", "binomial"),
    ("reduce_scatter", "pairwise"),
    ("reduce_scatter", "recursive_halving"),
}


def _count(collective: str, size: int) -> int:
    return 0 if collective == "barrier" else 3


def _schedules(spec: plait.algos.AlgorithmSpec, size: int) -> list[Schedule]:
    return [
        build_schedule(spec, Context(spec.collective, r, size, _count(spec.collective, size), 4))
        for r in range(size)
    ]


def _check_shape(schedule: Schedule, line: Line) -> None:
    """Each step appears once as what it is; each handle is waited for once, after it was
    issued; a combine follows its receive's wait."""
    issued, waited, done = set(), set(), set()
    for op in line:
        code, i = op[0], op[1]
        kind = schedule.steps[i].kind
        if code in (L_SEND, L_RECV, L_POST):
            want = {L_SEND: StepKind.SEND, L_RECV: StepKind.RECV, L_POST: StepKind.RECV_REDUCE}
            assert kind is want[code]
            assert i not in issued
            issued.add(i)
        elif code == L_WAIT:
            assert i in issued
            assert i not in waited
            waited.add(i)
        elif code == L_COMBINE:
            assert kind is StepKind.RECV_REDUCE
            assert i in waited
            assert i not in done
            done.add(i)
        else:
            assert code == L_LOCAL
            assert kind in (StepKind.COPY, StepKind.REDUCE)
            assert i not in done
            done.add(i)
    messages = {i for i, s in enumerate(schedule.steps) if s.kind <= StepKind.RECV_REDUCE}
    assert issued == waited == messages
    staged = {i for i, s in enumerate(schedule.steps) if s.kind is StepKind.RECV_REDUCE}
    local = set(range(len(schedule.steps))) - messages
    void = {i for i in local if _onto_itself(schedule.steps[i])}  # left out: they do nothing
    assert done == staged | (local - void)


def _onto_itself(step: Step) -> bool:
    s, d = step.src, step.dst
    assert s is not None
    assert d is not None
    return step.kind is StepKind.COPY and (s.buf, s.offset) == (d.buf, d.offset)


def _run_on_paper(schedules: list[Schedule], lines: list[Line]) -> None:
    """Run every rank's order at once; sends complete only once matched. All must finish."""
    size = len(schedules)
    pc = [0] * size
    # (sender, receiver, tag) -> sends, receives not yet matched (step indices), in order
    sends: dict[tuple[int, int, int], deque[int]] = defaultdict(deque)
    recvs: dict[tuple[int, int, int], deque[int]] = defaultdict(deque)
    finished: list[set[int]] = [set() for _ in range(size)]  # handles complete, per rank

    def match(key: tuple[int, int, int]) -> None:
        while sends[key] and recvs[key]:
            finished[key[0]].add(sends[key].popleft())
            finished[key[1]].add(recvs[key].popleft())

    moved = True
    while moved:
        moved = False
        for r in range(size):
            while pc[r] < len(lines[r]):
                op = lines[r][pc[r]]
                step = schedules[r].steps[op[1]]
                if op[0] == L_SEND:
                    key = (r, step.peer, step.tag)
                    sends[key].append(op[1])
                    match(key)
                elif op[0] in (L_RECV, L_POST):
                    key = (step.peer, r, step.tag)
                    recvs[key].append(op[1])
                    match(key)
                elif op[0] == L_WAIT and op[1] not in finished[r]:
                    break
                pc[r] += 1
                moved = True
    stuck = {r: lines[r][pc[r]] for r in range(size) if pc[r] < len(lines[r])}
    assert not stuck, f"ranks blocked at {stuck}"


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17])
@pytest.mark.parametrize("spec", MESSAGE_SPECS, ids=lambda s: f"{s.collective}-{s.name}")
def test_straight_lines_are_well_formed_and_never_deadlock(
    spec: plait.algos.AlgorithmSpec, size: int
) -> None:
    schedules = _schedules(spec, size)
    lines = [straight_line(s, 4) for s in schedules]
    if (spec.collective, spec.name) in ALWAYS:
        assert all(line is not None for line in lines), [
            r for r, line in enumerate(lines) if line is None
        ]
    if any(line is None for line in lines):
        return  # those ranks run the dataflow, which the prover checks
    for schedule, line in zip(schedules, lines, strict=True):
        assert line is not None
        _check_shape(schedule, line)
    _run_on_paper(schedules, [line for line in lines if line is not None])


def _builder(size: int = 3, count: int = 4) -> Builder:
    return Builder(Context("allreduce", 0, size, count), count, count)


def test_two_exchanges_each_waiting_on_its_own_receive_get_none() -> None:
    """Waiting for either receive first would hold back the other exchange's send, which
    its peer may need before it sends to us: no straight line is safe."""
    b = _builder()
    b.recv_reduce(1, Region(OUT, 0, 1), recv_first=False)
    b.recv_reduce(2, Region(OUT, 1, 1), recv_first=False)
    b.send(1, Region(OUT, 0, 1))  # after the receive from rank 1 (it reads what that wrote)
    b.send(2, Region(OUT, 1, 1))
    assert straight_line(b.build(), 4) is None


def test_the_wait_chosen_is_one_all_later_messages_need() -> None:
    """Issued first is the receive from rank 1, but only the one from rank 2 is needed by the
    send still to come: that one is waited for first."""
    b = _builder()
    first = b.recv_reduce(1, Region(OUT, 0, 1), recv_first=False)
    second = b.recv_reduce(2, Region(OUT, 1, 1), recv_first=False)
    send = b.send(1, Region(OUT, 1, 1))
    line = straight_line(b.build(), 4)
    assert line is not None
    waits = [op[1] for op in line if op[0] == L_WAIT]
    assert waits.index(second) < waits.index(first)
    assert [op[0] for op in line].index(L_SEND) > [op[:2] for op in line].index((L_WAIT, second))
    assert send in [op[1] for op in line if op[0] == L_SEND]


def test_long_schedules_and_large_messages_run_as_a_dataflow() -> None:
    b = _builder(count=LINE_STEPS + 1)
    for k in range(LINE_STEPS + 1):
        b.send(1, Region(OUT, k, 1))
    assert straight_line(b.build(), 4) is None
    big = LINE_BYTES // 4 + 1
    b = _builder(count=big)
    b.send(1, Region(OUT, 0, big))
    assert straight_line(b.build(), 4) is None
    assert straight_line(b.build(), 2) is not None  # the same count in 2-byte items fits
