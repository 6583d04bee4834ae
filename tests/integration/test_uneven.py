"""The uneven collectives on the communicator, against the numpy reference.

Threads play the ranks. Each test runs one world size with random per-rank
row counts (zeros included, and all zeros), several dtypes and row shapes,
every algorithm of each uneven collective forced and ``auto``; it asserts
exact agreement with :func:`plait.testing.reference` (whose uneven results
are flat), bit-identical replicated results, untouched inputs, and the
errors: bad counts raise ValueError before any byte moves, counts that
differ between ranks raise MismatchError.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import reference, run_ranks

QUICK = [1, 2, 3]
SIZES = [*QUICK, *(pytest.param(p, marks=pytest.mark.slow) for p in (4, 5, 7, 8))]
DTYPES = [np.float64, np.float32, np.int32, np.uint8, np.int64]
ROWS = [(), (3,), (2, 2)]


def _names(c: str) -> list[str]:
    return ["auto", *plait.algorithms(c)]


def _counts(rng: np.random.Generator, n: int, case: int) -> list[int]:
    """Random rows per rank with zeros; case 0 is all zeros, case 1 all equal."""
    if case == 0:
        return [0] * n
    if case == 1:
        return [2] * n
    return [int(k) for k in rng.integers(0, 4, n)]


def _data(rank: int, seed: int, rows: int, rest: tuple[int, ...], dtype: Any) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    return rng.integers(0, 50, (rows, *rest)).astype(dtype)


def _expect(c: str, inputs: list[np.ndarray | None], rest: tuple[int, ...], **kw: Any) -> Any:
    """The reference in rows: flat element counts in, results reshaped to ``(-1, *rest)``."""
    row = int(np.prod(rest, dtype=np.int64))
    counts = [k * row for k in kw.pop("counts")]
    flat = [x.reshape(-1) if x is not None else None for x in inputs]
    out = reference(c, flat, counts=counts, **kw)
    return [o.reshape(-1, *rest) if o is not None else None for o in out]


def _same(got: Any, want: Any) -> None:
    assert (got is None) == (want is None)
    if got is not None:
        assert got.dtype == want.dtype
        assert got.shape == want.shape, (got.shape, want.shape)
        assert got.tobytes() == want.tobytes()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", SIZES)
def test_uneven_collectives_match_the_reference(size: int) -> None:
    cases = [(case, dtype, rest) for case in range(4) for dtype in DTYPES[:3] for rest in ROWS]
    cases += [(5, dtype, (3,)) for dtype in DTYPES[3:]]

    def body(comm: plait.Communicator) -> None:
        r = comm.rank
        for seed, (case, dtype, rest) in enumerate(cases):
            rng = np.random.default_rng(seed)  # the same counts on every rank
            counts = _counts(rng, size, case)
            root = seed % size
            xs = [_data(q, seed, counts[q], rest, dtype) for q in range(size)]
            x = xs[r]
            keep = x.copy()
            want = _expect("allgatherv", xs, rest, counts=counts)[r]
            for name in _names("allgatherv"):
                _same(comm.allgatherv(x, counts, algorithm=name), want)
            _same(comm.allgatherv(x), want)  # counts learnt by an allgather
            want = _expect("gatherv", xs, rest, counts=counts, root=root)[r]
            for name in _names("gatherv"):
                _same(comm.gatherv(x, counts, root, algorithm=name), want)
                _same(comm.gatherv(x, root=root, algorithm=name), want)
            whole = _data(root, seed + 1, sum(counts), rest, dtype)
            want = _expect("scatterv", [whole] * size, rest, counts=counts, root=root)[r]
            for name in _names("scatterv"):
                if r == root:
                    got = comm.scatterv(whole, counts, root, algorithm=name)
                elif name == "auto":
                    got = comm.scatterv(None, root=root, out=np.empty_like(want))
                else:
                    got = comm.scatterv(np.empty((0, *rest), dtype), None, root, algorithm=name)
                _same(got, want)
            sums = [_data(q, seed + 2, sum(counts), rest, dtype) for q in range(size)]
            for op in (plait.SUM, plait.MAX):
                want = _expect("reduce_scatterv", sums, rest, counts=counts, op=op)[r]
                for name in _names("reduce_scatterv"):
                    _same(comm.reduce_scatter(sums[r], op, counts=counts, algorithm=name), want)
            matrix = np.random.default_rng(seed + 3).integers(0, 3, (size, size))
            if case == 0:
                matrix[:] = 0
            sends = [_data(q, seed + 4, int(matrix[q].sum()), rest, dtype) for q in range(size)]
            want = _expect("alltoallv", sends, rest, counts=[int(k) for k in matrix.reshape(-1)])[r]
            for name in _names("alltoallv"):
                got = comm.alltoallv(sends[r], matrix[r], algorithm=name)
                _same(got, want)
                _same(comm.alltoallv(sends[r], list(matrix[r]), matrix[:, r]), want)
            assert np.array_equal(x, keep)

    run_ranks(size, body, timeout=120)


def test_results_are_bit_identical_on_every_rank() -> None:
    def body(comm: plait.Communicator) -> bytes:
        counts = [3, 0, 5]
        x = np.random.default_rng(comm.rank).standard_normal((counts[comm.rank], 4))
        return bytes(comm.allgatherv(x, counts).tobytes())

    results = run_ranks(3, body)
    assert results[0] == results[1] == results[2]


def test_out_async_and_torch_style_split() -> None:
    def body(comm: plait.Communicator) -> None:
        counts = [1, 3]
        x = np.full((counts[comm.rank], 2), comm.rank, np.float32)
        out = np.empty((4, 2), np.float32)
        work = comm.allgatherv(x, counts, out=out, async_op=True)
        assert work.wait() is out
        parts = np.split(out, np.cumsum(counts)[:-1])
        assert [p.shape[0] for p in parts] == counts
        assert all((p == q).all() for q, p in enumerate(parts))
        got = comm.scatterv(
            out if comm.rank == 0 else None,
            counts,
            out=np.empty((counts[comm.rank], 2), np.float32),
            async_op=True,
        ).wait()
        assert (got == out[[0]] if comm.rank == 0 else got == out[1:]).all()
        res = comm.gatherv(x, async_op=True).wait()
        assert res is None if comm.rank else np.array_equal(res, out)
        y = np.arange(3 * 2, dtype=np.int64).reshape(3, 2)
        send = [1, 2] if comm.rank == 0 else [2, 1]
        assert comm.alltoallv(y, send, async_op=True).wait().shape[0] == 3

    run_ranks(2, body)


def test_torch_tensor_in_gives_tensor_out() -> None:
    torch = pytest.importorskip("torch")

    def body(comm: plait.Communicator) -> None:
        counts = [2, 1]
        x = torch.full((counts[comm.rank], 3), float(comm.rank))
        got = comm.allgatherv(x, counts)
        assert isinstance(got, torch.Tensor)
        assert got.shape == (3, 3)

    run_ranks(2, body)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda comm, x: comm.allgatherv(x, [1]), "needs 2 entries"),
        (lambda comm, x: comm.allgatherv(x, [1, -1]), "ints >= 0"),
        (lambda comm, x: comm.allgatherv(x, [1.0, 1]), "ints >= 0"),
        (lambda comm, x: comm.allgatherv(x, [2, 2]), "x has 1 rows"),
        (lambda comm, x: comm.allgatherv(x[0, 0], [1, 1]), "at least one dimension"),
        (lambda comm, x: comm.gatherv(x, [1, 1], root=2), "root 2 is out of range"),
        (lambda comm, x: comm.alltoallv(x, [1, 1, 0]), "needs 2 entries"),
        (lambda comm, x: comm.alltoallv(x, [0, 0]), "sum\\(send_counts\\) says 0"),
        (lambda comm, x: comm.reduce_scatter(x, counts=[0, 0]), "sum\\(counts\\) says 0"),
        (lambda comm, x: comm.allgatherv(x, [1, 1], algorithm="nope"), "nope"),
        (lambda comm, x: comm.gatherv(x, algorithm="nope"), "nope"),
    ],
)
def test_bad_counts_raise_before_any_byte_moves(call: Any, match: str) -> None:
    """Every rank raises at once, and the communicator still works after."""

    def body(comm: plait.Communicator) -> None:
        x = np.ones((1, 2))
        before = comm.stats()
        with pytest.raises((ValueError, TypeError), match=match):
            call(comm, x)
        assert comm.stats() == before
        assert comm.allgatherv(x, [1, 1]).shape == (2, 2)

    run_ranks(2, body)


def test_counts_of_the_wrong_type_raise_type_error() -> None:
    def body(comm: plait.Communicator) -> None:
        # scatterv's counts are checked on root (the others learn them from it)
        with pytest.raises(ValueError, match="root must pass counts"):
            comm.scatterv(np.ones((1, 2)))
        with pytest.raises(ValueError, match=r"sum\(counts\) says 2"):
            comm.scatterv(np.ones((1, 2)), [2])
        with pytest.raises(TypeError, match="list or tuple"):
            comm.allgatherv(np.ones((1, 2)), 2)  # type: ignore[call-overload]
        with pytest.raises(TypeError, match="1-D integer array"):
            comm.allgatherv(np.ones((1, 2)), np.ones(1))
        for counts in ([1.0], [True], ["1"]):  # entries that are not ints: as such an array
            with pytest.raises(TypeError, match="ints >= 0"):
                comm.allgatherv(np.ones((1, 2)), counts)

    run_ranks(1, body)


def test_counts_that_differ_between_ranks_raise_mismatch_error_on_every_rank() -> None:
    """The error shows the rows each rank passed: it showed element counts as "counts=[2, 4]"
    beside the row shape, which read as rows the caller never passed."""

    def body(comm: plait.Communicator) -> None:
        counts = [1, 1] if comm.rank == 0 else [1, 2]
        x = np.ones((counts[comm.rank], 2))
        mine = re.escape(f"allgatherv(rows {counts} of shape (2,), dtype=float64")
        with pytest.raises(plait.MismatchError, match=mine):
            comm.allgatherv(x, counts, algorithm="ring", timeout=10)

    run_ranks(2, body, lockstep=True)


def test_rows_of_different_sizes_raise_mismatch_error() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.ones((1, 2 + comm.rank))
        with pytest.raises(plait.MismatchError):
            comm.allgatherv(x, [1, 1], algorithm="ring", timeout=10)

    run_ranks(2, body, lockstep=True)


@pytest.mark.parametrize(
    "mine",
    [
        pytest.param(lambda r: ((1 + r, 0), [1, 1 + r]), id="rows of nothing, counts differ"),
        pytest.param(lambda r: ((0, 2 + r), [0, 0]), id="no rows, widths differ"),
        pytest.param(lambda r: ((2 + r, 3 - r), [2 + r, 2 + r]), id="same elements, rows differ"),
    ],
)
def test_rows_the_element_counts_do_not_show_raise_mismatch_error(mine: Any) -> None:
    """Rows of no element: counts [1, 1] on one rank and [1, 2] on the other returned
    results of 2 and 3 rows; rows of 2 × 3 against 3 × 2 elements (6 a rank on both)
    returned (4, 3) on one and (6, 2) on the other. The element counts agreed."""

    def body(comm: plait.Communicator) -> None:
        shape, counts = mine(comm.rank)
        with pytest.raises(plait.MismatchError, match="row"):
            comm.allgatherv(np.ones(shape), counts, algorithm="ring", timeout=10)

    run_ranks(2, body, lockstep=True)


def test_recv_counts_that_disagree_raise_on_every_rank() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.ones((2, 1))
        recv = [1, 1] if comm.rank == 0 else [1, 2]
        with pytest.raises(ValueError, match=r"on ranks 1 \(recv_counts \[1, 2\], sent \[1, 1\]\)"):
            comm.alltoallv(x, [1, 1], recv)
        assert comm.alltoallv(x, [1, 1], [1, 1]).shape == (2, 1)

    run_ranks(2, body)


def test_auto_picks_the_documented_algorithms() -> None:
    from plait.communicator import _UNEVEN_AUTO

    assert {c: f(8, True) for c, f in _UNEVEN_AUTO.items()} == {
        "allgatherv": "ring",
        "gatherv": "binomial",
        "scatterv": "binomial",
        "alltoallv": "pairwise",
        "reduce_scatterv": "pairwise",
    }
    assert _UNEVEN_AUTO["reduce_scatterv"](1 << 20, True) == "ring"
    assert _UNEVEN_AUTO["reduce_scatterv"](1 << 20, False) == "pairwise"


#: Each uneven call whose counts are exchanged first, rank 1 passing ``out`` with one row too
#: many; the result every rank should get (rank 0 and 2 pass the right out).
TOO_LATE = {
    "allgatherv": (
        lambda comm, out: comm.allgatherv(np.full((1 + comm.rank, 2), comm.rank), out=out),
        lambda r: np.repeat([[0, 0], [1, 1], [2, 2]], [1, 2, 3], axis=0),
    ),
    "gatherv": (
        lambda comm, out: comm.gatherv(np.full((1 + comm.rank, 2), comm.rank), None, 1, out=out),
        lambda r: np.repeat([[0, 0], [1, 1], [2, 2]], [1, 2, 3], axis=0) if r == 1 else None,
    ),
    "scatterv": (
        lambda comm, out: comm.scatterv(
            np.arange(12).reshape(6, 2) if comm.rank == 0 else None, [1, 2, 3], 0, out=out
        ),
        lambda r: np.arange(12).reshape(6, 2)[[0, 1, 3][r] : [1, 3, 6][r]],
    ),
    "alltoallv": (
        lambda comm, out: comm.alltoallv(np.full((3, 2), comm.rank), [1, 1, 1], out=out),
        lambda r: np.array([[0, 0], [1, 1], [2, 2]]),
    ),
}


@pytest.mark.parametrize("call", list(TOO_LATE))
def test_an_out_with_the_wrong_rows_for_the_exchanged_counts_fails_on_its_rank_alone(
    call: str,
) -> None:
    """Note [a share learned too late]: rank 1's out had a row too many for the counts it
    learned in the exchange; it raised alone, the others went on into the call, waited for
    it until their timeout, and every communicator broke."""
    run, want = TOO_LATE[call]

    def body(comm: plait.Communicator) -> Any:
        r = comm.rank
        right = want(r)
        rows = 0 if right is None else len(right) + (r == 1)
        out = np.full((rows, 2), -7) if right is not None else None
        if r == 1:
            with pytest.raises(ValueError, match=r"out has shape .* out was not written"):
                run(comm, out)
            assert out is not None
            assert (out == -7).all()
        else:
            got = run(comm, out)
            if right is None:
                assert got is None
            else:
                np.testing.assert_array_equal(got, right)
        return comm.allreduce(np.ones(1))  # every communicator still usable, in step

    for got in run_ranks(3, body, timeout=10):
        np.testing.assert_array_equal(got, [3.0])


@pytest.mark.parametrize(
    ("call", "kw", "error"),
    [
        ("allgatherv", {"async_op": "yes"}, TypeError),
        ("gatherv", {"async_op": None}, TypeError),
        ("scatterv", {"async_op": 1}, TypeError),
        ("alltoallv", {"async_op": 1}, TypeError),
        ("allgatherv", {"async_op": True, "timeout": -1}, ValueError),
        ("alltoallv", {"async_op": True, "timeout": float("nan")}, ValueError),
    ],
)
def test_calls_that_exchange_counts_check_async_op_and_timeout_first(
    call: str, kw: dict[str, Any], error: type[Exception]
) -> None:
    """The calls that exchange their counts first took any truthy ``async_op`` for True (and
    None for False), and an async one's bad ``timeout`` was refused only by its ``wait()``,
    after the exchange had run: each is now refused at the call, as the others are."""

    def body(comm: plait.Communicator) -> str:
        x = np.arange(2.0 * comm.size)
        args: dict[str, Any] = {
            "allgatherv": {},
            "gatherv": {},
            "scatterv": {"counts": [2] * comm.size},
            "alltoallv": {"send_counts": [2] * comm.size},
        }[call]
        with pytest.raises(error) as caught:
            getattr(comm, call)(x, **args, **kw)
        assert call in str(caught.value)
        got = comm.allreduce(np.ones(1))  # nothing was exchanged: the next call meets
        return f"{got[0]:g}"

    assert run_ranks(2, body) == ["2", "2"]


def test_counts_too_large_for_memory_name_the_call() -> None:
    """Counts that claim more rows than memory can hold gave numpy's words alone ("array is
    too big"), naming no rank, call or argument."""

    def body(comm: plait.Communicator) -> str:
        x = np.ones((2, 1))
        huge = 2**62 if comm.rank == 0 else 10**12  # numpy: "array is too big"; out of memory
        counts = [2, huge] if comm.rank == 0 else [huge, 2]
        with pytest.raises((ValueError, MemoryError)) as caught:  # both refuse before a byte
            comm.gatherv(x, counts, root=comm.rank)
        return str(caught.value)

    for said in run_ranks(2, body):
        assert re.search(r"rank \d: gatherv: cannot allocate its result of shape", said), said
