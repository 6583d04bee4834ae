"""Lateness: from start times on one clock, or from waits across clocks."""

from __future__ import annotations

import numpy as np
import pytest
from dumpkit import FakeClock

import plait
from plait.diagnostics.recorder import CallShape, FlightRecorder
from plait.diagnostics.stragglers import (
    LocalCall,
    format_lateness,
    from_table,
    local_calls,
    local_collectives,
    local_row,
    measure,
    newest_done,
    stragglers,
)

NAN = float("nan")


def test_lateness_from_starts() -> None:
    starts = np.array([[0.0, 0.5, 0.1], [10.0, 10.5, 10.0], [20.0, 21.0, 20.2]])
    ends = starts + 1.0
    result = measure(starts, ends, [4, 5, 6], ["allreduce"] * 3)
    assert [x.rank for x in result] == [0, 1, 2]
    assert result[1].median == pytest.approx(0.5)
    assert result[1].max == pytest.approx(1.0)
    assert result[1].worst_seq == 6
    assert result[0].median == 0.0
    assert result[2].mean == pytest.approx(0.1)
    assert [x.rank for x in stragglers(result, 0.05)] == [1, 2]
    assert [x.rank for x in stragglers(result, 0.2)] == [1]


def test_lateness_from_waits_ignores_rooted_collectives_and_clocks() -> None:
    # rank 1 arrives 0.3 s late; every rank's clock is off by a different amount
    offsets = np.array([0.0, 100.0, -50.0])
    starts = np.array([[0.0, 0.3, 0.0], [5.0, 5.3, 5.0]]) + offsets
    ends = np.array([[1.0, 1.0, 1.0], [6.0, 6.0, 6.0]]) + offsets
    starts[1, 0] = 4.0  # a broadcast's root may start early and end early: not compared
    result = measure(starts, ends, [0, 1], ["allreduce", "broadcast"], same_clock=False)
    assert [x.calls for x in result] == [1, 1, 1]
    assert result[1].median == pytest.approx(0.3)
    assert result[0].median == pytest.approx(0.0)


def test_unknown_times_are_left_out() -> None:
    starts = np.array([[0.0, NAN, 0.2], [1.0, NAN, NAN]])
    result = measure(starts, starts + 1, [0, 1], ["barrier", "barrier"])
    assert [x.calls for x in result] == [1, 0, 1]  # a call with one time compares nothing
    assert result[1].worst_seq is None
    assert format_lateness(result)[1] == "rank 1: no call to compare"
    assert format_lateness(result)[2] == (
        "rank 2: median 200.0 ms, mean 200.0 ms, max 200.0 ms (#0) over 1 calls"
    )


def test_a_lone_rank_measures_its_calls_on_time() -> None:
    # It measured none: a call needed two ranks' times, which a one-rank job never has.
    starts = np.array([[0.0], [1.0], [NAN]])
    result = measure(starts, starts + 1, [0, 1, 2], ["allreduce"] * 3)
    assert [(x.calls, x.median, x.max) for x in result] == [(2, 0.0, 0.0)]


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="calls, ranks"):
        measure(np.zeros(3), np.zeros(3), [0], ["allreduce"])
    with pytest.raises(ValueError, match="2 rows"):
        measure(np.zeros((2, 2)), np.zeros((2, 2)), [0], ["allreduce"])


def test_the_live_exchange(clock: FakeClock) -> None:
    """What comm.stragglers() would allgather, and what every rank computes from it."""
    shape = CallShape("allreduce", "ring", 2, np.dtype(np.float32), plait.SUM)
    recs = [FlightRecorder(r, 3, capacity=8) for r in range(3)]
    for seq in range(10):
        slots = []
        for r, rec in enumerate(recs):
            clock.advance(0.2 if r == 2 else 0.001)  # rank 2 arrives 0.2 s after rank 1
            slots.append(rec.begin(shape, seq))
        clock.advance(0.01)
        for rec, slot in zip(recs, slots, strict=True):
            rec.end(slot)
    calls = [local_calls(rec) for rec in recs]
    assert [c.seq for c in calls[0]] == list(range(2, 10))  # calls 0 and 1 left the ring of 8
    assert newest_done(calls[0]) == 9
    assert newest_done([]) == -1
    n = 6  # calls 4..9
    table = np.stack([local_row(c, 9, n) for c in calls])
    assert table.shape == (3, 18)
    for same_clock in (True, False):
        result = from_table(table, local_collectives(calls[0]), same_clock=same_clock)
        assert [x.calls for x in result] == [n] * 3
        assert result[2].median == pytest.approx(0.201, abs=1e-3)
        assert result[1].median == pytest.approx(0.001, abs=1e-3)
        assert result[2].worst_seq in range(4, 10)
    row = local_row(calls[0], 3, 4)  # up to call 3, the ring has calls 2 and 3: NaN before them
    assert np.isnan(row[[0, 1, 4, 5, 8, 9]]).all()
    assert row[2:4].tolist() == [2.0, 3.0]
    assert np.isfinite(row[[6, 7, 10, 11]]).all()


def _calls(seqs: list[int], start: float) -> list[LocalCall]:
    return [LocalCall(q, "allreduce", start + q, 0.5) for q in seqs]


def test_the_window_lists_calls_by_number() -> None:
    """Calls that are not measured (stragglers' own, failed ones) leave no hole in the window:
    it is the last n measured calls, whatever their numbers (Note [live stragglers])."""
    # calls 20..23 were two earlier stragglers calls, absent from every rank's list
    seqs = [*range(14, 20), *range(24, 27)]
    calls = [_calls(seqs, 0.0), _calls(seqs, 0.25)]
    table = np.stack([local_row(c, 26, 8) for c in calls])
    result = from_table(table, local_collectives(calls[0]), same_clock=True)
    assert [x.calls for x in result] == [8, 8]
    assert result[1].median == pytest.approx(0.25)
    # a call that failed on rank 1 only is in rank 0's row but not in rank 1's: left out
    calls[1] = [c for c in calls[1] if c.seq != 25]
    table = np.stack([local_row(c, 26, 8) for c in calls])
    result = from_table(table, local_collectives(calls[0]), same_clock=True)
    assert [x.calls for x in result] == [7, 7]
    assert result[0].worst_seq != 25


def test_an_empty_table_measures_nothing() -> None:
    table = np.stack([local_row([], 5, 3), local_row(_calls([4, 5], 0.0), 5, 3)])
    result = from_table(table, {}, same_clock=False)
    assert [x.calls for x in result] == [0, 0]
