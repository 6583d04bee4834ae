"""The simulator on one-sided schedules: what posts, waits and gets cost, data, traces, faults."""

from __future__ import annotations

import json

import numpy as np
import pytest

from plait import sim
from plait.ops import SUM
from plait.schedule.builder import Builder, Context, record
from plait.schedule.ir import Schedule, StepKind
from plait.sim.data import check, start_buffers
from plait.sim.engine import run_schedules

ALPHA, DELTA, GAMMA = 1e-6, 1e-10, 2e-10  # s per post, s/B copied, s/B reduced
ITEM = 4  # bytes per element


def allreduce(b: Builder) -> None:
    """Everyone reads everyone: publish the input, then fold every window in rank order."""
    win = b.shared(b.out.count)
    b.copy(b.inp, win)
    b.post(1)
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


def schedules(build: object, p: int, count: int) -> list[Schedule]:
    ctx = Context("allreduce", 0, p, count, ITEM, window=count * ITEM)
    return [record(build, ctx.with_rank(r)) for r in range(p)]  # type: ignore[arg-type]


def flat(p: int) -> sim.Network:
    """No links, every post (and message) ALPHA: the times below are exact."""
    return sim.flat(p, ALPHA, 1e-9, GAMMA, delta=DELTA, ports=False)


def test_a_one_sided_allreduce_costs_copies_a_post_and_reductions() -> None:
    times = []
    for count in (1 << 10, 1 << 14, 1 << 18):
        nb = count * ITEM
        res = sim.simulate_schedules(schedules(allreduce, 4, count), flat(4), ITEM)
        # Ranks 1..3: copy into the window, then (once rank 0's post is visible, ALPHA
        # after it) get rank 0's window, then three reductions of nb bytes each.
        assert res.time == pytest.approx(2 * DELTA * nb + ALPHA + 3 * GAMMA * nb, rel=1e-12)
        # Rank 0 copies its own window meanwhile, then waits for rank 1's post if needed.
        first = max(2 * DELTA * nb, DELTA * nb + ALPHA)
        assert res.finish[0] == pytest.approx(first + 3 * GAMMA * nb, rel=1e-12)
        assert res.messages == 0
        assert not res.link_bytes.any()  # gets move host memory, no link
        times.append(res.time)
    assert times == sorted(times)
    assert times[-1] > 100 * times[0]


def late_poster(b: Builder) -> None:
    """Rank 0 copies ``count`` elements into its window, then posts; rank 1 waits, then gets."""
    if b.rank == 0:
        b.copy(b.inp, b.shared(b.out.count))
        b.post(1)
    else:
        b.wait(0, 1)
        b.get(0, b.shared(b.out.count), b.out, 1)


def test_a_wait_is_charged_the_posters_time() -> None:
    nb = 1000 * ITEM
    out = run_schedules(schedules(late_poster, 2, 1000), flat(2), ITEM, record=True)
    post_at = DELTA * nb
    assert out.finish[0] == pytest.approx(post_at, rel=1e-12)
    assert out.records is not None
    wait = next(r for r in out.records if r.kind is StepKind.WAIT)
    assert wait.ready == 0.0
    assert wait.end == pytest.approx(post_at + ALPHA, rel=1e-12)
    get = next(r for r in out.records if r.kind is StepKind.GET)
    assert get.start == pytest.approx(post_at + ALPHA, rel=1e-12)
    assert out.finish[1] == pytest.approx(post_at + ALPHA + DELTA * nb, rel=1e-12)


def test_a_post_is_seen_after_the_intra_host_latency() -> None:
    intra = sim.LinkParams(3e-6, 1e-10)
    net = sim.hosts(1, 2, intra, sim.LinkParams(1e-5, 1e-9), gamma=GAMMA, delta=DELTA)
    out = run_schedules(schedules(late_poster, 2, 1000), net, ITEM)
    nb = 1000 * ITEM
    assert out.finish[1] == pytest.approx(DELTA * nb + intra.alpha + DELTA * nb, rel=1e-12)


def test_one_sided_data_reaches_the_reference() -> None:
    p, count = 4, 5
    scheds = schedules(allreduce, p, count)
    dt = np.dtype(np.float32)
    xs: list[np.ndarray | None] = [np.arange(count, dtype=dt) + 10 * r for r in range(p)]
    data = start_buffers("allreduce", scheds, xs, dt, 0, SUM)
    assert [b[3].size for b in data.buffers] == [count] * p
    out = run_schedules(scheds, flat(p), ITEM, data=data)
    results = check("allreduce", out, xs, SUM, 0, p)
    np.testing.assert_array_equal(results[2], sum(xs))  # type: ignore[arg-type]


def test_the_trace_shows_posts_waits_and_gets() -> None:
    res = sim.simulate_schedules(schedules(allreduce, 3, 64), flat(3), ITEM, trace=True)
    assert res.records is not None
    trace = sim.trace_events(res.records, name="one-sided")
    events = json.loads(json.dumps(trace))["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"copy", "post 1", "get <- r0 @1", "get_reduce <- r2 @1", "reduce"} <= names
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {"compute", "sync"}
    arrows = [e for e in events if e["ph"] in "sf" and e["cat"] == "post"]
    assert len(arrows) == 2 * 3 * 2  # every rank's two gets, each an arrow start and end


def test_a_wait_for_a_phase_never_posted_deadlocks() -> None:
    def never(b: Builder) -> None:
        b.post(1)
        if b.rank == 1:
            b.wait(0, 2)

    with pytest.raises(
        RuntimeError, match=r"deadlock: .*rank 1 step 1 \(wait for rank 0 phase 2\)"
    ):
        run_schedules(schedules(never, 2, 1), flat(2), ITEM)
