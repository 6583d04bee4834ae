"""Issue 15: ``out=`` that cannot be written in place, and arrays in the other byte order.

A list as ``out=`` used to be accepted and never written (the call filled a
copy); it is refused now, for every argument a call writes into. An array in
non-native byte order used to be summed as if it were native, and a rank
passing ``>f8`` against ``<f8`` elsewhere got a wrong sum that ranks did not
agree on; such arrays are converted at the edge now (Note [byte order] in
plait._request), with the result in the caller's dtype.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import plait
import plait.testing
from plait._request import call_digest
from plait.schedule.builder import Context
from plait.testing import memory_communicators, run_ranks

#: The byte order that is not this machine's.
SWAPPED = ">" if np.little_endian else "<"
FOREIGN = np.dtype(f"{SWAPPED}f8")


def _foreign(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).astype(FOREIGN)


# -- out= that cannot be written in place ---------------------------------------------------

#: Each collective that takes out=, called by rank 1 of 2 with out= a list or a tuple; the
#: argument checks refuse it before anything is sent, so rank 0 need not take part.
WRITES_OUT: dict[str, Callable[[plait.Communicator, Any], Any]] = {
    "allreduce": lambda comm, out: comm.allreduce(np.ones(2), out=out),
    "reduce": lambda comm, out: comm.reduce(np.ones(2), 1, out=out),
    "reduce_scatter": lambda comm, out: comm.reduce_scatter(np.ones(2), out=out),
    "allgather": lambda comm, out: comm.allgather(np.ones(2), out=out),
    "alltoall": lambda comm, out: comm.alltoall(np.ones(2), out=out),
    "gather": lambda comm, out: comm.gather(np.ones(2), 1, out=out),
    "scatter": lambda comm, out: comm.scatter(np.ones(2), 1, out=out),
    "scatter x=None": lambda comm, out: comm.scatter(None, 0, out=out),
    "allreduce compressed": lambda comm, out: comm.allreduce(
        np.ones(2), out=out, compression=plait_fp16()
    ),
}


def plait_fp16() -> Any:
    from plait.compression import FP16

    return FP16()


@pytest.mark.parametrize("call", list(WRITES_OUT))
@pytest.mark.parametrize("out", [[0.0, 0.0], (0.0, 0.0)], ids=["list", "tuple"])
def test_out_that_cannot_be_written_in_place_is_refused(call: str, out: Any) -> None:
    comms = memory_communicators(2, timeout=5)
    try:
        with pytest.raises(TypeError, match=r"write in place.*leave out= off") as info:
            WRITES_OUT[call](comms[1], out)
    finally:
        for comm in comms:
            comm.close()
    assert type(out).__name__ in str(info.value)
    assert out in ([0.0, 0.0], (0.0, 0.0))  # untouched, and nothing was sent


def test_broadcast_x_and_recv_buf_must_be_writable_in_place() -> None:
    [comm] = memory_communicators(1)
    with comm:
        with pytest.raises(TypeError, match="broadcast: x must be memory the call can write"):
            comm.broadcast([1.0, 2.0])
        with pytest.raises(TypeError, match="recv: buf must be memory the call can write"):
            comm.recv([0.0], 0)


@pytest.mark.parametrize("algorithm", ["scatter_allgather", "binomial", "auto"])
@pytest.mark.parametrize("size", [2, 3])
def test_broadcast_roots_read_only_x_is_only_read(algorithm: str, size: int) -> None:
    """Root only reads its x, so a read-only one is fine there; scatter_allgather's ring
    hands root its own blocks back, and root failed with "into is read-only" after data had
    moved (its peers lost it)."""

    def body(comm: plait.Communicator) -> list[float]:
        x = np.arange(7.0) * (comm.rank + 1)
        if comm.rank == 0:
            x.flags.writeable = False
        assert comm.broadcast(x, 0, algorithm=algorithm) is x
        return x.tolist()

    assert run_ranks(size, body, timeout=20) == [list(np.arange(7.0))] * size


@pytest.mark.parametrize("kind", ["strided", "big-endian", "both"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_broadcast_roots_read_only_x_that_needs_staging_is_only_read(kind: str, size: int) -> None:
    """A read-only root x that is not contiguous or not in native byte order (a read-only
    np.memmap of big-endian data) is staged to be sent; root's staging was to be written
    back into x, and root raised numpy's "assignment destination is read-only" after its
    data had gone to the others."""
    dtype = ">f8" if kind != "strided" else "<f8"
    step = 2 if kind != "big-endian" else 1

    def body(comm: plait.Communicator) -> list[float]:
        x = (np.arange(14.0) * (comm.rank + 1)).astype(dtype)[::step]
        if comm.rank == 0:
            x.flags.writeable = False
        assert comm.broadcast(x, 0) is x
        assert comm.allreduce(np.ones(1))[0] == size  # still usable, in step
        return x.tolist()

    want = list(np.arange(14.0)[::step])
    assert run_ranks(size, body, timeout=20) == [want] * size


def test_x_none_is_named_as_none() -> None:
    """``allreduce(None)`` (a rank that forgot its x) said "x: dtype object is not supported":
    np.asarray(None) is an array of one object."""
    [comm] = memory_communicators(1)
    with comm:
        for call in (comm.allreduce, comm.allgather, comm.alltoall, comm.reduce_scatter):
            with pytest.raises(TypeError, match=r": x is None; expected an array"):
                call(None)
        with pytest.raises(TypeError, match=r"gather: x is None; expected an array"):
            comm.gather(None, 0)


def test_out_may_be_a_writable_buffer() -> None:
    def body(comm: plait.Communicator) -> Any:
        out = array.array("d", [0.0, 0.0])
        res = comm.allreduce(np.array([1.0, 2.0]) * (comm.rank + 1), out=out)
        assert res is out
        raw = bytearray(2)
        comm.allreduce(np.array([1, 2], np.uint8), out=raw)
        held = np.zeros(2)
        view = _Interface(held)  # numpy reads it over held's memory
        assert comm.allreduce(np.ones(2), out=view) is view
        return list(out), bytes(raw), held

    for values, raw, held in run_ranks(2, body):
        assert values == [3.0, 6.0]
        assert raw == bytes([2, 4])
        np.testing.assert_array_equal(held, [2.0, 2.0])


class _Interface:
    """An object that shows its memory to numpy through ``__array_interface__`` only."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self.__array_interface__ = a.__array_interface__


