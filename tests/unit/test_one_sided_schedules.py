"""One-sided steps (POST, GET, GET_REDUCE, WAIT) in the verifier and the symbolic prover.

Hand-made schedules recorded with the builder: a correct "everyone reads
everyone" allreduce, and the ways to get one wrong (a missing or misplaced
post, a window overwritten while a peer may still read it, a read of what was
never written, bad regions and phases).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from plait.schedule.builder import Builder, Context, record
from plait.schedule.ir import OUT, SHARED, Region, Schedule, Step, StepKind
from plait.schedule.symbolic import prove
from plait.schedule.verify import ScheduleError, check_static, run_joint

Build = Callable[[Builder], None]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What ``prove`` needs: a collective, a name and a builder function."""

    build: Build
    collective: str = "allreduce"
    name: str = "one_sided"


def publish(b: Builder) -> Region:
    """Copy this rank's input into a fresh window region and post phase 1."""
    win = b.shared(b.out.count)
    b.copy(b.inp, win)
    b.post(1)
    return win


def gather_reduce(b: Builder, win: Region) -> None:
    """``OUT = x0 ∘ x1 ∘ … ∘ x(p-1)``, left to right on every rank, read from the windows."""
    for q in range(b.size):
        if q == b.rank:
            if q == 0:
                b.copy(win, b.out)
            else:
                b.reduce(win, b.out, src_first=False)
        elif q == 0:
            b.get(q, win, b.out, 1)
        else:
            b.get_reduce(q, win, b.out, 1, get_first=False)


def allreduce(b: Builder) -> None:
    """Everyone reads everyone: publish the input, then fold every window in rank order."""
    gather_reduce(b, publish(b))


def schedules(build: Build, size: int, count: int = 4, *, window: int = 1 << 20) -> list[Schedule]:
    ctx = Context("allreduce", 0, size, count, window=window)
    return [record(build, ctx.with_rank(r)) for r in range(size)]


