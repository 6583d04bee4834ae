"""A root given as a numpy integer (``np.argmax(...)``, an element of an array) is a root.

``check_root`` accepted numpy integers but calls went on with the value as given: an
unsigned one made the builders' ``(rank - root) % size`` wrap on ranks below the root, so
those ranks built another call's schedule and failed (``invalid peer``), and a signed one,
kept in the flight recorder's ring, made every later dump fail (JSON refuses numpy scalars):
the mismatch a later call found then raised TypeError in place of MismatchError.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import run_ranks

pytestmark = pytest.mark.timeout(60)

ROOT_TYPES = [np.uint8, np.uint32, np.uint64, np.int64]


@pytest.mark.parametrize("kind", ROOT_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize(
    ("collective", "algorithm"),
    [
        ("broadcast", "binomial"),
        ("broadcast", "scatter_allgather"),
        ("reduce", "binomial"),
        ("reduce", "rabenseifner"),
        ("gather", "binomial"),
        ("scatter", "binomial"),
        ("gatherv", "direct"),
        ("scatterv", "binomial"),
    ],
)
def test_a_numpy_root_is_the_rank_it_names(collective: str, algorithm: str, kind: Any) -> None:
    size, root = 3, 2

    def body(comm: plait.Communicator) -> Any:
        r, at = comm.rank, kind(root)
        if collective == "broadcast":
            x = np.full(4, float(r))
            comm.broadcast(x, at, algorithm=algorithm)
            return x
        if collective == "reduce":
            return comm.reduce(np.full(4, r + 1.0), at, algorithm=algorithm)
        if collective == "gather":
            return comm.gather(np.full(2, float(r)), at, algorithm=algorithm)
        if collective == "scatter":
            return comm.scatter(np.arange(2.0 * size), at, algorithm=algorithm)
        if collective == "gatherv":
            return comm.gatherv(np.full(r + 1, float(r)), [1, 2, 3], at, algorithm=algorithm)
        return comm.scatterv(np.arange(6.0), [1, 2, 3], at, algorithm=algorithm)

    got = run_ranks(size, body)
    for r, value in enumerate(got):
        if collective == "broadcast":
            np.testing.assert_array_equal(value, np.full(4, float(root)))
        elif collective in ("reduce", "gather", "gatherv") and r != root:
            assert value is None
        elif collective == "reduce":
            np.testing.assert_array_equal(value, np.full(4, 6.0))
        elif collective == "gather":
            np.testing.assert_array_equal(value, np.repeat(np.arange(3.0), 2).reshape(3, 2))
        elif collective == "gatherv":
            np.testing.assert_array_equal(value, [0.0, 1.0, 1.0, 2.0, 2.0, 2.0])
        elif collective == "scatter":
            np.testing.assert_array_equal(value, [2.0 * r, 2.0 * r + 1])
        else:
            np.testing.assert_array_equal(value, np.arange(6.0)[[0, 1, 3][r] :][: r + 1])


@pytest.mark.parametrize("kind", [np.uint16, np.int64], ids=lambda t: t.__name__)
def test_numpy_roots_of_the_object_collectives(kind: Any) -> None:
    def body(comm: plait.Communicator) -> Any:
        r = comm.rank
        got = comm.bcast_object({"from": r}, root=kind(2))
        parts = comm.scatter_object([f"part {i}" for i in range(3)], root=kind(2))
        gathered = comm.gather_object(r * 10, root=kind(2))
        return got, parts, gathered

    got = run_ranks(3, body)
    for r, (value, part, gathered) in enumerate(got):
        assert value == {"from": 2}
        assert part == f"part {r}"
        assert gathered == ([0, 10, 20] if r == 2 else None)


def test_a_mismatch_after_a_call_with_a_numpy_root_is_a_mismatch_and_dumps() -> None:
    def body(comm: plait.Communicator) -> Any:
        comm.broadcast(np.zeros(3), root=np.int64(0))
        try:
            comm.allreduce(np.zeros(4 + comm.rank), timeout=20)
        except plait.MismatchError as exc:
            return str(exc)
        raise AssertionError("no MismatchError")

    for msg in run_ranks(2, body):
        _, _, path = msg.partition("; flight recorder dump: ")
        with open(path.split(";")[0].strip()) as f:
            calls = json.load(f)["calls"]
        assert [c["root"] for c in calls if c["collective"] == "broadcast"] == [0]