def test_read_only_buffer_as_out_is_refused() -> None:
    [comm] = memory_communicators(1)
    with comm, pytest.raises(ValueError, match="out is read-only"):
        comm.allreduce(np.array([1, 2], np.uint8), out=memoryview(b"\0\0"))


def test_a_numpy_scalar_is_refused_wherever_the_call_writes() -> None:
    # A numpy scalar shows __array_interface__ over a copy of itself: it was accepted as out=,
    # as broadcast's x off root and as recv's buf, and silently left as it was.
    comms = memory_communicators(2, timeout=5)
    try:
        with pytest.raises(TypeError, match=r"out is a numpy scalar \(float64\).*0-d array"):
            comms[1].allreduce(np.array(1.0), out=np.float64(0.0))
        with pytest.raises(TypeError, match=r"x is a numpy scalar.*np.array\(value\)"):
            comms[1].broadcast(np.float64(2.5), 0)
        with pytest.raises(TypeError, match=r"buf is a numpy scalar.*0-d array"):
            comms[1].recv(np.float64(0.0), 0)
        with pytest.raises(TypeError, match="out is a numpy scalar"):
            comms[1].allgatherv(np.ones((1, 1)), out=np.float64(0.0))
    finally:
        for comm in comms:
            comm.close()


def test_an_output_whose_elements_share_memory_is_refused() -> None:
    # A stride-0 array (as_strided, torch's expand()) took the result of every element in one
    # memory cell: [6, 6, 6, 6] for an allreduce of arange(4) on 2 ranks.
    one = np.zeros(1)
    shared = np.lib.stride_tricks.as_strided(one, shape=(4,), strides=(0,))
    assert shared.flags.writeable
    comms = memory_communicators(2, timeout=5)
    try:
        with pytest.raises(ValueError, match=r"elements of out share memory.*axis 0"):
            comms[1].allreduce(np.arange(4.0), out=shared)
        with pytest.raises(ValueError, match="elements of x share memory"):
            comms[1].broadcast(shared, 0)
        with pytest.raises(ValueError, match="elements of buf share memory"):
            comms[1].recv(shared, 0)
    finally:
        for comm in comms:
            comm.close()
    assert one[0] == 0.0