def rewrite(sched: Schedule, i: int, **changes: object) -> Schedule:
    """``sched`` with step ``i`` changed (deps and everything derived kept)."""
    steps = list(sched.steps)
    steps[i] = dataclasses.replace(steps[i], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(sched, steps=tuple(steps))


# -- (i) a correct one-sided allreduce ------------------------------------------------------


@pytest.mark.parametrize("size", range(1, 8))
def test_everyone_reads_everyone_proves(size: int) -> None:
    for count in (0, 1, size + 1):
        prove(Recipe(allreduce), size, count)
        prove(Recipe(allreduce), size, count, commutative=False)
        prove(Recipe(allreduce), size, count, in_place=True)


def test_the_schedule_is_one_sided_and_chained() -> None:
    s = schedules(allreduce, 3)[1]
    assert s.one_sided
    assert s.shared_count == 4
    assert [st.kind for st in s.steps] == [
        StepKind.COPY,
        StepKind.POST,
        StepKind.GET,
        StepKind.REDUCE,
        StepKind.GET_REDUCE,
    ]
    assert all(i - 1 in st.deps for i, st in enumerate(s.steps) if i)


def test_run_joint_keeps_accepting_three_buffers() -> None:
    scheds = schedules(allreduce, 3, 2)
    leaf: Callable[[int, int], tuple[int, ...]] = lambda r, i: (r * 10 + i,)  # noqa: E731
    bufs = [[[leaf(r, i) for i in range(2)], [None] * 2, []] for r in range(3)]
    run_joint(scheds, bufs, lambda a, b: a + b)
    assert bufs[2][1] == [(0, 10, 20), (1, 11, 21)]
    assert all(len(b) == 3 for b in bufs)  # the caller's lists are not extended


def test_a_one_sided_barrier_hears_from_everyone() -> None:
    def barrier(b: Builder) -> None:
        b.post(1)
        for q in range(b.size):
            if q != b.rank:
                b.wait(q, 1)

    for size in range(1, 6):
        prove(Recipe(barrier, "barrier"), size, 0)

    def leaky(b: Builder) -> None:  # rank 1 waits for rank 0 only: it never hears of rank 2
        b.post(1)
        for q in range(b.size):
            if q != b.rank and (b.rank != 1 or q == 0):
                b.wait(q, 1)

    with pytest.raises(ScheduleError, match=r"rank 1 can leave before hearing from \[2\]"):
        prove(Recipe(leaky, "barrier"), 3, 0)


def test_what_the_reader_learns_flows_through_the_poster() -> None:
    # Rank 2 hears of rank 0 only through rank 1, which waited for rank 0 before posting.
    def chain(b: Builder) -> None:
        if b.rank:
            b.wait(b.rank - 1, 1)
        b.post(1)

    assert run_joint(schedules(chain, 3))[2] == {0, 1, 2}


# -- (ii) posts missing or late -------------------------------------------------------------


def test_a_missing_post_would_wait_forever() -> None:
    def no_post_on_1(b: Builder) -> None:
        win = b.shared(b.out.count)
        b.copy(b.inp, win)
        if b.rank != 1:
            b.post(1)
        gather_reduce(b, win)

    with pytest.raises(
        ScheduleError,
        match=r"deadlock: rank 0 step \d+ <get_reduce r1\.SHARED\[0:4\].*: "
        r"rank 1 never posts phase 1 or later; it would wait forever",
    ):
        prove(Recipe(no_post_on_1), 3, 4)


def test_a_post_after_the_reads_deadlocks() -> None:
    def late_post(b: Builder) -> None:  # every rank reads before it publishes
        win = b.shared(b.out.count)
        b.copy(b.inp, win)
        if b.size > 1:
            b.get(1 - b.rank, win, b.scratch(b.out.count), 1)
        b.post(1)
        b.copy(win, b.out)

    prove(Recipe(late_post), 1, 4)  # alone, nothing to wait for
    with pytest.raises(ScheduleError, match=r"deadlock: .*first stuck: rank 0 step 1 <get r1"):
        run_joint(schedules(late_post, 2))


# -- (iii) a window overwritten while a peer may read it ------------------------------------


def overwrite(b: Builder) -> None:
    """After the allreduce, put the result in the window (without waiting for the readers)."""
    allreduce(b)
    b.copy(b.out, Region(SHARED, 0, b.out.count))


def overwrite_after_wait(b: Builder) -> None:
    """The same, once every reader has said (phase 2) that it is done reading."""
    allreduce(b)
    b.post(2)
    for q in range(b.size):
        if q != b.rank:
            b.wait(q, 2)
    b.copy(b.out, Region(SHARED, 0, b.out.count))


def test_overwriting_a_published_window_is_a_race() -> None:
    pattern = (
        r"race: rank 0 step 5 <copy OUT\[0:4\] -> SHARED\[0:4\].*> overwrites SHARED\[0:4\] "
        r"while rank 1 may still read it \(step 2 <get r0\.SHARED\[0:4\].*phase 1\)"
    )
    with pytest.raises(ScheduleError, match=pattern):
        run_joint(schedules(overwrite, 3))  # structure only: races need no data
    with pytest.raises(ScheduleError, match=pattern):
        prove(Recipe(overwrite), 3, 4)


def test_overwriting_after_waiting_for_the_readers_passes() -> None:
    for size in range(1, 6):
        prove(Recipe(overwrite_after_wait), size, 4)


def test_waiting_for_only_some_readers_is_still_a_race() -> None:
    def waits_for_rank_1_only(b: Builder) -> None:
        allreduce(b)
        b.post(2)
        if b.rank != 1:
            b.wait(1, 2)
        b.copy(b.out, Region(SHARED, 0, b.out.count))

    with pytest.raises(ScheduleError, match=r"rank 0 step \d+ .* while rank 2 may still read"):
        run_joint(schedules(waits_for_rank_1_only, 3))


def test_a_stale_phase_does_not_cover_a_rewrite() -> None:
    # Rank 0 publishes twice in one region; rank 1 reads the second value but names
    # phase 1, so it may read before the rewrite: a race, though this run reads late.
    def twice(b: Builder) -> None:
        win = b.shared(b.out.count)
        if b.rank == 0:
            b.copy(b.inp, win)
            b.post(1)
            b.wait(1, 1)
            b.reduce(b.inp, win, src_first=False)
            b.post(2)
        else:
            b.post(1)
            b.wait(0, 2)
            b.get(0, win, b.out, 1)

    with pytest.raises(ScheduleError, match=r"race: rank 0 step 3 <reduce .*phase 1\)"):
        run_joint(schedules(twice, 2))
    fixed = schedules(twice, 2)
    fixed[1] = rewrite(fixed[1], 2, tag=2)
    run_joint(fixed)


# -- (iv) reading what was never written ----------------------------------------------------


def test_a_get_of_a_window_never_written_fails_the_proof() -> None:
    def unwritten(b: Builder) -> None:  # posts the window without copying the input in
        win = b.shared(b.out.count)
        b.post(1)
        gather_reduce(b, win)

    # Rank 0's own first operand is its (empty) window: reducing it fails.
    with pytest.raises(ScheduleError, match="reduces an element that was never written"):
        prove(Recipe(unwritten), 2, 3)

    def plain_get(b: Builder) -> None:  # a broadcast whose root posts an unwritten window
        win = b.shared(b.out.count)
        b.post(1)
        if b.rank:
            b.get(0, win, b.out, 1)

    with pytest.raises(ScheduleError, match=r"rank 1 OUT\[0\] = None, expected \(\(0, 0\),\)"):
        prove(Recipe(plain_get, "broadcast"), 2, 3)


# -- (v) static checks ----------------------------------------------------------------------


def test_a_get_is_bounded_by_the_peers_window() -> None:
    def reads_too_much(b: Builder) -> None:
        win = b.shared(4 if b.rank == 0 else 8)
        b.post(1)
        if b.rank == 1:
            b.get(0, win, Region(OUT, 0, 8), 1)

    with pytest.raises(
        ScheduleError,
        match=r"rank 1 step 1 <get r0\.SHARED\[0:8\].*SHARED\[0:8\] outside buffer of 4",
    ):
        check_static(schedules(reads_too_much, 2, 8))


def test_a_local_window_region_is_bounded_by_its_own_window() -> None:
    scheds = schedules(allreduce, 2)
    bad = rewrite(scheds[0], 0, dst=Region(SHARED, 2, 4))
    with pytest.raises(ScheduleError, match=r"rank 0 step 0 .*SHARED\[2:6\] outside buffer of 4"):
        check_static([bad, scheds[1]])


def test_phases_start_at_one_and_increase() -> None:
    scheds = schedules(overwrite_after_wait, 2)
    posts = [i for i, st in enumerate(scheds[0].steps) if st.kind is StepKind.POST]
    assert [scheds[0].steps[i].tag for i in posts] == [1, 2]
    decreasing = rewrite(scheds[0], posts[1], tag=1)
    with pytest.raises(ScheduleError, match=r"rank 0 step 4 <post phase 1.*phase 1 after phase 1"):
        check_static([decreasing, scheds[1]])
    zero = rewrite(scheds[0], posts[0], tag=0)
    with pytest.raises(ScheduleError, match=r"rank 0 step 1 <post phase 0.*phases start at 1"):
        check_static([zero, scheds[1]])
    wait = next(i for i, st in enumerate(scheds[1].steps) if st.kind is StepKind.WAIT)
    with pytest.raises(ScheduleError, match=r"rank 1 step \d+ <wait r0 phase 0.*start at 1"):
        check_static([scheds[0], rewrite(scheds[1], wait, tag=0)])
    with pytest.raises(ScheduleError, match=r"rank 0 never posts phase 3 or later"):
        check_static([scheds[0], rewrite(scheds[1], wait, tag=3)])


def test_a_one_sided_schedule_exchanges_no_messages() -> None:
    scheds = schedules(allreduce, 2)
    send = rewrite(scheds[0], 2, kind=StepKind.SEND, peer=1, src=Region(OUT, 0, 4), dst=None)
    with pytest.raises(ScheduleError, match=r"rank 0 step 2 <send .*cannot exchange messages"):
        check_static([send, scheds[1]])

    def mixed(b: Builder) -> None:
        b.post(1)
        b.send(1 - b.rank, b.inp)
        b.recv(1 - b.rank, b.out)

    # With messages too, a schedule is mixed (tests/unit/test_mixed_schedules.py).
    assert [(s.one_sided, s.mixed) for s in schedules(mixed, 2)] == [(False, True)] * 2


def test_one_sided_steps_need_a_one_sided_chained_schedule() -> None:
    scheds = schedules(allreduce, 2)
    unmarked = dataclasses.replace(scheds[0], one_sided=False)
    with pytest.raises(ScheduleError, match="not marked one_sided"):
        check_static([unmarked, scheds[1]])
    unchained = rewrite(scheds[0], 2, deps=(0,))
    with pytest.raises(ScheduleError, match=r"rank 0 step 2 .*must follow step 1"):
        check_static([unchained, scheds[1]])
    get = 3  # rank 0: copy, post, copy, get_reduce from rank 1
    assert scheds[0].steps[get].kind is StepKind.GET_REDUCE
    bad_peer = rewrite(scheds[0], get, peer=0)
    with pytest.raises(ScheduleError, match="invalid peer 0"):
        check_static([bad_peer, scheds[1]])
    from_out = rewrite(scheds[0], get, src=Region(OUT, 0, 4))
    with pytest.raises(ScheduleError, match=r"a get reads a peer's window, not OUT\[0:4\]"):
        check_static([from_out, scheds[1]])
    post_with_data = rewrite(scheds[0], 1, dst=Region(SHARED, 0, 4))
    with pytest.raises(ScheduleError, match="a post moves no data"):
        check_static([post_with_data, scheds[1]])


def test_the_window_limits_the_builder() -> None:
    with pytest.raises(ValueError, match="do not fit the window of 8 bytes"):
        schedules(allreduce, 2, 16, window=8)
    assert Step(StepKind.POST, tag=1).count == 0
