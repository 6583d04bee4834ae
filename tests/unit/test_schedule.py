"""The builder's bookkeeping and the verifier's ability to catch broken schedules."""

from __future__ import annotations

import itertools

import pytest

from plait.schedule.builder import MOST_SEGMENTS, Builder, Context, blocks, segments
from plait.schedule.ir import IN, OUT, TMP, Region, Schedule, StepKind
from plait.schedule.verify import ScheduleError, run_joint


def builder(rank: int, size: int, n_in: int = 8, n_out: int = 8) -> Builder:
    return Builder(Context("allreduce", rank, size, 8), n_in, n_out)


def test_blocks_and_segments() -> None:
    assert blocks(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert blocks(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert blocks(0, 2) == [(0, 0), (0, 0)]
    r = Region(OUT, 4, 10)
    assert segments(r, 0) == [r]
    assert segments(r, 4) == [Region(OUT, 4, 4), Region(OUT, 8, 4), Region(OUT, 12, 2)]


def test_a_long_region_is_cut_into_longer_segments_not_more() -> None:
    n = 4 * MOST_SEGMENTS + 1
    cut = segments(Region(IN, 0, n), 1)
    assert len(cut) <= MOST_SEGMENTS
    assert [s.offset for s in cut] == sorted(s.offset for s in cut)
    assert sum(s.count for s in cut) == n  # every element once, in order
    assert all(a.offset + a.count == b.offset for a, b in itertools.pairwise(cut))


def test_a_schedule_never_grows_with_a_claimed_count_alone() -> None:
    """An allgatherv whose counts claim a trillion rows of a peer (who refuses them): its
    ring schedule was built step by step, a core busy and memory growing for minutes."""
    from plait.algos._registry import build_schedule, get

    ctx = Context("allgatherv", 0, 2, 0, segment=16384, counts=(1, 1 << 40))
    sched = build_schedule(get("allgatherv", "ring"), ctx)
    assert len(sched.steps) <= 2 * MOST_SEGMENTS + 8


def test_dependencies_follow_data_hazards() -> None:
    b = builder(0, 2)
    c = b.copy(b.inp, b.out)  # writes OUT[0:8]
    s1 = b.send(1, b.out.sub(0, 4))  # reads what c wrote
    s2 = b.send(1, b.out.sub(4, 4))
    r = b.recv_reduce(1, b.out.sub(0, 4), recv_first=True)  # must wait for s1 (WAR), not s2
    t = b.scratch(4)
    u = b.copy(b.inp.sub(0, 4), t)  # independent of everything on OUT
    sched = b.build()
    steps = sched.steps
    assert steps[s1].deps == (c,)
    assert steps[s2].deps == (c,)
    assert steps[r].deps == (c, s1)
    assert steps[u].deps == ()
    assert [steps[s1].tag, steps[s2].tag, steps[r].tag] == [0, 1, 0]
    assert sched.tmp_count == 4
    assert sched.dependents[c] == (s1, s2, r)


def test_empty_steps_are_dropped() -> None:
    b = builder(0, 2)
    assert b.send(1, b.out.sub(0, 0)) == -1
    assert b.copy(b.out, b.out) == -1
    assert b.build().steps == ()


def test_bad_peer_is_refused() -> None:
    b = builder(0, 2)
    with pytest.raises(ValueError, match="invalid peer"):
        b.send(0, b.out)
    with pytest.raises(ValueError, match="invalid peer"):
        b.recv(2, b.out)


def _two(build0: object, build1: object, n: int = 8) -> list[Schedule]:
    out = []
    for rank, fn in enumerate((build0, build1)):
        b = builder(rank, 2, n, n)
        fn(b)  # type: ignore[operator]
        out.append(b.build())
    return out


def test_verifier_accepts_an_exchange() -> None:
    def body(b: Builder) -> None:
        b.copy(b.inp, b.out)
        b.send(1 - b.rank, b.out)
        b.recv_reduce(1 - b.rank, b.out, recv_first=b.rank == 1)

    run_joint(_two(body, body))


def test_verifier_finds_unmatched_send() -> None:
    with pytest.raises(ScheduleError, match="has no receive"):
        run_joint(_two(lambda b: b.send(1, b.inp), lambda b: None))


def test_verifier_finds_length_mismatch() -> None:
    with pytest.raises(ScheduleError, match="sends 8 elements, receives 4"):
        run_joint(_two(lambda b: b.send(1, b.inp), lambda b: b.recv(0, b.out.sub(0, 4))))


def test_verifier_finds_deadlock_without_buffering() -> None:
    # Both ranks receive before they send, into the region they then send: a cycle.
    def body(b: Builder) -> None:
        b.recv(1 - b.rank, b.out)
        b.send(1 - b.rank, b.out)

    with pytest.raises(ScheduleError, match="deadlock"):
        run_joint(_two(body, body))


def test_verifier_finds_out_of_bounds_and_writes_to_input() -> None:
    from plait.schedule.ir import Step

    def sched(step: Step) -> list[Schedule]:
        s = Schedule(0, 1, (step,), 4, 4, 0, ((),), (0,))
        return [s]

    with pytest.raises(ScheduleError, match="outside buffer"):
        run_joint(sched(Step(StepKind.COPY, src=Region(IN, 2, 4), dst=Region(OUT, 0, 4))))
    with pytest.raises(ScheduleError, match="writes the input"):
        run_joint(sched(Step(StepKind.COPY, src=Region(OUT, 0, 4), dst=Region(IN, 0, 4))))
    with pytest.raises(ScheduleError, match="outside buffer"):
        run_joint(sched(Step(StepKind.COPY, src=Region(OUT, 0, 1), dst=Region(TMP, 0, 1))))


def test_prover_rejects_a_wrong_algorithm() -> None:
    """A schedule that forgets one rank's contribution must fail the proof."""
    from plait.algos._registry import AlgorithmSpec
    from plait.schedule.symbolic import prove

    def lossy(b: Builder) -> None:  # rank 0 never sends: result misses x0 on rank 1
        b.copy(b.inp, b.out)
        if b.rank == 0:
            b.recv_reduce(1, b.out, recv_first=False)
        else:
            b.send(0, b.out)

    with pytest.raises(ScheduleError, match="rank 1 OUT"):
        prove(AlgorithmSpec("allreduce", "lossy", lossy), 2, 3)

    def unordered(b: Builder) -> None:  # reduces in rank order on one rank only
        b.copy(b.inp, b.out)
        b.send(1 - b.rank, b.out)
        b.recv_reduce(1 - b.rank, b.out, recv_first=True)

    with pytest.raises(ScheduleError, match=r"differ in the last bits|expected"):
        prove(AlgorithmSpec("allreduce", "unordered", unordered), 2, 3, commutative=False)


def test_prover_rejects_associations_that_differ_between_ranks() -> None:
    """Every rank holds every contribution, but grouped differently: bits would differ."""
    from plait.algos._registry import AlgorithmSpec
    from plait.schedule.symbolic import prove

    def lopsided(b: Builder) -> None:  # rank 0 makes ((0 1) 2), ranks 1 and 2 (0 (1 2))
        p = b.size
        peers = b.scratch(p * b.ctx.count)
        parts = [peers.sub(q * b.ctx.count, b.ctx.count) for q in range(p)]
        for q in range(p):
            if q != b.rank:
                b.send(q, b.inp)
                b.recv(q, parts[q])
        b.copy(b.inp, parts[b.rank])
        if b.rank == 0:
            b.copy(parts[0], b.out)
            b.reduce(parts[1], b.out, src_first=False)
            b.reduce(parts[2], b.out, src_first=False)
        else:
            b.copy(parts[2], b.out)
            b.reduce(parts[1], b.out, src_first=True)
            b.reduce(parts[0], b.out, src_first=True)

    with pytest.raises(
        ScheduleError,
        match=r"computed as \(0 \(1 2\)\) on rank 1 but as "
        r"\(\(0 1\) 2\) on rank 0",
    ):
        prove(AlgorithmSpec("allreduce", "lopsided", lopsided), 3, 2)


def test_prover_refuses_a_call_no_communicator_makes() -> None:
    """A root outside the ranks was proven as a reduce that returns nothing anywhere."""
    from plait.algos._registry import get
    from plait.schedule.symbolic import prove

    spec = get("reduce", "binomial")
    for root in (-1, 4):
        with pytest.raises(ValueError, match=rf"root must be a rank, in 0\.\.3; got {root}"):
            prove(spec, 4, 8, root=root)
    with pytest.raises(ValueError, match="count must be >= 0; got -3"):
        prove(get("allreduce", "ring"), 4, -3)
    with pytest.raises(ValueError, match="size must be at least 1; got 0"):
        prove(get("allreduce", "ring"), 0, 3)
    prove(spec, 4, 8, root=3)


def test_a_message_refused_for_its_after_leaves_no_trace() -> None:
    """A send or receive told to wait for a later step raises before it numbers a message
    or counts the schedule as one with messages: a one-sided schedule whose builder went on
    after the error came out "mixed", and a caught error left a gap in the tags."""
    b = builder(0, 2)
    with pytest.raises(ValueError, match="only wait for earlier steps"):
        b.send(1, Region(IN, 0, 4), after=[0])
    with pytest.raises(ValueError, match="only wait for earlier steps"):
        b.recv(1, Region(OUT, 0, 4), after=[0])
    b.post(1)
    sched = b.build()
    assert not sched.mixed
    b = builder(0, 2)
    with pytest.raises(ValueError, match="only wait for earlier steps"):
        b.send(1, Region(IN, 0, 4), after=[0])
    b.send(1, Region(IN, 0, 4))
    assert [st.tag for st in b.build().steps] == [0]