def test_an_output_whose_rows_overlap_is_refused() -> None:
    # Rows 2 elements apart, 3 long: 9 elements in 6 memory cells. A receive of arange(9)
    # was accepted and left [[0, 1, 3], [3, 4, 6], [6, 7, 8]]: elements 2 and 5 were lost.
    cells = np.zeros(6)
    rows = np.lib.stride_tricks.as_strided(cells, shape=(3, 3), strides=(16, 8))
    assert rows.flags.writeable
    comms = memory_communicators(2, timeout=5)
    try:
        comms[0].send(np.arange(9.0), 1)
        with pytest.raises(ValueError, match=r"elements of buf overlap in memory \(shape \(3, 3\)"):
            comms[1].recv(rows, 0)
        with pytest.raises(ValueError, match="elements of out overlap in memory"):
            comms[1].allreduce(np.arange(9.0).reshape(3, 3), out=rows)
        with pytest.raises(ValueError, match="elements of x overlap in memory"):
            comms[1].broadcast(rows, 0)
        got = comms[1].recv(np.empty((3, 3)), 0)  # the message stays for a good buffer
        np.testing.assert_array_equal(got.ravel(), np.arange(9.0))
        # Views that slice, step or transpose are apart, as are strides that interleave.
        apart = np.lib.stride_tricks.as_strided(np.zeros(8), shape=(3, 2), strides=(16, 24))
        comms[0].send(np.arange(6.0), 1)
        np.testing.assert_array_equal(comms[1].recv(apart, 0).ravel(), np.arange(6.0))
    finally:
        for comm in comms:
            comm.close()
    assert not cells.any()


@pytest.mark.parametrize("timeout", [np.int64(5), np.float32(5.0), np.float64(2.5)])
def test_timeout_may_be_a_numpy_number(timeout: Any) -> None:
    def body(comm: plait.Communicator) -> Any:
        return comm.allreduce(np.ones(2), timeout=timeout)

    for got in run_ranks(2, body):
        np.testing.assert_array_equal(got, [2.0, 2.0])
    [comm] = memory_communicators(1)
    with comm, pytest.raises(TypeError, match="timeout must be a number"):
        comm.allreduce(np.ones(2), timeout=np.bool_(True))


#: One call of each edge that takes async_op=, made by a rank alone with a bad flag.
ASYNC_CALLS: dict[str, Callable[[plait.Communicator, Any], Any]] = {
    "allreduce": lambda comm, flag: comm.allreduce(np.ones(2), async_op=flag),
    "broadcast": lambda comm, flag: comm.broadcast(np.ones(2), 0, async_op=flag),
    "allgather": lambda comm, flag: comm.allgather(np.ones(2), async_op=flag),
    "allgatherv": lambda comm, flag: comm.allgatherv(np.ones((1, 2)), [1, 1], async_op=flag),
}


@pytest.mark.parametrize("call", sorted(ASYNC_CALLS))
@pytest.mark.parametrize("flag", ["yes", "", 1, 0, None])
def test_async_op_must_be_a_bool(call: str, flag: Any) -> None:
    # A string or a number was taken for its truth ('yes' and '' alike for a blocking call
    # on the short path, any of them for an async one on the long way). Refused before the
    # call is numbered: rank 0 never takes part, and rank 1's next call still meets it.
    comms = memory_communicators(2, timeout=5)

    def body(comm: plait.Communicator) -> Any:
        ASYNC_CALLS[call](comm, False)  # its short path kept, where it has one
        work = comm.allreduce(np.ones(2), async_op=np.bool_(comm.rank == 0))
        return work.wait() if comm.rank == 0 else work

    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(body, comms))
        with pytest.raises(TypeError, match=r"async_op must be True or False; got"):
            ASYNC_CALLS[call](comms[1], flag)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(body, comms))
        for g in got:
            np.testing.assert_array_equal(g, [2.0, 2.0])
    finally:
        for comm in comms:
            comm.close()


#: Each uneven call that learns its counts first, called by rank 1 of 2 with a bad out=: it
#: is refused before the count exchange, so rank 0 need not take part (it used to raise after
#: the exchange on that rank alone, and leave the others waiting in the call that follows).
UNEVEN_OUT: dict[str, Callable[[plait.Communicator, Any], Any]] = {
    "allgatherv": lambda comm, out: comm.allgatherv(np.ones((1, 2)), out=out),
    "gatherv": lambda comm, out: comm.gatherv(np.ones((1, 2)), None, 1, out=out),
    "scatterv": lambda comm, out: comm.scatterv(None, None, 0, out=out),
    "alltoallv": lambda comm, out: comm.alltoallv(np.ones((2, 2)), [1, 1], out=out),
}


