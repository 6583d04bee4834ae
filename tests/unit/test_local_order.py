"""Two steps of a rank that touch the same memory are ordered whatever the timing.

The executor starts every step whose dependencies are done, while the joint run
picks one order: a schedule that leaves two such steps unordered was proven
correct and could give wrong results (Note [local order] in
:mod:`plait.schedule.order`). The prover, and the verifier's static check, refuse it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from plait.algos._registry import AlgorithmSpec, build_schedule, get
from plait.schedule.builder import Builder, Context, HostLayout, record
from plait.schedule.ir import Schedule, StepKind
from plait.schedule.symbolic import prove
from plait.schedule.verify import ScheduleError, check_static, run_joint


def chain(b: Builder) -> None:
    """A broadcast along the chain 0 -> 1 -> ... -> p-1: each rank passes on what it got."""
    if b.rank > 0:
        b.recv(b.rank - 1, b.out)
    if b.rank < b.size - 1:
        b.send(b.rank + 1, b.out)


CHAIN = AlgorithmSpec("broadcast", "chain", chain)


def with_deps(sched: Schedule, deps: Callable[[int, tuple[int, ...]], tuple[int, ...]]) -> Schedule:
    """``sched`` with step ``i``'s deps ``deps(i, old)``, and the fields derived from them."""
    steps = tuple(dataclasses.replace(s, deps=deps(i, s.deps)) for i, s in enumerate(sched.steps))
    dependents: list[list[int]] = [[] for _ in steps]
    for i, s in enumerate(steps):
        for d in s.deps:
            dependents[d].append(i)
    return dataclasses.replace(
        sched,
        steps=steps,
        dependents=tuple(tuple(d) for d in dependents),
        n_deps=tuple(len(s.deps) for s in steps),
        roots=tuple(i for i, s in enumerate(steps) if not s.deps),
    )


def altered(rank: int, change: Callable[[Schedule], Schedule]) -> Callable[..., Schedule]:
    """A ``build`` for :func:`prove`: the registry's schedules, ``rank``'s changed."""

    def build(spec: AlgorithmSpec, ctx: Context) -> Schedule:
        sched = build_schedule(spec, ctx)
        return change(sched) if ctx.rank == rank else sched

    return build


def test_a_chain_whose_middle_rank_forwards_before_it_receives_is_refused() -> None:
    # Without its dependency, rank 1's send may go before its receive: on the memory
    # transport, started last, rank 0 left rank 2 with zeros, and the one order the joint
    # run takes proved it.
    free = altered(1, lambda s: with_deps(s, lambda i, d: ()))
    with pytest.raises(
        ScheduleError,
        match=r"rank 1: step 0 <recv OUT\[0:4\] <- r0 #0 deps=\[\]> and step 1 <send OUT\[0:4\] "
        r"-> r2 #0 deps=\[\]> both touch OUT\[0:4\] and step 0 writes it, but nothing orders them",
    ):
        prove(CHAIN, 3, 4, build=free)


def test_the_chain_with_its_dependencies_proves() -> None:
    for size in range(1, 6):
        for count in (0, 1, 4):
            prove(CHAIN, size, count, root=0, build=lambda spec, ctx: record(spec.build, ctx))


def test_a_registered_algorithm_missing_one_dependency_is_refused() -> None:
    # The ring's first receive-and-reduce on rank 2 without the copy of IN into OUT before
    # it: the joint run copies first (it ran the copy at once), the executor need not.
    spec = get("allreduce", "ring")
    first = build_schedule(spec, Context("allreduce", 2, 4, 5))
    at = next(i for i, s in enumerate(first.steps) if s.kind is StepKind.RECV_REDUCE)
    (copy,) = first.steps[at].deps
    assert first.steps[copy].kind is StepKind.COPY
    prove(spec, 4, 5, build=build_schedule)

    def drop(s: Schedule) -> Schedule:
        return with_deps(s, lambda i, d: tuple(x for x in d if i != at or x != copy))

    with pytest.raises(
        ScheduleError,
        match=rf"rank 2: step {copy} <copy IN\[0:5\] -> OUT\[0:5\] deps=\[\]> and step {at} "
        r"<recv_reduce OUT\[0:2\] .* both touch OUT\[0:2\] and both write it",
    ):
        prove(spec, 4, 5, build=altered(2, drop))


