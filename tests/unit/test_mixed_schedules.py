"""Mixed schedules: messages across hosts, one-sided steps on each host's window.

Note [mixed schedules] in :mod:`plait.schedule.ir`: the steps that use the window
run in step order, messages beside them as their data allows. Here: the builder
chains them, the static check refuses schedules that do not, the joint run finds
races in them, and ``hierarchical_arena`` and ``cascade_arena`` are proven on every
host layout for p = 1..33 (the real runs are in tests/multiprocess).
"""

from __future__ import annotations

import dataclasses

import pytest

from plait.algos._registry import get
from plait.schedule.builder import Builder, Context, HostLayout, record
from plait.schedule.ir import SHARED, Region, Schedule, StepKind, uses_window
from plait.schedule.symbolic import prove
from plait.schedule.verify import ScheduleError, check_hosts, check_static, run_joint

SPEC = get("allreduce", "hierarchical_arena")
PIPELINED = get("allreduce", "cascade_arena")
QUICK = {1, 2, 3, 4, 5, 7}


def layouts(p: int) -> list[list[int]]:
    """Hosts of 2 and 3 in order, interleaved, of unequal size, and one rank per host."""
    return [
        [r // 2 for r in range(p)],
        [r // 3 for r in range(p)],
        [r % 3 for r in range(p)],
        [0 if r < p // 2 + 1 else 1 + r % 2 for r in range(p)],
        list(range(p)),
    ]


def build(
    p: int, count: int, hosts: list[int], window: int = 1 << 20, spec: object = SPEC
) -> list[Schedule]:
    ctx = Context("allreduce", 0, p, count, hosts=HostLayout(hosts), window=window)
    return [record(spec.build, ctx.with_rank(r)) for r in range(p)]  # type: ignore[attr-defined]


def exchange_then_publish(b: Builder) -> None:
    """Two ranks of one host exchange messages, share through the window, then exchange again."""
    other = 1 - b.rank
    b.send(other, b.inp)
    b.recv(other, b.out)
    win = b.shared(b.out.count)
    b.copy(b.out, win)
    b.post(1)
    b.get_reduce(other, win, b.out, 1, get_first=b.rank == 1)
    b.send(other, b.out)
    b.recv(other, b.scratch(b.out.count))


def two(build_fn: object, count: int = 4) -> list[Schedule]:
    ctx = Context("allreduce", 0, 2, count, hosts=HostLayout([0, 0]), window=1 << 20)
    return [record(build_fn, ctx.with_rank(r)) for r in range(2)]  # type: ignore[arg-type]


def test_the_builder_chains_the_window_steps() -> None:
    for sched in two(exchange_then_publish):
        assert sched.mixed
        assert not sched.one_sided
        last = -1
        for i, step in enumerate(sched.steps):
            if uses_window(step):
                if last >= 0:
                    assert last in step.deps, (i, step)
                last = i
        assert last >= 0
    check_static(two(exchange_then_publish))


def test_messages_are_ordered_by_their_data_only() -> None:
    """A message that shares no data with the window part runs beside it."""

    def beside(b: Builder) -> None:
        other = 1 - b.rank
        win = b.shared(b.out.count)
        b.copy(b.inp, win)
        b.post(1)
        b.send(other, b.inp)  # reads IN only: nothing of the window part
        b.get(other, win, b.out, 1)
        b.recv(other, b.scratch(b.inp.count))

    for sched in two(beside):
        send = next(i for i, st in enumerate(sched.steps) if st.kind is StepKind.SEND)
        get = next(i for i, st in enumerate(sched.steps) if st.kind is StepKind.GET)
        assert not sched.steps[send].deps
        assert send not in sched.steps[get].deps
    run_joint(two(beside))


def test_the_static_check_refuses_a_window_step_out_of_the_chain() -> None:
    scheds = two(exchange_then_publish)
    s0 = scheds[0]
    post = next(i for i, st in enumerate(s0.steps) if st.kind is StepKind.POST)
    steps = list(s0.steps)
    steps[post] = dataclasses.replace(s0.steps[post], deps=())
    with pytest.raises(ScheduleError, match="must follow the last one before it"):
        check_static([dataclasses.replace(s0, steps=tuple(steps)), scheds[1]])


def test_a_write_after_a_message_still_races_with_a_reader() -> None:
    """A message does not order a write to the window after a peer's read of it."""

    def racy(b: Builder) -> None:
        other = 1 - b.rank
        win = b.shared(b.out.count)
        b.copy(b.inp, win)
        b.post(1)
        b.get(other, win, b.out, 1)
        b.send(other, b.out)  # a message between the two does not say the peer has read
        b.recv(other, b.scratch(b.out.count))
        b.copy(b.out, win)  # overwrites what the peer may still be reading
        b.post(2)

    with pytest.raises(ScheduleError, match="race"):
        run_joint(two(racy))


def test_ranks_that_send_no_message_across_hosts_are_one_sided() -> None:
    # Hosts of 2, 2 and 1 ranks: one leader per host; ranks 3 and 4 only share (the
    # executor runs them on their host's window, tests/multiprocess/test_host_windows.py).
    scheds = build(5, 7, [0, 1, 2, 0, 1])
    assert [s.mixed for s in scheds] == [True, True, False, False, False]
    assert [s.one_sided for s in scheds] == [False, False, False, True, True]
    alone = scheds[2]  # alone on its host: messages only, no window
    assert not alone.shared_count
    check_static(scheds)


def test_one_host_is_one_sided() -> None:
    ctx = Context("allreduce", 0, 3, 7, window=1 << 20)
    scheds = [record(SPEC.build, ctx.with_rank(r)) for r in range(3)]
    assert all(s.one_sided and not s.mixed for s in scheds)


@pytest.mark.parametrize(
    "size",
    [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in range(1, 34)],
)
def test_hierarchical_and_cascade_arena_prove_on_every_layout(size: int) -> None:
    for spec in (SPEC, PIPELINED):
        for hosts in layouts(size):
            for count in sorted({0, 1, size - 1, size, size + 1, 131}):
                prove(spec, size, count, hosts=hosts)
                prove(spec, size, count, hosts=hosts, in_place=True)
            # Small windows: many pieces, each reusing the window's regions.
            for window in (2 * size + 2, 3 * size + 5, 4 * size + 9):
                for count in (size + 1, 37):
                    prove(spec, size, count, hosts=hosts, window=window)
                    prove(spec, size, count, hosts=hosts, window=window, in_place=True)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_missing_wait_is_a_race_the_proof_finds(pipelined: bool) -> None:
    """The check can fail: a rank that reads its leader's result a phase early is caught."""
    if pipelined:  # many pieces, two in the window at once
        scheds = build(4, 37, [0, 0, 1, 1], window=17, spec=PIPELINED)
    else:
        scheds = build(4, 3, [0, 0, 1, 1])
    s1 = scheds[1]
    get_at = max(i for i, st in enumerate(s1.steps) if st.kind is StepKind.GET)
    steps = list(s1.steps)
    steps[get_at] = dataclasses.replace(s1.steps[get_at], tag=1)  # phase 1, not 2
    broken = [scheds[0], dataclasses.replace(s1, steps=tuple(steps)), *scheds[2:]]
    with pytest.raises(ScheduleError, match="race"):
        run_joint(broken)


def test_messages_never_move_the_window() -> None:
    def send_window(b: Builder) -> None:
        win = b.shared(b.out.count)
        b.copy(b.inp, win)
        b.send(1 - b.rank, win)

    with pytest.raises(ValueError, match="cannot send from or receive into the window"):
        two(send_window)
    scheds = two(exchange_then_publish)
    s0 = scheds[0]
    last_send = max(i for i, st in enumerate(s0.steps) if st.kind is StepKind.SEND)
    steps = list(s0.steps)
    steps[last_send] = dataclasses.replace(s0.steps[last_send], src=Region(SHARED, 0, 4))
    with pytest.raises(ScheduleError, match="a message cannot move the window's memory"):
        check_static([dataclasses.replace(s0, steps=tuple(steps)), scheds[1]])


@pytest.mark.parametrize(
    ("shared", "host_windows", "hosts", "picked"),
    [
        (True, False, None, True),  # one host, one window: its one-sided shape
        (False, True, [0, 0, 1, 1], True),  # a window per host
        (True, False, [0, 0, 1, 1], False),  # one window across hosts (emulated)
        (False, False, [0, 0, 1, 1], False),  # no window
    ],
)
def test_plait_algo_names_it_only_where_its_windows_are(
    shared: bool, host_windows: bool, hosts: list[int] | None, picked: bool
) -> None:
    from plait.selection.overrides import parse
    from plait.selection.select import Settings, choose

    config = Settings(overrides=parse("allreduce:hierarchical_arena"))
    layout = None if hosts is None else HostLayout(hosts)
    choice = choose(
        "allreduce",
        4,
        1 << 20,
        commutative=True,
        hosts=layout,
        config=config,
        shared=shared,
        host_windows=host_windows,
    )
    assert (choice.name == "hierarchical_arena") is picked, choice


def test_the_proof_refuses_a_window_read_across_hosts() -> None:
    """A window is one host's: a one-sided step that names a rank on another host fails the
    proof (the one-host ``arena`` over two hosts), and so does a host-aware schedule whose
    read is pointed at a rank across."""
    with pytest.raises(ScheduleError, match="reads the window of rank 2 on host 1"):
        prove(get("allreduce", "arena"), 4, 5, hosts=[0, 0, 1, 1])
    prove(get("allreduce", "arena"), 4, 5)  # on one host it proves
    hosts = [0, 0, 1, 1]
    scheds = build(4, 6, hosts)
    check_hosts(scheds, hosts)
    s1 = scheds[1]
    at = next(i for i, st in enumerate(s1.steps) if st.kind is StepKind.GET)
    steps = list(s1.steps)
    steps[at] = dataclasses.replace(s1.steps[at], peer=3)
    moved = [scheds[0], dataclasses.replace(s1, steps=tuple(steps)), *scheds[2:]]
    with pytest.raises(ScheduleError, match="rank 1 is on host 0"):
        check_hosts(moved, hosts)


def _ancestors(sched: Schedule) -> list[set[int]]:
    found: list[set[int]] = []
    for step in sched.steps:
        mine: set[int] = set(step.deps)
        for d in step.deps:
            mine |= found[d]
        found.append(mine)
    return found


def test_a_pieces_messages_overlap_the_next_pieces_window_steps() -> None:
    """``cascade_arena`` pipelines its pieces: piece 0's messages across hosts and piece 1's
    reduction on the host's window depend on each other in neither direction, so they run
    together (in ``hierarchical_arena`` piece 1 waits for piece 0's messages)."""
    sched = build(4, 37, [0, 0, 1, 1], window=17, spec=PIPELINED)[0]  # pieces of 5 elements
    above = _ancestors(sched)
    sends = [i for i, st in enumerate(sched.steps) if st.kind is StepKind.SEND]
    reads = [i for i, st in enumerate(sched.steps) if st.kind is StepKind.GET_REDUCE]
    first_send, second_read = sends[0], reads[1]  # piece 0 across, piece 1 on the host
    assert first_send not in above[second_read]
    assert second_read not in above[first_send]
    assert second_read < first_send  # the next piece's window steps come first
    above = _ancestors(build(4, 37, [0, 0, 1, 1], window=17)[0])
    sched = build(4, 37, [0, 0, 1, 1], window=17)[0]
    sends = [i for i, st in enumerate(sched.steps) if st.kind is StepKind.SEND]
    reads = [i for i, st in enumerate(sched.steps) if st.kind is StepKind.GET_REDUCE]
    assert sends[0] in above[reads[1]]


def test_a_window_too_small_for_two_pieces_runs_them_in_sequence() -> None:
    """``cascade_arena`` takes any window ``hierarchical_arena`` takes: where two pieces do
    not fit, it runs one at a time (pipelined order over one region would deadlock)."""
    for window in range(3, 20):
        for hosts in ([0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 1, 0, 1, 2]):
            for count in (1, 5, 37):
                prove(PIPELINED, len(hosts), count, hosts=hosts, window=window)
                prove(PIPELINED, len(hosts), count, hosts=hosts, window=window, in_place=True)