@pytest.mark.parametrize("call", list(UNEVEN_OUT))
@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        (np.zeros((3, 2), np.float32), TypeError, "out has dtype float32; expected float64"),
        (np.zeros((3, 5)), ValueError, r"out has shape \(3, 5\); expected \(3, 2\)"),
        (np.zeros((3, 2))[:, :1].T, ValueError, "out has shape"),
        ([[0.0, 0.0]], TypeError, "write in place"),
    ],
    ids=["dtype", "row", "transposed", "list"],
)
def test_uneven_out_is_refused_before_the_count_exchange(
    call: str, out: Any, error: type[Exception], message: str
) -> None:
    if call == "scatterv" and "write in place" not in message:
        pytest.skip("off root, scatterv's out= gives the dtype and the row: nothing to compare")
    comms = memory_communicators(2, timeout=3)
    try:
        with pytest.raises(error, match=message):
            UNEVEN_OUT[call](comms[1], out)
        # Nothing was sent: the communicator is in step with rank 0 and still usable.
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda comm: comm.allreduce(np.ones(1)), comms))
    finally:
        for comm in comms:
            comm.close()
    for got in results:
        np.testing.assert_array_equal(got, [2.0])


# -- byte order -----------------------------------------------------------------------------


def test_check_word_holds_the_byte_order() -> None:
    ctx = Context("allreduce", 0, 2, 4, 8, True, 0, 4, None)
    native, swapped = np.dtype("=f8"), FOREIGN
    assert native.name == swapped.name
    assert call_digest("ring", ctx, native, plait.SUM) != call_digest(
        "ring", ctx, swapped, plait.SUM
    )


@pytest.mark.parametrize("size", [1, 2, 3])
def test_non_native_input_on_every_rank(size: int) -> None:
    def body(comm: plait.Communicator) -> Any:
        x = _foreign(np.arange(5) + 10.0 * comm.rank)
        res = comm.allreduce(x)
        assert res.dtype == FOREIGN  # the caller's dtype
        inplace = x.copy()
        assert comm.allreduce(inplace, out=inplace) is inplace
        np.testing.assert_array_equal(inplace, res)
        native_out = np.empty(5)
        comm.allreduce(x, out=native_out)
        np.testing.assert_array_equal(native_out, res)
        return res

    expected = sum(np.arange(5) + 10.0 * r for r in range(size))
    for res in run_ranks(size, body):
        np.testing.assert_array_equal(res, expected)


@pytest.mark.parametrize("size", [2, 3])
def test_byte_orders_mixed_across_ranks(size: int) -> None:
    def body(comm: plait.Communicator) -> dict[str, Any]:
        r = comm.rank
        mine = np.arange(2.0 * size) + 100.0 * r
        x = _foreign(mine) if r == 0 else mine
        got: dict[str, Any] = {
            "allreduce": comm.allreduce(x),
            "allreduce MAX": comm.allreduce(x, plait.MAX, algorithm="ring"),
            "reduce_scatter": comm.reduce_scatter(x),
            "allgather": comm.allgather(x),
            "alltoall": comm.alltoall(x),
            "reduce": comm.reduce(x, 1),
            "gather": comm.gather(x, 1),
            "scatter": comm.scatter(x, 0),
        }
        b = x.copy()
        comm.broadcast(b, 0)
        got["broadcast"] = b
        return {k: None if v is None else np.asarray(v, np.float64) for k, v in got.items()}

    inputs = [np.arange(2.0 * size) + 100.0 * r for r in range(size)]
    results = run_ranks(size, body)
    for name in results[0]:
        c, _, op = name.partition(" ")
        expected = plait.testing.reference(
            c, inputs, op=plait.MAX if op else plait.SUM, root=1 if c in ("reduce", "gather") else 0
        )
        for r in range(size):
            want = expected[r]
            if want is None:
                assert results[r][name] is None, (name, r)
            else:
                np.testing.assert_array_equal(results[r][name], want, err_msg=f"{name}, rank {r}")


def test_point_to_point_in_the_other_byte_order() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            comm.send(_foreign([1.5, -2.0]), 1)
            return None
        buf = np.empty(2, FOREIGN)
        assert comm.recv(buf, 0) is buf
        return buf

    _, got = run_ranks(2, body)
    np.testing.assert_array_equal(got, [1.5, -2.0])
