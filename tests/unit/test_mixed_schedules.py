"""Mixed schedules: messages across hosts, one-sided steps on each host's window.

Note [mixed schedules] in :mod:`plait.schedule.ir`: the steps that use the window
are fences. Here: the builder makes them so, the static check refuses schedules
that are not, the joint run finds races in them, and ``hierarchical_arena`` is
proven on every host layout (the real runs are in tests/multiprocess).
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


def build(p: int, count: int, hosts: list[int], window: int = 1 << 20) -> list[Schedule]:
    ctx = Context("allreduce", 0, p, count, hosts=HostLayout(hosts), window=window)
    return [record(SPEC.build, ctx.with_rank(r)) for r in range(p)]


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


def test_the_builder_makes_window_steps_fences() -> None:
    for sched in two(exchange_then_publish):
        assert sched.mixed
        assert not sched.one_sided
        fence = -1
        for i, step in enumerate(sched.steps):
            if uses_window(step):
                assert set(step.deps) >= set(range(max(fence, 0), i)), (i, step)
                fence = i
            elif fence >= 0:
                assert fence in step.deps, (i, step)
        assert fence >= 0
    check_static(two(exchange_then_publish))


def test_the_static_check_refuses_a_window_step_that_is_not_a_fence() -> None:
    scheds = two(exchange_then_publish)
    s0 = scheds[0]
    copy = next(i for i, st in enumerate(s0.steps) if st.kind is StepKind.COPY)
    loose = dataclasses.replace(s0.steps[copy], deps=(copy - 1,))
    steps = list(s0.steps)
    steps[copy] = loose
    with pytest.raises(ScheduleError, match="must follow every step before it"):
        check_static([dataclasses.replace(s0, steps=tuple(steps)), scheds[1]])
    send = next(i for i, st in enumerate(s0.steps) if i > copy and st.kind is StepKind.SEND)
    steps = list(s0.steps)
    steps[send] = dataclasses.replace(s0.steps[send], deps=())
    with pytest.raises(ScheduleError, match="must follow the last step that used the window"):
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
    [p if p in QUICK else pytest.param(p, marks=pytest.mark.slow) for p in [*range(1, 18), 24, 33]],
)
def test_hierarchical_arena_proves_on_every_layout(size: int) -> None:
    for hosts in layouts(size):
        for count in sorted({0, 1, size - 1, size, size + 1, 131}):
            prove(SPEC, size, count, hosts=hosts)
            prove(SPEC, size, count, hosts=hosts, in_place=True)
        # Small windows: many pieces, each reusing the window's two regions.
        for window in (2 * size + 2, 3 * size + 5):
            for count in (size + 1, 37):
                prove(SPEC, size, count, hosts=hosts, window=window)
                prove(SPEC, size, count, hosts=hosts, window=window, in_place=True)


def test_a_missing_wait_is_a_race_the_proof_finds() -> None:
    """The check can fail: a rank that reads its leader's result a phase early is caught."""
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
