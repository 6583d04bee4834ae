"""Arrays and arguments of unusual form: ndarray subclasses, a view too large for memory,
timeouts at and past their bounds, custom ops that differ only in their function, and what a
root without data is told."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import plait
from plait.runtime.work import MAX_TIMEOUT
from plait.testing import RankFailure, run_ranks

#: np.matrix warns that it is not the recommended way (an error under this suite's filters).
MATRIX = pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")

ALLREDUCE = ["auto", "arena", "arena_oneshot", "direct", "ring", "recursive_doubling"]


@MATRIX
@pytest.mark.parametrize("algorithm", ALLREDUCE)
def test_a_matrix_is_read_as_the_plain_array_over_its_memory(algorithm: str) -> None:
    """np.matrix stays 2-D under reshape(-1): a one-sided call failed midway on one rank while
    its peer finished (Note [array subclasses])."""

    def body(c: plait.Communicator) -> list[Any]:
        x = np.matrix([[1.0, 2.0], [3.0, 4.0]]) * (c.rank + 1)
        y = c.allreduce(x, algorithm=algorithm)
        out = np.matrix(np.zeros((2, 2)))
        same = c.allreduce(x, algorithm=algorithm, out=out)
        return [type(y), y.tolist(), same is out, out.tolist()]

    want = [[6.0, 12.0], [18.0, 24.0]]
    for r in run_ranks(3, body):
        assert r == [np.ndarray, want, True, want]


@MATRIX
def test_other_calls_take_a_matrix_too() -> None:
    def body(c: plait.Communicator) -> list[Any]:
        m = np.matrix([[1.0, 2.0], [3.0, 4.0]]) + c.rank
        b = np.matrix([[5.0, 6.0]]) if c.rank == 0 else np.matrix(np.zeros((1, 2)))
        c.broadcast(b)
        return [
            b.tolist(),
            np.asarray(c.reduce_scatter(m)).tolist(),
            np.asarray(c.alltoall(m)).tolist(),
            np.asarray(c.allgather(m)).shape,
            np.asarray(c.scatter(m if c.rank == 0 else None, out=np.zeros((1, 2)))).tolist(),
        ]

    r0, r1 = run_ranks(2, body)
    assert r0 == [[[5.0, 6.0]], [[3.0, 5.0]], [[1.0, 2.0], [2.0, 3.0]], (2, 2, 2), [[1.0, 2.0]]]
    assert r1 == [[[5.0, 6.0]], [[7.0, 9.0]], [[3.0, 4.0], [4.0, 5.0]], (2, 2, 2), [[3.0, 4.0]]]


@pytest.mark.parametrize("where", ["x", "out"])
def test_a_masked_array_is_refused(where: str) -> None:
    """Its masked values would be summed as if they were data."""
    masked = np.ma.masked_array([1.0, 1000.0], mask=[False, True])

    def body(c: plait.Communicator) -> str:
        x, out = (masked, None) if where == "x" else (np.ones(2), masked.copy())
        with pytest.raises(TypeError, match=f"{where} is a masked array.*pass {where}.data"):
            c.allreduce(x, out=out)
        return "refused"

    assert run_ranks(2, body) == ["refused", "refused"]


def test_a_view_too_large_for_memory_fails_at_once() -> None:
    """A read-only view of 2**50 elements: the call's buffer fails to be made before any
    schedule is built (the one-sided schedule of its four billion pieces took for ever)."""

    def body(c: plait.Communicator) -> str:
        with pytest.raises(MemoryError):
            c.allreduce(np.broadcast_to(np.zeros(1), (2**50,)), algorithm="arena", timeout=3)
        return "refused"

    assert run_ranks(2, body, timeout=10) == ["refused", "refused"]


def test_work_wait_checks_its_timeout() -> None:
    def body(c: plait.Communicator) -> list[Any]:
        said: list[Any] = []
        for bad, kind in ((-1, ValueError), (math.nan, ValueError), ("1", TypeError)):
            w = c.allreduce(np.ones(3), async_op=True)
            with pytest.raises(kind, match="wait: timeout must be"):
                w.wait(timeout=bad)
            said.append(w.wait().tolist())
        w = c.allreduce(np.ones(3), async_op=True)
        said.append(w.wait(math.inf).tolist())  # taken as MAX_TIMEOUT
        said.append(w.wait(0).tolist())  # done: 0 only looks
        return said

    for r in run_ranks(2, body):
        assert r == [[2.0] * 3] * 5


@pytest.mark.parametrize("seconds", [math.inf, 1e300])
def test_a_timeout_past_the_longest_is_the_longest(seconds: float) -> None:
    """A wait of 1e300 s used to fail at once with OverflowError, once it waited."""

    def body(c: plait.Communicator) -> list[Any]:
        if c.rank == 1:
            c.barrier()  # rank 0 is then in its allreduce first, and waits in its slow way
        got = c.allreduce(np.ones(3), timeout=seconds).tolist()
        if c.rank == 0:
            c.barrier()
        return [got, c.allreduce(np.ones(2), algorithm="ring", timeout=seconds).tolist()]

    with pytest.raises(RankFailure):  # the barriers above cross: rank 0 waits in allreduce
        run_ranks(2, body, timeout=2)
    assert (
        run_ranks(2, lambda c: c.allreduce(np.ones(2), timeout=seconds).tolist())
        == [[2.0, 2.0]] * 2
    )
    assert plait.init(size=1, rank=0, timeout=seconds).timeout == MAX_TIMEOUT


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("abc", "PLAIT_TIMEOUT='abc': timeout must be a number of seconds"),
        ("-5", "PLAIT_TIMEOUT='-5': timeout must be positive"),
        ("0", "PLAIT_TIMEOUT='0': timeout must be positive"),
    ],
)
def test_a_bad_plait_timeout_is_named(
    value: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to fail `import plait` with float()'s words, or time every call out at once."""
    monkeypatch.setenv("PLAIT_TIMEOUT", value)
    with pytest.raises(ValueError, match=said):
        run_ranks(1, lambda c: None, timeout=None)
    monkeypatch.setenv("PLAIT_TIMEOUT", "inf")
    assert run_ranks(1, lambda c: c.timeout, timeout=None) == [MAX_TIMEOUT]
    done = subprocess.run(
        [sys.executable, "-c", "import plait"],
        env={"PLAIT_TIMEOUT": value, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_custom_ops_that_differ_only_in_their_function_mismatch() -> None:
    """Every lambda is named <lambda>: ranks whose lambdas differ got different results."""

    def body(c: plait.Communicator) -> list[str]:
        said = []
        for op in (
            plait.Op(lambda a, b, out=None: np.add(a, b, out=out))
            if c.rank
            else plait.Op(lambda a, b, out=None: np.multiply(a, b, out=out)),
            plait.Op(np.add) if c.rank else plait.Op(np.multiply, name="add"),
        ):
            sub = c.split(0)  # each try on a communicator of its own: a mismatch breaks one
            with pytest.raises(plait.MismatchError, match="different call"):
                sub.allreduce(np.array([2.0, 3.0]), op)
            said.append("mismatch")
        same = plait.Op(lambda a, b, out=None: np.maximum(a, b, out=out))
        said.append(str(c.allreduce(np.array([2.0, 3.0]) + c.rank, same).tolist()))
        return said

    assert run_ranks(2, body) == [["mismatch", "mismatch", "[3.0, 4.0]"]] * 2


def test_a_root_that_passes_no_data_to_scatter_is_told_so() -> None:
    def body(c: plait.Communicator) -> str:
        with pytest.raises(ValueError, match="root 0 must pass x, the array it splits"):
            c.scatter(None, out=np.zeros(2))
        return "refused"

    assert run_ranks(1, body) == ["refused"]


def test_subpackages_are_reached_from_a_bare_import() -> None:
    """The README's `plait.compression.Int8()` after `import plait` alone."""
    code = (
        "import plait; print(plait.compression.Int8().__class__.__name__, "
        "plait.bucketing.Bucketer.__name__)\n"
        "try:\n    plait.nothing\nexcept AttributeError as e:\n    print(e)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.splitlines() == [
        "Int8 Bucketer",
        "module 'plait' has no attribute 'nothing'",
    ]


class Grad(np.ndarray):
    """A subclass that reshapes as ndarray does, as a framework's gradient might be."""


def test_a_subclass_keys_a_stateful_compressor_by_itself() -> None:
    """A memmap-like gradient is the compressor's array itself: TopK keeps its residual by
    the gradient's identity (a plain view, new at each call, could not key it)."""

    def body(c: plait.Communicator) -> list[Any]:
        g = (np.ones(8) * (c.rank + 1)).view(Grad)
        top = plait.compression.TopK(0.5)
        return [np.asarray(c.allreduce(g, compression=top)).tolist() for _ in range(2)]

    first, second = run_ranks(2, body)[0]
    assert first == [0.0] * 4 + [3.0] * 4
    assert second == [6.0] * 4 + [0.0] * 4  # the first call's residual, kept for g, added


def test_a_request_wait_of_0_only_looks() -> None:
    def body(c: plait.Communicator) -> str:
        if c.rank == 0:
            c.barrier()
            c.send(np.ones(2), 1)
            return "sent"
        req = c.irecv(np.zeros(2), 0)
        with pytest.raises(plait.CommTimeout):
            req.wait(0)  # nothing sent yet: the request stays pending
        c.barrier()
        return str(req.wait().tolist())

    assert run_ranks(2, body) == ["sent", "[1.0, 1.0]"]
