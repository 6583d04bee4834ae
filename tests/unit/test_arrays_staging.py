"""Device arrays staged through the host, tested with a fake device (tests/fake_device.py).

What is checked (Note [staging through the host] in plait._arrays): the host
copy is taken only after asking the producer to synchronise (a fake array with
queued contents gives stale data otherwise); results written back land in the
caller's own object and are there when the call returns (the fake's writes
land only on a device synchronize); ``out=`` and ``out=x`` keep their meaning;
a fresh result comes back as a device array on the same device; a failed call
writes nothing back; an array that cannot be staged is refused up front.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import plait
from fake_device import FakeDevice, FakeDeviceArray, Unstageable
from plait.compression import FP16
from plait.testing import memory_communicators, run_ranks

pytestmark = pytest.mark.timeout(30)


def test_the_fake_catches_a_copy_taken_without_synchronising() -> None:
    """The fake itself: a host copy taken without stream= misses the queued contents."""
    dev = FakeDevice()
    x = FakeDeviceArray(np.zeros(3), dev)
    x.launch([1.0, 2.0, 3.0])
    stale = np.from_dlpack(x, device="cpu", copy=True)  # numpy passes no stream=
    assert stale.tolist() == [0.0, 0.0, 0.0]
    assert x.unsynced_reads == 1
    x[...] = np.full(3, 7.0)
    assert x.held().tolist() == [0.0, 0.0, 0.0]  # the write is queued until synchronize
    dev.synchronize()
    assert x.held().tolist() == [7.0, 7.0, 7.0]


def test_allreduce_in_place_writes_back_into_the_device_array() -> None:
    def body(comm: plait.Communicator) -> Any:
        dev = FakeDevice()
        x = FakeDeviceArray(np.zeros(4, np.float32), dev)
        x.launch(np.arange(4, dtype=np.float32) * (comm.rank + 1))  # still being written
        res = comm.allreduce(x, out=x)
        return res is x, x.held(), x.streams, x.unsynced_reads, x.writes, dev.syncs

    for same, held, streams, unsynced, writes, syncs in run_ranks(2, body):
        assert same
        np.testing.assert_array_equal(held, np.arange(4, dtype=np.float32) * 3)
        assert streams == [None]
        assert unsynced == 0
        assert writes == 1
        assert syncs >= 1


def test_fresh_result_is_a_device_array_on_the_same_device() -> None:
    def body(comm: plait.Communicator) -> Any:
        dev = FakeDevice()
        x = FakeDeviceArray(np.full((2, 3), comm.rank + 1, np.int64), dev)
        total = comm.allreduce(x)
        rows = comm.allgather(x)
        mine = comm.reduce_scatter(FakeDeviceArray(np.ones((4, 3)), dev))
        return total, rows, mine, x

    for total, rows, mine, x in run_ranks(2, body):
        for res in (total, rows, mine):
            assert isinstance(res, FakeDeviceArray)
            assert res.device is x.device
        np.testing.assert_array_equal(total.held(), np.full((2, 3), 3))
        np.testing.assert_array_equal(rows.held(), [np.full((2, 3), 1), np.full((2, 3), 2)])
        np.testing.assert_array_equal(mine.held(), np.full((2, 3), 2.0))
        assert x.writes == 0  # x was only read
        np.testing.assert_array_equal(x.held()[0, 0] in (1, 2), True)


def test_out_is_written_back_and_x_left_alone() -> None:
    def body(comm: plait.Communicator) -> Any:
        dev = FakeDevice()
        x = FakeDeviceArray(np.full(3, comm.rank + 1.0), dev)
        out = FakeDeviceArray(np.zeros(3), dev)
        res = comm.allreduce(x, plait.MAX, out=out)
        host_out = np.zeros(3)
        comm.allreduce(x, out=host_out)  # a device x into a numpy out
        return res is out, out.held(), x.held(), x.writes, out.streams, host_out

    for same, out, x, x_writes, out_streams, host_out in run_ranks(2, body):
        assert same
        np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])
        assert x_writes == 0
        assert x[0] in (1.0, 2.0)
        assert out_streams == []  # out's contents were never needed, so never copied
        np.testing.assert_array_equal(host_out, [3.0, 3.0, 3.0])


def test_async_results_are_written_back_before_wait_returns() -> None:
    def body(comm: plait.Communicator) -> Any:
        dev = FakeDevice()
        x = FakeDeviceArray(np.full(2, comm.rank + 1.0), dev)
        fresh = comm.allreduce(x, async_op=True)
        y = FakeDeviceArray(np.full(2, comm.rank + 1.0), dev)
        in_place = comm.allreduce(y, plait.PROD, out=y, async_op=True)
        got = fresh.wait()
        assert fresh.wait() is got
        assert fresh.done()
        assert fresh.exception() is None
        return got, in_place.wait() is y, y.held()

    for got, same, y in run_ranks(2, body):
        assert isinstance(got, FakeDeviceArray)
        np.testing.assert_array_equal(got.held(), [3.0, 3.0])
        assert same
        np.testing.assert_array_equal(y, [2.0, 2.0])


def test_broadcast_fills_device_arrays_off_root_only() -> None:
    def body(comm: plait.Communicator) -> Any:
        dev = FakeDevice()
        x = FakeDeviceArray(np.full(3, 10.0 * (comm.rank + 1)), dev)
        assert comm.broadcast(x, root=1) is x
        return x.held(), x.writes

    (held0, writes0), (held1, writes1) = run_ranks(2, body)
    np.testing.assert_array_equal(held0, [20.0, 20.0, 20.0])
    np.testing.assert_array_equal(held1, [20.0, 20.0, 20.0])
    assert writes0 == 1
    assert writes1 == 0


def test_uneven_scatter_and_point_to_point() -> None:
    def body(comm: plait.Communicator) -> Any:
        dev = FakeDevice()
        r = comm.rank
        rows = comm.allgatherv(FakeDeviceArray(np.full((r + 1, 2), r), dev))
        part = comm.scatter(FakeDeviceArray(np.arange(4.0).reshape(2, 2), dev), root=0)
        buf = FakeDeviceArray(np.zeros(3, np.int32), dev)
        peer = 1 - r
        req = comm.irecv(buf, peer)
        comm.send(FakeDeviceArray(np.full(3, r + 5, np.int32), dev), peer)
        assert req.wait() is buf
        return rows.held(), part.held(), buf.held()

    for r, (rows, part, buf) in enumerate(run_ranks(2, body)):
        np.testing.assert_array_equal(rows, [[0, 0], [1, 1], [1, 1]])
        np.testing.assert_array_equal(part, np.arange(4.0).reshape(2, 2)[r : r + 1])
        np.testing.assert_array_equal(buf, np.full(3, 1 - r + 5))


def test_compressed_allreduce_of_a_device_array() -> None:
    def body(comm: plait.Communicator) -> Any:
        dev = FakeDevice()
        x = FakeDeviceArray(np.full(8, comm.rank + 1.0, np.float32), dev)
        res = comm.allreduce(x, plait.AVG, compression=FP16())
        out = FakeDeviceArray(np.zeros(8, np.float32), dev)
        comm.allreduce(x, out=out, compression=FP16())
        return res, out.held()

    for res, out in run_ranks(2, body):
        assert isinstance(res, FakeDeviceArray)
        np.testing.assert_array_equal(res.held(), np.full(8, 1.5, np.float32))
        np.testing.assert_array_equal(out, np.full(8, 3.0, np.float32))


def test_a_failed_call_writes_nothing_back() -> None:
    comms = memory_communicators(2, timeout=5)
    try:
        dev = FakeDevice()
        x = FakeDeviceArray(np.ones(3), dev)
        with pytest.raises(plait.CommTimeout, match="output buffer's contents are undefined"):
            comms[0].allreduce(x, out=x, timeout=0.2)  # rank 1 never calls
        assert x.writes == 0
        np.testing.assert_array_equal(x.held(), np.ones(3))
        y = FakeDeviceArray(np.ones(3), dev)
        with pytest.raises(TypeError, match=r"op must be a plait\.Op"):
            comms[1].allreduce(y, "sum", out=y)  # type: ignore[call-overload]
        assert y.writes == 0
        assert y.streams == [None]
    finally:
        for comm in comms:
            comm.close()


def test_arrays_that_cannot_be_staged_are_refused_with_why() -> None:
    [comm] = memory_communicators(1)
    with comm:
        with pytest.raises(TypeError, match=r"x \(Unstageable\) is in device memory.*staged"):
            comm.allreduce(Unstageable())
        with pytest.raises(TypeError, match="out is a Unstageable, which cannot be changed"):
            comm.allreduce(np.ones(1), out=Unstageable())
