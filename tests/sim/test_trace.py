"""Chrome / Perfetto traces: one process per rank, slices that never overlap on a track."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from plait import sim


def test_trace_file(tmp_path: Path) -> None:
    res = sim.simulate("allreduce", "ring", 4 * 6 * 8, sim.flat(6, 1e-6, 1e-9, 1e-10), trace=True)
    path = tmp_path / "ring.json"
    sim.write_trace(res, path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(6)}
    slices = [e for e in events if e["ph"] == "X"]
    assert res.records is not None
    assert len(slices) == len(res.records)
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in slices:
        assert e["dur"] >= 0
        tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end - 1e-9  # slices on one track do not overlap
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == res.messages
    last = max(e["ts"] + e["dur"] for e in slices)
    assert last == pytest.approx(res.time * 1e6)


def test_records_follow_the_schedule() -> None:
    res = sim.simulate("broadcast", "binomial", 1000, sim.flat(4, 1e-6, 1e-9), trace=True)
    assert res.records is not None
    for rec in res.records:
        assert rec.ready <= rec.start <= rec.end <= res.time


def test_trace_needs_records(tmp_path: Path) -> None:
    res = sim.simulate("allreduce", "ring", 64, sim.flat(2, 1e-6, 1e-9))
    with pytest.raises(ValueError, match="trace=True"):
        sim.write_trace(res, tmp_path / "x.json")