def test_a_window_step_missing_its_dependency_on_a_copy_is_refused() -> None:
    # A mixed schedule: its get-and-reduce into OUT must follow the copy of IN into OUT,
    # which is no step of the window's chain.
    spec = get("allreduce", "hierarchical_arena")
    hosts = [0, 0, 1, 1]
    ctx = Context("allreduce", 0, 4, 6, hosts=HostLayout(hosts), window=1 << 40)
    first = build_schedule(spec, ctx)
    assert first.mixed
    at = next(i for i, s in enumerate(first.steps) if s.kind is StepKind.GET_REDUCE)
    (copy,) = (d for d in first.steps[at].deps if first.steps[d].kind is StepKind.COPY)

    def drop(s: Schedule) -> Schedule:
        return with_deps(s, lambda i, d: tuple(x for x in d if i != at or x != copy))

    with pytest.raises(ScheduleError, match=rf"rank 0: step {copy} <copy .* and step {at} "):
        prove(spec, 4, 6, hosts=hosts, build=altered(0, drop))


def exchange(b: Builder) -> None:
    """Each of two ranks sends its IN and reduces what it receives into OUT."""
    b.copy(b.inp, b.out)
    b.send(1 - b.rank, b.inp)
    b.recv_reduce(1 - b.rank, b.out, recv_first=b.rank == 1)


def test_in_place_a_send_of_in_and_a_receive_into_out_are_one_memory() -> None:
    spec = AlgorithmSpec("allreduce", "exchange", exchange)
    prove(spec, 2, 3)
    # In place the copy is skipped and the receive may reduce into the memory the send
    # still reads: nothing orders them (the peer's message does not wait for this one).
    with pytest.raises(
        ScheduleError,
        match=r"rank 0: step 1 <send IN\[0:3\] .* and step 2 <recv_reduce OUT\[0:3\] .* "
        r"both touch OUT\[0:3\] \(IN and OUT are one memory in place\) and step 2 writes it",
    ):
        prove(spec, 2, 3, in_place=True)


def test_a_message_chain_orders_steps_that_no_dependency_does() -> None:
    # In place, a binomial allreduce sends IN and receives the result into OUT, the same
    # memory, with no dependency between the two: the result it receives was made from
    # what it sent, so the send has read everything first.
    spec = get("allreduce", "binomial")
    sched = build_schedule(spec, Context("allreduce", 1, 2, 1))
    send, recv = (i for i, s in enumerate(sched.steps) if s.kind in (StepKind.SEND, StepKind.RECV))
    assert send not in sched.steps[recv].deps
    for size in (2, 3, 5):
        prove(spec, size, 1, in_place=True, build=build_schedule)


def test_derived_fields_that_disagree_with_deps_are_refused() -> None:
    # The executor and the joint run follow dependents and n_deps: a schedule whose deps
    # say otherwise would be checked in one order and run in another.
    scheds = [record(chain, Context("broadcast", r, 3, 4)) for r in range(3)]
    run_joint(scheds)
    middle = scheds[1]
    steps = tuple(dataclasses.replace(s, deps=()) for s in middle.steps)
    with pytest.raises(ScheduleError, match="n_deps disagree"):
        check_static([scheds[0], dataclasses.replace(middle, steps=steps), scheds[2]])
    loose = dataclasses.replace(middle, n_deps=(0, 0), roots=(0,))
    with pytest.raises(ScheduleError, match="n_deps disagree"):
        check_static([scheds[0], loose, scheds[2]])
    early = dataclasses.replace(middle, roots=(0, 1))
    with pytest.raises(ScheduleError, match="roots are not the steps without deps"):
        check_static([scheds[0], early, scheds[2]])
